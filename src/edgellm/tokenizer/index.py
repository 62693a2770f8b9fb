"""Token text -> id for a large vocabulary, without a Python dict.

A dict over Gemma 3's 262k token strings costs ~50 MB of str and int objects and ~0.4 s to
build. This index keeps the strings where they already are (the GGUF reader's compact
StringArray) and adds two int arrays: each token's hash, and an open-addressing table of token
ids -- ~4 MB in all. The hashes are computed in numpy over the strings' UTF-8 bytes, a few
milliseconds for a whole vocabulary, never by decoding a token."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edgellm.io.strings import as_string_array

# A string's hash: its UTF-8 bytes read as one little-endian integer, modulo a Mersenne prime
# (small enough that numpy sums byte * 256^j mod p in uint64 without overflow). Equal hashes
# only cost a comparison of the bytes; the table slot mixes all the bits (Fibonacci hashing).
_MODULUS = (1 << 31) - 1
_MIX = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1
_COLUMNS = 1024  # strings longer than this are hashed one by one (see string_hashes)


def text_hash(raw: bytes) -> int:
    return int.from_bytes(raw, "little") % _MODULUS


class VocabIndex:
    """Finds a token's id by its text. `respelled` gives the tokens a tokenizer sees spelled
    otherwise than the vocabulary stores them (id -> that spelling); they are found only by it."""

    def __init__(self, tokens: Sequence[str], respelled: Mapping[int, str] | None = None):
        self._strings = as_string_array(tokens)
        self._blob, starts, ends = self._strings.spans()
        self._respelled: dict[str, int] = {}
        for token_id in sorted(respelled or {}):  # ascending: the last of equal spellings wins
            self._respelled[respelled[token_id]] = token_id
        hashes = string_hashes(self._strings)
        ids = np.arange(len(hashes) - 1, -1, -1)  # the highest id of equal texts is met first
        if respelled:
            hashed = np.ones(len(hashes), bool)
            hashed[list(respelled)] = False
            ids = ids[hashed[ids]]
        self._bits = max(4, (2 * len(ids)).bit_length())
        table = _probing_table(_slots(hashes[ids], self._bits), ids, self._bits)
        self._hashes, self._table = memoryview(hashes), memoryview(table)  # indexing yields ints
        self._starts, self._ends = memoryview(starts), memoryview(ends)

    def get(self, text: str) -> int | None:
        """The id of the token spelled `text`; the last one when several are."""
        found = self._respelled.get(text)
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no token holds one
            return found
        h = text_hash(raw)
        slot = ((h * _MIX) & _U64) >> (64 - self._bits)
        while (token_id := self._table[slot]) >= 0:
            if self._hashes[token_id] == h and self._blob[self._starts[token_id]:self._ends[token_id]] == raw:
                return token_id if found is None else max(found, token_id)
            slot += 1
        return found

    def __contains__(self, text: str) -> bool:
        return self.get(text) is not None

    def __len__(self) -> int:
        return len(self._strings)


def string_hashes(strings: Sequence[str]) -> np.ndarray:
    """text_hash of every string. Strings up to _COLUMNS bytes are summed a column of bytes at a
    time, longest first, so the strings still going at byte j are a prefix of that order; each
    term is below 2^39, so the sums stay exact in uint64 and are reduced once, at the end. Longer
    strings (none in real vocabularies) are hashed one by one."""
    array = as_string_array(strings)
    blob, starts, ends = array.spans()
    raw = np.frombuffer(blob, np.uint8)
    lengths = (ends - starts).astype(np.int64)
    order = np.argsort(-lengths, kind="stable")
    first, remaining = starts[order].astype(np.int64), lengths[order]
    long = int(np.searchsorted(-remaining, -_COLUMNS, side="left"))  # strings longer than _COLUMNS
    sums = np.zeros(len(order), np.uint64)
    power = 1
    for j in range(min(int(remaining[0]), _COLUMNS) if len(order) else 0):
        going = int(np.searchsorted(-remaining, -j, side="left"))  # strings longer than j
        sums[long:going] += raw[first[long:going] + j].astype(np.uint64) * np.uint64(power)
        power = power * 256 % _MODULUS
    hashes = np.empty(len(order), np.int64)
    hashes[order] = (sums % np.uint64(_MODULUS)).astype(np.int64)
    hashes[order[:long]] = [text_hash(array.raw(int(i))) for i in order[:long]]
    return hashes


def _slots(hashes: np.ndarray, bits: int) -> np.ndarray:
    mixed = hashes.astype(np.uint64) * np.uint64(_MIX)  # wraps modulo 2^64, as in get()
    return (mixed >> np.uint64(64 - bits)).astype(np.int64)


def _probing_table(slots: np.ndarray, ids: np.ndarray, bits: int) -> np.ndarray:
    """Token ids placed by linear probing in one vectorized pass: in order of their home slot
    (`ids` order among equal ones: VocabIndex lists the highest id first, so a probe meets the
    last of equal texts first), each at its home
    or just after the one before, whichever is later -- every slot from an id's home to its place
    is then taken, which is what a probe relies on. The runs spill past the last home slot rather
    than wrap; an empty slot past them all ends every probe."""
    order = np.argsort(slots, kind="stable")
    homes = slots[order]
    steps = np.arange(len(homes))
    places = np.maximum.accumulate(homes - steps) + steps if len(homes) else homes
    last = int(places[-1]) if len(places) else 0
    table = np.full(max(1 << bits, last + 1) + 1, -1, np.int32)  # any home slot, then an empty one
    table[places] = ids[order]
    return table
