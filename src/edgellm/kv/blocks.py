"""Block bookkeeping, no tensors: a pool of fixed-size KV blocks under a byte budget, and
the prefix index that lets a request reuse the blocks of an earlier one with the same
tokens. Policy (which sequence grows, what to evict) lives with the callers."""
from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from edgellm.errors import OutOfMemoryBudget


class BlockPool:
    """Hands out block ids under one byte budget. Blocks of different KV precisions differ in
    size, so each block records its own bytes (`block_bytes` is the default size). Reference
    counts let a prefix block be shared; a block returns to the free list when its last holder
    lets go."""

    def __init__(self, block_bytes: int, budget_bytes: int | None = None):
        self.block_bytes = block_bytes
        self.budget_bytes = budget_bytes
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._free: list[int] = []
        self._next_id = 0
        self.used_bytes = 0
        # holder -> (bytes it may grow to, bytes of each of its blocks): reserve()
        self._reserved: dict[int, tuple[Any, int, int]] = {}
        # The engine thread and app threads (a session releasing its KV) both come here.
        self.lock = threading.RLock()

    @property
    def used_blocks(self) -> int:
        return len(self._refs)

    def available_bytes(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes - self.used_bytes

    def allocate(self, n: int, block_bytes: int | None = None) -> list[int]:
        with self.lock:
            return self._allocate(n, block_bytes)

    def _allocate(self, n: int, block_bytes: int | None) -> list[int]:
        if n <= 0:
            return []
        size = self.block_bytes if block_bytes is None else block_bytes
        available = self.available_bytes()
        if available is not None and n * size > available:
            raise OutOfMemoryBudget(n * size, available)
        ids = []
        for _ in range(n):
            block = self._free.pop() if self._free else self._new_id()
            self._refs[block], self._sizes[block] = 1, size
            ids.append(block)
        self.used_bytes += n * size
        return ids

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def share(self, block: int) -> None:
        with self.lock:
            self._refs[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        with self.lock:
            for block in blocks:
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    del self._refs[block]
                    self.used_bytes -= self._sizes.pop(block)
                    self._free.append(block)

    def reserve(self, holder: Any, nbytes: int, block_bytes: int) -> None:
        """Count `holder` (anything with a `blocks` list) as taking `nbytes` in all from now on,
        however few of them its blocks hold yet; until unreserve()."""
        with self.lock:
            self._reserved[id(holder)] = (holder, nbytes, block_bytes)

    def unreserve(self, holder: Any) -> None:
        with self.lock:
            self._reserved.pop(id(holder), None)

    def unheld_reserved_bytes(self) -> int:
        """What reserved holders may still grow into: their reservations less the blocks they hold."""
        with self.lock:
            return sum(max(0, nbytes - len(holder.blocks) * size) for holder, nbytes, size in self._reserved.values())

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def size(self, block: int) -> int:
        return self._sizes[block]


def chain_hashes(tokens: Sequence[int], block_size: int, salt: str = "") -> list[str]:
    """One hash per full block, each covering the block's tokens and every block before it,
    so equal hashes mean equal prefixes (not just equal blocks)."""
    hashes, previous = [], salt
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = ",".join(map(str, tokens[start:start + block_size]))
        previous = hashlib.sha256(f"{previous}|{block}".encode()).hexdigest()
        hashes.append(previous)
    return hashes


def _locked(method):
    """Run a PrefixIndex method under its pool's lock."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.pool.lock:
            return method(self, *args, **kwargs)
    return locked


@dataclass
class PrefixStats:
    hit_tokens: int = 0
    miss_tokens: int = 0


@dataclass
class _Entry:
    block: int
    nbytes: int
    payload: Any  # the block's KV for every layer (opaque here)
    users: int = 0


@dataclass
class PrefixIndex:
    """hash chain -> cached KV block. The cache holds a reference to each block in the pool,
    beside the sequences that computed or reuse it, so a block costs memory once however many
    hold it. What counts against `budget_bytes` is what only the cache keeps alive: such
    blocks, unless pinned, are evicted least recently used first."""

    pool: BlockPool
    budget_bytes: int
    stats: PrefixStats = field(default_factory=PrefixStats)
    _entries: OrderedDict = field(default_factory=OrderedDict)


    def __len__(self) -> int:
        return len(self._entries)

    @property
    @_locked
    def nbytes(self) -> int:
        """Bytes of the blocks only the cache holds (the rest belong to running sequences too)."""
        return sum(e.nbytes for e in self._entries.values() if self._alone(e))

    def _alone(self, entry: _Entry) -> bool:
        return self.pool.refcount(entry.block) == 1

    @_locked
    def bytes_of(self, hashes: Sequence[str]) -> int:
        """Bytes of those of `hashes` that are cached."""
        return sum(self._entries[h].nbytes for h in hashes if h in self._entries)

    @_locked
    def lookup(self, hashes: Sequence[str]) -> list[Any]:
        """Payloads of the longest cached run of `hashes` from the start; marks them in use
        (call release with the same hashes when the request ends)."""
        return [payload for _, payload in self.lookup_blocks(hashes)]

    @_locked
    def lookup_blocks(self, hashes: Sequence[str]) -> list[tuple[int, Any]]:
        """lookup, with each payload's block id (to share it: BlockPool.share)."""
        found = []
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None:
                break
            entry.users += 1
            self._entries.move_to_end(h)
            found.append((entry.block, entry.payload))
        return found

    @_locked
    def shared_bytes(self, hashes: Sequence[str]) -> int:
        """Bytes of the longest cached run of `hashes` whose blocks others (running sequences)
        hold besides the cache; marks nothing."""
        total = 0
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None:
                break
            total += 0 if self._alone(entry) else entry.nbytes
        return total

    @_locked
    def release(self, hashes: Sequence[str]) -> None:
        for h in hashes:
            entry = self._entries.get(h)
            if entry is not None and entry.users > 0:
                entry.users -= 1
        self._evict()

    @_locked
    def insert(self, h: str, payload: Any, block_bytes: int | None = None, *, block: int | None = None) -> bool:
        """Cache a block's KV (`block_bytes`, default the pool's block size) under its chain
        hash: the pool block a sequence holds it in (shared from now on), or else a new one.
        False when it is already there or no room can be made."""
        size = self.pool.block_bytes if block_bytes is None else block_bytes
        if h in self._entries:
            self._entries.move_to_end(h)
            return False
        if size > self.budget_bytes:
            return False
        if block is not None:
            self.pool.share(block)
        else:
            self._evict(room_for=size)
            try:
                (block,) = self.pool.allocate(1, size)
            except OutOfMemoryBudget:
                return False
        self._entries[h] = _Entry(block, size, payload)
        return True

    @_locked
    def evict(self, nbytes: int) -> int:
        """Free at least `nbytes` of unused cached blocks if there are that many, oldest
        first (a new request needs the room); returns the bytes freed."""
        before = self.nbytes
        self._evict(limit=before - nbytes)
        return before - self.nbytes

    def _evict(self, room_for: int = 0, limit: int | None = None) -> None:
        """Forget unpinned blocks only the cache holds, oldest first, until those it alone
        holds fit `limit` (default: the budget less `room_for`)."""
        limit = self.budget_bytes - room_for if limit is None else limit
        held = self.nbytes
        for h in list(self._entries):  # oldest first
            if held <= limit:
                return
            entry = self._entries[h]
            if entry.users == 0 and self._alone(entry):
                held -= entry.nbytes
                self._remove(h)

    def _remove(self, h: str) -> None:
        self.pool.free([self._entries.pop(h).block])

    @property
    @_locked
    def evictable_bytes(self) -> int:
        """Bytes eviction could return to the pool now."""
        return sum(e.nbytes for e in self._entries.values() if e.users == 0 and self._alone(e))

    @_locked
    def drop(self, hashes: Sequence[str]) -> int:
        """Forget these blocks now unless someone is using them; returns how many went."""
        dropped = 0
        for h in hashes:
            entry = self._entries.get(h)
            if entry is not None and entry.users == 0:
                self._remove(h)
                dropped += 1
        return dropped

    @_locked
    def clear(self) -> None:
        for h in list(self._entries):
            self._remove(h)
