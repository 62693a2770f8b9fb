"""The int8 prompt GEMM (int8_gemm.c, the AVX2 and AVX-512 builds): the weights' own codes (I4R64, widened Q5_0 in
Q8R16) times int8 activations per token and group of 32, each token's largest activations in fp32,
against an fp64 rendering of the same arithmetic and against the fp32 product; a token's row whatever
shares its call; and the linears that take it."""
from __future__ import annotations

import pytest
import torch

from edgellm import kernels
from edgellm.kernels.int8_prompt import OUTLIERS, Int8Prompt
from edgellm.kernels.isa import Variant, cpu_features
from edgellm.quant.int4_pack import pack_int4, scale_zero_pairs

AVX2 = Variant("avx2")
needs_avx2 = pytest.mark.skipif(not {"avx2", "fma", "f16c", "bmi2", "movbe"} <= cpu_features(),
                                reason="the CPU cannot run the avx2 kernels")


def _rounded_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What int8_gemm.c computes, in fp64: each token's OUTLIERS largest |x| exactly, the rest of its
    activations rounded to int8 per group of 32."""
    x, w = x.double(), w.double()
    t, k = x.shape
    top = x.abs().topk(OUTLIERS, dim=1).indices
    outliers = torch.zeros_like(x).scatter_(1, top, x.gather(1, top))
    groups = (x - outliers).view(t, k // 32, 32)
    sx = groups.abs().amax(-1, keepdim=True) / 127
    sx[sx == 0] = 1.0
    rounded = (torch.round(groups / sx) * sx).view(t, k)
    return (rounded + outliers) @ w.T


def _i4r64(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """packed codes, scale_zero pairs and the fp64 weight they hold: w = (q - 8) * scale + zero."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    pairs = scale_zero_pairs(torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3,
                             torch.randn(n, k // 32, generator=gen) * 0.02)
    scale, zero = (pairs[..., i].T.double().repeat_interleave(32, dim=1) for i in (0, 1))
    return pack_int4(q), pairs, (q.double() - 8) * scale + zero


def _q5_0_in_q8r16(n: int, k: int, gen: torch.Generator, low: int = -16) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8R16 rows holding Q5_0 values (-16..15, as widened Q5_0 blocks are; from `low` = -128 a real Q8_0's)
    and their fp64 weight."""
    v = torch.randint(low, -low, (n, k), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half()
    blocks = torch.cat([torch.cat([d[:, b:b + 1].view(torch.uint8), v[:, 32 * b:32 * b + 32].view(torch.uint8)], 1)
                        for b in range(k // 32)], 1)
    return kernels.q8_0_as_q8r16(blocks.contiguous(), k), v.double() * d.double().repeat_interleave(32, dim=1)


def _activations(t: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(t, k, generator=gen)
    x[:, 5] *= 40.0  # an outlier channel, as a norm's weight makes them
    x[0, k // 2:] *= 10.0  # one token louder in its later groups
    x[-1, :32] = 0.0  # an all-zero group
    return x


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact, fp = _rounded_product(x, w), x.double() @ w.double().T
    scale = fp.abs().amax(dim=1, keepdim=True)
    assert ((y.double() - exact).abs() <= 1e-5 * scale).all()  # the same integers, float sums in another order
    assert ((y.double() - fp).abs() <= 3e-2 * scale).all()  # int8 activations: ~1/254 of a group's largest


@needs_avx2
@pytest.mark.parametrize("t, n, k", [(1, 64, 64), (7, 128, 128), (13, 192, 640), (33, 64, 2048)])
def test_i4r64_codes_times_int8_activations_are_the_rounded_product(t, n, k):
    gen = torch.Generator().manual_seed(t * n + k)
    packed, pairs, w = _i4r64(n, k, gen)
    x = _activations(t, k, gen)
    y = Int8Prompt(x, kernels.library_for(AVX2)).times_i4r64(packed, pairs, (0, n))
    _check(y, x, w)


@needs_avx2
def test_a_row_range_of_an_i4r64_weight_is_its_rows_product():
    gen = torch.Generator().manual_seed(3)
    packed, pairs, w = _i4r64(256, 320, gen)
    x = _activations(9, 320, gen)
    y = Int8Prompt(x, kernels.library_for(AVX2)).times_i4r64(packed, pairs, (64, 192))
    assert y.shape == (9, 128)
    _check(y, x, w[64:192])


@needs_avx2
@pytest.mark.parametrize("t, n, k", [(1, 16, 32), (6, 48, 640), (17, 96, 2048)])
def test_widened_q5_0_values_times_int8_activations_are_the_rounded_product(t, n, k):
    gen = torch.Generator().manual_seed(t + n + k)
    rows, w = _q5_0_in_q8r16(n, k, gen)
    x = _activations(t, k, gen)
    _check(Int8Prompt(x, kernels.library_for(AVX2)).times_q5_0(rows), x, w)


def _q6_k(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random Q6_K blocks (codes 0..63, an int8 scale per 16) and their weight, decoded by the
    tests' own reference (tests/quant/reference.py)."""
    return _k_quant("Q6_K", n, k)


def _k_quant(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random blocks of a K-quant (Q6_K, Q5_K) and their weight, by the tests' own reference."""
    import random

    from tests.quant import reference

    block_bytes = {"Q6_K": 210, "Q5_K": 176}[fmt]
    data = reference.random_tensor(fmt, n * k, random.Random(n + k))
    w = torch.tensor(reference.decode(fmt, data), dtype=torch.float64).view(n, k)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(n, k // 256 * block_bytes), w


@needs_avx2
@pytest.mark.parametrize("t, n, k", [(1, 16, 256), (6, 48, 768), (17, 32, 2048)])
def test_q6_k_blocks_times_int8_activations_are_the_rounded_product(t, n, k):
    """Each half group of 16 k's scaled by its own int8 scale, its codes summed in int16 two steps at a
    time (pairs of 63 * 127 would overflow in four)."""
    gen = torch.Generator().manual_seed(t + n + k)
    rows, w = _q6_k(n, k)
    x = _activations(t, k, gen)
    _check(Int8Prompt(x, kernels.library_for(AVX2)).times_q6_k(rows), x, w)


@needs_avx2
def test_outlier_channels_leave_the_other_channels_their_precision():
    """One channel 1000x the others: rounded with them, it would round the other 31 activations of its
    group to zero."""
    gen = torch.Generator().manual_seed(7)
    packed, pairs, w = _i4r64(64, 256, gen)
    x = torch.randn(4, 256, generator=gen)
    x[:, 3] *= 1000.0
    y = Int8Prompt(x, kernels.library_for(AVX2)).times_i4r64(packed, pairs, (0, 64))
    without = x.double().clone()
    without[:, 3] = 0.0
    rest = without @ w.T  # what the other 255 channels contribute
    assert ((y.double() - x.double() @ w.T).abs() <= 2e-2 * rest.abs().amax(dim=1, keepdim=True)).all()


@needs_avx2
def test_a_tokens_row_is_the_same_whatever_shares_its_call():
    """Quantization, outliers and sums are each token's own: a prompt computed whole and one whose first
    tokens came from the prefix cache get the same rows, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    lib = kernels.library_for(AVX2)
    rows, _ = _q5_0_in_q8r16(32, 512, gen)
    q6_k, _ = _q6_k(16, 512)
    packed, pairs, _ = _i4r64(128, 512, gen)
    x = _activations(11, 512, gen)
    x[2, 17] = 500.0  # one token's outlier that no other token has
    whole = Int8Prompt(x, lib)
    four, five, six = whole.times_i4r64(packed, pairs, (0, 128)), whole.times_q5_0(rows), whole.times_q6_k(q6_k)
    for start, end in [(0, 1), (2, 3), (1, 6), (5, 11)]:
        part = Int8Prompt(x[start:end], lib)
        assert torch.equal(part.times_i4r64(packed, pairs, (0, 128)), four[start:end])
        assert torch.equal(part.times_q5_0(rows), five[start:end])
        assert torch.equal(part.times_q6_k(q6_k), six[start:end])


@needs_avx2
def test_bad_shapes_are_refused():
    lib = kernels.library_for(AVX2)
    with pytest.raises(ValueError, match="K % 32"):
        Int8Prompt(torch.randn(2, 48), lib)
    with pytest.raises(ValueError, match="fp32"):
        Int8Prompt(torch.randn(2, 64).bfloat16(), lib)
    packed, pairs, _ = _i4r64(64, 64, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="do not fit"):
        Int8Prompt(torch.randn(2, 128), lib).times_i4r64(packed, pairs, (0, 64))


def test_int8_gemm_is_in_every_simd_build(variant, lib):
    assert kernels.int8_gemm_native(lib) == (variant.name in ("avx2", "avx512", "neon"))  # scalar: fp32 prompts


VNNI_BUILDS = [pytest.param(Variant("avx2", frozenset({"vnni"})), marks=pytest.mark.skipif(
                   "avx_vnni" not in cpu_features(), reason="the CPU has no AVX-VNNI")),
               pytest.param(Variant("avx512"), marks=pytest.mark.skipif(
                   Variant("avx512") not in kernels.runnable(), reason="the CPU cannot run the avx512 kernels"))]


@pytest.mark.parametrize("build", VNNI_BUILDS, ids=lambda v: v.label)
def test_vpdpbusd_builds_make_the_same_floats_as_plain_avx2(build):
    """vpdpbusd (AVX-VNNI, or AVX512-VNNI on 256-bit registers) sums 4 products into int32 where
    vpmaddubsw + vpmaddwd sum them via int16: the same integers, then the same float operations."""
    gen = torch.Generator().manual_seed(13)
    plain, vnni = kernels.library_for(AVX2), kernels.library_for(build)
    packed, pairs, _ = _i4r64(128, 640, gen)
    rows, _ = _q5_0_in_q8r16(48, 640, gen)
    x = _activations(9, 640, gen)
    assert torch.equal(Int8Prompt(x, vnni).times_i4r64(packed, pairs, (0, 128)),
                       Int8Prompt(x, plain).times_i4r64(packed, pairs, (0, 128)))
    assert torch.equal(Int8Prompt(x, vnni).times_q5_0(rows), Int8Prompt(x, plain).times_q5_0(rows))
    q6_k, _ = _q6_k(32, 768)
    x = _activations(9, 768, gen)
    assert torch.equal(Int8Prompt(x, vnni).times_q6_k(q6_k), Int8Prompt(x, plain).times_q6_k(q6_k))


@needs_avx2
def test_linears_on_plain_avx2_take_the_int8_gemm_for_prompts(monkeypatch):
    """Int4Linear (one plane, groups of 32) and BlockLinear's widened Q5_0 and Q6_K parts go to the int8
    GEMM; a BlockLinear's other parts (Q8_0) beside them keep the float GEMM, each part in its place."""
    import random

    from edgellm.kernels import build, isa
    from edgellm.quant.blocks import BlockLinear
    from edgellm.quant.ggml import GGMLType
    from edgellm.quant.linear import Int4Linear

    from tests.quant import reference

    monkeypatch.setenv("EDGELLM_ISA", "avx2")
    isa.selected.cache_clear()
    build.library.cache_clear()
    try:
        assert "int8 prompt GEMMs" in kernels.describe()
        gen = torch.Generator().manual_seed(11)
        parts, weights = [], []
        for i, (fmt, n) in enumerate([("Q5_0", 64), ("Q8_0", 32), ("Q5_0", 48), ("Q6_K", 16)]):
            data = reference.random_tensor(fmt, n * 256, random.Random(i))
            weights.append(torch.tensor(reference.decode(fmt, data), dtype=torch.float64).view(n, 256))
            parts.append((torch.frombuffer(bytearray(data), dtype=torch.uint8), GGMLType[fmt], (n, 256)))
        linear = BlockLinear(parts)
        assert [p.q5_0 for p in linear.parts] == [True, False, True, False]
        x = _activations(40, 256, gen)
        w = torch.cat(weights)
        q6_k_calls = []
        times_q6_k = Int8Prompt.times_q6_k
        monkeypatch.setattr(Int8Prompt, "times_q6_k", lambda self, *a, **kw: q6_k_calls.append(1) or times_q6_k(self, *a, **kw))
        y = linear(x)
        assert q6_k_calls == [1]
        fp = x.double() @ w.T
        assert ((y.double() - fp).abs() <= 3e-2 * fp.abs().amax(dim=1, keepdim=True)).all()
        float_rows = slice(64, 96)  # the Q8_0 part: dequantized, fp32 GEMM
        assert ((y[:, float_rows].double() - fp[:, float_rows]).abs() <= 1e-4 * fp.abs().amax()).all()

        q = torch.randint(0, 16, (128, 256), generator=gen, dtype=torch.uint8)
        scale, zero = torch.rand(128, 8, generator=gen) * 0.02 + 1e-3, torch.randn(128, 8, generator=gen) * 0.02
        int4 = Int4Linear(q, scale, zero)
        scale_zero = torch.from_numpy(int4.scale_zero).view(torch.bfloat16)
        w4 = (q.double() - 8) * scale_zero[..., 0].T.double().repeat_interleave(32, 1) \
            + scale_zero[..., 1].T.double().repeat_interleave(32, 1)
        _check(int4(x), x, w4)
    finally:
        isa.selected.cache_clear()
        build.library.cache_clear()


@needs_avx2
@pytest.mark.parametrize("k", [32, 64, 2048])
def test_each_tokens_outliers_are_its_largest_values_wherever_they_sit(k):
    """The outliers are found from the groups' maxima: all 8 in one group, spread one a group, in a row
    of fewer groups than outliers, or a row of zeros, each token's are its own 8 largest |x|."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=gen)
    x[0, :8] = torch.arange(8) * 10.0 + 100.0  # all in the first group
    x[1, torch.arange(8) * (k // 8)] = -300.0 - torch.arange(8)  # spread, negative
    x[2, -8:] *= 50.0  # all in the last group
    x[3] = 0.0
    quantized = Int8Prompt(x, kernels.library_for(AVX2))
    chosen = quantized.channels[quantized.at.long()]
    for token in range(3):
        assert set(chosen[token].tolist()) == set(x[token].abs().topk(OUTLIERS).indices.tolist())
        assert torch.equal(quantized.values[token], x[token, chosen[token].long()])
    for token in range(5):
        assert chosen[token].tolist() == sorted(chosen[token].tolist())  # ascending: a fixed order for their sum


def _i8_variants() -> list:
    return [v for v in kernels.runnable() if v.name != "scalar" and kernels.library_for(v).edgellm_int8_gemm_native()]


@pytest.mark.parametrize("variant", _i8_variants(), ids=lambda v: v.label)
def test_a_weight_packed_strip_by_strip_gives_the_panels_product_bit_for_bit(variant):
    """edgellm_int8_gemm_weight (the native layers' prompt GEMM: each thread packs a strip of 16 rows and
    multiplies it at once, on edgellm's pool) computes what packing the whole panel first does, for 4-bit
    I4R64 codes, widened Q5_0 and Q6_K, with outliers, a token count that is no whole tile, and an output
    wider than the weight (a fused projection's part); and a GGUF file's Q5_K and, where the build takes
    byte codes (x86 with VNNI), a real Q8_0 as their fp64 rendering has the product."""
    from edgellm.kernels.buffers import address

    lib = kernels.library_for(variant)
    gen = torch.Generator().manual_seed(21)
    t, k = 19, 512
    x = _activations(t, k, gen)
    packed, pairs, _ = _i4r64(128, k, gen)
    q5, _ = _q5_0_in_q8r16(48, k, gen)
    q6, _ = _q6_k(32, k)
    prompt = Int8Prompt(x, lib)
    cases = [(4, packed, pairs, prompt.times_i4r64(packed, pairs, (0, 128))), (5, q5, None, prompt.times_q5_0(q5)),
             (6, q6, None, prompt.times_q6_k(q6))]
    if lib.edgellm_int8_gemm_takes(8):  # a real Q8_0's codes: the same product as its fp64 rendering
        q8, w8 = _q5_0_in_q8r16(64, k, gen, low=-128)
        y8 = torch.empty(t, 64)
        lib.edgellm_int8_gemm_weight(prompt.act.data_ptr(), t, k, address(q8), None, 64, 8, y8.data_ptr(), 64,
                                     prompt.channels.data_ptr(), len(prompt.channels), prompt.at.data_ptr(),
                                     prompt.values.data_ptr(), prompt.at.shape[1], 2)
        _check(y8, x, w8)
    q5k, w5k = _k_quant("Q5_K", 32, k)
    y5k = torch.empty(t, 32)
    lib.edgellm_int8_gemm_weight(prompt.act.data_ptr(), t, k, address(q5k), None, 32, 13, y5k.data_ptr(), 32,
                                 prompt.channels.data_ptr(), len(prompt.channels), prompt.at.data_ptr(),
                                 prompt.values.data_ptr(), prompt.at.shape[1], 2)
    _check(y5k, x, w5k)  # a GGUF file's Q5_K: 5-bit codes, each sub-block of 32 its scale and zero
    for bits, weight, scale_zero, expected in cases:
        n = expected.shape[1]
        out = torch.full((t, n + 16), -1.0)
        lib.edgellm_int8_gemm_weight(prompt.act.data_ptr(), t, k, address(weight), address(scale_zero), n, bits,
                                     out.data_ptr(), n + 16, prompt.channels.data_ptr(), len(prompt.channels),
                                     prompt.at.data_ptr(), prompt.values.data_ptr(), prompt.at.shape[1], 2)
        assert torch.equal(out[:, :n], expected), bits
        assert (out[:, n:] == -1.0).all()  # nothing past the part's columns


def test_byte_codes_are_taken_where_the_products_are_summed_in_int32():
    """A real Q8_0's codes (q + 128) go to the int8 GEMM only where vpdpbusd sums them (AVX-512, AVX-VNNI):
    vpmaddubsw's int16 pairs would overflow, NEON's sdot reads signed codes."""
    for variant in _i8_variants():
        lib = kernels.library_for(variant)
        assert all(lib.edgellm_int8_gemm_takes(form) for form in (4, 5, 6, 13))
        assert lib.edgellm_int8_gemm_takes(8) == (variant.name == "avx512" or "vnni" in variant.label), variant.label
