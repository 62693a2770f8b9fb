"""Caches and sequences without a model: growth in blocks, eviction, rings, codecs."""
from __future__ import annotations

import pytest
import torch

from edgellm.errors import InvalidRequest, OutOfMemoryBudget
from edgellm.kv import CAUSAL, KVConfig, KVManager, LayerSpec
from edgellm.kv.cache import SlidingCausal, causal_mask
from edgellm.kv.codecs import bytes_per_head_token, codec
from edgellm.kv.store import page_object_bytes
from edgellm.models.layers import Rotary

HEADS, DIM = 2, 64
EXACT = dict(k_precision="f32", v_precision="f32")  # these tests check the mechanics exactly


def _kv(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, HEADS, t, DIM, generator=torch.Generator().manual_seed(seed))


def _positions_kv(start: int, t: int) -> torch.Tensor:
    """Values that encode their own position, to see which tokens a cache kept."""
    return torch.arange(start, start + t, dtype=torch.float32).view(1, 1, t, 1).expand(1, HEADS, t, DIM).clone()


def _manager(**config) -> KVManager:
    specs = [LayerSpec(HEADS, DIM, None, None)] * 2
    return KVManager(specs, KVConfig(**{**EXACT, **config}), context_length=4096)


def test_memory_grows_by_blocks_with_tokens_held_not_with_max_context():
    seq, _ = _manager(block_size=16, max_tokens=4000).new_sequence()
    sizes = []
    for step in range(40):
        seq.prepare(1)
        for layer in seq:
            layer.update_and_fetch(_kv(1), _kv(1))
        seq.advance([step])
        sizes.append(seq.nbytes)
    per_block = 2 * 2 * HEADS * 16 * DIM * 4  # layers x (K, V) x heads x tokens x dim x fp32
    assert sizes[0] == per_block and sizes[15] == per_block and sizes[16] == 2 * per_block
    assert sizes[-1] == 3 * per_block
    assert len(seq.blocks) == 3


def test_prepare_reserves_the_whole_chunk_before_the_forward_pass():
    # Growing KV inside a forward pass interleaves long-lived buffers with the layers'
    # temporaries on the heap; reserving it up front keeps peak memory predictable.
    seq, _ = _manager(block_size=16).new_sequence()
    seq.prepare(40)
    per_block = 2 * 2 * HEADS * 16 * DIM * 4
    assert seq.nbytes == 3 * per_block  # 40 tokens -> 3 blocks, before any token is written
    buffers = [[page.k.parts["x"].ctypes.data for page in layer.pages] for layer in seq]
    for layer in seq:
        layer.update_and_fetch(_kv(40), _kv(40))
    assert [[page.k.parts["x"].ctypes.data for page in layer.pages] for layer in seq] == buffers  # no regrowth


def test_release_returns_blocks_to_the_pool():
    manager = _manager(block_size=8)
    seq, _ = manager.new_sequence()
    seq.prepare(20)
    assert manager.pool.used_blocks == 3
    seq.release()
    assert manager.pool.used_blocks == 0


def test_budget_refuses_growth_with_typed_error():
    block = _manager(block_size=8).block_bytes  # 2 layers' K and V, and their pages' objects
    assert block == 2 * 2 * HEADS * 8 * DIM * 4 + 2 * page_object_bytes(codec("f32"), codec("f32"))
    seq, _ = _manager(block_size=8, budget_bytes=2 * block).new_sequence()
    seq.prepare(16)
    with pytest.raises(OutOfMemoryBudget):
        seq.prepare(17)


def test_sink_window_keeps_sinks_plus_last_tokens_with_contiguous_positions():
    sinks, block, limit = 4, 8, 40
    seq, _ = _manager(block_size=block, max_tokens=limit, sinks=sinks).new_sequence()
    held = []  # the original positions each cache slot holds
    for pos in range(100):
        seq.prepare(1)
        k, v, _ = seq[0].update_and_fetch(_positions_kv(pos, 1), _positions_kv(pos, 1))
        seq[1].update_and_fetch(_positions_kv(pos, 1), _positions_kv(pos, 1))
        seq.advance([pos])
        held = v[0, 0, :, 0].tolist()
    assert len(held) <= limit and seq.offset == len(held)
    assert held[:sinks] == [0, 1, 2, 3]
    tail = held[sinks:]
    assert tail == list(range(100 - len(tail), 100))  # the most recent tokens, in order
    assert seq.nbytes <= 2 * 2 * HEADS * DIM * 4 * (limit + block)


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    cos, sin = rotary(positions)  # (T, 1, D)
    x = x.transpose(1, 2)  # (B, T, H, D)
    return (x * cos + torch.cat((-x[..., DIM // 2:], x[..., :DIM // 2]), -1) * sin).transpose(1, 2)


def test_eviction_rotates_kept_keys_back_to_their_new_positions():
    # As a model does: each new key is rotated for the cache's next position. After evictions,
    # every kept key must equal its raw key rotated for the slot it now occupies.
    rotary = Rotary(DIM, 10000.0)
    seq, _ = KVManager([LayerSpec(HEADS, DIM, None, rotary.rotate)], KVConfig(block_size=8, max_tokens=32, sinks=2, **EXACT),
                       context_length=4096).new_sequence()
    raw = _kv(48, seed=3)
    for i in range(48):
        seq.prepare(1)
        key = _rope(raw[:, :, i:i + 1], torch.tensor([seq.offset]), rotary)
        keys, origin, _ = seq[0].update_and_fetch(key, _positions_kv(i, 1))
        seq.advance([i])
    kept = [int(p) for p in origin[0, 0, :, 0].tolist()]
    assert kept[:2] == [0, 1] and kept[-1] == 47 and len(kept) < 48
    expect = _rope(raw[:, :, kept], torch.arange(len(kept)), rotary)
    torch.testing.assert_close(keys, expect, atol=1e-4, rtol=1e-4)


def test_ring_cache_sees_only_the_window_and_matches_masking():
    window = 6
    manager = KVManager([LayerSpec(HEADS, DIM, window, None)], KVConfig(block_size=4, **EXACT), context_length=4096)
    seq, _ = manager.new_sequence()
    k_all, v_all = _kv(20, 1), _kv(20, 2)
    keys, values, vis = seq[0].update_and_fetch(k_all[:, :, :9], v_all[:, :, :9])  # a chunk longer than the window
    assert vis == SlidingCausal(window) and keys.shape[2] == 9
    for pos in range(9, 20):
        keys, values, vis = seq[0].update_and_fetch(k_all[:, :, pos:pos + 1], v_all[:, :, pos:pos + 1])
        visible = keys if vis is None else keys[:, :, vis[0]]
        expect = k_all[:, :, pos - window + 1:pos + 1]
        assert visible.shape[2] == window
        assert {tuple(r) for r in visible[0, 0].tolist()} == {tuple(r) for r in expect[0, 0].tolist()}
    assert seq[0].nbytes < 2 * HEADS * window * DIM * 4 + 1000  # never more than the window


def test_prefill_chunks_are_causal_at_the_end_of_the_cache():
    seq, _ = _manager().new_sequence()
    assert seq[0].update_and_fetch(_kv(5), _kv(5))[2] == CAUSAL  # square: a fresh prefill
    keys, _, visibility = seq[0].update_and_fetch(_kv(3), _kv(3))
    assert visibility == CAUSAL and keys.shape[2] == 8  # the 3 queries are positions 5..7
    mask = causal_mask(3, 8)
    assert mask[0].sum() == 6 and mask[2].all()
    assert seq[0].update_and_fetch(_kv(1), _kv(1))[2] is None


@pytest.mark.parametrize("name, max_rel_err", [("f32", 0.0), ("bf16", 1e-2), ("int8", 1.5e-2), ("int4", 0.15)])
def test_codec_round_trip_error(name, max_rel_err):
    x = _kv(50, seed=5) * 3
    c = codec(name)
    back = c.decode(c.encode(x))
    assert ((back - x).abs().max() / x.abs().max()).item() <= max_rel_err


def test_kv_bytes_ratios_of_quantized_precisions():
    bf16 = bytes_per_head_token("bf16", 64)
    assert bytes_per_head_token("int8", 64) / bf16 == pytest.approx(0.56, abs=0.01)
    assert bytes_per_head_token("int4", 64) / bf16 == pytest.approx(0.31, abs=0.01)


def test_bad_kv_config_is_rejected():
    with pytest.raises(InvalidRequest):
        KVConfig(k_precision="int3")
    with pytest.raises(InvalidRequest):
        KVConfig(max_tokens=10, sinks=4, block_size=32)


def test_ring_cache_fresh_prefill_sees_only_itself():
    window = 8
    manager = KVManager([LayerSpec(HEADS, DIM, window, None)], KVConfig(block_size=4, **EXACT), context_length=4096)
    seq, _ = manager.new_sequence()
    k_all, v_all = _positions_kv(0, 12), _positions_kv(0, 12)
    keys, values, vis = seq[0].update_and_fetch(k_all[:, :, :5], v_all[:, :, :5])
    assert vis == CAUSAL and keys.shape[2] == 5  # no empty slots to mask out
    keys, values, vis = seq[0].update_and_fetch(k_all[:, :, 5:12], v_all[:, :, 5:12])  # then a chunk
    assert vis == SlidingCausal(window)  # the old slots oldest first, then the chunk: a band, no mask
    vis = causal_mask(7, keys.shape[2], vis.window)
    for row, pos in enumerate(range(5, 12)):
        seen = sorted(int(p) for p in keys[0, 0, vis[row], 0].tolist())
        assert seen == list(range(max(0, pos - window + 1), pos + 1))


def test_ring_chunk_after_wrapping_gets_the_window_oldest_first():
    window = 8
    manager = KVManager([LayerSpec(HEADS, DIM, window, None)], KVConfig(block_size=4, **EXACT), context_length=4096)
    seq, _ = manager.new_sequence()
    k_all = _positions_kv(0, 30)
    seq[0].update_and_fetch(k_all[:, :, :11], k_all[:, :, :11])  # 11 tokens: the ring has wrapped
    keys, values, vis = seq[0].update_and_fetch(k_all[:, :, 11:14], k_all[:, :, 11:14])
    assert vis == SlidingCausal(window)
    assert keys[0, 0, :, 0].tolist() == list(range(3, 14))  # positions 3..10 from the ring, then the chunk
    assert torch.equal(values, keys)
    for _ in range(3):  # several more wraps, chunks longer than the window included
        start = seq[0].offset
        keys, _, vis = seq[0].update_and_fetch(k_all[:, :, start:start + 5], k_all[:, :, start:start + 5])
        assert keys[0, 0, :, 0].tolist() == list(range(start - window, start + 5)) and vis == SlidingCausal(window)


def test_ring_with_gaps_falls_back_to_a_mask():
    window = 8
    manager = KVManager([LayerSpec(HEADS, DIM, window, None)], KVConfig(block_size=4, **EXACT), context_length=4096)
    seq, _ = manager.new_sequence()
    k_all = _positions_kv(0, 20)
    seq[0].update_and_fetch(k_all[:, :, :11], k_all[:, :, :11])
    seq[0].trim(2)  # positions 9 and 10 forgotten: their slots are empty, 3..8 remain (1, 2 were overwritten)
    keys, _, vis = seq[0].update_and_fetch(k_all[:, :, 9:12], k_all[:, :, 9:12])
    assert isinstance(vis, torch.Tensor) and vis.shape == (3, keys.shape[2])
    for row, pos in enumerate(range(9, 12)):
        seen = sorted(int(p) for p in keys[0, 0, vis[row], 0].tolist())
        assert seen == list(range(max(3, pos - window + 1), pos + 1))
