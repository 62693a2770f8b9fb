"""GGML tensor types: sizes, dequantization to float32, and 4-bit affine extraction.

Every decoder works on a whole tensor at once: the raw bytes are viewed as a
(n_blocks, bytes_per_block) uint8 matrix and fields are column slices of it, so
there is no Python loop per block. Shapes are in torch order: for a 2-D weight
(N, K) with K fastest, which is GGUF's ne[] reversed.
"""
from __future__ import annotations

import math
from enum import IntEnum
from typing import Callable

import numpy as np

from edgellm.extras import torch

__all__ = [
    "GGMLType",
    "BLOCK_SIZES",
    "DEQUANT_TYPES",
    "INT4_TYPES",
    "INT4_GROUP",
    "type_name",
    "tensor_nbytes",
    "dequantize",
    "int4_affine",
]


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


QK_K = 256

# (elements_per_block, bytes_per_block). Sizes are known for every listed type so
# a file loader can step over tensors it cannot decode; decoding is a subset.
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    # ggml's current block_q8_1 is {f16 d, f16 s, i8 qs[32]}; older builds used
    # two f32. It only exists as a matmul intermediate, never in model files.
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (QK_K, 84),
    GGMLType.Q3_K: (QK_K, 110),
    GGMLType.Q4_K: (QK_K, 144),
    GGMLType.Q5_K: (QK_K, 176),
    GGMLType.Q6_K: (QK_K, 210),
    GGMLType.Q8_K: (QK_K, 292),
    GGMLType.IQ2_XXS: (QK_K, 66),
    GGMLType.IQ2_XS: (QK_K, 74),
    GGMLType.IQ3_XXS: (QK_K, 98),
    GGMLType.IQ1_S: (QK_K, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (QK_K, 110),
    GGMLType.IQ2_S: (QK_K, 82),
    GGMLType.IQ4_XS: (QK_K, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (QK_K, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (QK_K, 54),
    GGMLType.TQ2_0: (QK_K, 66),
    GGMLType.MXFP4: (32, 17),
}

# Types whose weights are exactly (q - 8) * scale + zero with groups of 32 along K.
INT4_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K})
INT4_GROUP = 32

# Decoded elements per chunk: bounds the temporaries of a large tensor (an
# embedding is ~10^8 elements) while keeping per-chunk Python overhead negligible.
_CHUNK_ELEMS = 1 << 19


def type_name(ggml_type: int) -> str:
    """Human-readable name of a GGML type id, also for ids this module does not know."""
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"unknown GGML type {ggml_type}"


def _block_size(ggml_type: int) -> tuple[int, int]:
    try:
        return BLOCK_SIZES[GGMLType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"unsupported tensor type: {type_name(ggml_type)}") from None


def tensor_nbytes(ggml_type: int, n_elements: int) -> int:
    """Bytes occupied by n_elements of ggml_type; ValueError for bad counts or types."""
    block_elems, block_bytes = _block_size(ggml_type)
    if n_elements < 0 or n_elements % block_elems:
        raise ValueError(
            f"{type_name(ggml_type)} stores blocks of {block_elems} elements; "
            f"{n_elements} elements is not a whole number of blocks"
        )
    return n_elements // block_elems * block_bytes


# ---------------------------------------------------------------- field helpers


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    # Fields sit at odd offsets inside blocks, so copy the two bytes out
    # before reinterpreting them.
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()  # (B, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(B, n) bytes -> (B, 2n): all low nibbles first, then all high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def _bits_le(qh: torch.Tensor) -> torch.Tensor:
    """(B, n) bytes -> (B, 8n) bits; bit j of the little-endian integer at index j."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # (B, n, 8)
    return bits.reshape(qh.shape[0], -1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K scale field into 8 six-bit scales and mins."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]  # (B, 4) each
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)  # (B, 8)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)  # (B, 8)
    return sc, mn


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K quants (B, 128) -> (B, 8, 32): chunk c's low nibbles are
    sub-block 2c, its high nibbles sub-block 2c+1."""
    q = qs.reshape(-1, 4, 32)
    return torch.stack([q & 0xF, q >> 4], dim=2).reshape(-1, 8, 32)


# ---------------------------------------------------------------- block decoders
# Each maps (B, bytes_per_block) uint8 -> (B, elements_per_block) float32 and
# follows ggml's arithmetic order so results match its reference dequantizer.


def _q4_0_q(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 2:18])  # (B, 32)


def _dq_q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_q4_0_q(b).float() - 8) * _f16(b, 0)


# IQ4_NL's 16 levels (ggml's kvalues_iq4nl): non-uniform, denser near zero
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _dq_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """IQ4_NL: Q4_0's layout (fp16 d, 16 bytes of nibbles), each nibble an index into the levels."""
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32)
    return levels[_q4_0_q(b).long()] * _f16(b, 0)


def _q4_1_q(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:20])  # (B, 32)


def _dq_q4_1(b: torch.Tensor) -> torch.Tensor:
    return _q4_1_q(b).float() * _f16(b, 0) + _f16(b, 2)


def _dq_q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:22]) | (_bits_le(b[:, 2:6]) << 4)  # (B, 32)
    return (q.float() - 16) * _f16(b, 0)


def _dq_q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]) | (_bits_le(b[:, 4:8]) << 4)  # (B, 32)
    return q.float() * _f16(b, 0) + _f16(b, 2)


def _dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].view(torch.int8).float() * _f16(b, 0)


def _q4_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K -> q (B, 8, 32) uint8, sub-block scale d*sc and min dmin*m, each (B, 8)."""
    sc, mn = _k_scales(b[:, 4:16])
    return _k_nibbles(b[:, 16:144]), _f16(b, 0) * sc.float(), _f16(b, 2) * mn.float()


def _dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    q, scale, mins = _q4_k_parts(b)
    y = scale.unsqueeze(-1) * q.float() - mins.unsqueeze(-1)  # (B, 8, 32)
    return y.reshape(-1, QK_K)


def _dq_q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales(b[:, 4:16])
    # Sub-block s (= 2c + nibble half) takes its fifth bit from bit s of qh[l].
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1  # (B, 8, 32)
    q = _k_nibbles(b[:, 48:176]) | (high << 4)  # (B, 8, 32)
    scale = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    mins = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    return (scale * q.float() - mins).reshape(-1, QK_K)


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    # Each 128-element half h uses ql[64h:64h+64] as two 32-byte rows A, B and
    # yields quarters (A low, B low, A high, B high); quarter k takes bits 2k..2k+1
    # of qh[32h + l] and scale sc[8h + 2k + l // 16].
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # (B, half, A/B, 32)
    low4 = torch.cat([ql & 0xF, ql >> 4], dim=2)  # (B, 2, 4, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high2 = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3  # (B, 2, 4, 32)
    q = (low4 | (high2 << 4)).to(torch.int8) - 32  # values -32..31
    sc = b[:, 192:208].view(torch.int8).reshape(n, 2, 4, 2, 1).float()
    d = _f16(b, 208).view(n, 1, 1, 1, 1)
    y = d * sc * q.reshape(n, 2, 4, 2, 16).float()  # (B, 2, 4, 2, 16)
    return y.reshape(n, QK_K)


_BLOCK_DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q4_0: _dq_q4_0,
    GGMLType.IQ4_NL: _dq_iq4_nl,
    GGMLType.Q4_1: _dq_q4_1,
    GGMLType.Q5_0: _dq_q5_0,
    GGMLType.Q5_1: _dq_q5_1,
    GGMLType.Q8_0: _dq_q8_0,
    GGMLType.Q4_K: _dq_q4_k,
    GGMLType.Q5_K: _dq_q5_k,
    GGMLType.Q6_K: _dq_q6_k,
}

_FLOAT_TYPES: dict[GGMLType, str] = {GGMLType.F32: "float32", GGMLType.F16: "float16", GGMLType.BF16: "bfloat16"}

DEQUANT_TYPES = frozenset(_BLOCK_DECODERS) | frozenset(_FLOAT_TYPES)


# ---------------------------------------------------------------- public API


def _checked(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], supported: frozenset
) -> GGMLType:
    """Validate raw/shape against the type and return the GGMLType."""
    name = type_name(ggml_type)
    if ggml_type not in supported:
        raise ValueError(f"unsupported tensor type: {name}")
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError("raw must be a 1-D torch.uint8 tensor")
    if any(int(s) < 0 for s in shape):
        raise ValueError(f"invalid shape {tuple(shape)}")
    block_elems = BLOCK_SIZES[GGMLType(ggml_type)][0]
    if block_elems > 1 and (len(shape) == 0 or shape[-1] % block_elems):
        raise ValueError(
            f"{name} rows must be a multiple of {block_elems} elements, got shape {tuple(shape)}"
        )
    expected = tensor_nbytes(ggml_type, math.prod(shape))
    if raw.numel() != expected:
        raise ValueError(
            f"{name} tensor of shape {tuple(shape)} needs {expected} bytes, got {raw.numel()}"
        )
    return GGMLType(ggml_type)


def _reinterpret(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View bytes as dtype; copy first when the start is not aligned for it."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % itemsize or not raw.is_contiguous():
        raw = raw.clone()
    return raw.view(dtype)


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a GGML tensor to float32 of `shape` (torch order, last dim fastest).

    `raw` is never written to and the result never aliases it, so raw may be a
    view of a read-only memory map.
    """
    if isinstance(raw, np.ndarray):  # a GGUF file's bytes
        raw = torch.from_numpy(raw)
    t = _checked(raw, ggml_type, tuple(shape), DEQUANT_TYPES)
    if t in _FLOAT_TYPES:
        # copy=True so an F32 result never aliases the (read-only) source
        values = _reinterpret(raw, getattr(torch, _FLOAT_TYPES[t]))
        return values.to(torch.float32, copy=True).reshape(shape)
    block_elems, block_bytes = BLOCK_SIZES[t]
    blocks = raw.reshape(-1, block_bytes)  # (n_blocks, block_bytes)
    out = torch.empty(blocks.shape[0], block_elems, dtype=torch.float32)
    decode = _BLOCK_DECODERS[t]
    step = max(1, _CHUNK_ELEMS // block_elems)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = decode(blocks[start : start + step])
    return out.reshape(shape)


def float_vector(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """An F32 / F16 / BF16 tensor (norm weights, biases, RoPE factors) as a new float32 array, in
    numpy; other types through dequantize."""
    if ggml_type not in _FLOAT_TYPES or not isinstance(raw, np.ndarray):
        return dequantize(raw, ggml_type, shape).numpy()
    _checked_size(raw.size, ggml_type, shape)
    if ggml_type == GGMLType.BF16:
        bits = np.frombuffer(raw.tobytes(), dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(raw.tobytes(), dtype=_FLOAT_TYPES[GGMLType(ggml_type)]).astype(np.float32).reshape(shape)


def _checked_size(nbytes: int, ggml_type: int, shape: tuple[int, ...]) -> None:
    expected = tensor_nbytes(ggml_type, math.prod(shape))
    if nbytes != expected:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {tuple(shape)} needs {expected} bytes, got {nbytes}")


# Formats whose weights are small unsigned integers times a per-32 scale plus offset.
AFFINE_BITS = {GGMLType.Q4_0: 4, GGMLType.Q4_1: 4, GGMLType.Q4_K: 4,
               GGMLType.Q5_0: 5, GGMLType.Q5_1: 5, GGMLType.Q8_0: 8}


def _affine_blocks(t: GGMLType, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, block_bytes) -> q (B, elems) uint8, scale and zero (B, elems // 32): w = q*scale + zero."""
    if t == GGMLType.Q4_0:
        d = _f16(b, 0)
        return _q4_0_q(b), d, -8 * d
    if t == GGMLType.Q4_1:
        return _q4_1_q(b), _f16(b, 0), _f16(b, 2)
    if t == GGMLType.Q5_0:
        d = _f16(b, 0)
        return _nibbles(b[:, 6:22]) | (_bits_le(b[:, 2:6]) << 4), d, -16 * d
    if t == GGMLType.Q5_1:
        return _nibbles(b[:, 8:24]) | (_bits_le(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2)
    if t == GGMLType.Q8_0:
        d = _f16(b, 0)
        return (b[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8), d, -128 * d
    q, scale, mins = _q4_k_parts(b)  # Q4_K: q (B, 8, 32), scale/mins (B, 8)
    return q.reshape(q.shape[0], -1), scale, -mins


def integer_affine(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Split a weight (N, K) of an AFFINE_BITS type into q, scale, zero, bits with

        w[n, k] = q[n, k] * scale[n, k // 32] + zero[n, k // 32]

    q is uint8 (N, K) below 2**bits; scale and zero are float32 (N, K // 32). Exact: the
    integers are the file's own, the scales its fp16 values."""
    t = _checked(raw, ggml_type, tuple(shape), frozenset(AFFINE_BITS))
    if len(shape) != 2:
        raise ValueError(f"integer_affine needs a 2-D weight, got shape {tuple(shape)}")
    n, k = shape
    q, scale, zero = _affine_blocks(t, raw.reshape(-1, BLOCK_SIZES[t][1]))
    groups = k // INT4_GROUP
    return q.reshape(n, k), scale.reshape(n, groups), zero.reshape(n, groups), AFFINE_BITS[t]


def int4_affine(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a Q4_0/Q4_1/Q4_K weight (N, K) into q, scale, zero such that

        w[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]

    (the int4 kernel's convention); q is uint8 (N, K) in 0..15."""
    _checked(raw, ggml_type, tuple(shape), INT4_TYPES)
    q, scale, zero, _ = integer_affine(raw, ggml_type, shape)
    return q, scale, zero + 8 * scale
