"""Bytes -> text for streaming: never emit half a UTF-8 character, never emit the start of
a stop string before knowing whether it completes."""
from __future__ import annotations

import codecs
from typing import Callable


class IncrementalDetokenizer:
    """Turns token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """What is left at the end; a truncated character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings across token boundaries.

    Text is released only once it cannot be the beginning of a stop string; on a match,
    everything before the stop string is released and the stop string itself is not."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if not self.stops:
            return text
        self._pending += text
        hits = [(self._pending.find(s), s) for s in self.stops if s in self._pending]
        if hits:
            index, self.matched = min(hits)
            released, self._pending = self._pending[:index], ""
            return released
        hold = self._longest_partial_match()
        cut = len(self._pending) - hold
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return released

    def _longest_partial_match(self) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        released, self._pending = self._pending, ""
        return released
