"""Tool calls out of a model's text, piece by piece as it streams, in OpenAI's delta shape.

Three readers, one per kind of tool_choice (gateway/tools.py picks one per choice):
- "auto": the model family's own syntax (model.tool_parser, gateway/tool_syntaxes.py); here the
  Hermes/Qwen3 one, `HermesCalls`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number of them among ordinary text.
- `ArrayCalls` ("required"): the whole output is a JSON array of {"name", "parameters"} objects,
  as the constraint vLLM builds for it makes the model write (other rows of call objects, Mistral's
  and Llama 3's, are read by it too).
- `NamedCall` (a named function): the whole output is that function's arguments.

Each takes the text in any chunking (`feed`, then `finish` once) and returns Pieces: a piece of
content or one tool_calls delta entry (the first of a call carries index, id, type, name and
arguments "", later ones argument text, as OpenAI streams them). A piece is given only once it is
final, so any chunking of a text gives the same pieces joined: a whole response is `feed(text)`
and `finish()` (`whole`), and a stream adds up to it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

START, END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Piece:
    """Text for `content`, one entry of a delta's `tool_calls`, or text of the model's thinking
    (`reasoning_content`, gateway/reasoning.py): exactly one of them is set."""

    content: str | None = None
    call: dict | None = None
    reasoning: str | None = None


class Calls:
    """What the three readers share: numbering calls, and `called` once one was given."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.count = 0  # calls opened

    @property
    def called(self) -> bool:
        return self.count > 0

    def open(self, name: str, arguments: str | None = None) -> list[Piece]:
        """A call's pieces: its opening, then its arguments when they are known."""
        index, self.count = self.count, self.count + 1
        pieces = [Piece(call={"index": index, "id": self.new_id(), "type": "function", "function": {"name": name, "arguments": ""}})]
        return pieces + self.arguments(arguments or "", index)

    @staticmethod
    def arguments(text: str, index: int) -> list[Piece]:
        return [Piece(call={"index": index, "function": {"arguments": text}})] if text else []

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError


def call_of(value: object, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of {"name": ..., <key>: {...}} (the first of `keys` it has), or
    None when the value is not that: a call is a name and an object of arguments (absent: none). The
    arguments are written again by json.dumps, as vLLM's parsers do, whatever whitespace the model
    put in them."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(next((key for key in keys if key in value), keys[0]), {})
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class HermesCalls(Calls):
    """`<tool_call>{json}</tool_call>` among text. The text outside the calls is content; a call
    whose JSON is not a call stays in the content as written (vLLM's hermes parser keeps the whole
    output then). Text from `<tool_call>` on is held until its `</tool_call>` (or the end of the
    output: a last call may be left open), and a tail that may be the start of `<tool_call>` until
    the next chunk tells. Whitespace is held until text follows it, and with a call made the
    whitespace that no text follows (before, between and after calls) is dropped, however the text
    was chunked: a stream shows exactly the content a whole response has, and content of
    whitespace alone is none (null).
    `single` (parallel_tool_calls false): calls after the first are dropped."""

    def __init__(self, single: bool = False, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.single = single
        self.buffer = ""  # text not decided yet: a possible start tag, or a call's body
        self.inside = False  # the buffer is a call's body (its START consumed)
        self.spaces = ""  # whitespace content held back

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while True:
            if self.inside:
                end = self.buffer.find(END)
                if end < 0:
                    return _merged(pieces)
                pieces += self._call(self.buffer[:end], closed=True)
                self.buffer, self.inside = self.buffer[end + len(END):], False
            else:
                start = self.buffer.find(START)
                if start < 0:
                    keep = partial_tag(self.buffer)
                    pieces += self._content(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return _merged(pieces)
                pieces += self._content(self.buffer[:start])
                self.buffer, self.inside = self.buffer[start + len(START):], True

    def finish(self) -> list[Piece]:
        pieces = self._call(self.buffer, closed=False) if self.inside else self._content(self.buffer)
        self.buffer, self.inside = "", False
        if self.spaces and not self.called:  # an answer of whitespace alone is still the answer
            pieces.append(Piece(content=self.spaces))
            self.spaces = ""
        return _merged(pieces)

    def parsed(self, body: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of a call's body, None when it is not a call: here JSON
        (another syntax with the same tags reads its own: tool_syntaxes.py's Qwen3CoderCalls)."""
        try:
            return call_of(json.loads(body), ("arguments",))
        except (ValueError, RecursionError):  # not JSON (or nested past what the decoder takes)
            return None

    def _call(self, body: str, closed: bool) -> list[Piece]:
        call = self.parsed(body)
        if call is None:
            return self._content(START + body + (END if closed else ""))
        if self.single and self.called:
            return []
        return self.open(*call)

    def _content(self, text: str) -> list[Piece]:
        """Text up to its last non-whitespace character; the whitespace after it waits for more."""
        self.spaces += text
        shown = self.spaces.rstrip()
        self.spaces = self.spaces[len(shown):]
        return [Piece(content=shown)] if shown else []


def partial_tag(text: str, tag: str = START) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ArrayCalls(Calls):
    """`[{"name": ..., "parameters": {...}}, ...]`: each call is given when its object closes.
    The constraint makes the output such an array; one that is not (cut short by max_tokens, or
    a worker that does not constrain) ends the calls where it stops being one, and an output with
    no call at all is content, as written.
    Other rows of call objects are read alike: `keys` names the arguments (the first one a call
    has), `opening` starts the row (None: the first object does) and `separator` comes between
    two calls (Llama 3's `{...}; {...}`)."""

    def __init__(self, single: bool = False, new_id: Callable[[], str] = new_call_id, keys: tuple[str, ...] = ("parameters",),
                 opening: str | None = "[", separator: str = ",") -> None:
        super().__init__(new_id)
        self.single = single
        self.keys, self.separator = keys, separator
        self.text = ""
        self.position = 0  # where reading goes on
        self.expect = opening or "item"  # what comes next: the opening, an "item", or the separator before the next one
        self.done = False  # the array ended, or the text stopped being one: the rest is not read

    def feed(self, text: str) -> list[Piece]:
        self.text += text
        pieces: list[Piece] = []
        while not self.done and (item := self._next_item()) is not None:
            call = call_of(item, self.keys)
            if call is None:
                self.done = True
            elif not (self.single and self.called):
                pieces += self.open(*call)
        return pieces

    def finish(self) -> list[Piece]:
        return [] if self.called or not self.text else [Piece(content=self.text)]

    def _next_item(self) -> object | None:
        """The next whole item; None while it is incomplete, or when there is none to come."""
        while True:
            at = skip_space(self.text, self.position)
            if at == len(self.text):
                return None
            if self.expect == "item":
                try:
                    item, self.position = json.JSONDecoder().raw_decode(self.text, at)
                except (ValueError, RecursionError):
                    return None  # incomplete, or never whole: finish() decides
                self.expect = self.separator
                return item
            if self.text[at] != self.expect:  # "]" after an item ends the array; anything else is no array (no more calls)
                self.done = True
                return None
            self.position, self.expect = at + 1, "item"


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


class NamedCall(Calls):
    """A named tool_choice: the output is the arguments of one call of `name`, streamed as written."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.name = name

    def feed(self, text: str) -> list[Piece]:
        return self.arguments(text, 0) if self.called else self.open(self.name, text)

    def finish(self) -> list[Piece]:
        return [] if self.called else self.open(self.name)


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Neighbouring content pieces as one."""
    out: list[Piece] = []
    for piece in pieces:
        if piece.content is not None and out and out[-1].content is not None:
            out[-1] = Piece(content=out[-1].content + piece.content)
        else:
            out.append(piece)
    return out


def joined(pieces: list[Piece]) -> tuple[str, list[dict]]:
    """Pieces added up as a client accumulates a stream: the content, and each call whole
    ({"id", "type", "function": {"name", "arguments"}})."""
    content, calls = "", []
    for piece in pieces:
        if piece.content is not None:
            content += piece.content
        elif piece.call is None:  # thinking: gateway/reasoning.py adds it up
            continue
        elif "id" in piece.call:
            calls.append({key: value for key, value in piece.call.items() if key != "index"}
                         | {"function": dict(piece.call["function"])})
        else:
            calls[piece.call["index"]]["function"]["arguments"] += piece.call["function"]["arguments"]
    return content, calls


def whole(reader: Calls, text: str) -> tuple[str, list[dict]]:
    """A whole output's content and calls."""
    return joined(reader.feed(text) + reader.finish())
