"""The load: the requests of a run, the same for every target of a round, and when they arrive.

Synthetic prompts are token ids drawn from ID_RANGE (exact lengths; a valid id in any vocabulary
of 30k tokens or more) or text of common English words, each one token in the GPT-2, Llama and
Qwen byte-level BPE vocabularies (SmolLM2's: 128 words are 128 tokens), so a text prompt is about
--input-len tokens on any server. Each round draws new prompts (seeded), so a server's prefix
cache never sees a prompt twice, unless they start with a shared prefix (--shared-prefix-len): the
same tokens at the start of every prompt, the warm-up's too, as a system prompt shared by every
user.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ID_RANGE = (1000, 30000)
WORDS = tuple("""
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law
car city community name president team minute idea kid body information back parent face others
level office door health person art war history party result change morning reason research girl
guy moment air teacher force education foot boy age policy music market sense nation plan
college interest death experience effect use class control care field development role effort
rate heart drug show leader light voice wife police mind price report decision son view
relationship town road arm difference value building action model season society tax director
position player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data
picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population truth song energy
""".split())
# Extensions (vLLM, SGLang, llama.cpp and jaxstream accept them) that make a request generate exactly
# max_tokens tokens. A target drops one its server refuses (`served.py`).
EXACT_LENGTH = ("ignore_eos", "min_tokens")

ROLES = {"system", "developer", "user", "assistant"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}


class ConversationError(ValueError):
    """A conversations file that cannot be used; the message names the entry."""


@dataclass(frozen=True)
class Conversation:
    messages: tuple[tuple[str, str], ...]  # (role, content), ending with a user turn
    max_tokens: int | None = None


@dataclass(frozen=True)
class Request:
    """One request of the load, before a target puts its model name and stream flags on it."""

    max_tokens: int
    prompt: str | list[int] | None = None  # /v1/completions
    messages: tuple[tuple[str, str], ...] | None = None  # /v1/chat/completions
    input_len: int | None = None  # prompt tokens as drawn (text: about); None for a conversation

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def body(self, temperature: float, extra: dict, extensions: tuple[str, ...] = EXACT_LENGTH) -> dict:
        """The JSON body, without model and stream fields. `extensions`: those of EXACT_LENGTH to send."""
        body: dict = {"messages": [{"role": r, "content": c} for r, c in self.messages]} if self.chat else {"prompt": self.prompt}
        body.update(max_tokens=self.max_tokens, temperature=temperature)
        if "ignore_eos" in extensions:
            body["ignore_eos"] = True
        if "min_tokens" in extensions:
            body["min_tokens"] = self.max_tokens
        return {**body, **extra}


@dataclass(frozen=True)
class Schedule:
    """When requests go out: a closed loop of `concurrency` in flight, or at `arrivals` (seconds from the start)."""

    concurrency: int | None = None
    arrivals: tuple[float, ...] | None = None


def rng_for(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([seed, *key])


def synthetic(n: int, input_len: int, output_len: int, prompt_format: str, rng: np.random.Generator,
              prefix: list | None = None) -> list[Request]:
    """n prompts of `input_len` tokens each, after the `prefix` (`shared_prefix`'s) when one is given."""
    prefix = prefix or []
    rows = _tokens(prompt_format, n, input_len, rng)
    if prompt_format == "ids":
        return [Request(output_len, prompt=[*prefix, *row], input_len=len(prefix) + input_len) for row in rows]
    return [Request(output_len, prompt=" ".join([*prefix, *row]), input_len=len(prefix) + input_len) for row in rows]


def shared_prefix(length: int, prompt_format: str, rng: np.random.Generator) -> list:
    """The first `length` tokens of every prompt (ids, or words), as a shared system prompt would be.
    Words join with a space before the prompt's own, so a prompt's first `length` tokens are these."""
    return _tokens(prompt_format, 1, length, rng)[0]


def _tokens(prompt_format: str, n: int, length: int, rng: np.random.Generator) -> list[list]:
    if prompt_format == "ids":
        return rng.integers(*ID_RANGE, size=(n, length)).tolist()
    return [[WORDS[i] for i in row] for row in rng.integers(0, len(WORDS), size=(n, length))]


def from_conversations(conversations: list[Conversation], n: int, output_len: int) -> list[Request]:
    """The first n, in file order, cycling."""
    picked = (conversations[i % len(conversations)] for i in range(n))
    return [Request(c.max_tokens or output_len, messages=c.messages) for c in picked]


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> tuple[float, ...]:
    """The first at 0, then exponential gaps of mean 1 / rate."""
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return tuple(np.concatenate([[0.0], np.cumsum(gaps)]).tolist())


def read_conversations(path: Path) -> list[Conversation]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConversationError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversationError(f"{str(path)!r} is not JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise ConversationError(f"{str(path)!r} must hold a non-empty JSON list of conversations")
    return [_conversation(entry, i) for i, entry in enumerate(data)]


def _conversation(entry: object, i: int) -> Conversation:
    where = f"entry {i}"
    if not isinstance(entry, dict) or ("messages" in entry) == ("conversations" in entry):
        raise ConversationError(f"{where}: expected an object with either 'messages' or 'conversations' (ShareGPT)")
    turns = []
    if "messages" in entry:
        for m in _list(entry["messages"], f"{where}.messages"):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ConversationError(f"{where}.messages: each message needs a role among {sorted(ROLES)}, got {m!r:.80}")
            turns.append((m["role"], _text(m.get("content"), f"{where}.messages")))
    else:
        for m in _list(entry["conversations"], f"{where}.conversations"):
            if not isinstance(m, dict) or m.get("from") not in SHAREGPT_ROLES:
                raise ConversationError(f"{where}.conversations: each turn needs 'from' among {sorted(SHAREGPT_ROLES)}, "
                                        f"got {m!r:.80}")
            turns.append((SHAREGPT_ROLES[m["from"]], _text(m.get("value"), f"{where}.conversations")))
    while turns and turns[-1][0] == "assistant":  # the reference answer
        turns.pop()
    if not turns or turns[-1][0] != "user":
        raise ConversationError(f"{where}: has no user turn to answer")
    max_tokens = entry.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ConversationError(f"{where}.max_tokens: must be an integer >= 1, got {max_tokens!r}")
    return Conversation(tuple(turns), max_tokens)


def _list(value: object, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise ConversationError(f"{where}: must be a non-empty list")
    return value


def _text(content: object, where: str) -> str:
    """A string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise ConversationError(f"{where}: content must be a string or a list of text parts, got {content!r:.80}")
