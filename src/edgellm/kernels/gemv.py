"""Decode-sized products (up to MAX_ROWS activation rows) in native code: int4_gemv.c on edgellm's
INT4 layout (quant/int4_pack.py), block_gemv.c on a GGUF file's Q8_0 / Q5_0 / Q5_K / Q6_K blocks
in place and on edgellm's INT8 rows. `lib` picks a variant's library (tests); the selected one by
default."""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from edgellm import threads
from edgellm.extras import torch
from edgellm.kernels.build import library, profiled
from edgellm.kernels.buffers import address, as_array, like

MAX_ROWS = 8  # activation rows per call (decode steps of up to 8 sequences)
I8 = 24
Q8R16 = 100  # edgellm's Q8_0 rows interleaved by 16 (q8r16.c); beside the ggml numbers
Q8R16_ROWS = 16
# ggml Q5_0, Q8_0, Q5_K, Q6_K, I8 (edgellm's INT8 rows) and Q8R16: what block_gemv.c reads
BLOCK_TYPES = (6, 8, 13, 14, I8, Q8R16)
# ggml Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K -> (weights, bytes) a block: what int4_repack.c reads
REPACK_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144)}


def check_block_type(ggml_type: int) -> None:
    if ggml_type not in BLOCK_TYPES:
        raise ValueError(f"no native kernel for ggml type {ggml_type} (takes {BLOCK_TYPES})")


def supports(n: int, k: int, group: int) -> bool:
    """Shapes the INT4 kernels take: whole 64-row blocks, groups of 4 k's that tile K."""
    return n % 64 == 0 and group % 4 == 0 and k % group == 0


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} activation rows per call, got {x.shape[0]}")
    return x.float().contiguous()


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, planes: int,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y (M, N) fp32 = x (M, K) @ W^T for W (N, planes * K) in the I4R64 layout, M <= MAX_ROWS."""
    lib = lib or library()
    x = _rows(x)
    m, ka = x.shape
    n, kw = packed.shape[0], packed.shape[1] * 2
    y = torch.empty(m, n, dtype=torch.float32)
    work = torch.empty(lib.edgellm_int4_gemv_work(m, ka, group), dtype=torch.uint8)
    with profiled("edgellm::int4_gemv"):
        lib.edgellm_int4_gemv(x.data_ptr(), m, ka, address(packed), address(scale_zero), n, kw, group,
                              y.data_ptr(), n, work.data_ptr(), threads.current())
    return y


def block_gemv(x: torch.Tensor, rows: torch.Tensor, ggml_type: int, k: int, row_scale: torch.Tensor | None = None,
               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y (M, N) fp32 = x (M, K) @ W^T for W given as N rows of GGUF blocks (uint8), M <= MAX_ROWS;
    edgellm's INT8 rows (type I8) with their bf16 `row_scale` (N,)."""
    check_block_type(ggml_type)
    if (ggml_type == I8) != (row_scale is not None):
        raise ValueError("row_scale goes with INT8 rows (type I8), and only with them")
    lib = lib or library()
    x = _rows(x)
    m, n = x.shape[0], rows.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    work = torch.empty(lib.edgellm_block_gemv_work(m, k), dtype=torch.uint8)
    with profiled("edgellm::block_gemv"):
        lib.edgellm_block_gemv(x.data_ptr(), m, k, address(rows), ggml_type, n, address(row_scale), y.data_ptr(), n,
                               work.data_ptr(),
                               threads.current())
    return y


def q5_0_as_q8_0(rows, lib: ctypes.CDLL | None = None):
    """Q5_0 rows (N, K / 32 * 22) uint8 as Q8_0 rows (N, K / 32 * 34) of exactly the same weights
    (numpy in, numpy out; a tensor in, a tensor out)."""
    lib = lib or library()
    blocks = np.ascontiguousarray(as_array(rows))
    out = np.empty((blocks.shape[0], blocks.shape[1] // 22 * 34), dtype=np.uint8)
    lib.edgellm_q5_0_to_q8_0(blocks.ctypes.data, blocks.size // 22, out.ctypes.data)
    return like(out, rows)


def q8_0_as_q8r16(rows, k: int, out=None, lib: ctypes.CDLL | None = None):
    """N Q8_0 rows of K weights (N, K / 32 * 34) uint8, N % 16 == 0, as the same bytes in the
    Q8R16 layout (q8r16.c), shaped (N, K / 32 * 34) like them (a row of it is not a row of W:
    16 rows interleave); into `out` if given."""
    lib = lib or library()
    blocks = np.ascontiguousarray(as_array(rows))
    n = blocks.shape[0]
    if n % Q8R16_ROWS or k % 32 or blocks.shape[1] != k // 32 * 34:
        raise ValueError(f"Q8R16 takes whole groups of {Q8R16_ROWS} Q8_0 rows, got {tuple(blocks.shape)} for K = {k}")
    result = np.empty_like(blocks) if out is None else as_array(out)
    lib.edgellm_q8_0_to_q8r16(blocks.ctypes.data, n, k, result.ctypes.data, threads.current())
    return like(result, rows) if out is None else out


def i4r64_from_blocks(blocks, ggml_type: int, n: int, k: int, packed, scale_zero, row0: int = 0,
                      lib: ctypes.CDLL | None = None) -> None:
    """Rows row0 .. row0 + n of an I4R64 weight (`packed` (N, planes * K / 2) uint8, `scale_zero`
    (planes * K / 32, N, 2) bf16 bits; quant/int4_pack.py) from n rows of GGUF blocks of an affine type
    (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0; int4_repack.c): the bytes Int4Linear.from_affine writes."""
    lib = lib or library()
    blocks, packed, scale_zero = np.ascontiguousarray(as_array(blocks)), as_array(packed), as_array(scale_zero)
    planes = packed.shape[1] * 2 // k
    elements, block_bytes = REPACK_BLOCKS.get(ggml_type, (1, 0))
    if blocks.dtype != np.uint8 or blocks.size != n * (k // elements) * block_bytes or packed.dtype != np.uint8 \
            or scale_zero.shape != (planes * k // 32, packed.shape[0], 2) or scale_zero.itemsize != 2:
        raise ValueError(f"no I4R64 repack of {tuple(blocks.shape)} {blocks.dtype} as GGML type {ggml_type} rows "
                         f"({n}, {k}) into {tuple(packed.shape)} and {tuple(scale_zero.shape)}")
    if lib.edgellm_i4r64_from_blocks(blocks.ctypes.data, ggml_type, n, k, planes, packed.ctypes.data,
                                     scale_zero.ctypes.data, packed.shape[0], row0, threads.current()) != 0:
        raise ValueError(f"no I4R64 repack of GGML type {ggml_type} rows ({n}, {k}) into {packed.shape[0]} rows")


def affine_rows(rows: np.ndarray, ggml_type: int, k: int, ids: Sequence[int], lib: ctypes.CDLL | None = None) -> np.ndarray:
    """(len(ids), k) fp32: rows `ids` of a table of GGUF blocks of an affine type (Q4_0, Q4_1, Q4_K,
    Q5_0, Q5_1, Q8_0; `rows` (V, bytes a row) uint8), dequantized as ggml does (embedding lookups)."""
    lib = lib or library()
    rows = as_array(rows)
    elements, block_bytes = REPACK_BLOCKS.get(ggml_type, (1, 0))
    if not block_bytes or rows.dtype != np.uint8 or rows.ndim != 2 or k % elements or rows.shape[1] != k // elements * block_bytes:
        raise ValueError(f"no row lookup of {tuple(rows.shape)} {rows.dtype} as GGML type {ggml_type} rows of {k}")
    if any(not 0 <= i < rows.shape[0] for i in ids):
        raise IndexError(f"row ids must lie in [0, {rows.shape[0]})")
    out = np.empty((len(ids), k), dtype=np.float32)
    if ids:
        lib.edgellm_affine_rows_to_float(rows.ctypes.data, ggml_type, k, (ctypes.c_int64 * len(ids))(*ids), len(ids),
                                         out.ctypes.data)
    return out


def q8r16_rows(packed: torch.Tensor, k: int, ids: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """(len(ids), K) fp32: rows `ids` of a whole Q8R16 table (embedding lookups)."""
    lib = lib or library()
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= packed.shape[0]):
        raise IndexError(f"row ids must lie in [0, {packed.shape[0]})")
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    lib.edgellm_q8r16_rows(address(packed), k, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out
