"""The decode GEMVs of every kernel variant (int4_gemv.c on the I4R64 layout, block_gemv.c on GGUF
blocks and INT8 rows) against fp64 products of the dequantized weight, and against the scalar
reference variant: the integer dot products are exact in every variant, so only float summation
order may differ from the reference."""
from __future__ import annotations

import random

import pytest
import numpy as np
import torch

from edgellm import kernels
from edgellm.kernels.build import _sources, build, compiler, load
from edgellm.kernels.isa import Variant, cpu_features
from edgellm.quant.ggml import GGMLType
from edgellm.quant.int4_pack import pack_int4, scale_zero_pairs, unpack_int4
from tests.quant import reference

# int16 activations: ~2e-5 of the largest product measured; fp32 sums in another order than the
# reference variant's: ~1e-6
TO_FP64, TO_SCALAR = 2e-4, 2e-5


def _int4(n: int, k: int, planes: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, planes * k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, planes * k // group, generator=g) * 0.02 + 1e-3
    zero = torch.randn(n, planes * k // group, generator=g) * 0.01
    expand = lambda t: t.bfloat16().double().repeat_interleave(group, 1)  # noqa: E731  (the kernel reads bf16)
    w = (q.double() - 8) * expand(scale) + expand(zero)
    return pack_int4(q), scale_zero_pairs(scale, zero), w.view(n, planes, k).sum(1)


def _close(ours: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    return bool((ours.double() - expected.double()).abs().max() <= tolerance * expected.double().abs().max())


@pytest.mark.parametrize("n, k, planes, group", [(64, 64, 1, 32), (960, 576, 1, 32), (576, 1536, 1, 64),
                                                 (128, 640, 2, 32), (192, 256, 1, 128)])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8])
def test_int4_gemv_matches_fp64_and_the_scalar_reference(lib, scalar, n, k, planes, group, m):
    packed, pairs, w = _int4(n, k, planes, group)
    x = torch.randn(m, k, dtype=torch.float64, generator=torch.Generator().manual_seed(m)) * 3
    ours = kernels.int4_gemv(x.float(), packed, pairs, group, planes, lib=lib)
    assert ours.shape == (m, n) and ours.dtype == torch.float32
    assert _close(ours, x @ w.T, TO_FP64)
    assert _close(ours, kernels.int4_gemv(x.float(), packed, pairs, group, planes, lib=scalar), TO_SCALAR)


def test_int4_gemv_without_vbmi_matches_the_scalar_reference(tmp_path, scalar):
    # CPUs with AVX512-VBMI unpack INT4 weights with vpermb into rows in order; Cascade Lake's
    # baseline path (vpunpck, rows in a per-lane order) is built here without that flag
    if not {"avx512vbmi", "avx512_vnni"} <= cpu_features():
        pytest.skip("the regular avx512 library already is the baseline path, or the CPU has no AVX-512")
    if compiler() is None:
        pytest.skip("no C compiler")
    build(_sources(), Variant("avx512").compiler_flags(), tmp_path / "baseline.so")
    lib = load(tmp_path / "baseline.so")
    for n, k, planes, group in [(960, 576, 1, 32), (128, 640, 2, 32), (192, 256, 1, 128)]:
        packed, pairs, w = _int4(n, k, planes, group)
        for m in (1, 3, 4, 8):
            x = torch.randn(m, k, dtype=torch.float64, generator=torch.Generator().manual_seed(m)) * 3
            ours = kernels.int4_gemv(x.float(), packed, pairs, group, planes, lib=lib)
            assert _close(ours, x @ w.T, TO_FP64)
            assert _close(ours, kernels.int4_gemv(x.float(), packed, pairs, group, planes, lib=scalar), TO_SCALAR)


def test_int4_gemv_zero_and_extreme_activations(lib):
    packed, pairs, w = _int4(64, 128, 1, 32, seed=3)
    x = torch.zeros(2, 128)
    x[1, 5], x[1, 100] = 1e4, -3e-3
    ours = kernels.int4_gemv(x, packed, pairs, 32, 1, lib=lib).double()
    assert torch.equal(ours[0], torch.zeros(64, dtype=torch.float64))
    expected = x.double() @ w.T
    assert (ours[1] - expected[1]).abs().max() < 1e-4 * expected[1].abs().max()


def test_layout_round_trips_and_equals_torchs_avx512_packing():
    q = torch.randint(0, 16, (192, 96), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (192, 48) and torch.equal(unpack_int4(packed), q)
    # byte i of a block's k-row holds rows i (low nibble) and 32 + i (high nibble)
    assert int(packed.view(3, 96, 32)[1, 7, 5]) == int(q[64 + 5, 7]) | int(q[64 + 37, 7]) << 4
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # the same bytes torch packs there
        assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
    with pytest.raises(ValueError, match="N % 64"):
        pack_int4(q[:40])


BLOCK_FORMATS = ["Q8_0", "Q5_0", "Q5_K", "Q6_K"]


def _blocks(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (N rows of K) and their fp64 values from the independent scalar decoder."""
    data = reference.random_tensor(fmt, n * k, random.Random(seed))
    values = torch.tensor(reference.decode(fmt, data), dtype=torch.float64).view(n, k)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(n, -1), values


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_block_gemv_matches_the_reference_decoder(lib, scalar, fmt, m):
    rows, w = _blocks(fmt, 48, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
    ours = kernels.block_gemv(x.float(), rows, GGMLType[fmt], 512, lib=lib)
    assert _close(ours, x @ w.T, TO_FP64)
    assert _close(ours, kernels.block_gemv(x.float(), rows, GGMLType[fmt], 512, lib=scalar), TO_SCALAR)


def test_q5_0_widened_to_q8_0_by_every_variant_holds_the_same_weights(lib, scalar):
    rows, w = _blocks("Q5_0", 40, 256, seed=11)
    wide = kernels.q5_0_as_q8_0(rows, lib=lib)
    assert torch.equal(wide, kernels.q5_0_as_q8_0(rows, lib=scalar))
    assert torch.equal(torch.tensor(reference.decode("Q8_0", bytes(wide.flatten().numpy())), dtype=torch.float64).view(40, 256), w)


@pytest.mark.parametrize("m", [1, 4])
def test_int8_rows_with_their_scales(lib, scalar, m):
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-127, 128, (96, 256), dtype=torch.int8, generator=g)
    scale = (torch.rand(96, generator=g) * 0.01 + 1e-3).bfloat16()
    w = q.double() * scale.double()[:, None]
    x = torch.randn(m, 256, generator=g, dtype=torch.float64)
    rows = q.view(torch.uint8)
    ours = kernels.block_gemv(x.float(), rows, GGMLType.I8, 256, scale, lib=lib)
    assert _close(ours, x @ w.T, TO_FP64)
    assert _close(ours, kernels.block_gemv(x.float(), rows, GGMLType.I8, 256, scale, lib=scalar), TO_SCALAR)
    with pytest.raises(ValueError, match="row_scale"):
        kernels.block_gemv(x.float(), rows, GGMLType.I8, 256, lib=lib)


def test_gemv_takes_at_most_eight_rows(lib):
    packed, pairs, _ = _int4(64, 64, 1, 32)
    with pytest.raises(ValueError, match="at most 8"):
        kernels.int4_gemv(torch.zeros(9, 64), packed, pairs, 32, 1, lib=lib)


def _q8r16(n: int, k: int, seed: int, lib):
    rows, w = _blocks("Q8_0", n, k, seed)
    return kernels.q8_0_as_q8r16(rows, k, lib=lib), rows, w


def test_q8r16_holds_the_q8_0_rows_bytes_sixteen_rows_interleaved(lib, scalar):
    packed, rows, w = _q8r16(48, 256, 5, lib)
    assert packed.shape == rows.shape and torch.equal(packed, kernels.q8_0_as_q8r16(rows, 256, lib=scalar))
    group = packed.view(3, 8, 544)[1, 2]  # rows 16-31, block 2 (weights 64-95)
    block = rows[16 + 5, 2 * 34:3 * 34]  # row 21's block 2
    assert bytes(group[10:12].numpy()) == bytes(block[:2].numpy())  # its fp16 d
    assert [int(group[32 + 32 * p + 10 + e]) for p in range(16) for e in (0, 1)] == block[2:].tolist()
    assert torch.equal(kernels.blocks_to_float(packed, kernels.Q8R16, 256, dtype=torch.float32, lib=lib).double(), w)
    ids = torch.tensor([47, 0, 21, 21])
    assert torch.equal(kernels.q8r16_rows(packed, 256, ids, lib=lib).double(), w[ids])
    with pytest.raises(ValueError, match="whole groups of 16"):
        kernels.q8_0_as_q8r16(rows[:40], 256, lib=lib)
    with pytest.raises(IndexError):
        kernels.q8r16_rows(packed, 256, torch.tensor([48]), lib=lib)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_q8r16_gemv_matches_fp64_and_every_variant_computes_the_same_floats(lib, scalar, m):
    # per block an exact int32 dot product, then one fma per row in block order: the same floats
    # in every variant and for every number of rows (a sequence in a batch gets what it gets alone)
    packed, _, w = _q8r16(64, 640, m, lib)
    x = torch.randn(m, 640, generator=torch.Generator().manual_seed(m), dtype=torch.float64) * 2
    ours = kernels.block_gemv(x.float(), packed, kernels.Q8R16, 640, lib=lib)
    assert _close(ours, x @ w.T, TO_FP64)
    assert torch.equal(ours, kernels.block_gemv(x.float(), packed, kernels.Q8R16, 640, lib=scalar))
    for i in range(m):
        assert torch.equal(ours[i], kernels.block_gemv(x[i:i + 1].float(), packed, kernels.Q8R16, 640, lib=lib)[0])


REPACK_FORMATS = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.parametrize("fmt", REPACK_FORMATS)
def test_the_native_i4r64_repack_writes_the_bytes_of_the_torch_packing(lib, fmt):
    """int4_repack.c from the file's blocks against Int4Linear.from_affine(integer_affine(...)), byte for
    byte: one or two planes, a part starting inside a 64-row run (fused q|k|v of 96 + 160 + 64 rows)."""
    from edgellm.quant.ggml import integer_affine
    from edgellm.quant.linear import Int4Linear

    k, sizes = 512, (96, 160, 64)
    parts = [_blocks(fmt, n, k, seed=7 + i)[0] for i, n in enumerate(sizes)]
    affine = [integer_affine(p.reshape(-1), GGMLType[fmt], (n, k)) for p, n in zip(parts, sizes)]
    reference = Int4Linear.from_affine(*(torch.cat([a[j] for a in affine]) for j in range(3)), bits=affine[0][3])
    ours = Int4Linear.empty(sum(sizes), k, planes=reference.planes)
    row = 0
    for p, n in zip(parts, sizes):
        kernels.i4r64_from_blocks(p, GGMLType[fmt], n, k, ours.packed, ours.scale_zero, row, lib=lib)
        row += n
    assert np.array_equal(ours.packed, reference.packed)
    assert np.array_equal(ours.scale_zero, reference.scale_zero)


@pytest.mark.parametrize("fmt", REPACK_FORMATS)
def test_affine_row_lookups_match_the_reference_decoder(lib, fmt):
    """An embedding table's rows (an untied model's Q4_K_M keeps its table in Q4_K), read in C."""
    from edgellm.kernels.gemv import affine_rows

    rows, w = _blocks(fmt, 40, 512, seed=11)
    ids = [3, 0, 39, 3]
    ours = affine_rows(rows.numpy(), GGMLType[fmt], 512, ids, lib=lib)
    np.testing.assert_allclose(ours, w[ids].numpy(), rtol=1e-6, atol=1e-6 * float(w.abs().max()))
    with pytest.raises(IndexError):
        affine_rows(rows.numpy(), GGMLType[fmt], 512, [40], lib=lib)
    with pytest.raises(ValueError, match="no row lookup"):
        affine_rows(_blocks("Q6_K", 4, 256, seed=1)[0].numpy(), GGMLType.Q6_K, 256, [0], lib=lib)


def test_the_repack_refuses_types_and_shapes_it_does_not_take(lib):
    packed, scale_zero = torch.empty(64, 128, dtype=torch.uint8), torch.empty(8, 64, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no I4R64 repack"):
        kernels.i4r64_from_blocks(_blocks("Q6_K", 64, 256, seed=1)[0], GGMLType.Q6_K, 64, 256, packed, scale_zero,
                                  lib=lib)
    with pytest.raises(ValueError, match="no I4R64 repack"):  # rows past the weight's
        kernels.i4r64_from_blocks(_blocks("Q4_0", 64, 256, seed=1)[0], GGMLType.Q4_0, 64, 256, packed, scale_zero,
                                  row0=32, lib=lib)
    with pytest.raises(ValueError, match="no I4R64 repack"):  # 8-bit codes need two planes
        kernels.i4r64_from_blocks(_blocks("Q8_0", 64, 256, seed=1)[0], GGMLType.Q8_0, 64, 256, packed, scale_zero,
                                  lib=lib)
    with pytest.raises(ValueError, match="no I4R64 repack"):  # fewer bytes than the rows' blocks
        kernels.i4r64_from_blocks(_blocks("Q4_0", 64, 256, seed=1)[0][:32], GGMLType.Q4_0, 64, 256, packed,
                                  scale_zero, lib=lib)
