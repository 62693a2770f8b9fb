"""Pieces shared by edgellm's encoders: cutting added tokens out of text, and memoized lookups."""
from __future__ import annotations

import re
from collections.abc import Iterator


class Memo(dict):
    """A function's results by argument, computed at first use (one encode's index lookups)."""

    def __init__(self, function):
        super().__init__()
        self._function = function

    def __missing__(self, key):
        value = self[key] = self._function(key)
        return value


class AddedTokens:
    """Cuts added tokens out of text: the leftmost match, the longest one at that position."""

    def __init__(self, ids: dict[str, int]):
        self._ids = ids
        lengths: dict[str, set[int]] = {}
        for token in ids:
            lengths.setdefault(token[0], set()).add(len(token))
        self._lengths = {first: sorted(ls, reverse=True) for first, ls in lengths.items()}
        self._starts = re.compile("[" + "".join(map(re.escape, self._lengths)) + "]") if ids else None

    def split(self, text: str) -> Iterator[tuple[str, int | None]]:
        """(text before an added token, its id) pairs, then (the rest, None)."""
        start = pos = 0
        while self._starts is not None and (found := self._starts.search(text, pos)) is not None:
            at = found.start()
            pos = at + 1
            for length in self._lengths[text[at]]:
                token_id = self._ids.get(text[at:at + length])
                if token_id is not None:
                    yield text[start:at], token_id
                    start = pos = at + length
                    break
        yield text[start:], None
