"""Linear layers built from GGML weights: dense (fp32, or the compute dtype) and packed 4-bit.

Weights are (N, K) = (out_features, in_features); forward takes (..., K) and
returns (..., N) in the layer's compute dtype (fp32 in exact mode; in fast mode bf16 where the
CPU multiplies bf16 natively, else fp32 — kernels.compute_dtype): callers decide where to widen,
so no cast is spent where the next op takes that dtype anyway.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from edgellm import kernels
from edgellm.extras import lazy, torch
from edgellm.kernels.buffers import as_array
from edgellm.module import Module

from .ggml import AFFINE_BITS, INT4_GROUP, dequantize, type_name
from .int4_pack import pack_int4, scale_zero_pairs

__all__ = [
    "MODES",
    "DenseLinear",
    "Int4Linear",
    "WeightPart",
    "make_linear",
    "make_fused_linear",
]

MODES = ("exact", "fast")

F = lazy("torch.nn.functional")

# (raw bytes, ggml type, torch-order shape (N, K)) of one GGUF weight: a numpy view of a GGUF file, or a
# tensor (safetensors files).
WeightPart = tuple[np.ndarray, int, tuple[int, int]]

# Row chunk for packing: a multiple of the layout's 64-row blocks, so packing chunks and
# concatenating equals packing the whole matrix, without an int32 copy of all of q at once.
_PACK_ROWS = 4096
# From this many activation rows on (counting each plane's pass), unpacking the weight to the
# compute dtype and running PyTorch's GEMM beats the GEMV kernel in chunks of kernels.MAX_ROWS
# (SmolLM2 on an AMD EPYC Zen 4, November 2026: 1.4x per linear at 64 rows, 2.5-5x at 512).
UNPACK_ROWS = 32


def fast_dtype() -> torch.dtype:
    """What fast mode multiplies in on this CPU (bf16 only with native bf16)."""
    return kernels.compute_dtype()


class DenseLinear(Module):
    """y = x @ W.T with W stored in compute_dtype; x is cast to it for the matmul (on PyTorch: weights
    no native kernel reads, and exact mode's fp32 reference)."""

    def __init__(self, weight: torch.Tensor, compute_dtype: torch.dtype | None = None):
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
        self.compute_dtype = compute_dtype or torch.float32
        self.weight = weight.to(self.compute_dtype).contiguous()  # (N, K)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.compute_dtype), self.weight)

    def __repr__(self) -> str:
        return f"DenseLinear(in={self.in_features}, out={self.out_features}, dtype={self.compute_dtype})"


class Int4Linear(Module):
    """4-bit weight linear in edgellm's I4R64 layout (quant/int4_pack.py), on the native kernels.

    Weight w[n, k] = (q[n, k] - 8) * scale[n, k // group] + zero[n, k // group] (group 32 for
    GGUF blocks; 64 or 128 for edgellm's own INT4 schemes); scale and zero are held in bf16.

    With planes=2, q/scale/zero hold two 4-bit planes side by side along K (see
    from_affine) and x is repeated to match: [W_hi W_lo] @ [x; x] = (W_hi + W_lo) @ x,
    so one kernel call multiplies by an up-to-8-bit weight.

    Up to kernels.MAX_ROWS activation rows (decode) go to the INT4 GEMV and come out fp32; from
    UNPACK_ROWS on, the weight is unpacked into a scratch of the compute dtype for PyTorch's GEMM.
    `packed` (N, planes * K / 2) uint8 and `scale_zero` (planes * K / group, N, 2) bf16 bits (uint16)
    are numpy arrays.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, planes: int = 1,
                 group: int = INT4_GROUP):
        n, k = _check_int4_parts(q, scale, zero, group)
        if k % planes:
            raise ValueError(f"K = {k} does not split into {planes} planes")
        self.planes, self.group = planes, group
        self.in_features, self.out_features = k // planes, n
        self.packed = as_array(_pack_rows(q))  # (N, K // 2) uint8
        self.scale_zero = as_array(scale_zero_pairs(scale, zero))  # (K // group, N, 2) bf16 bits

    @classmethod
    def from_affine(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> Int4Linear:
        """From w = q * scale + zero per group of 32, q < 2**bits (bits <= 8), exactly.

        Up to 4 bits: one plane, zero shifted by 8·scale for the kernel's (q - 8).
        5 to 8 bits: q = 16·hi + lo, so w = [(hi - 8)·16s + 128s] + [(lo - 8)·s + 8s + zero]."""
        if bits <= 4:
            return cls(q, scale, zero + 8 * scale)
        if bits > 8:
            raise ValueError(f"at most 8-bit integers fit two 4-bit planes, got {bits}")
        planes_q = torch.cat([q >> 4, q & 15], dim=1)  # (N, 2K)
        planes_scale = torch.cat([16 * scale, scale], dim=1)  # (N, 2K // 32)
        planes_zero = torch.cat([128 * scale, 8 * scale + zero], dim=1)
        return cls(planes_q, planes_scale, planes_zero, planes=2)

    @classmethod
    def empty(cls, n: int, k: int, planes: int, group: int = INT4_GROUP) -> Int4Linear:
        """An (n, k) layer with uninitialized weights, to be filled (kernels.i4r64_from_blocks)."""
        out = cls.__new__(cls)
        out.planes, out.group, out.in_features, out.out_features = planes, group, k, n
        out.packed = np.empty((n, planes * k // 2), dtype=np.uint8)
        out.scale_zero = np.empty((planes * k // group, n, 2), dtype=np.uint16)
        return out

    @staticmethod
    def supports(n: int, k: int, group: int = INT4_GROUP) -> bool:
        """Whether the native INT4 kernels run here and take an (n, k) weight."""
        return n > 0 and k > 0 and kernels.supports(n, k, group) and kernels.available()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if x2.shape[0] * self.planes < UNPACK_ROWS:
            # decode: the INT4 GEMV on the packed bytes, int16 activations, fp32 out
            step = kernels.MAX_ROWS
            outs = [kernels.int4_gemv(x2[i:i + step], self.packed, self.scale_zero, self.group, self.planes)
                    for i in range(0, x2.shape[0], step)]
            y = outs[0] if len(outs) == 1 else torch.cat(outs)
            return y.reshape(*lead, self.out_features)
        # prompt: the int8 GEMM on the codes themselves (without native bf16), or unpacked to a scratch of
        # the compute dtype for a GEMM (PyTorch's, or int16 with AVX-VNNI)
        dtype = kernels.compute_dtype()
        x2 = x2.to(dtype)
        n, step = self.out_features, kernels.SCRATCH_ROWS
        if dtype == torch.float32 and kernels.int8_takes_i4r64(n, self.in_features, self.group, self.planes):
            int8, y = kernels.Int8Prompt(x2), torch.empty(x2.shape[0], n)
            for start in range(0, n, step):
                int8.times_i4r64(self.packed, self.scale_zero, (start, min(start + step, n)), out=y[:, start:start + step])
            return y.reshape(*lead, n)
        outs = [kernels.prompt_matmul(x2, kernels.int4_unpack(self.packed, self.scale_zero, self.group, self.planes,
                                                              (start, min(start + step, n)), dtype),  # (K, rows)
                                      transposed=True)
                for start in range(0, n, step)]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).reshape(*lead, n)

    def __repr__(self) -> str:
        return f"Int4Linear(in={self.in_features}, out={self.out_features}, group={self.group}, planes={self.planes})"


def _check_int4_parts(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> tuple[int, int]:
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError("q must be a 2-D uint8 tensor (N, K)")
    n, k = q.shape
    if not kernels.supports(n, k, group):
        raise ValueError(f"the INT4 layout needs N % 64 == 0 and K % {group} == 0, got (N, K) = ({n}, {k})")
    groups = (n, k // group)
    if tuple(scale.shape) != groups or tuple(zero.shape) != groups:
        raise ValueError(f"scale and zero must have shape {groups}")
    return n, k


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    chunks = [pack_int4(q[start:start + _PACK_ROWS]) for start in range(0, q.shape[0], _PACK_ROWS)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # (N, K // 2)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown linear mode {mode!r}; expected one of {MODES}")


def _check_part(part: WeightPart) -> tuple[int, int]:
    shape = tuple(part[2])
    if len(shape) != 2:
        raise ValueError(
            f"linear weight must be 2-D, got {type_name(part[1])} tensor of shape {shape}"
        )
    return shape


def make_linear(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], mode: str) -> Module:
    """Linear layer for one GGML weight of torch-order shape (N, K).

    "exact": fp32 dense of the dequantized weight. "fast": packed INT4 for
    Q4_0/Q4_1/Q4_K (where the native kernels run and take the shape), dense in the compute
    dtype otherwise.
    """
    return make_fused_linear([(raw, ggml_type, shape)], mode)


def make_fused_linear(parts: Sequence[WeightPart], mode: str) -> Module:
    """One linear whose output is the concatenation of the parts' outputs.

    Used to fuse Q/K/V or gate/up projections: all parts share K and are stacked
    along N. The result's `out_splits` lists each part's N, for torch.split.
    If any part cannot use the INT4 kernels, the whole stack is dense (compute dtype), since
    the fused matmul needs one weight format.
    """
    _check_mode(mode)
    if not parts:
        raise ValueError("make_fused_linear needs at least one weight")
    shapes = [_check_part(p) for p in parts]
    k = shapes[0][1]
    if any(s[1] != k for s in shapes):
        raise ValueError(f"fused weights must share K (in_features), got shapes {shapes}")
    n_total = sum(s[0] for s in shapes)
    use_int4 = (
        mode == "fast"
        and all(p[1] in AFFINE_BITS for p in parts)
        and Int4Linear.supports(n_total, k)
    )
    if use_int4:
        module = _fused_int4(parts)
    else:
        module = _fused_dense(parts, torch.float32 if mode == "exact" else fast_dtype())  # on PyTorch
    module.out_splits = [s[0] for s in shapes]
    return module


def _fused_int4(parts: Sequence[WeightPart]) -> Int4Linear:
    """The parts' GGUF blocks repacked natively into one I4R64 weight (kernels/int4_repack.c), part
    after part. Mixed formats are fine: all share the form q * scale + zero; the widest sets the planes."""
    bits = max(AFFINE_BITS[t] for _, t, _ in parts)
    out = Int4Linear.empty(sum(shape[0] for _, _, shape in parts), parts[0][2][1], planes=1 if bits <= 4 else 2)
    row = 0
    for raw, t, (n, k) in parts:
        kernels.i4r64_from_blocks(raw, t, n, k, out.packed, out.scale_zero, row)
        row += n
    return out


def _fused_dense(parts: Sequence[WeightPart], dtype: torch.dtype) -> DenseLinear:
    # Cast each part before concatenating so peak memory holds at most one
    # fp32 part besides the stack.
    weights = [dequantize(raw, t, tuple(shape)).to(dtype) for raw, t, shape in parts]
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)  # (N, K)
    return DenseLinear(weight, dtype)
