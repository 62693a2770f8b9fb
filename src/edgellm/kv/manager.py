"""The manager that creates a model's sequences from one block pool under one byte budget, for
every KV precision, and reuses cached prefixes (shared blocks, not copies)."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from edgellm.errors import OutOfMemoryBudget
from edgellm.kv.blocks import BlockPool, PrefixIndex, chain_hashes
from edgellm.kv.cache import DenseCache, KVCache, RingCache
from edgellm.kv.codecs import codec
from edgellm.kv.config import (KVConfig, LayerSpec, auto_prefix_cache_bytes, fixed_kv_bytes, kv_bytes_per_token,
                               split_precision)
from edgellm.kv.sequence import SequenceKV
from edgellm.kv.store import KVPage, page_object_bytes


class KVManager:
    """Creates sequences for one model. One block pool and one prefix cache serve every KV
    precision the model is asked for (`for_precision`), under one byte budget."""

    def __init__(self, specs: Sequence[LayerSpec], config: KVConfig, context_length: int, salt: str = "",
                 *, shared: KVManager | None = None, adapter=None):
        self.specs, self.config, self.salt = list(specs), config, salt
        self.context_length, self.adapter = context_length, adapter
        self.bytes_per_token = kv_bytes_per_token(self.specs, config)
        # a block is a page per growing layer: its arrays, and the Python objects that hold them
        pages = sum(1 for s in self.specs if s.window is None)
        objects = page_object_bytes(codec(config.k_precision), codec(config.v_precision))
        self.block_bytes = max(1, self.bytes_per_token * config.block_size + pages * objects)
        self.fixed_blocks = -(-fixed_kv_bytes(self.specs, config) // self.block_bytes)
        # Prefix hashes carry the precision (an INT4 block never serves an f16 request) and the
        # adapter (a prefix computed under one never serves another, or the base).
        lora = "" if adapter is None else f"|lora:{adapter.digest}"
        self._hash_salt = f"{salt}|{config.k_precision}:{config.v_precision}{lora}"
        if shared is None:
            self.pool = BlockPool(self.block_bytes, config.budget_bytes)
            prefix_bytes = auto_prefix_cache_bytes(config) if config.prefix_cache_bytes is None else config.prefix_cache_bytes
            self.prefix = PrefixIndex(self.pool, prefix_bytes) if prefix_bytes > 0 else None
            self._variants: dict[tuple[str, str], KVManager] = {}
        else:
            self.pool, self.prefix, self._variants = shared.pool, shared.prefix, shared._variants
        if adapter is None:
            self._variants[(config.k_precision, config.v_precision)] = self

    def for_precision(self, precision: str) -> KVManager:
        """This manager's twin for another KV precision ("int8", "int8:int4" for K:V), on the
        same pool, budget and prefix cache."""
        key = split_precision(precision)
        if key not in self._variants:
            config = replace(self.config, k_precision=key[0], v_precision=key[1])
            KVManager(self.specs, config, self.context_length, self.salt, shared=self)
        return self._variants[key]

    def for_adapter(self, adapter) -> KVManager:
        """This manager's twin whose sequences run under a LoRA adapter (lora/; None: this
        manager): same pool, budget and prefix cache, prefixes keyed by the adapter. Made per
        use (cheap), so an unloaded adapter is held by nothing but the sequences still using it."""
        if adapter is None:
            return self
        return KVManager(self.specs, self.config, self.context_length, self.salt, shared=self, adapter=adapter)

    @property
    def precision(self) -> str:
        c = self.config
        return c.k_precision if c.k_precision == c.v_precision else f"{c.k_precision}:{c.v_precision}"

    def hashes(self, tokens: Sequence[int], after: str | None = None) -> list[str]:
        """Chain hashes of the full blocks of `tokens`, as this manager's prefix cache keys them;
        `after`: the hash of the block before tokens[0] (None: tokens start the sequence)."""
        return chain_hashes(tokens, self.config.block_size, self._hash_salt if after is None else after)

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
        (evicted on demand), less what reserved sequences may still grow into. None: no budget."""
        free = self._unused_bytes()
        return None if free is None else free - self.pool.unheld_reserved_bytes()

    def reserve(self, seq: SequenceKV, tokens: int) -> None:
        """Count `seq` as holding all it may grow to (`tokens` in all) from now on, so that
        free_bytes() leaves that room to it; it ends when the sequence is released."""
        self.pool.reserve(seq, self.bytes_needed(tokens), self.block_bytes)

    def _unused_bytes(self) -> int | None:
        available = self.pool.available_bytes()
        if available is None:
            return None
        return available + (self.prefix.evictable_bytes if self.prefix else 0)

    def admit(self, tokens: int) -> None:
        """Refuse, before any work, a request whose KV would not fit the budget (reservations
        are the serving layer's admission, free_bytes())."""
        free = self._unused_bytes()
        needed = self.bytes_needed(tokens)
        if free is not None and needed > free:
            raise OutOfMemoryBudget(needed, free)

    def lend(self, nbytes: int, what: str) -> None:
        """Take `nbytes` off the budget for memory that lives beside the KV (a LoRA adapter loaded
        at run time), evicting unused cached prefixes for it; OutOfMemoryBudget when running
        sequences hold the rest. No budget: nothing to do."""
        with self.pool.lock:
            if self.pool.budget_bytes is None:
                return
            self._make_room(nbytes)
            available = self.pool.available_bytes()
            if nbytes > available:
                raise OutOfMemoryBudget(nbytes, max(available, 0), what)
            self.pool.budget_bytes -= nbytes

    def give_back(self, nbytes: int) -> None:
        """Return what `lend` took."""
        with self.pool.lock:
            if self.pool.budget_bytes is not None:
                self.pool.budget_bytes += nbytes

    def take(self, n: int) -> list[int]:
        """n blocks of this precision, evicting unused cached prefixes to make room."""
        self._make_room(n * self.block_bytes)
        return self.pool.allocate(n, self.block_bytes)

    def _make_room(self, nbytes: int) -> None:
        """Evict unused cached prefixes until `nbytes` of the budget are free (or none are left)."""
        available = self.pool.available_bytes()
        short = 0 if available is None else nbytes - available
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)

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
        seq._hashes = list(seq._prefix_hashes)
        return reused

    def remember_blocks(self, seq: SequenceKV, start: int) -> None:
        """Offer the blocks completed since token `start` to the prefix cache, which then
        holds them too (they are shared, not copied)."""
        if self.prefix is None:
            return
        first = start // self.config.block_size
        for b, h in enumerate(seq.block_hashes(first), start=first):
            payload = [layer.block(b) for layer in seq.layers]
            if any(part is None for part in payload):  # a ring lost it: later blocks would be unreachable
                return
            self.prefix.insert(h, payload, self.block_bytes, block=seq.blocks[self.fixed_blocks + b])

    def remember(self, h: str, exported: list[dict[str, np.ndarray]]) -> bool:
        """Cache one block's KV, as exported per layer (the disk tier's form), under its
        chain hash."""
        if self.prefix is None:
            return False
        k, v = codec(self.config.k_precision), codec(self.config.v_precision)
        payload = [parts if spec.window is not None else KVPage.from_export(k, v, spec.kv_heads, spec.head_dim, parts)
                   for spec, parts in zip(self.specs, exported)]
        return self.prefix.insert(h, payload, self.block_bytes)

    @staticmethod
    def exported(payload: list) -> list[dict[str, np.ndarray]]:
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
