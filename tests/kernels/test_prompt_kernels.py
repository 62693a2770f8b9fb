"""The prompt-time kernels of every variant against fp64 references and the scalar variant: weights
unpacked for the GEMM (dequant.c, block_gemv.c), chunk attention (attention.c), the gated MLP's
middle (act.c), per-head norm + RoPE (rope.c), fused norms (norm.c), and the KV encoder the decode
layers write with (kv_codec.h) against kv/codecs.py byte for byte."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgellm import kernels
from edgellm.kernels.build import _sources, build, compiler, load
from edgellm.kernels.isa import Variant, cpu_features
from edgellm.kv.codecs import codec
from edgellm.quant.ggml import GGMLType
from tests.kernels.test_gemv import BLOCK_FORMATS, _blocks, _int4

DTYPES = [torch.float32, torch.bfloat16]
BF16_ROUNDING = 2 ** -8  # relative: one rounding to bf16


def _within(ours: torch.Tensor, expected: torch.Tensor, relative: float) -> bool:
    ours, expected = ours.double(), expected.double()
    return bool(((ours - expected).abs() <= expected.abs() * relative + 1e-12).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, planes, group", [(64, 64, 1, 32), (256, 640, 2, 32), (192, 256, 1, 128)])
def test_int4_unpack_is_the_weight_transposed(lib, dtype, n, k, planes, group):
    packed, pairs, w = _int4(n, k, planes, group)
    wt = kernels.int4_unpack(packed, pairs, group, planes, dtype=dtype, lib=lib)
    assert wt.shape == (k, n) and wt.dtype == dtype
    assert _within(wt.T, w, 1e-6 if dtype == torch.float32 else BF16_ROUNDING)


def test_int4_unpack_in_row_chunks_equals_the_whole(lib):
    packed, pairs, _ = _int4(256, 128, 2, 32, seed=4)
    whole = kernels.int4_unpack(packed, pairs, 32, 2, dtype=torch.float32, lib=lib).clone()
    part = kernels.int4_unpack(packed, pairs, 32, 2, (64, 192), dtype=torch.float32, lib=lib)
    assert torch.equal(part, whole[:, 64:192])
    with pytest.raises(ValueError, match="64-row"):
        kernels.int4_unpack(packed, pairs, 32, 2, (10, 64), lib=lib)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_blocks_to_float_is_the_weight_rounded_once(lib, dtype, fmt):
    rows, w = _blocks(fmt, 16, 256, seed=7)
    ours = kernels.blocks_to_float(rows, GGMLType[fmt], 256, dtype=dtype, lib=lib)
    assert ours.dtype == dtype and _within(ours, w, 2 ** -22 if dtype == torch.float32 else BF16_ROUNDING)


def test_int8_rows_to_float(lib):
    q = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    scale = (torch.rand(8) * 0.01).bfloat16()
    ours = kernels.blocks_to_float(q.view(torch.uint8), GGMLType.I8, 64, dtype=torch.float32, row_scale=scale, lib=lib)
    assert torch.equal(ours, q.float() * scale.float()[:, None])


def _attention_reference(q, k, v, scale, mask):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                          enable_gqa=True)


def _value_tolerance(lib, v: torch.Tensor, queries: int) -> float:
    # fp32 throughout: ~1e-6 measured; with AVX512-BF16, a prompt's P·V rounds P and V to bf16 (2^-9 each)
    return 4 * 2 ** -9 * float(v.abs().max()) if kernels.attention_bf16_values(queries, lib) else 1e-4


@pytest.mark.parametrize("heads, kv_heads, dim, t, s", [
    (9, 3, 64, 130, 130),     # SmolLM2: a fresh causal prefill
    (4, 1, 256, 70, 70),      # Gemma 3: four query heads per KV head
    (9, 3, 64, 7, 100),       # a chunk after a cached prefix
    (18, 2, 32, 33, 33),      # nine heads per KV head: more than one row block per head group
    (2, 2, 128, 1, 17),       # plain multi-head, one query
    (14, 2, 64, 45, 45),      # seven query heads per KV head (Qwen2.5): 7-row passes (4 + 3 on AVX2)
    (10, 2, 64, 21, 50),      # five: 5-row passes, a block with one position
])
def test_attention_matches_fp64_causal_and_masked(lib, scalar, heads, kv_heads, dim, t, s):
    g = torch.Generator().manual_seed(heads * t + s)
    q = (torch.randn(1, t, heads, dim, generator=g) * 2).transpose(1, 2)  # a strided view, as the models pass
    k, v = torch.randn(2, 1, kv_heads, s, dim, generator=g)
    causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    tolerance = _value_tolerance(lib, v, q.shape[2])
    ours = kernels.attention(q, k, v, 0.125, None, lib=lib)
    assert ours.shape == (1, heads, t, dim)
    assert (ours.double() - _attention_reference(q, k, v, 0.125, causal)).abs().max() < tolerance
    assert (ours - kernels.attention(q, k, v, 0.125, None, lib=scalar)).abs().max() < tolerance
    mask = torch.rand(t, s, generator=g) < 0.3
    mask[:, 3] = True
    ours = kernels.attention(q, k, v, 0.125, mask, lib=lib)
    assert (ours.double() - _attention_reference(q, k, v, 0.125, mask)).abs().max() < tolerance


@pytest.mark.parametrize("heads, kv_heads, dim, t, s, window", [
    (4, 1, 256, 512, 1024, 512),  # Gemma 3: a second 512-token chunk on a sliding layer
    (4, 1, 256, 70, 70, 33),      # a fresh prefill longer than its window
    (9, 3, 64, 37, 100, 20),      # windows that start mid-vector, odd sizes
    (18, 2, 32, 5, 40, 64),       # a window wider than the keys: plain causal
])
def test_attention_sliding_window_matches_fp64(lib, heads, kv_heads, dim, t, s, window):
    g = torch.Generator().manual_seed(heads * t + s + window)
    q = (torch.randn(1, t, heads, dim, generator=g) * 2).transpose(1, 2)
    k, v = torch.randn(2, 1, kv_heads, s, dim, generator=g)
    ours = kernels.attention(q, k, v, 0.125, None, window=window, lib=lib)
    visible = torch.ones(t, s, dtype=torch.bool).tril(s - t) & ~torch.ones(t, s, dtype=torch.bool).tril(s - t - window)
    assert (ours.double() - _attention_reference(q, k, v, 0.125, visible)).abs().max() < _value_tolerance(lib, v, q.shape[2])


def test_bf16_values_left_off_for_speed_still_match_fp64(tmp_path):
    # Where vdpbf16ps runs at half the FMA rate (AMX cores) the library multiplies P·V in fp32; the
    # bf16 path, what a Zen 4 runs, is built here without that tuning so it stays tested.
    features = cpu_features()
    if not {"avx512_bf16", "amx_bf16"} <= features or "bf16" not in kernels.runnable()[0].extras:
        pytest.skip("the regular avx512+bf16 library already takes bf16 P·V here, or the CPU has no AVX512-BF16")
    if compiler() is None:
        pytest.skip("no C compiler")
    build(_sources(), Variant("avx512", frozenset({"bf16"})).compiler_flags(), tmp_path / "bf16.so")
    lib = load(tmp_path / "bf16.so")
    assert kernels.attention_bf16_values(64, lib)
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(1, 64, 8, 64, generator=g) * 2).transpose(1, 2)
    k, v = torch.randn(2, 1, 2, 80, 64, generator=g)
    causal = torch.ones(64, 80, dtype=torch.bool).tril(16)
    ours = kernels.attention(q, k, v, 0.125, None, lib=lib)
    assert (ours.double() - _attention_reference(q, k, v, 0.125, causal)).abs().max() < _value_tolerance(lib, v, 64)


def test_attention_with_soft_capped_scores_matches_fp64(lib):
    # Gemma 2: scores s -> cap · tanh(s / cap) before the mask and softmax
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 20, 4, 64, generator=g) * 2).transpose(1, 2)
    k, v = torch.randn(2, 1, 2, 50, 64, generator=g)
    causal = torch.ones(20, 50, dtype=torch.bool).tril(30)
    ours = kernels.attention(q, k, v, 0.125, None, lib=lib, softcap=2.0)
    scores = 2.0 * torch.tanh((q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.125 / 2.0)
    expected = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v.double().repeat_interleave(2, 1)
    assert (ours.double() - expected).abs().max() < _value_tolerance(lib, v, q.shape[2])
    assert (ours.double() - _attention_reference(q, k, v, 0.125, causal)).abs().max() > 0.01  # the cap matters


def test_attention_softmax_survives_large_scores(lib):
    q = torch.full((1, 2, 4, 64), 30.0)
    k, v = torch.randn(2, 1, 1, 4, 64, generator=torch.Generator().manual_seed(5)) * 5
    ours = kernels.attention(q, k, v, 1.0, None, lib=lib)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.isfinite(ours).all()
    assert (ours.double() - _attention_reference(q, k, v, 1.0, causal)).abs().max() < _value_tolerance(lib, v, q.shape[2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_matches_pytorch(lib, dtype, activation):
    from edgellm.models.layers import ACTIVATIONS

    gate_up = (torch.randn(3, 5, 2 * 96, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = ACTIVATIONS[activation](gate) * up
    ours = kernels.gated_act(gate_up, activation, lib=lib)
    assert ours.shape == (3, 5, 96) and ours.dtype == dtype
    tolerance = 2e-6 if dtype == torch.float32 else 8e-3  # the polynomial exp / one bf16 rounding
    assert (ours.double() - expected).abs().max() < tolerance * expected.abs().max()


def test_nan_stays_nan_through_bf16_rounding(lib):
    gate_up = torch.ones(2, 64, dtype=torch.bfloat16)
    gate_up[0, 3] = float("nan")
    out = kernels.gated_act(gate_up, "silu", lib=lib)
    assert torch.isnan(out[0, 3]) and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("heads, dim, with_norm", [(12, 64, False), (5, 256, True)])
def test_norm_rope_matches_the_pytorch_layers(lib, heads, dim, with_norm):
    from edgellm.models.layers import RMSNorm, Rotary, apply_rotary

    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(1, 9, heads + 2, dim, generator=g) * 3
    rope = Rotary(dim, 10_000.0)(torch.arange(3, 12))
    norm = RMSNorm(torch.rand(dim, generator=g) + 0.5, 1e-6) if with_norm else None
    x = qkv[:, :, :heads]  # a strided view into a fused projection, as the models pass it
    expected = apply_rotary(norm(x) if norm else x, *rope)
    rest = qkv[:, :, heads:].clone()
    ours = kernels.norm_rope(x, *rope, None if norm is None else norm.weight, 1e-6 if norm else 0.0, lib=lib)
    assert ours.data_ptr() == qkv.data_ptr()  # in place
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, :, heads:], rest)  # the other heads untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norms_match_pytorch(lib, dtype):
    g = torch.Generator().manual_seed(11)
    weight = torch.rand(640, generator=g) + 0.5
    x = torch.randn(9, 640, generator=g) * 3
    y = (torch.randn(9, 640, generator=g) * 5).to(dtype)
    expected = F.rms_norm(x, (640,), weight, 1e-6)
    ours = kernels.rms_norm(x, weight, 1e-6, dtype, lib=lib)
    assert ours.dtype == dtype  # a prompt's linear input, cast in the same pass
    assert _within(ours, expected, 1e-6 if dtype == torch.float32 else BF16_ROUNDING)
    added = kernels.add_rms_norm(x, y, weight, 1e-6, lib=lib)
    torch.testing.assert_close(added, x + F.rms_norm(y.float(), (640,), weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["f32", "f16", "int8", "int4"])
def test_kv_encoder_writes_the_bytes_kv_codecs_write(lib, precision):
    """The decode layers store K and V themselves: the bytes must be the PyTorch path's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 5, 64, generator=g) * 3
    x[0, 1, 2] = 0.0  # an all-zero row: the scale floor
    x[0, 0, 4, :32] = 7.5  # a constant group: INT4's zero range
    kv = codec(precision)
    expected = {name: part.to(getattr(torch, kv.part_shapes(64)[name][1])) for name, part in kv.encode(x).items()}
    ours = {name: torch.zeros(1, 2, 5, size, dtype=getattr(torch, dtype)) for name, (size, dtype) in kv.part_shapes(64).items()}
    ptr = lambda name: ours[name].data_ptr() if name in ours else None  # noqa: E731
    lib.edgellm_kv_encode(x.data_ptr(), 10, 64, ptr("x") or ptr("q"), ptr("scale"), ptr("min"),
                          ["f32", "f16", "int8", "int4"].index(precision))
    for name, part in expected.items():
        assert torch.equal(ours[name].view(torch.uint8), part.contiguous().view(torch.uint8)), name
