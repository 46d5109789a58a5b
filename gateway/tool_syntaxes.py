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

Each reader gives the same pieces whatever the chunking (gateway/tool_parser.py's contract).
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable

from gateway.tool_parser import ArrayCalls, Calls, HermesCalls, Piece, new_call_id, partial_tag

MISTRAL_START = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
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


# model.tool_parser -> the reader of tool_choice "auto" (constructed with single=, and new_id= where given)
AUTO_READERS: dict[str, type[Calls]] = {"hermes": HermesCalls, "mistral": MistralCalls, "llama3_json": Llama3JsonCalls}
# model.tool_parser -> how its calls' ids are made (every choice's, so a call sent back suits the template)
CALL_IDS: dict[str, Callable[[], str]] = {"mistral": mistral_call_id}
