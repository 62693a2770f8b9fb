import random

import pytest
import torch
import torch.nn.functional as F

from edgellm import kernels
from edgellm.quant import linear as linear_mod
from edgellm.quant.ggml import GGMLType, dequantize, integer_affine
from edgellm.quant.linear import UNPACK_ROWS, DenseLinear, Int4Linear, make_fused_linear, make_linear

from . import reference

# The INT4 layout keeps scale/zero in bf16 (8-bit mantissa), and prompts multiply in the compute
# dtype (bf16 where the CPU has it), so outputs differ from fp32 math on the exact weight by ~0.3 %.
INT4_REL_TOL = 1e-2
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the INT4 layout runs on the native kernels")
FAST = kernels.compute_dtype()  # what fast mode's dense layers and prompt GEMMs multiply in


def _part(fmt: str, n: int, k: int, seed: int = 0):
    data = reference.random_tensor(fmt, n * k, random.Random(f"{fmt}/{n}x{k}/{seed}"))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), GGMLType[fmt], (n, k)


def _weight(parts) -> torch.Tensor:
    return torch.cat([dequantize(*p) for p in parts])  # (N, K) fp32


def _x(k: int, rows: int = 5, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@needs_kernels
@pytest.mark.parametrize(
    "fmt, n, k",
    [("Q4_0", 960, 576), ("Q4_1", 3072, 576), ("Q4_K", 576, 1536), ("Q4_0", 576, 1536)],
)
@pytest.mark.parametrize("rows", [5, 20, UNPACK_ROWS + 8])
def test_int4_linear_matches_dequantized_weight(fmt, n, k, rows):
    part = _part(fmt, n, k)
    lin = make_linear(*part, mode="fast")
    assert isinstance(lin, Int4Linear)
    x = _x(k, rows, dtype=torch.float32)
    y = lin(x)
    # decode-sized inputs (GEMV, in chunks of 8 rows) come out fp32; prompts in the compute dtype
    assert y.dtype == (FAST if rows >= UNPACK_ROWS else torch.float32) and y.shape == (rows, n)
    assert _rel_err(y, F.linear(x, _weight([part]))) < INT4_REL_TOL


@needs_kernels
def test_prompt_gemm_in_scratch_chunks_equals_one_gemm(monkeypatch):
    lin = make_linear(*_part("Q4_1", 256, 128), mode="fast")
    x = torch.randn(40, 128)
    one_gemm = lin(x)
    monkeypatch.setattr(kernels, "SCRATCH_ROWS", 64)  # a big layer: unpacked and multiplied 64 rows at a time
    # the same products; only the BLAS's summation order may differ with N (MKL's fp32 at AVX2
    # width: 1e-4 of the output)
    torch.testing.assert_close(lin(x), one_gemm, rtol=0, atol=1e-3 * float(one_gemm.abs().max()))


@needs_kernels
def test_int4_linear_nbytes():
    lin = make_linear(*_part("Q4_K", 64, 512), mode="fast")
    # 4 bits per weight + bf16 scale and zero per group of 32
    assert lin.nbytes == 64 * 512 // 2 + 64 * (512 // 32) * 2 * 2


@needs_kernels
def test_int4_linear_packs_in_row_chunks(monkeypatch):
    # Packing chunk by chunk must equal packing at once, including a 64-row tail: Int4Linear's own
    # packing (from_affine, edgellm's schemes; a GGUF file's blocks are repacked in C).
    monkeypatch.setattr(linear_mod, "_PACK_ROWS", 128)
    part = _part("Q4_1", 320, 64)
    x = _x(64)
    ref = F.linear(x.float(), _weight([part]))
    assert _rel_err(Int4Linear.from_affine(*integer_affine(*part))(x), ref) < INT4_REL_TOL


@needs_kernels
@pytest.mark.parametrize(
    "specs",
    [
        [("Q4_0", 576, 576), ("Q4_1", 192, 576), ("Q4_0", 192, 576)],  # QKV, mixed int4 kinds
        [("Q4_K", 1536, 512), ("Q4_K", 1536, 512)],  # gate_up
    ],
)
def test_fused_int4(specs):
    parts = [_part(fmt, n, k, seed=i) for i, (fmt, n, k) in enumerate(specs)]
    fused = make_fused_linear(parts, mode="fast")
    assert isinstance(fused, Int4Linear)
    assert fused.out_splits == [n for _, n, _ in specs]
    x = _x(specs[0][2], rows=3)
    y = fused(x)
    assert _rel_err(y, F.linear(x.float(), _weight(parts))) < INT4_REL_TOL
    for piece, part in zip(torch.split(y, fused.out_splits, dim=-1), parts):
        assert _rel_err(piece, F.linear(x.float(), dequantize(*part))) < INT4_REL_TOL


@needs_kernels
def test_fused_4_and_8_bit_parts_share_two_planes():
    parts = [_part("Q4_K", 256, 512), _part("Q8_0", 64, 512)]
    fast = make_fused_linear(parts, mode="fast")
    assert isinstance(fast, Int4Linear) and fast.planes == 2 and fast.out_splits == [256, 64]
    x = _x(512, dtype=torch.float32)
    assert _rel_err(fast(x), F.linear(x, _weight(parts))) < INT4_REL_TOL


def test_fused_mixed_types_fall_back_to_dense():
    parts = [_part("Q4_K", 256, 512), _part("Q6_K", 64, 512), _part("Q8_0", 64, 512)]
    weight = _weight(parts)
    x = _x(512, dtype=torch.float32)

    fast = make_fused_linear(parts, mode="fast")
    assert isinstance(fast, DenseLinear) and fast.weight.dtype == FAST
    assert fast.out_splits == [256, 64, 64]
    assert _rel_err(fast(x), F.linear(x, weight)) < INT4_REL_TOL

    exact = make_fused_linear(parts, mode="exact")
    assert exact.weight.dtype == torch.float32
    assert torch.equal(exact(x), F.linear(x, weight))


@needs_kernels
@pytest.mark.parametrize("fmt", ["Q8_0", "Q5_0", "Q5_1"])
def test_five_to_eight_bit_formats_become_two_exact_4bit_planes(fmt):
    n, k = 64, 64
    part = _part(fmt, n, k)
    lin = make_linear(*part, mode="fast")
    assert isinstance(lin, Int4Linear) and lin.planes == 2
    assert lin.in_features == k and lin.nbytes == n * k + 2 * (2 * k // 32) * n * 2
    x = _x(k)
    assert _rel_err(lin(x), F.linear(x.float(), dequantize(*part))) < INT4_REL_TOL


@needs_kernels
def test_two_planes_reproduce_8bit_integers_exactly():
    # Scales, zeros and x all exactly representable in bf16: the only rounding left is the
    # kernel's fp32 accumulation, so any plane-splitting mistake would show.
    q = torch.randint(0, 256, (64, 64), dtype=torch.uint8)
    scale = 2.0 ** torch.randint(-6, -2, (64, 2)).float()
    zero = torch.randint(-64, 64, (64, 2)).float() / 64
    lin = Int4Linear.from_affine(q, scale, zero, bits=8)
    weight = q.float() * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    x = torch.randn(3, 64).to(torch.bfloat16).float()
    y, ref = lin(x).float(), x @ weight.T
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["Q6_K", "F16", "F32"])
def test_fast_mode_other_types_are_dense_in_the_compute_dtype(fmt):
    k = 512 if fmt == "Q6_K" else 64
    lin = make_linear(*_part(fmt, 48, k), mode="fast")
    assert isinstance(lin, DenseLinear) and lin.weight.dtype == FAST
    assert lin.nbytes == 48 * k * FAST.itemsize


def test_int4_falls_back_when_the_layout_rejects_shape():
    part = _part("Q4_0", 40, 64)  # N not a multiple of the layout's 64-row blocks
    assert not Int4Linear.supports(40, 64)
    lin = make_linear(*part, mode="fast")
    assert isinstance(lin, DenseLinear) and lin.weight.dtype == FAST
    x = _x(64)
    assert _rel_err(lin(x), F.linear(x.float(), _weight([part]))) < INT4_REL_TOL


def test_exact_mode_is_fp32_dequantized():
    part = _part("Q4_1", 48, 64)
    lin = make_linear(*part, mode="exact")
    assert isinstance(lin, DenseLinear) and lin.nbytes == 48 * 64 * 4
    x = torch.randn(2, 3, 64)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 48)
    assert torch.equal(y, F.linear(x, dequantize(*part)))


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_is_in_compute_dtype_with_input_leading_dims(mode, dtype):
    lin = make_linear(*_part("Q4_0", 32, 64), mode=mode)  # 32 rows: dense in fast mode too
    x = torch.randn(2, 3, 64).to(dtype)
    y = lin(x)
    assert y.dtype == (torch.float32 if mode == "exact" else FAST) and y.shape == (2, 3, 32)
    assert lin(x[:, :0]).shape == (2, 0, 32)  # empty batch


def test_int4_linear_rejects_bad_parts():
    q = torch.zeros(40, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="N % 64"):
        Int4Linear(q, torch.ones(40, 2), torch.zeros(40, 2))
    q = torch.zeros(64, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="shape"):
        Int4Linear(q, torch.ones(64, 3), torch.zeros(64, 3))


def test_make_linear_rejects_bad_arguments():
    part = _part("Q4_0", 32, 64)
    with pytest.raises(ValueError, match="mode"):
        make_linear(*part, mode="turbo")
    with pytest.raises(ValueError, match="share K"):
        make_fused_linear([part, _part("Q4_0", 32, 128)], mode="fast")
    with pytest.raises(ValueError, match="2-D"):
        make_linear(part[0], part[1], (2, 16, 64), mode="exact")
    with pytest.raises(ValueError):
        make_fused_linear([], mode="exact")
