"""One sequence's KV across all layers: per-layer caches over blocks of the shared pool, the
sink + sliding-window policy, copy on write of shared blocks; and several sequences seen as one
batch."""
from __future__ import annotations

from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from edgellm.extras import torch

from edgellm.errors import InvalidRequest
from edgellm.kv.blocks import BlockPool, PrefixIndex
from edgellm.kv.cache import KVCache
from edgellm.kv.config import KVConfig, LayerSpec


class BlockOwner(Protocol):
    """What a sequence needs of the KV manager (manager.py) that made it: the pool its blocks
    come from, the prefix cache its finished blocks go to, and how its layers are made."""

    config: KVConfig
    specs: list[LayerSpec]
    adapter: Any
    fixed_blocks: int
    pool: BlockPool
    prefix: PrefixIndex | None

    def make_layer(self, spec: LayerSpec) -> KVCache: ...
    def take(self, n: int) -> list[int]: ...
    def hashes(self, tokens: Sequence[int], after: str | None = None) -> list[str]: ...
    def remember_blocks(self, seq: SequenceKV, start: int) -> None: ...


class SequenceKV:
    """The KV of one sequence: a list of per-layer caches (what the model iterates over)
    plus the blocks it holds in the pool. Call prepare(n) before a forward of n tokens and
    advance(ids) after it."""

    def __init__(self, manager: BlockOwner, limit: int):
        self.manager, self.config, self.limit = manager, manager.config, limit
        # the LoRA adapter this KV is computed under (lora/; None: the base): the model applies it to
        # this sequence's rows, and its prefix blocks are keyed by it
        self.adapter = manager.adapter
        self.layers: list[KVCache] = [manager.make_layer(spec) for spec in manager.specs]
        self.token_ids: list[int] = []
        self.evicted = 0  # tokens dropped by the sliding window so far
        self.blocks: list[int] = manager.take(manager.fixed_blocks)
        self._prefix_hashes: list[str] = []  # cached blocks this sequence reuses
        self._hashes: list[str] = []  # chain hashes of token_ids' full blocks so far (block_hashes)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> KVCache:
        return self.layers[i]

    def __iter__(self) -> Iterator[KVCache]:
        return iter(self.layers)

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    def positions(self, t: int) -> np.ndarray:
        """Positions of the next t tokens, (t,)."""
        return np.arange(self.offset, self.offset + t)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def prepare(self, n_new: int) -> None:
        """Make room for n_new tokens: slide the window if needed, then take blocks (and copy
        the block they start in if it is shared: after a trim)."""
        if self.offset + n_new > self.limit:
            if self.offset + n_new - self.limit > self.limit - self.config.sinks - self.config.block_size:
                raise InvalidRequest(f"{n_new} new tokens do not fit a window of {self.limit}")
            self._slide(self.offset + n_new - self.limit)
        self._unshare(self.offset // self.config.block_size, self.offset + n_new)
        needed = self._growing_blocks(self.offset + n_new) - self._held_blocks
        self.blocks += self.manager.take(needed)
        for layer in self.layers:
            layer.reserve(self.offset + n_new)

    def trim(self, n: int) -> int:
        """Forget the newest n tokens (rejected speculation, a retried turn); returns how many.
        Shared blocks stay untouched: the next write into one copies it first."""
        n = min(n, self.offset)
        for layer in self.layers:
            layer.trim(n)
        del self.token_ids[len(self.token_ids) - n:]
        del self._hashes[len(self.token_ids) // self.config.block_size:]
        self._free_surplus()
        return n

    def keep_overwritten(self, n: int) -> None:
        """Before writing n tokens that may be trimmed again: rings keep what they overwrite."""
        for layer in self.layers:
            layer.keep_overwritten(n)

    def _growing_blocks(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    @property
    def _held_blocks(self) -> int:
        return len(self.blocks) - self.manager.fixed_blocks

    def _unshare(self, first: int, end: int) -> None:
        """Copy on write: the held blocks from `first` up to token `end` that others (the prefix
        cache, other sequences) also hold get pages of their own before anything writes them."""
        pool, fixed = self.manager.pool, self.manager.fixed_blocks
        for b in range(first, min(self._held_blocks, self._growing_blocks(end))):
            if pool.refcount(self.blocks[fixed + b]) > 1:
                (own,) = self.manager.take(1)
                pool.free([self.blocks[fixed + b]])
                self.blocks[fixed + b] = own
                for layer in self.layers:
                    layer.unshare(b)

    def _slide(self, overflow: int) -> None:
        # Evict whole blocks right after the sinks, so memory really shrinks.
        n = -(-overflow // self.config.block_size) * self.config.block_size
        self._unshare(self.config.sinks // self.config.block_size, self.offset)  # every later token moves
        for layer in self.layers:
            layer.evict(self.config.sinks, n)
        self.evicted += n
        self._free_surplus()

    def _free_surplus(self) -> None:
        surplus = self._held_blocks - self._growing_blocks(self.offset)
        if surplus > 0:
            self.manager.pool.free(self.blocks[-surplus:])
            del self.blocks[-surplus:]

    def advance(self, ids: Sequence[int]) -> None:
        """Record the tokens just computed; finished blocks become reusable prefixes."""
        start = len(self.token_ids)
        self.token_ids.extend(int(i) for i in ids)
        if self.evicted == 0:
            self.manager.remember_blocks(self, start)

    def block_hashes(self, first: int = 0) -> list[str]:
        """The prefix cache's chain hashes of token_ids' full blocks from block `first` on, each new
        block's chained onto the last one's (hashing the whole history again at every token cost
        ~0.4 ms a decode step at 4,096 tokens)."""
        size, done = self.config.block_size, len(self._hashes)
        if len(self.token_ids) >= (done + 1) * size:
            self._hashes += self.manager.hashes(self.token_ids[done * size:], after=self._hashes[-1] if done else None)
        return self._hashes[first:]

    def release(self) -> None:
        """Return every block at once (the caller drops its reference to the caches)."""
        self.manager.pool.free(self.blocks)
        self.manager.pool.unreserve(self)
        self.blocks = []
        self.manager.prefix.release(self._prefix_hashes) if self.manager.prefix else None
        self._prefix_hashes = []
        self.layers = []


class LayerBatch:
    """One layer's caches of several sequences, updated and fetched together; attention then
    runs per sequence over lists (their lengths differ)."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[list, list, list]:
        fetched = [c.update_and_fetch(k[i:i + 1], v[i:i + 1]) for i, c in enumerate(self.caches)]
        keys, values, visibility = zip(*fetched)
        return list(keys), list(values), list(visibility)


class BatchKV:
    """Several sequences' KV seen as one batch by the model (a decode step of a batch)."""

    def __init__(self, sequences: list[SequenceKV]):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences[0])

    def __getitem__(self, i: int) -> LayerBatch:
        return LayerBatch([s[i] for s in self.sequences])

    def __iter__(self) -> Iterator[LayerBatch]:
        return (self[i] for i in range(len(self)))

    def positions(self, t: int) -> np.ndarray:
        """(B, t) positions: each sequence continues from its own offset."""
        return np.stack([s.positions(t) for s in self.sequences])
