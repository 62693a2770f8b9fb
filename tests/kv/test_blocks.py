"""Block pool and prefix index: pure bookkeeping, tested without a model."""
from __future__ import annotations

import pytest

from edgellm.errors import OutOfMemoryBudget
from edgellm.kv.blocks import BlockPool, PrefixIndex, chain_hashes


def test_pool_allocates_frees_and_reuses_ids():
    pool = BlockPool(block_bytes=100)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.used_bytes == 300
    pool.free(a[:2])
    assert pool.used_blocks == 1
    b = pool.allocate(2)
    assert set(b) == set(a[:2])  # freed ids come back before new ones are minted


def test_pool_budget_is_enforced_with_numbers():
    pool = BlockPool(block_bytes=100, budget_bytes=250)
    pool.allocate(2)
    with pytest.raises(OutOfMemoryBudget) as info:
        pool.allocate(1)
    assert info.value.needed_bytes == 100 and info.value.available_bytes == 50
    assert pool.used_blocks == 2  # a refused allocation takes nothing


def test_refcounts_keep_shared_blocks_alive():
    pool = BlockPool(block_bytes=10)
    (block,) = pool.allocate(1)
    pool.share(block)
    pool.free([block])
    assert pool.refcount(block) == 1 and pool.used_blocks == 1
    pool.free([block])
    assert pool.refcount(block) == 0 and pool.used_blocks == 0


def test_chain_hashes_cover_whole_prefix_not_just_the_block():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7], block_size=2)
    assert len(a) == 3  # partial last block is not hashed
    b = chain_hashes([9, 9, 3, 4, 5, 6], block_size=2)
    assert a[1] != b[1]  # same second block, different history
    assert chain_hashes([1, 2, 3, 4], 2) == a[:2]
    assert chain_hashes([1, 2], 2, salt="other model") != a[:1]


def test_prefix_lookup_returns_longest_cached_run():
    index = PrefixIndex(BlockPool(block_bytes=10), budget_bytes=1000)
    hashes = chain_hashes(list(range(8)), 2)
    for h in hashes[:3]:
        index.insert(h, f"kv{h[:4]}")
    found = index.lookup(hashes)
    assert found == [f"kv{h[:4]}" for h in hashes[:3]]
    assert index.lookup(chain_hashes([7, 7, 0, 1], 2)) == []


def test_lru_eviction_spares_blocks_in_use():
    pool = BlockPool(block_bytes=10)
    index = PrefixIndex(pool, budget_bytes=30)  # room for 3 blocks
    names = ["a", "b", "c"]
    for name in names:
        index.insert(name, name)
    index.lookup(["a"])  # a is in use and most recently used
    index.insert("d", "d")  # evicts the least recently used unused block: b
    assert set(index._entries) == {"a", "c", "d"} and pool.used_blocks == 3
    index.insert("e", "e")  # then c
    assert set(index._entries) == {"a", "d", "e"}
    index.release(["a"])
    index.lookup(["e"])
    index.release(["e"])
    index.insert("f", "f")  # a is free again and now the oldest
    assert set(index._entries) == {"d", "e", "f"}


def test_index_respects_pool_budget_shared_with_sequences():
    pool = BlockPool(block_bytes=10, budget_bytes=20)
    pool.allocate(2)  # sequences hold the whole budget
    index = PrefixIndex(pool, budget_bytes=100)
    assert index.insert("x", "x") is False and len(index) == 0


def test_interrupted_writes_leave_nothing_behind_for_long(tmp_path):
    import os
    import time

    from edgellm.atomic import atomic_path, sweep_partials

    target = tmp_path / "cache.bin"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("interrupted")
    assert not target.exists() and list(tmp_path.iterdir()) == []  # a failed write leaves nothing
    stale, fresh = tmp_path / ".old.bin.x1.partial", tmp_path / ".live.bin.x2.partial"
    stale.write_bytes(b"a killed writer's")
    fresh.write_bytes(b"a live writer's")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and not stale.exists() and fresh.exists()
    assert sweep_partials(tmp_path, older_than_s=0) == 1
