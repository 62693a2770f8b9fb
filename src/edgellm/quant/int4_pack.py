"""edgellm's INT4 weight layout, I4R64 (docs/kernels.md), written here and read by the native kernels
(kernels/int4_layout.h) on every machine alike: the same bytes on AVX-512, AVX2, NEON and scalar.

    packed (N, K/2) uint8: rows in blocks of 64; within a block, per k, 32 bytes whose byte i
        holds row i (low nibble) and row 32 + i (high nibble)
    scale_zero (K/group, N, 2) bf16: one (scale, zero) pair per row and group of k's
    w[n, k] = (q[n, k] - 8) * scale[k // group, n] + zero[k // group, n]

One k of a block is 64 consecutive rows: a vector of rows per load, and the (scale, zero) pairs of
a group are consecutive rows too. The bytes equal PyTorch's AVX-512 INT4 packing (a test checks
where that exists), but nothing here depends on it."""
from __future__ import annotations

from edgellm.extras import torch

LAYOUT_VERSION = 1  # bump when the bytes change: packed-weight caches are keyed by it
ROWS = 64


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 values 0..15 -> (N, K/2) uint8 in the I4R64 layout; N % 64 == 0, K even."""
    n, k = q.shape
    if n % ROWS or k % 2:
        raise ValueError(f"I4R64 needs N % {ROWS} == 0 and an even K, got ({n}, {k})")
    blocks = q.reshape(n // ROWS, 2, ROWS // 2, k)  # (blocks, low/high half, 32 rows, K)
    nibbles = blocks[:, 0] | (blocks[:, 1] << 4)  # (blocks, 32, K): row i and row 32 + i
    return nibbles.transpose(1, 2).contiguous().view(n, k // 2)  # per k, 32 bytes


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: (N, K/2) -> (N, K) uint8 values 0..15."""
    n, half = packed.shape
    per_k = packed.reshape(n // ROWS, half * 2, ROWS // 2)  # (blocks, K, 32)
    rows = torch.stack([per_k & 15, per_k >> 4], dim=1)  # (blocks, low/high, K, 32)
    return rows.transpose(2, 3).reshape(n, half * 2)


def scale_zero_pairs(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(N, K/group) scales and zeros -> the (K/group, N, 2) bf16 pairs the kernels read."""
    return torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
