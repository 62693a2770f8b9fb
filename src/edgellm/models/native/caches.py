"""What the native decoder layers know of the KV caches: each layer cache as layer_types.h's
KVSlots over its pages, and each sequence's per-layer KVSlots as one array, rebuilt only when
one of its caches changes pages (building ~30 structs per sequence every step cost ~0.1 ms each).
A cache's page table grows in place when the cache only gained pages at its end (each new block of
a decoding sequence), written as rows of int64s: rebuilt whole from a ctypes struct per page, the
30 tables of a 512-token context took ~2 ms on the first decode step after its prompt (now ~1.3)
and again at every new block (now one row per table). A page's row is kept while the page lives, so
the pages of a cached prefix are described once for every sequence that reuses them (a turn after
a 1,000-token cached history: TTFT 12.5 -> 11.5 ms).

A decode step runs a few Python passes over each sequence's layers (offsets, versions, what was
written); everything else a sequence's array needs — whether the C layers read its caches, the room
reserved in them — is worked out when the array is (re)built, since each pass over 30 layers is
paid again for every row of every step."""
from __future__ import annotations

import ctypes
import weakref
from typing import Sequence

import numpy as np

from edgellm.models.native.structs import KVPage, KVSlots
from edgellm.kv.cache import DenseCache, RingCache
from edgellm.kv.codecs import FloatCodec, Int4Codec, Int8Codec

_KV_F32, _KV_F16, _KV_INT8, _KV_INT4, _KV_BF16 = 0, 1, 2, 3, 4  # layer_types.h
assert ctypes.sizeof(KVPage) == 8 * 8  # page_rows writes a page as 8 int64 fields


class CacheViews:
    """The KVSlots of the caches one decoder has seen (weakly held: a finished sequence's go with it)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per cache: a _CacheView
        # per sequence (by its first layer's cache): its layers' KVSlots as one array
        self._sequences: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def sequence(self, layers: Sequence, new_tokens: int) -> int | None:
        """The address of the sequence's per-layer KVSlots array, with room reserved in every cache
        for its next `new_tokens`; None where the C layers cannot take it (a cache they do not
        read, layers out of step, past max_len)."""
        if not layers:
            return None
        start = layers[0].offset
        if start + new_tokens > self.max_len or any(c.offset != start for c in layers):
            return None
        versions = [c.version for c in layers]
        entry = self._sequences.get(layers[0])
        if entry is None or entry.versions != versions or start + new_tokens > entry.room \
                or entry.ids != tuple(map(id, layers)):
            if not all(self._view(c).native for c in layers):
                return None
            for cache in layers:  # grow before any KVSlots points into the stores
                cache.reserve(start + new_tokens)
            entry = self._sequences[layers[0]] = _SequenceSlots(layers, [self._slots(c) for c in layers])
        for i in entry.rings:  # a ring's written slots grow every step
            entry.array[i].used = layers[i].used_slots
        return ctypes.addressof(entry.array)

    def _view(self, cache) -> _CacheView:
        view = self._caches.get(cache)
        if view is None:
            view = self._caches[cache] = _CacheView(native_cache(cache))
        return view

    def _slots(self, cache) -> KVSlots:
        view = self._view(cache)
        if view.version != cache.version or view.slots is None:
            view.version, view.slots = cache.version, view.update(cache)
        view.slots.used = getattr(cache, "used_slots", 0)  # a ring's written slots grow every step
        return view.slots


class _SequenceSlots:
    """One sequence's per-layer KVSlots in one array, built at its caches' current versions, and
    the tokens its dense caches have room for (rings take any number)."""

    def __init__(self, layers: Sequence, slots: list[KVSlots]):
        # which caches (by id: a reference would keep the key, its first layer, and every page alive)
        self.ids = tuple(map(id, layers))
        self.array = (KVSlots * len(slots))(*slots)
        self.versions = [c.version for c in layers]
        self.rings = [i for i, c in enumerate(layers) if hasattr(c, "used_slots")]
        self.room = min((c.capacity for c in layers if not hasattr(c, "used_slots")), default=1 << 62)


class _CacheView:
    """What the decoder knows of one layer cache: its KVSlots, and the page table they point to with
    the cache's pages it was written from."""

    def __init__(self, native: bool):
        self.native = native
        self.version = -1  # the cache's `version` when `slots` was built
        self.slots: KVSlots | None = None
        self.table: ctypes.Array | None = None  # KVPage entries, room for more
        self.pages: list = []  # the cache's pages the table's first entries describe

    def update(self, cache) -> KVSlots:
        """KVSlots of the cache as it is now: the table extended in place where the cache only gained
        pages after those it had, else written anew with room to grow."""
        pages, kept = list(cache.pages), len(self.pages)
        if self.table is None or len(pages) > len(self.table) or pages[:kept] != self.pages:
            self.table, kept = (KVPage * max(2 * len(pages), 16))(), 0  # the old one may still be read: a new one
        if len(pages) > kept:  # as int64 rows: a ctypes struct per page cost ~1.5 us, these ~0.3
            np.frombuffer(self.table, dtype=np.int64).reshape(len(self.table), 8)[kept:len(pages)] = page_rows(pages[kept:])
        self.pages = pages
        ring = cache.slot_positions
        return KVSlots(ctypes.addressof(self.table), cache.page_tokens, cache.capacity,
                       None if ring is None else ring.ctypes.data)


# Each page's row, kept while the page lives (its buffers never change): a page of a cached prefix is
# described once, not again on every sequence's first decode step (30 layers x its pages, ~2 us each).
_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def page_rows(pages: Sequence) -> list[tuple[int, ...]]:
    """KVPages (kv/store.py) as layer_types.h's, each as its 8 int64 fields: K's values, scale, min
    and codec, then V's."""
    rows = []
    for page in pages:
        row = _ROWS.get(page)
        if row is None:
            row = _ROWS[page] = _fields(page.k) + _fields(page.v)
        rows.append(row)
    return rows


def _fields(store) -> tuple[int, int, int, int]:
    values, scale, low = store.buffers()
    return values.ctypes.data, 0 if scale is None else scale.ctypes.data, 0 if low is None else low.ctypes.data, \
        codec_code(store.codec)


def codec_code(codec) -> int | None:
    if isinstance(codec, FloatCodec):
        return {"float32": _KV_F32, "float16": _KV_F16, "bfloat16": _KV_BF16}.get(codec.dtype)
    if isinstance(codec, Int8Codec):
        return _KV_INT8
    return _KV_INT4 if isinstance(codec, Int4Codec) else None


def native_cache(cache) -> bool:
    return type(cache) in (DenseCache, RingCache) and all(codec_code(c) is not None for c in cache.codecs)
