"""One sequence's KV across all layers, and the manager that creates sequences from a
shared block pool, applies the sink + sliding-window policy and reuses cached prefixes."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch

from edgellm.errors import InvalidRequest, OutOfMemoryBudget
from edgellm.kv.blocks import BlockPool, PrefixIndex, chain_hashes
from edgellm.kv.cache import DenseCache, KVCache, RingCache, Rotate
from edgellm.kv.codecs import bytes_per_head_token, codec
from edgellm.kv.store import KVPage


@dataclass(frozen=True)
class KVConfig:
    # f32 | bf16 | f16 | int8 | int4; keys are the sensitive half. f16 (llama.cpp's default too)
    # halves f32's memory and bytes read per decoded token, with a 10-bit mantissa.
    k_precision: str = "f16"
    v_precision: str = "f16"
    block_size: int = 32  # tokens per block: the unit of growth, accounting and prefix reuse
    max_tokens: int | None = None  # held per sequence; beyond it, sinks + sliding window (None: the context)
    sinks: int = 4  # first tokens always kept ("attention sinks")
    budget_bytes: int | None = None  # all KV together (sequences + prefix cache); None: unbounded
    # Finished blocks kept for later requests with the same prefix. None: automatic
    # (auto_prefix_cache_bytes); 0 disables prefix reuse.
    prefix_cache_bytes: int | None = None

    @classmethod
    def for_mode(cls, mode: str) -> KVConfig:
        """The default for a precision mode: "exact" (the fp32 reference) keeps fp32 KV."""
        return cls(k_precision="f32", v_precision="f32") if mode == "exact" else cls()

    def __post_init__(self) -> None:
        for precision in (self.k_precision, self.v_precision):
            codec(precision)  # raises InvalidRequest for unknown names
        if self.block_size < 1 or self.sinks < 0:
            raise InvalidRequest("block_size must be >= 1 and sinks >= 0")
        if self.max_tokens is not None and self.max_tokens < self.sinks + 2 * self.block_size:
            raise InvalidRequest(f"max_tokens must be at least sinks + 2 blocks ({self.sinks + 2 * self.block_size})")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise InvalidRequest("prefix_cache_bytes must be >= 0 (0 turns prefix reuse off)")


def split_precision(text: str) -> tuple[str, str]:
    """"int8" -> (int8, int8); "int8:int4" -> K int8, V int4 (how the CLI and API name them)."""
    k, _, v = text.partition(":")
    return k, v or k


AUTO_PREFIX_CAP = 256 * 2**20


def auto_prefix_cache_bytes(config: KVConfig) -> int:
    """The prefix cache's share when nobody set one: a quarter of a KV budget, or else a
    sixteenth of the memory free now, at most 256 MiB (~11,000 tokens of SmolLM2's f16 KV).
    Cached blocks are evicted, oldest first, whenever a request needs their room."""
    if config.budget_bytes is not None:
        return config.budget_bytes // 4
    import psutil

    return min(AUTO_PREFIX_CAP, psutil.virtual_memory().available // 16)


@dataclass(frozen=True)
class LayerSpec:
    """What a model tells the cache about one layer."""

    kv_heads: int
    head_dim: int
    window: int | None  # a sliding-window layer keeps only this many positions
    rotate: Rotate | None  # moves stored keys along positions (for the sink window)


def kv_bytes_per_token(specs: Sequence[LayerSpec], config: KVConfig) -> int:
    """K + V bytes one more token costs in the growing (non-window) layers."""
    return sum(s.kv_heads * (bytes_per_head_token(config.k_precision, s.head_dim) +
                             bytes_per_head_token(config.v_precision, s.head_dim))
               for s in specs if s.window is None)


def fixed_kv_bytes(specs: Sequence[LayerSpec], config: KVConfig) -> int:
    """Bytes of the ring layers, which do not grow with the sequence."""
    return sum(s.window * s.kv_heads * (bytes_per_head_token(config.k_precision, s.head_dim) +
                                        bytes_per_head_token(config.v_precision, s.head_dim))
               for s in specs if s.window is not None)


class SequenceKV:
    """The KV of one sequence: a list of per-layer caches (what the model iterates over)
    plus the blocks it holds in the pool. Call prepare(n) before a forward of n tokens and
    advance(ids) after it."""

    def __init__(self, manager: KVManager, limit: int):
        self.manager, self.config, self.limit = manager, manager.config, limit
        self.layers: list[KVCache] = [manager.make_layer(spec) for spec in manager.specs]
        self.token_ids: list[int] = []
        self.evicted = 0  # tokens dropped by the sliding window so far
        self.blocks: list[int] = manager.take(manager.fixed_blocks)
        self._prefix_hashes: list[str] = []  # cached blocks this sequence reuses

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> KVCache:
        return self.layers[i]

    def __iter__(self) -> Iterator[KVCache]:
        return iter(self.layers)

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    def positions(self, t: int) -> torch.Tensor:
        """Positions of the next t tokens, (t,)."""
        return torch.arange(self.offset, self.offset + t)

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
        self._free_surplus()
        return n

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

    def release(self) -> None:
        """Return every block at once (the caller drops its reference to the caches)."""
        self.manager.pool.free(self.blocks)
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

    def positions(self, t: int) -> torch.Tensor:
        """(B, t) positions: each sequence continues from its own offset."""
        return torch.stack([s.positions(t) for s in self.sequences])


class KVManager:
    """Creates sequences for one model. One block pool and one prefix cache serve every KV
    precision the model is asked for (`for_precision`), under one byte budget."""

    def __init__(self, specs: Sequence[LayerSpec], config: KVConfig, context_length: int, salt: str = "",
                 *, shared: KVManager | None = None):
        self.specs, self.config, self.salt = list(specs), config, salt
        self.context_length = context_length
        self.bytes_per_token = kv_bytes_per_token(self.specs, config)
        self.block_bytes = max(1, self.bytes_per_token * config.block_size)
        self.fixed_blocks = -(-fixed_kv_bytes(self.specs, config) // self.block_bytes)
        # Prefix hashes carry the precision: an INT4 block never serves an f16 request.
        self._hash_salt = f"{salt}|{config.k_precision}:{config.v_precision}"
        if shared is None:
            self.pool = BlockPool(self.block_bytes, config.budget_bytes)
            prefix_bytes = auto_prefix_cache_bytes(config) if config.prefix_cache_bytes is None else config.prefix_cache_bytes
            self.prefix = PrefixIndex(self.pool, prefix_bytes) if prefix_bytes > 0 else None
            self._variants: dict[tuple[str, str], KVManager] = {}
        else:
            self.pool, self.prefix, self._variants = shared.pool, shared.prefix, shared._variants
        self._variants[(config.k_precision, config.v_precision)] = self

    def for_precision(self, precision: str) -> KVManager:
        """This manager's twin for another KV precision ("int8", "int8:int4" for K:V), on the
        same pool, budget and prefix cache."""
        key = split_precision(precision)
        if key not in self._variants:
            config = replace(self.config, k_precision=key[0], v_precision=key[1])
            KVManager(self.specs, config, self.context_length, self.salt, shared=self)
        return self._variants[key]

    @property
    def precision(self) -> str:
        c = self.config
        return c.k_precision if c.k_precision == c.v_precision else f"{c.k_precision}:{c.v_precision}"

    def hashes(self, tokens: Sequence[int]) -> list[str]:
        """Chain hashes of the full blocks of `tokens`, as this manager's prefix cache keys them."""
        return chain_hashes(tokens, self.config.block_size, self._hash_salt)

    # -- the one byte budget -------------------------------------------------------------

    def bytes_needed(self, tokens: int) -> int:
        """KV bytes a sequence of `tokens` holds at its largest (sliding windows cap it)."""
        held = tokens if self.config.max_tokens is None else min(tokens, self.config.max_tokens + self.config.block_size)
        return (-(-held // self.config.block_size) + self.fixed_blocks) * self.block_bytes

    def shared_bytes(self, prompt: Sequence[int]) -> int:
        """Bytes of the prompt's cached prefix blocks that running sequences hold: a new
        sequence shares them, needing no room for them (blocks only the cache holds count as
        free already: evictable)."""
        return self.prefix.shared_bytes(self.hashes(prompt[:len(prompt) - 1])) if self.prefix and prompt else 0

    def free_bytes(self) -> int | None:
        """Bytes a new sequence can have: the budget left plus cached prefixes nobody uses
        (evicted on demand). None: no budget."""
        available = self.pool.available_bytes()
        if available is None:
            return None
        return available + (self.prefix.evictable_bytes if self.prefix else 0)

    def admit(self, tokens: int) -> None:
        """Refuse, before any work, a request whose KV would not fit the budget."""
        free = self.free_bytes()
        needed = self.bytes_needed(tokens)
        if free is not None and needed > free:
            raise OutOfMemoryBudget(needed, free)

    def take(self, n: int) -> list[int]:
        """n blocks of this precision, evicting unused cached prefixes to make room."""
        available = self.pool.available_bytes()
        short = 0 if available is None else n * self.block_bytes - available
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return self.pool.allocate(n, self.block_bytes)

    # -- sequences and prefixes ----------------------------------------------------------

    def make_layer(self, spec: LayerSpec) -> KVCache:
        k, v = codec(self.config.k_precision), codec(self.config.v_precision)
        if spec.window is not None:
            return RingCache(k, v, spec.kv_heads, spec.head_dim, window=spec.window,
                             block_size=self.config.block_size, rotate=spec.rotate)
        return DenseCache(k, v, spec.kv_heads, spec.head_dim, block_size=self.config.block_size, rotate=spec.rotate)

    def new_sequence(self, prompt: Sequence[int] = ()) -> tuple[SequenceKV, int]:
        """A fresh sequence, pre-filled with the longest cached prefix of `prompt`; returns
        it and how many prompt tokens it already holds (at least one is left to compute)."""
        seq = SequenceKV(self, min(self.config.max_tokens or self.context_length, self.context_length))
        try:
            reused = self._reuse_prefix(seq, prompt) if self.prefix is not None else 0
        except BaseException:  # e.g. no room for the reused blocks: give back the pins and ring blocks
            seq.release()
            raise
        return seq, reused

    def _reuse_prefix(self, seq: SequenceKV, prompt: Sequence[int]) -> int:
        """Hold the cached blocks of the prompt's longest cached prefix: the same blocks (and
        pages) as the cache and every other sequence reusing them, not copies."""
        hashes = self.hashes(prompt[:len(prompt) - 1])  # keep >= 1 token to compute
        found = self.prefix.lookup_blocks(hashes)
        seq._prefix_hashes = hashes[:len(found)]
        reused = len(found) * self.config.block_size
        self.prefix.stats.hit_tokens += reused
        self.prefix.stats.miss_tokens += len(prompt) - reused
        for b, (block, payload) in enumerate(found):
            self.pool.share(block)
            seq.blocks.append(block)
            for layer, part in zip(seq.layers, payload):
                layer.adopt(b, part)
        seq.token_ids = list(prompt[:reused])
        return reused

    def remember_blocks(self, seq: SequenceKV, start: int) -> None:
        """Offer the blocks completed since token `start` to the prefix cache, which then
        holds them too (they are shared, not copied)."""
        if self.prefix is None:
            return
        first = start // self.config.block_size
        for b, h in enumerate(self.hashes(seq.token_ids)[first:], start=first):
            payload = [layer.block(b) for layer in seq.layers]
            self.prefix.insert(h, payload, self.block_bytes, block=seq.blocks[self.fixed_blocks + b])

    def remember(self, h: str, exported: list[dict[str, torch.Tensor]]) -> bool:
        """Cache one block's KV, as exported per layer (the disk tier's form), under its
        chain hash."""
        if self.prefix is None:
            return False
        k, v = codec(self.config.k_precision), codec(self.config.v_precision)
        payload = [parts if spec.window is not None else KVPage.from_export(k, v, spec.kv_heads, spec.head_dim, parts)
                   for spec, parts in zip(self.specs, exported)]
        return self.prefix.insert(h, payload, self.block_bytes)

    @staticmethod
    def exported(payload: list) -> list[dict[str, torch.Tensor]]:
        """A cached block's KV per layer in the disk tier's form (remember's argument)."""
        return [part.export() if isinstance(part, KVPage) else part for part in payload]

    def pin(self, tokens: Sequence[int]) -> list[str]:
        """Keep the cached blocks of `tokens` from eviction (a session between turns);
        returns the pinned hashes for unpin()."""
        if self.prefix is None:
            return []
        hashes = self.hashes(tokens)
        return hashes[:len(self.prefix.lookup(hashes))]

    @property
    def live_bytes(self) -> int:
        """KV held by running sequences (the pool's bytes less the prefix cache's)."""
        return self.pool.used_bytes - (self.prefix.nbytes if self.prefix else 0)

    def forget_prefixes(self) -> None:
        """Empty the prefix cache (blocks in use stay until their sequences end)."""
        if self.prefix is not None:
            self.prefix.clear()

    def pinned_bytes(self, pins: Sequence[str]) -> int:
        return self.prefix.bytes_of(pins) if self.prefix is not None else 0

    def unpin(self, pins: Sequence[str], *, drop: bool = False) -> int:
        """Let pinned blocks go; with drop, forget them now. Returns the bytes dropped."""
        if self.prefix is None or not pins:
            return 0
        self.prefix.release(pins)
        if not drop:
            return 0
        nbytes = self.prefix.bytes_of(pins)
        self.prefix.drop(pins)
        return nbytes - self.prefix.bytes_of(pins)


def fresh_sequence(model, config: KVConfig | None = None) -> SequenceKV:
    """A standalone sequence cache for `model` (tests, evaluation, profiling)."""
    config = config or KVConfig.for_mode(getattr(model, "mode", "fast"))
    if config.prefix_cache_bytes is None:
        config = replace(config, prefix_cache_bytes=0)
    manager = KVManager(model.cache_specs(), config, model.config.context_length)
    return manager.new_sequence()[0]
