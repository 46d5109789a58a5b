"""Stop strings and stop patterns over streamed text.

Stop strings: text is held back while its tail could still grow into a stop string, so nothing
that ends up part of a stop string is ever sent. A request stops at the first push whose text
completes a stop string (as vLLM and SGLang do): we do not wait to see whether a longer stop
string that began earlier would complete too. When several complete within the same push, the
one that starts earliest wins (ties: the shorter, which completed first); the output is cut right
before it, or right after it with `keep_stop` (SGLang's no_stop_trim).

Stop patterns (SGLang's stop_regex): after each push, `re.search` over the output so far, as SGLang
searches the decoded tail of the output after each token. Nothing is held back for them: SGLang
streams text as it comes, and its match stays in the output (SGLang trims a finish's `matched`
from the text, and for a pattern that is the pattern's source, not the text it matched). The
output ends where the match ends: text after it in the same push is dropped. Patterns are tried in
order, after the stop strings (SGLang's order); the first that matches is the finish's `matched`.
A match first found now ends at or after the end of the text searched last time (earlier text
only matters to zero-width tests at a match's end: `$`, word boundaries), so it starts at most the
pattern's longest match before that, where the search starts (at the output's start for an
unbounded pattern or one with a lookahead, which reads past its match); `^` still means the
output's start, and lookbehinds still see the text before.

Patterns are searched with the `regex` module (Python's `re` syntax and meaning, plus a time
limit): a pattern that backtracks catastrophically (`(a|aa)+$`) would otherwise stall this
detokenizer for every request it serves. A search that takes longer than PATTERN_TIMEOUT_S raises
SlowPattern, which ends that request alone.
"""

from __future__ import annotations

import re
from re import _parser  # the pattern's longest match, as SGLang bounds its window (sre_parse)

import regex

PATTERN_TIMEOUT_S = 0.05  # one search of one pattern over one request's output


class SlowPattern(Exception):
    """A stop pattern's search ran out of time: the request cannot be served as asked."""

    def __init__(self, pattern: str) -> None:
        super().__init__(f"stop_regex {pattern!r} took more than {PATTERN_TIMEOUT_S * 1000:g} ms to search the output "
                         "(catastrophic backtracking?); the request was ended")
        self.pattern = pattern


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], patterns: tuple[str, ...] = (), keep_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)  # an empty stop string would match at once
        self._patterns = tuple((regex.compile(p), reach(p)) for p in patterns)  # the gateway checked they compile
        self._searched = 0  # the output's length when patterns were last searched
        self._keep = keep_stop
        self._held = ""
        self._text = ""  # the whole output so far, sent or held: kept only for patterns

    def push(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Return (text safe to send now, the stop string or pattern matched or None). With
        `check` false (before min_new_tokens) the text passes unmatched, though patterns see it later."""
        buf = self._held + text  # a match can only start in held text or in `text`, see _tail
        sent = len(self._text) - len(self._held)  # of the whole output, what went out already
        if self._patterns:
            self._text += text
        if not check:
            self._held = ""
            return buf, None
        found = [(at, len(s), s) for s in self._stops if (at := buf.find(s)) >= 0]
        if found:
            at, n, stop = min(found)
            self._held = ""
            return buf[: at + n if self._keep else at], stop
        for pattern, longest in self._patterns:
            try:
                match = pattern.search(self._text, max(self._searched - longest, 0), timeout=PATTERN_TIMEOUT_S)
            except TimeoutError:
                raise SlowPattern(pattern.pattern) from None
            if match is not None:
                self._held = ""
                return self._text[sent : max(match.end(), sent)], pattern.pattern
        self._searched = len(self._text)
        keep = self._tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def finish(self) -> str:
        """Release held text when the request ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


def reach(pattern: str) -> int:
    """How far before the text searched last a new match of `pattern` can start: its longest match
    (the whole output, as far as it matters, when unbounded or when it may look ahead)."""
    if "(?=" in pattern or "(?!" in pattern:  # an escaped "(" only costs a longer search
        return 1 << 62
    try:
        return min(_parser.parse(pattern).getwidth()[1], 1 << 62)
    except re.error:  # syntax only `regex` knows: search it all
        return 1 << 62
