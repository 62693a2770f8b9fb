"""Decode-sized products (a few activation rows) in native code: int4_gemv.c on torch's packed
INT4 bytes, block_gemv.c on a GGUF file's Q8_0 / Q5_0 / Q6_K blocks in place."""
from __future__ import annotations

import torch

from edgellm.kernels.build import library, profiled

MAX_ROWS = 4  # activation rows per call (decode steps of up to 4 sequences)
BLOCK_TYPES = (6, 8, 14)  # ggml Q5_0, Q8_0, Q6_K: what block_gemv.c reads


def check_block_type(ggml_type: int) -> None:
    if ggml_type not in BLOCK_TYPES:
        raise ValueError(f"no native kernel for ggml type {ggml_type} (takes {BLOCK_TYPES})")


def supports(n: int, k: int, group: int) -> bool:
    """Shapes the kernel takes: whole 64-row blocks, even groups that tile K."""
    return n % 64 == 0 and group % 2 == 0 and k % group == 0


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, planes: int) -> torch.Tensor:
    """y (M, N) fp32 = x (M, K) @ W^T for W (N, planes * K) in torch's packed INT4 layout."""
    m, ka = x.shape
    n, kw = packed.shape[0], packed.shape[1] * 2
    x = x.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    work = torch.empty(m * (ka // 2) + 2 * m * (ka // group), dtype=torch.int32)
    with profiled("edgellm::int4_gemv"):
        library().edgellm_int4_gemv(x.data_ptr(), m, ka, packed.data_ptr(), scale_zero.data_ptr(), n, kw, group,
                                     y.data_ptr(), work.data_ptr(), torch.get_num_threads())
    return y


def block_gemv(x: torch.Tensor, rows: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """y (M, N) fp32 = x (M, K) @ W^T for W given as N rows of GGUF Q8_0, Q5_0 or Q6_K blocks (uint8)."""
    check_block_type(ggml_type)
    m, n = x.shape[0], rows.shape[0]
    x = x.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    work = torch.empty(m * (k // 2) + 2 * m * (k // 32), dtype=torch.int32)
    with profiled("edgellm::block_gemv"):
        library().edgellm_block_gemv(x.data_ptr(), m, k, rows.data_ptr(), ggml_type, n, y.data_ptr(),
                                      work.data_ptr(), torch.get_num_threads())
    return y
