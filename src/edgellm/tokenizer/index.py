"""Token text -> id for a large vocabulary, without a Python dict.

A dict over Gemma 3's 262k token strings costs ~50 MB of str and int objects. This index keeps
the strings where they already are (the GGUF reader's compact StringArray) and adds two int
arrays: each token's hash, and an open-addressing table of token ids -- ~4 MB in all."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class VocabIndex:
    """Finds a token's id by its text, as `spell` writes each token (the text a tokenizer sees)."""

    def __init__(self, tokens: Sequence[str], spell: Callable[[str], str] = str):
        self._tokens, self._spell = tokens, spell
        # hash() is Python's keyed SipHash: the same within this process, which is all we need.
        hashes = np.fromiter((hash(spell(t)) for t in tokens), dtype=np.int64, count=len(tokens))
        table = _open_addressing_table(hashes)
        self._mask = len(table) - 1
        self._hashes, self._table = memoryview(hashes), memoryview(table)  # indexing yields ints

    def get(self, text: str) -> int | None:
        """The id of the token spelled `text`; the last one when several are."""
        h = hash(text)
        slot = h & self._mask
        while (token_id := self._table[slot]) >= 0:
            if self._hashes[token_id] == h and self._spell(self._tokens[token_id]) == text:
                return token_id
            slot = (slot + 1) & self._mask
        return None

    def __contains__(self, text: str) -> bool:
        return self.get(text) is not None

    def __len__(self) -> int:
        return len(self._tokens)


def _open_addressing_table(hashes: np.ndarray) -> np.ndarray:
    """Slots (a power of two, at most half full) holding token ids at their hash's slot or the
    next free one after it (linear probing), placed in rounds: each round, every token still
    waiting claims its slot if free -- the highest id first, so `get`'s probe meets the last
    of equal texts first -- and moves one slot on otherwise."""
    size = 1 << max(4, (2 * len(hashes) - 1).bit_length())
    table = np.full(size, -1, np.int32)
    waiting = np.arange(len(hashes) - 1, -1, -1)
    slots = hashes[waiting] & (size - 1)
    while len(waiting):
        free = np.flatnonzero(table[slots] < 0)
        claimed, first = np.unique(slots[free], return_index=True)  # first waiting token per slot
        winners = free[first]
        table[claimed] = waiting[winners]
        keep = np.ones(len(waiting), bool)
        keep[winners] = False
        waiting, slots = waiting[keep], (slots[keep] + 1) & (size - 1)
    return table
