"""A prompt's GEMM, y = x W^T, on a weight just unpacked to float (prompt.py): PyTorch's GEMM in the
compute dtype, or where the CPU has AVX-VNNI but no native bf16 the integer GEMM of int16_gemm.c,
~1.7x PyTorch's fp32 one at AVX2 width (11-bit weights and int16 activations per group of 64)."""
from __future__ import annotations

import ctypes

from edgellm.extras import lazy, torch

from edgellm import threads
from edgellm.kernels.build import library, profiled
from edgellm.kernels.prompt import scratch

F = lazy("torch.nn.functional")

STRIP, GROUP = 16, 64  # int16_gemm.c: rows per packed strip, k per quantization group


def int16_gemm_native(lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build has the integer prompt GEMM (the avx2+vnni variant)."""
    lib = lib or library()
    return lib is not None and bool(lib.edgellm_int16_gemm_native())


def int16_gemm_supports(n: int, k: int, lib: ctypes.CDLL | None = None) -> bool:
    return n % STRIP == 0 and k % GROUP == 0 and n > 0 and int16_gemm_native(lib)


def int16_gemm(x: torch.Tensor, w: torch.Tensor, transposed: bool = False, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x (T, K) fp32 times W^T, for W (N, K) fp32, or given as Wt (K, N) when `transposed`: (T, N) fp32.
    Both are quantized in the call (int16_gemm.c); the packed weight lives in a per-thread scratch."""
    lib = lib or library()
    n, k = (w.shape[1], w.shape[0]) if transposed else w.shape
    if x.dtype != torch.float32 or w.dtype != torch.float32 or x.shape[-1] != k or not w.is_contiguous():
        raise ValueError(f"int16_gemm takes fp32 x (T, {k}) and a contiguous fp32 weight, got {x.dtype} {tuple(x.shape)}"
                         f" and {w.dtype} {tuple(w.shape)}")
    if not int16_gemm_supports(n, k, lib):
        raise ValueError(f"int16_gemm needs the avx2+vnni kernels, N % {STRIP} == 0 and K % {GROUP} == 0; got ({n}, {k})")
    x = x.contiguous()
    t, n_threads = x.shape[0], threads.current()
    panel = scratch(lib.edgellm_int16_gemm_panel_bytes(n, k), torch.uint8, "int16 panel")
    work = scratch(lib.edgellm_int16_gemm_work_bytes(t, k), torch.uint8, "int16 activations")
    out = torch.empty(t, n, dtype=torch.float32)
    row_stride, col_stride = (1, n) if transposed else (k, 1)
    with profiled("edgellm::int16_gemm"):
        lib.edgellm_int16_gemm_pack(w.data_ptr(), row_stride, col_stride, n, k, panel.data_ptr(), n_threads)
        lib.edgellm_int16_gemm(x.data_ptr(), t, k, panel.data_ptr(), n, out.data_ptr(), n, work.data_ptr(), n_threads)
    return out


def prompt_matmul(x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """x (T, K) in the compute dtype times W^T for W (N, K), or Wt (K, N) when `transposed`."""
    n, k = (w.shape[1], w.shape[0]) if transposed else w.shape
    if x.dtype == torch.float32 and w.dtype == torch.float32 and int16_gemm_supports(n, k):
        return int16_gemm(x, w, transposed)
    return torch.mm(x, w) if transposed else F.linear(x, w)
