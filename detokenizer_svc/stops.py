"""Stop strings over streamed text.

Text is held back while its tail could still grow into a stop string, so nothing that ends up
part of a stop string is ever sent. A request stops at the first push whose text completes a
stop string (as vLLM and SGLang do): we do not wait to see whether a longer stop string that
began earlier would complete too. When several complete within the same push, the one that
starts earliest wins (ties: the shorter, which completed first); the output is cut right
before it.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)  # an empty stop string would match at once
        self._held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to send now, the stop string matched or None)."""
        buf = self._held + text  # a match can only start in held text or in `text`, see _tail
        found = [(at, len(s), s) for s in self._stops if (at := buf.find(s)) >= 0]
        if found:
            at, _, stop = min(found)
            self._held = ""
            return buf[:at], stop
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
