"""What a KV page costs in memory: its arrays and the Python objects around them, which the KV pool
counts too (kv/store.py PAGE_OBJECT_BYTES), so that a server's RSS grows by what its gauges say."""
from __future__ import annotations

import tracemalloc

from edgellm.kv.codecs import codec
from edgellm.kv.store import KVPage, page_object_bytes


def test_a_pages_objects_cost_what_the_pool_counts_for_them():
    for precision, head_dim in (("f16", 64), ("int8", 256), ("int4", 64), ("f32", 128)):
        tracemalloc.start()
        try:
            pages = [KVPage.empty(codec(precision), codec(precision), 3, head_dim, 32) for _ in range(500)]
            traced, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        beyond = (traced - sum(p.nbytes for p in pages)) / len(pages)
        counted = page_object_bytes(codec(precision), codec(precision))
        assert 0.7 * counted <= beyond <= 1.3 * counted, (precision, beyond, counted)


def test_a_block_counts_its_pages_objects():
    import edgellm.kv.manager as manager
    from edgellm.kv import KVConfig, LayerSpec

    specs = [LayerSpec(3, 64, None, None)] * 4 + [LayerSpec(3, 64, 128, None)]  # 4 growing layers, 1 ring
    kv = manager.KVManager(specs, KVConfig(), context_length=256)
    assert kv.block_bytes == kv.bytes_per_token * 32 + 4 * page_object_bytes(codec("f16"), codec("f16"))
