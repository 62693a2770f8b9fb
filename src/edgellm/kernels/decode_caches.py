"""What the native decoder layers know of the KV caches: each layer cache as layer_types.h's
KVSlots over its pages, and each sequence's per-layer KVSlots as one array, rebuilt only when
one of its caches changes pages (building ~30 structs per sequence every step cost ~0.1 ms each).

A decode step runs a few Python passes over each sequence's layers (offsets, versions, what was
written); everything else a sequence's array needs — whether the C layers read its caches, the room
reserved in them — is worked out when the array is (re)built, since each pass over 30 layers is
paid again for every row of every step."""
from __future__ import annotations

import ctypes
import weakref
from typing import Sequence

import torch

from edgellm.kernels.layer_structs import KVPage, KVSlots, KVStore
from edgellm.kv.cache import DenseCache, RingCache
from edgellm.kv.codecs import FloatCodec, Int4Codec, Int8Codec

_KV_F32, _KV_F16, _KV_INT8, _KV_INT4, _KV_BF16 = 0, 1, 2, 3, 4  # layer_types.h


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
            view.version, (view.slots, view.pages) = cache.version, kv_slots(cache)
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
    """What the decoder knows of one layer cache."""

    def __init__(self, native: bool):
        self.native = native
        self.version = -1  # the cache's `version` when `slots` was built
        self.slots: KVSlots | None = None
        self.pages = None  # the page table `slots` points to


def kv_slots(cache) -> tuple[KVSlots, ctypes.Array]:
    """The cache as layer_types.h's KVSlots, and its page table (keep it alive as long)."""
    pages = (KVPage * len(cache.pages))(*(KVPage(kv_store(p.k), kv_store(p.v)) for p in cache.pages))
    ring = cache.slot_positions
    slots = KVSlots(ctypes.addressof(pages), cache.page_tokens, cache.capacity, None if ring is None else ring.data_ptr())
    return slots, pages


def kv_store(store) -> KVStore:
    """A TokenStore (kv/store.py) as kv_codec.h's KVStore."""
    values, scale, low = store.buffers()
    return KVStore(values.data_ptr(), None if scale is None else scale.data_ptr(),
                   None if low is None else low.data_ptr(), codec_code(store.codec))


def codec_code(codec) -> int | None:
    if isinstance(codec, FloatCodec):
        return {torch.float32: _KV_F32, torch.float16: _KV_F16, torch.bfloat16: _KV_BF16}.get(codec.dtype)
    if isinstance(codec, Int8Codec):
        return _KV_INT8
    return _KV_INT4 if isinstance(codec, Int4Codec) else None


def native_cache(cache) -> bool:
    return type(cache) in (DenseCache, RingCache) and all(codec_code(c) is not None for c in cache.codecs)
