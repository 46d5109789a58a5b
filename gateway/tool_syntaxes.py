"""Tool calls in each model family's own syntax: what tool_choice "auto" reads (model.tool_parser,
vLLM's --tool-call-parser names). A forced choice reads the shape its constraint gives, whatever
the family (gateway/tool_parser.py's ArrayCalls and NamedCall), as vLLM's does.

- "hermes" (Qwen2.5, Qwen3, Hermes; and every template without tools, whose prompt describes them in
  it: tokenizer_svc/tool_prompt.py): `<tool_call>{"name", "arguments"}</tool_call>` among text
  (`HermesCalls`).
- "mistral" (Mistral 7B v0.3, Mixtral; vLLM's mistral_tool_parser.py with a Hugging Face tokenizer,
  its "pre-v11" form): text, then `[TOOL_CALLS]` and a JSON array of {"name", "arguments"} objects.
  `[TOOL_CALLS]` is a special token: with tools offered the output keeps special tokens, as vLLM's
  adjust_request has it. Call ids are 9 letters and digits, which Mistral's chat template requires
  of the calls sent back to it.
- "llama3_json" (Llama 3.x; vLLM's llama_tool_parser.py): an output that starts with `{` (after
  `<|python_tag|>`, which vLLM strips too) is `{"name", "parameters"}` objects (or "arguments"), `;`
  between two of them; any other output is the answer, streamed as it comes. vLLM's whole-response
  reader also finds call objects inside text while its stream does not: here both read as its stream.
- "deepseek_v3" (DeepSeek-V3 and R1; vLLM's deepseekv3_tool_parser.py, SGLang's deepseekv3): text,
  then a section of calls, `<｜tool▁calls▁begin｜>`, each call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`,
  a newline and its arguments in a ```json fence, `<｜tool▁call▁end｜>`, and `<｜tool▁calls▁end｜>`.
  Those markers are tokens of DeepSeek's vocabulary that are not special: the text keeps them
  whatever skip_special_tokens says, as vLLM's parser expects.
- "qwen3_coder" (Qwen3-Coder, Qwen3.5; vLLM's and SGLang's qwen3_coder): Hermes's tags around XML,
  `<tool_call>`, `<function=NAME>`, per argument `<parameter=KEY>` its value `</parameter>`,
  `</function>`, `</tool_call>`, among text. A value is text (one newline after its tag and one
  before its end tag are the layout's), read by the tool's JSON schema type as vLLM's reader reads
  it: `null` as null, a string as written, an integer, number or boolean as one, an object or
  array as JSON; a value its type does not read, or a parameter the schema does not name, stays a string.

Each reader gives the same pieces whatever the chunking (gateway/tool_parser.py's contract).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable

from gateway.tool_parser import ArrayCalls, Calls, HermesCalls, Piece, call_of, new_call_id, partial_tag

MISTRAL_START = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
# DeepSeek-V3's markers (fullwidth bars, and U+2581 for the spaces)
DEEPSEEK_CALLS, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL, DEEPSEEK_CALL_END, DEEPSEEK_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's template refuses any other id of a call sent back to it."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


class MistralCalls(Calls):
    """Content until `[TOOL_CALLS]` (a tail that may begin it held until the next chunk tells), then
    a JSON array of calls, each given as its object closes (ArrayCalls). An array with no call in it
    leaves the whole output as content, as written."""

    def __init__(self, single: bool = False, new_id: Callable[[], str] = mistral_call_id) -> None:
        super().__init__(new_id)
        self.array = ArrayCalls(single, new_id, keys=("arguments",))
        self.buffer = ""  # content not given yet: a possible start of the tag
        self.inside = False  # the tag was seen: what follows is the array's

    @property
    def called(self) -> bool:
        return self.array.called

    def feed(self, text: str) -> list[Piece]:
        if self.inside:
            return self.array.feed(text)
        self.buffer += text
        start = self.buffer.find(MISTRAL_START)
        if start < 0:
            shown = self.buffer[: len(self.buffer) - partial_tag(self.buffer, MISTRAL_START)]
            self.buffer = self.buffer[len(shown):]
            return self._content(shown)
        pieces = self._content(self.buffer[:start])
        rest, self.buffer, self.inside = self.buffer[start + len(MISTRAL_START):], "", True
        return pieces + self.array.feed(rest)

    def finish(self) -> list[Piece]:
        if not self.inside:
            return self._content(self.buffer)
        if self.array.called:
            return self.array.finish()
        return [Piece(content=MISTRAL_START + self.array.text)]  # after the content already given: the output as written

    def _content(self, text: str) -> list[Piece]:
        return [Piece(content=text)] if text else []


class Llama3JsonCalls(Calls):
    """Whether the output is calls is told by its start: `{` (after whitespace and `<|python_tag|>`,
    held until then) makes it a row of call objects (ArrayCalls without brackets, `;` between),
    anything else the answer, given as it comes."""

    def __init__(self, single: bool = False, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.row = ArrayCalls(single, new_id, keys=("arguments", "parameters"), opening=None, separator=";")
        self.start = ""  # the output's start, while it does not tell yet
        self.mode: str | None = None  # "calls" or "content", once told
        self.prefix = ""  # in "calls": what came before the first `{` (whitespace, the tag)

    @property
    def called(self) -> bool:
        return self.row.called

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "calls":
            return self.row.feed(text)
        if self.mode == "content":
            return [Piece(content=text)] if text else []
        self.start += text
        head = self.start.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):].lstrip()
        if PYTHON_TAG.startswith(head):
            return []  # whitespace, or the tag's beginning: not told yet
        self.mode = "calls" if head.startswith("{") else "content"
        if self.mode == "calls":
            self.prefix = self.start[: len(self.start) - len(head)]
            return self.row.feed(head)
        return [Piece(content=self.start)]

    def finish(self) -> list[Piece]:
        if self.mode == "calls":  # no call at all: the whole output is the answer, as written
            return [] if self.row.called else [Piece(content=self.prefix + self.row.text)]
        return [Piece(content=self.start)] if self.mode is None and self.start else []


class DeepSeekV3Calls(Calls):
    """Content until `<｜tool▁calls▁begin｜>` (a tail that may begin it held until the next chunk
    tells), then the section's calls, each given once its `<｜tool▁call▁end｜>` comes (or, cut short,
    at the output's end if its arguments are whole); what follows the section is not read, as
    vLLM's reader leaves it. A call that is not one (no name, arguments not a JSON object) ends the
    reading there; a section with no call in it leaves the whole output as content, as written."""

    def __init__(self, single: bool = False, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.single = single
        self.buffer = ""  # content not given yet: a possible start of the section
        self.section: str | None = None  # the text after the section's start, once it came
        self.position = 0  # where reading the section goes on
        self.done = False  # the section ended, or stopped being calls: nothing more is read

    def feed(self, text: str) -> list[Piece]:
        if self.section is not None:
            self.section += text
            return self._calls()
        self.buffer += text
        start = self.buffer.find(DEEPSEEK_CALLS)
        if start < 0:
            shown = self.buffer[: len(self.buffer) - partial_tag(self.buffer, DEEPSEEK_CALLS)]
            self.buffer = self.buffer[len(shown):]
            return [Piece(content=shown)] if shown else []
        pieces = [Piece(content=self.buffer[:start])] if start else []
        self.section, self.buffer = self.buffer[start + len(DEEPSEEK_CALLS):], ""
        return pieces + self._calls()

    def finish(self) -> list[Piece]:
        if self.section is None:
            return [Piece(content=self.buffer)] if self.buffer else []
        pieces = []
        rest = self.section[self.position:].lstrip()
        if not self.done and rest.startswith(DEEPSEEK_CALL):  # the last call, its end not written
            pieces = self._opened(deepseek_call(rest[len(DEEPSEEK_CALL):]))
        if self.called:
            return pieces
        return [Piece(content=DEEPSEEK_CALLS + self.section)]  # after the content already given: the output as written

    def _calls(self) -> list[Piece]:
        """Each call of the section that closed since the last feed."""
        pieces: list[Piece] = []
        while not self.done:
            rest = self.section[self.position:]
            head = rest.lstrip()
            markers = (DEEPSEEK_CALL, DEEPSEEK_CALLS_END)
            if head.startswith(DEEPSEEK_CALLS_END) or not (head.startswith(DEEPSEEK_CALL) or any(m.startswith(head) for m in markers)):
                self.done = True  # the section's end, or text that is no call: no more calls
            elif (end := head.find(DEEPSEEK_CALL_END)) < 0:
                break  # the call, or the marker, is not whole yet
            else:
                call = deepseek_call(head[len(DEEPSEEK_CALL):end])
                self.done = call is None
                pieces += self._opened(call)
                self.position += len(rest) - len(head) + end + len(DEEPSEEK_CALL_END)
        return pieces

    def _opened(self, call: tuple[str, str] | None) -> list[Piece]:
        if call is None or (self.single and self.called):
            return []
        return self.open(*call)


def deepseek_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one DeepSeek-V3 call's body: `TYPE<｜tool▁sep｜>NAME`, a newline,
    the arguments' JSON object in a ```json fence (left out, or cut short at the output's end, it is
    read alike); None when it is not a call."""
    _, sep, rest = body.partition(DEEPSEEK_SEP)
    name, newline, arguments = rest.partition("\n")
    if not sep or not newline:
        return None
    arguments = arguments.strip().removeprefix("```json").removeprefix("```").rstrip("`").strip()
    try:
        return call_of({"name": name.strip(), "arguments": json.loads(arguments)}, ("arguments",))
    except (ValueError, RecursionError):  # not JSON (or nested past what the decoder takes)
        return None


QWEN3_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
QWEN3_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3CoderCalls(HermesCalls):
    """Hermes's tags and reading (text, calls held until their end tag), each call's body XML:
    `<function=NAME>` and its `<parameter=KEY>VALUE</parameter>`s. `tools` (the request's): each
    value read by its parameter's schema type (`typed`)."""

    def __init__(self, single: bool = False, new_id: Callable[[], str] = new_call_id, tools: tuple[dict, ...] = ()) -> None:
        super().__init__(single, new_id)
        # function name -> parameter name -> its JSON schema type ("string" where none is given)
        self.types = {t["function"]["name"]: {key: (schema or {}).get("type", "string") for key, schema in
                                               ((t["function"].get("parameters") or {}).get("properties") or {}).items()}
                      for t in tools}

    def parsed(self, body: str) -> tuple[str, str] | None:
        function = QWEN3_FUNCTION.match(body)
        if function is None or not function[1].strip():
            return None
        name, types = function[1].strip(), self.types.get(function[1].strip(), {})
        arguments = {key.strip(): typed(value.removeprefix("\n").removesuffix("\n"), types.get(key.strip(), "string"))
                     for key, value in QWEN3_PARAMETER.findall(function[2])}
        return name, json.dumps(arguments, ensure_ascii=False)


def typed(value: str, kind: object) -> object:
    """A qwen3_coder parameter's text as its schema type reads it (vLLM's reader's rule); as written
    where the type does not read it."""
    kinds = kind if isinstance(kind, list) else [kind]
    if value.lower() == "null":  # whatever the type, as vLLM's reader
        return None
    for kind in kinds:
        try:
            if kind == "integer":
                return int(value)
            if kind == "number":
                number = float(value)
                return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
            if kind == "boolean" and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if kind in ("object", "array"):
                return json.loads(value)
        except (ValueError, RecursionError):
            continue
    return value


# model.tool_parser -> the reader of tool_choice "auto" (constructed with single=, and new_id= where given;
# tools= for a syntax in TYPED_READERS)
AUTO_READERS: dict[str, type[Calls]] = {"hermes": HermesCalls, "mistral": MistralCalls, "llama3_json": Llama3JsonCalls,
                                        "deepseek_v3": DeepSeekV3Calls, "qwen3_coder": Qwen3CoderCalls}
# The syntaxes whose arguments are text, read by the request's tools' schemas
TYPED_READERS = ("qwen3_coder",)
# model.tool_parser -> how its calls' ids are made (every choice's, so a call sent back suits the template)
CALL_IDS: dict[str, Callable[[], str]] = {"mistral": mistral_call_id}
