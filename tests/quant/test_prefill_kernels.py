"""Prompt-time native kernels against references: unpacking packed INT4 to bf16 for the GEMM
(kernels/dequant.c) and chunk attention (kernels/attention.c)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgellm import kernels
from edgellm.quant.linear import UNPACK_ROWS, Int4Linear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs AVX-512 VNNI and a C compiler")


def _layer(n: int, k: int, planes: int, group: int, seed: int = 0) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, planes * k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, planes * k // group, generator=g) * 0.02 + 1e-3
    zero = torch.randn(n, planes * k // group, generator=g) * 0.01
    return Int4Linear(q, scale, zero, planes=planes, group=group)


@pytest.mark.parametrize("n, k, planes, group", [(64, 64, 1, 32), (960, 576, 1, 32), (576, 1536, 1, 64),
                                                 (256, 640, 2, 32), (192, 256, 1, 128)])
def test_unpacked_weight_is_the_one_torchs_kernel_multiplies(n, k, planes, group):
    layer = _layer(n, k, planes, group)
    wt = kernels.int4_unpack_bf16(layer.packed, layer.scale_zero, group, planes).clone()
    assert wt.shape == (k, n) and wt.dtype == torch.bfloat16
    # the identity through torch's own INT4 kernel reads out its weight, transposed
    eye = torch.eye(k, dtype=torch.bfloat16).repeat(1, planes)
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, group, layer.scale_zero)
    # identical but where (q - 8)·s + z nearly cancels and fp32 operation order shows
    assert (wt.float() - theirs.float()).abs().max() < 1e-4 * theirs.float().abs().max()
    assert (wt != theirs).float().mean() < 1e-3


def test_prompt_sized_inputs_take_the_bf16_gemm_and_agree_with_the_int4_kernel():
    layer = _layer(512, 640, 2, 32, seed=1)
    x = torch.randn(UNPACK_ROWS, 640)
    ours = layer(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == (UNPACK_ROWS, 512)
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16().repeat(1, 2), layer.packed, 32,
                                                        layer.scale_zero)
    assert (ours.float() - theirs.float()).abs().max() < 2e-2 * theirs.float().abs().max()


def _reference(q, k, v, scale, mask):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                          enable_gqa=True)


@pytest.mark.parametrize("heads, kv_heads, dim, t, s", [
    (9, 3, 64, 130, 130),     # SmolLM2: a fresh causal prefill
    (4, 1, 256, 70, 70),      # Gemma 3: four query heads per KV head
    (9, 3, 64, 7, 100),       # a chunk after a cached prefix
    (18, 2, 32, 33, 33),      # nine heads per KV head: more than one row block per head group
    (2, 2, 128, 1, 17),       # plain multi-head, one query
])
def test_attention_matches_fp64_causal_and_masked(heads, kv_heads, dim, t, s):
    g = torch.Generator().manual_seed(heads * t + s)
    q = (torch.randn(1, t, heads, dim, generator=g) * 2).transpose(1, 2)  # a strided view, as the models pass
    k, v = torch.randn(2, 1, kv_heads, s, dim, generator=g)
    causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    tolerance = _value_tolerance(v)
    ours = kernels.attention(q, k, v, 0.125, None)
    assert ours.shape == (1, heads, t, dim)
    assert (ours.double() - _reference(q, k, v, 0.125, causal)).abs().max() < tolerance
    mask = torch.rand(t, s, generator=g) < 0.3
    mask[:, 3] = True
    ours = kernels.attention(q, k, v, 0.125, mask)
    assert (ours.double() - _reference(q, k, v, 0.125, mask)).abs().max() < tolerance


@pytest.mark.parametrize("heads, kv_heads, dim, t, s, window", [
    (4, 1, 256, 512, 1024, 512),  # Gemma 3: a second 512-token chunk on a sliding layer
    (4, 1, 256, 70, 70, 33),      # a fresh prefill longer than its window
    (9, 3, 64, 37, 100, 20),      # windows that start mid-vector, odd sizes
    (18, 2, 32, 5, 40, 64),       # a window wider than the keys: plain causal
])
def test_attention_sliding_window_matches_fp64(heads, kv_heads, dim, t, s, window):
    g = torch.Generator().manual_seed(heads * t + s + window)
    q = (torch.randn(1, t, heads, dim, generator=g) * 2).transpose(1, 2)
    k, v = torch.randn(2, 1, kv_heads, s, dim, generator=g)
    ours = kernels.attention(q, k, v, 0.125, None, window=window)
    visible = torch.ones(t, s, dtype=torch.bool).tril(s - t) & ~torch.ones(t, s, dtype=torch.bool).tril(s - t - window)
    assert (ours.double() - _reference(q, k, v, 0.125, visible)).abs().max() < _value_tolerance(v)


def _value_tolerance(v: torch.Tensor) -> float:
    # fp32 throughout: ~1e-6 measured; with AVX512-BF16, P·V rounds P and V to bf16 (2^-9 each)
    return 4 * 2 ** -9 * float(v.abs().max()) if kernels.attention_bf16_values() else 1e-4


def test_attention_softmax_survives_large_scores():
    q = torch.full((1, 2, 4, 64), 30.0)
    k, v = torch.randn(2, 1, 1, 4, 64, generator=torch.Generator().manual_seed(5)) * 5
    ours = kernels.attention(q, k, v, 1.0, None)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.isfinite(ours).all()
    assert (ours.double() - _reference(q, k, v, 1.0, causal)).abs().max() < _value_tolerance(v)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_matches_pytorch(activation):
    from edgellm.models.layers import ACTIVATIONS

    gate_up = (torch.randn(3, 5, 2 * 96, generator=torch.Generator().manual_seed(2)) * 4).bfloat16()
    gate, up = gate_up.double().chunk(2, dim=-1)
    reference = ACTIVATIONS[activation](gate) * up
    ours = kernels.gated_act(gate_up, activation)
    assert ours.shape == (3, 5, 96) and ours.dtype == torch.bfloat16
    assert (ours.double() - reference).abs().max() < 8e-3 * reference.abs().max()  # one bf16 rounding


@pytest.mark.parametrize("heads, dim, with_norm", [(12, 64, False), (5, 256, True)])
def test_norm_rope_matches_the_pytorch_layers(heads, dim, with_norm):
    from edgellm.models.layers import RMSNorm, Rotary, apply_rotary

    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(1, 9, heads + 2, dim, generator=g) * 3
    rope = Rotary(dim, 10_000.0)(torch.arange(3, 12))
    norm = RMSNorm(torch.rand(dim, generator=g) + 0.5, 1e-6) if with_norm else None
    x = qkv[:, :, :heads]  # a strided view into a fused projection, as the models pass it
    reference = apply_rotary(norm(x) if norm else x, *rope)
    rest = qkv[:, :, heads:].clone()
    ours = kernels.norm_rope(x, *rope, None if norm is None else norm.weight, 1e-6 if norm else 0.0)
    assert ours.data_ptr() == qkv.data_ptr()  # in place
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, :, heads:], rest)  # the other heads untouched


def test_unpacking_in_row_chunks_equals_the_whole(monkeypatch):
    layer = _layer(256, 128, 2, 32, seed=4)
    whole = kernels.int4_unpack_bf16(layer.packed, layer.scale_zero, 32, 2).clone()
    part = kernels.int4_unpack_bf16(layer.packed, layer.scale_zero, 32, 2, (64, 192))
    assert torch.equal(part, whole[:, 64:192])
    with pytest.raises(ValueError):
        kernels.int4_unpack_bf16(layer.packed, layer.scale_zero, 32, 2, (10, 64))
    x = torch.randn(40, 128)
    one_gemm = layer(x)
    monkeypatch.setattr(kernels, "SCRATCH_ROWS", 64)  # a big layer: unpacked and multiplied 64 rows at a time
    torch.testing.assert_close(layer(x), one_gemm)


def test_nan_stays_nan_through_bf16_rounding():
    gate_up = torch.ones(2, 64, dtype=torch.bfloat16)
    gate_up[0, 3] = float("nan")
    out = kernels.gated_act(gate_up, "silu")
    assert torch.isnan(out[0, 3]) and torch.isfinite(out[1]).all()


def test_attention_with_every_key_visible_is_not_causal():
    from edgellm.models.layers import attention

    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(3, 1, 2, 6, 64, generator=g)
    ours = attention(q, k, v, None, scale=0.125, native=True)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125)
    assert (ours - reference).abs().max() < _value_tolerance(v)


def test_fused_norms_match_the_pytorch_layer():
    from edgellm.models.layers import RMSNorm

    g = torch.Generator().manual_seed(11)
    norm = RMSNorm(torch.rand(640, generator=g) + 0.5, 1e-6, native=True)
    x = torch.randn(1, 9, 640, generator=g) * 3
    y = (torch.randn(1, 9, 640, generator=g) * 5).bfloat16()
    reference = norm(x)
    ours = norm.for_linear(x)
    assert ours.dtype == torch.bfloat16  # a prompt's linear input, cast in the same pass
    assert ((ours.float() - reference).abs() <= reference.abs() * 2 ** -8 + 1e-6).all()
    torch.testing.assert_close(norm.add_to(x, y), x + norm(y), atol=1e-5, rtol=1e-5)
    few = x[:, :4]  # decode-sized: stays fp32 for the exact int16-activation GEMVs
    assert norm.for_linear(few).dtype == torch.float32
