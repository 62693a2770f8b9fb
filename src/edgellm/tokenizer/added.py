"""Pieces shared by edgellm's encoders: cutting added tokens out of text, memoized lookups, and
the BPE merge loop itself."""
from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterator


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


def merge_pieces(texts: list[str | None], ids: list[int],
                 candidate: Callable[[str, str, int], tuple | None],
                 still_merges: Callable[[str, str, str], bool]) -> list[int]:
    """BPE over a doubly linked list of pieces, with a heap of candidate merges. `candidate(left
    text, right text, left index)` is a heap entry ending in (left index, merged text, token id),
    ordered as the encoder's merge priority, or None where the pair does not merge. An entry goes
    stale when a neighbour merges first; it is dropped unless `still_merges(left text, right
    text, merged text)` (the test Hugging Face's BPE makes, kept for equal output)."""
    n = len(texts)
    prev, next_ = list(range(-1, n - 1)), list(range(1, n + 1))
    if n:
        next_[-1] = -1
    heap = [c for i in range(n - 1) if (c := candidate(texts[i], texts[i + 1], i)) is not None]
    heapq.heapify(heap)
    while heap:
        left, merged, token_id = heapq.heappop(heap)[-3:]
        right = next_[left]
        if texts[left] is None or right < 0 or not still_merges(texts[left], texts[right], merged):
            continue
        texts[left], texts[right], ids[left] = merged, None, token_id
        next_[left] = after = next_[right]
        if after >= 0:
            prev[after] = left
            if (c := candidate(merged, texts[after], left)) is not None:
                heapq.heappush(heap, c)
        if (before := prev[left]) >= 0 and (c := candidate(texts[before], merged, before)) is not None:
            heapq.heappush(heap, c)
    return [token_id for token_id, text in zip(ids, texts) if text is not None]
