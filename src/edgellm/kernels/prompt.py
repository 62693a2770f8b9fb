"""Prompt-sized work in native code: weights unpacked to a float scratch for PyTorch's GEMM in the
compute dtype (dequant.c, block_gemv.c), chunk attention (attention.c), the gated MLP's middle
(act.c), per-head norm and RoPE (rope.c), RMSNorm fused with its cast or residual add (norm.c).

The compute dtype is bf16 only where the CPU multiplies bf16 natively (build.compute_dtype); the
kernels read and write whichever it is. `lib` picks a variant's library (tests)."""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from edgellm.extras import torch

from edgellm import threads
from edgellm.kernels.build import available, compute_dtype, library, profiled
from edgellm.kernels.buffers import address, as_array
from edgellm.kernels.gemv import I8, MAX_ROWS, check_block_type

_scratch = threading.local()
SCRATCH_ROWS = 8192  # weights are unpacked at most this many output rows at a time (10 MB at K = 640, bf16)
_DTYPE_CODES = {"torch.float32": 0, "torch.bfloat16": 1}  # simd.h's DTYPE_F32, DTYPE_BF16


def _code(dtype: torch.dtype) -> int:
    if str(dtype) not in _DTYPE_CODES:
        raise ValueError(f"native kernels read and write fp32 or bf16, not {dtype}")
    return _DTYPE_CODES[str(dtype)]


def scratch(numel: int, dtype: torch.dtype, slot: str = "weight") -> torch.Tensor:
    """This thread's reused buffer for one layer's dequantized weight (or another `slot`'s use)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get((slot, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[slot, dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def int4_unpack(packed: torch.Tensor, scale_zero: torch.Tensor, group: int, planes: int,
                rows: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Wt (K, n): rows [start, end) (all by default; multiples of 64) of the dequantized weight
    of an (N, planes * K) I4R64 layer, transposed, in `dtype` (the compute dtype by default).

    The result is a view of a per-thread scratch buffer, valid until this thread's next call:
    the model never holds more than one weight chunk in float."""
    dtype, lib = dtype or compute_dtype(), lib or library()
    n, kw = packed.shape[0], packed.shape[1] * 2
    ka = kw // planes
    start, end = rows or (0, n)
    if start % 64 or end % 64 or not 0 <= start < end <= n:
        raise ValueError(f"rows [{start}, {end}) must be whole 64-row blocks of {n}")
    wt = scratch((end - start) * ka, dtype).view(ka, end - start)
    with profiled("edgellm::int4_unpack"):
        lib.edgellm_int4_unpack(address(packed), address(scale_zero), n, kw, group, planes, start, end - start,
                                wt.data_ptr(), _code(dtype), threads.current())
    return wt


def blocks_to_float(rows: torch.Tensor, ggml_type: int, k: int, out: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None, row_scale: torch.Tensor | None = None,
                    lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """W (N, K) from N rows of GGUF Q8_0 / Q5_0 / Q5_K / Q6_K blocks (or INT8 rows with their bf16
    `row_scale`), into `out` or else this thread's scratch (valid until its next use), in out's
    dtype or `dtype` (the compute dtype by default)."""
    check_block_type(ggml_type)
    if (ggml_type == I8) != (row_scale is not None):
        raise ValueError("row_scale goes with INT8 rows (type I8), and only with them")
    lib = lib or library()
    n, rows = rows.shape[0], np.ascontiguousarray(as_array(rows))
    dtype = out.dtype if out is not None else (dtype or compute_dtype())
    w = out if out is not None else scratch(n * k, dtype).view(n, k)
    if w.shape != (n, k) or not w.is_contiguous():
        raise ValueError(f"out must be a contiguous ({n}, {k}) tensor")
    with profiled("edgellm::blocks_to_float"):
        lib.edgellm_blocks_to_float(rows.ctypes.data, ggml_type, n, k, address(row_scale),
                                    w.data_ptr(), _code(dtype), threads.current())
    return w


def attention_supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `attention` takes these (1, H, T, D) queries and (1, Hkv, S, D) keys."""
    h, d, hkv = q.shape[1], q.shape[3], k.shape[1]
    return (available() and q.shape[0] == 1 and d % 32 == 0 and h % hkv == 0 and q.dtype == k.dtype == torch.float32
            and q.stride(3) == k.stride(3) == 1)


def attention_bf16_values(queries: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether `attention` multiplies probabilities by V in bf16 for a chunk of this many queries
    (CPUs with AVX512-BF16, chunks of a prompt's size; fewer queries run in fp32 like decode)."""
    return bool((lib or library()).edgellm_attention_bf16_values(queries))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
              window: int = 0, lib: ctypes.CDLL | None = None, softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T · scale) v for q (1, H, T, D), k and v (1, Hkv, S, D), as (1, H, T, D) fp32;
    with softcap (Gemma 2) the scores are capped first: s -> softcap · tanh(s / softcap).

    Scores and softmax in fp32; P·V in bf16 where the CPU has AVX512-BF16 and T is a prompt's
    (attention_bf16_values; see attention.c).

    mask None = causal, the queries being the last T of the S positions, and with window > 0
    each query sees only the `window` newest of its keys (keys in position order); else mask
    is (T, S) bool."""
    _, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if window < 0 or (window and mask is not None):
        raise ValueError("window must be >= 0, and only without a mask")
    if mask is None and t > s:
        raise ValueError(f"causal attention needs the {t} queries among the {s} keys")
    if v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(1, t, h, d, dtype=torch.float32)
    n_threads = threads.current()
    lib = lib or library()
    work = torch.empty(lib.edgellm_attention_work(s, hkv, d, n_threads), dtype=torch.float32)
    mask_bytes = None if mask is None else mask.contiguous().view(torch.uint8)  # kept alive for the call
    mask_ptr = None if mask_bytes is None else mask_bytes.data_ptr()
    with profiled("edgellm::attention"):
        lib.edgellm_attention(q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(1),
                              k.stride(2), t, s, h, hkv, d, scale, softcap or 0.0, mask_ptr, window, out.data_ptr(),
                              work.data_ptr(), n_threads)
    return out.transpose(1, 2)


_ACT_CODES = {"silu": 0, "gelu_tanh": 1}
GATED_ACT_MIN_ROWS = 2  # one row (a decode step off the native layer) is cheaper in PyTorch


def gated_act_supports(gate_up: torch.Tensor) -> bool:
    rows = gate_up.numel() // gate_up.shape[-1]
    return (available() and gate_up.dtype in _DTYPE_CODES and gate_up.shape[-1] % 32 == 0
            and rows >= GATED_ACT_MIN_ROWS)


def gated_act(gate_up: torch.Tensor, activation: str, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """act(gate) * up for a fused (..., 2I) gate|up, as (..., I) in its dtype (bf16 or fp32)."""
    inter = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    with profiled("edgellm::gated_act"):
        (lib or library()).edgellm_gated_act(gate_up.data_ptr(), rows, inter, _ACT_CODES[activation], out.data_ptr(),
                                             _code(gate_up.dtype), threads.current())
    return out


def norm_rope_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x (1, T, H, D) fp32 with contiguous heads; cos and sin (T, 1, D) fp32, contiguous."""
    table = (x.shape[1], 1, x.shape[3]) if x.dim() == 4 else None
    return (available() and x.dim() == 4 and x.shape[0] == 1 and x.dtype == torch.float32 and x.shape[3] % 32 == 0
            and x.stride(3) == 1 and x.stride(2) == x.shape[3]
            and all(t.shape == table and t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin)))


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
              eps: float = 0.0, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """In place on x (1, T, H, D): RMSNorm per head (when weight is given), then rotate-half RoPE."""
    _, t, h, d = x.shape
    with profiled("edgellm::norm_rope"):
        (lib or library()).edgellm_norm_rope(x.data_ptr(), t, h, d, x.stride(1),
                                             address(weight), eps, cos.data_ptr(),
                                             sin.data_ptr(), threads.current())
    return x


NORM_MIN_ROWS = MAX_ROWS + 1  # decode-sized inputs stay fp32: the int16-activation GEMVs want them exact


def rms_norm_supports(x: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (available() and x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] % 16 == 0
            and rows >= NORM_MIN_ROWS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None,
             lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """RMSNorm(x) · w for x (..., D) fp32, in `dtype` (the compute dtype by default): a linear's input
    in one pass."""
    d, dtype = x.shape[-1], dtype or compute_dtype()
    out = torch.empty(x.shape, dtype=dtype)
    with profiled("edgellm::rms_norm"):
        (lib or library()).edgellm_rms_norm(x.data_ptr(), x.numel() // d, d, address(weight), eps, out.data_ptr(),
                                            _code(dtype), threads.current())
    return out


def add_rms_norm_supports(residual: torch.Tensor, y: torch.Tensor) -> bool:
    return (rms_norm_supports(residual) and y.dtype in _DTYPE_CODES and y.is_contiguous()
            and y.shape == residual.shape)


def add_rms_norm(residual: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """residual + RMSNorm(y) · w for residual (..., D) fp32 and y (..., D) bf16 or fp32, as a new fp32 tensor."""
    d = residual.shape[-1]
    out = torch.empty(residual.shape, dtype=torch.float32)
    with profiled("edgellm::add_rms_norm"):
        (lib or library()).edgellm_add_rms_norm(residual.data_ptr(), y.data_ptr(), residual.numel() // d, d,
                                                address(weight), eps, out.data_ptr(), _code(y.dtype),
                                                threads.current())
    return out
