"""Native kernels where PyTorch has none fast enough: compiled from C at first use.

`int4_gemv` (int4_gemv.c) multiplies a few activation rows by a weight in torch's packed INT4 layout
(the same bytes `_weight_int4pack_mm_for_cpu` reads, so no second copy of the weights) with
AVX-512 VNNI integer dot products. The C source is built with the system compiler
(`cc -O3 -march=native`, about a second) into edgellm's cache directory, keyed by the source
and the CPU; machines without a compiler, AVX-512 VNNI or torch's AVX-512 packing simply
keep torch's kernel. `int4_unpack_bf16` (dequant.c) unpacks the same bytes into a bf16 scratch
weight for prompts, where the bf16 GEMM is ~3x the INT4 kernel; `attention` (attention.c) runs a
prompt chunk's attention ~2-4x faster than PyTorch's flash kernel here; `gated_act` (act.c) is the
gated MLP's act(gate)·up in one pass; `norm_rope` (rope.c) a prompt's per-head norm and RoPE in
place. EDGELLM_KERNELS=0 turns the native path off. `block_gemv` (block_gemv.c)
multiplies by GGUF Q8_0 / Q5_0 / Q6_K weights straight from the model file (quant/blocks.py). llama_layer.c
runs a whole Llama decoder layer for one token on these kernels, gemma3_layer.c a Gemma 3
one (see decode.py)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from contextlib import nullcontext
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

MAX_ROWS = 4  # activation rows per call (decode steps of up to 4 sequences)
_SOURCES = ("int4_gemv.c", "block_gemv.c", "activations.h", "dequant.c", "attention.c", "act.c", "rope.c", "vec_math.h", "layer_ops.h", "layer_ops.c", "llama_layer.c", "gemma3_layer.c")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(sources: dict[str, bytes], target: Path) -> None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        paths = []
        for name, text in sources.items():
            paths.append(Path(tmp) / name)
            paths[-1].write_bytes(text)
        out = Path(tmp) / target.name
        units = [str(p) for p in paths if p.suffix == ".c"]
        subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *units,
                        "-o", str(out), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: a concurrent process sees the whole library or none


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("EDGELLM_KERNELS", "1") == "0":
        return None
    if not {"avx512f", "avx512bw", "avx512_vnni"} <= _cpu_flags():
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None  # torch packs INT4 differently for AVX2: the layout below would be wrong
    from edgellm.registry import cache_dir

    sources = {name: resources.files("edgellm.kernels").joinpath(name).read_bytes() for name in _SOURCES}
    cpu = open("/proc/cpuinfo", "rb").read().split(b"\n\n")[0]
    key = hashlib.sha256(b"".join(sources.values()) + cpu).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"edgellm_{key}.so"
    try:
        if not target.is_file():
            _build(sources, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.edgellm_int4_gemv.restype = lib.edgellm_block_gemv.restype = lib.edgellm_blocks_to_bf16.restype = None
    lib.edgellm_int4_gemv.argtypes = [p, i, i64, p, p, i64, i64, i64, p, p, i]
    lib.edgellm_block_gemv.argtypes = [p, i, i64, p, i, i64, p, p, i]
    lib.edgellm_blocks_to_bf16.argtypes = [p, i, i64, i64, p, i]
    lib.edgellm_int4_unpack_bf16.restype = lib.edgellm_attention.restype = None
    lib.edgellm_attention.argtypes = [p, i64, i64, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p, p, i]
    lib.edgellm_attention_work.restype = i64
    lib.edgellm_attention_bf16_values.restype = i
    lib.edgellm_gated_act_bf16.restype = lib.edgellm_norm_rope.restype = None
    lib.edgellm_norm_rope.argtypes = [p, i64, i64, i64, i64, p, ctypes.c_float, p, p, i]
    lib.edgellm_gated_act_bf16.argtypes = [p, i64, i64, i, p, i]
    lib.edgellm_attention_work.argtypes = [i64, i64, i64, i]
    lib.edgellm_int4_unpack_bf16.argtypes = [p, p, i64, i64, i64, i, p, i]
    return lib


def library() -> ctypes.CDLL | None:
    return _library()


def available() -> bool:
    return _library() is not None


def profiled(label: str):
    """A record_function naming a native call in `bench --profile`; free when not profiling."""
    return torch.profiler.record_function(label) if torch.autograd.profiler._is_profiler_enabled else nullcontext()


def block_gemv(x: torch.Tensor, rows: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """y (M, N) fp32 = x (M, K) @ W^T for W given as N rows of GGUF Q8_0, Q5_0 or Q6_K blocks (uint8)."""
    m, n = x.shape[0], rows.shape[0]
    x = x.float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    work = torch.empty(m * (k // 2) + 2 * m * (k // 32), dtype=torch.int32)
    with profiled("edgellm::block_gemv"):
        _library().edgellm_block_gemv(x.data_ptr(), m, k, rows.data_ptr(), ggml_type, n, y.data_ptr(),
                                      work.data_ptr(), torch.get_num_threads())
    return y


def blocks_to_bf16(rows: torch.Tensor, ggml_type: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """W (N, K) bf16 from N rows of GGUF Q8_0 / Q5_0 / Q6_K blocks, into `out` or else this thread's
    scratch (valid until its next use)."""
    n, rows = rows.shape[0], rows.contiguous()
    w = out if out is not None else scratch_bf16(n * k).view(n, k)
    with profiled("edgellm::blocks_to_bf16"):
        _library().edgellm_blocks_to_bf16(rows.data_ptr(), ggml_type, n, k, w.data_ptr(), torch.get_num_threads())
    return w


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
        _library().edgellm_int4_gemv(x.data_ptr(), m, ka, packed.data_ptr(), scale_zero.data_ptr(), n, kw, group,
                                     y.data_ptr(), work.data_ptr(), torch.get_num_threads())
    return y


_scratch = threading.local()


def scratch_bf16(numel: int) -> torch.Tensor:
    """This thread's reused bf16 buffer for one layer's dequantized weight."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _scratch.buffer = torch.empty(numel, dtype=torch.bfloat16)
    return buffer[:numel]


def int4_unpack_bf16(packed: torch.Tensor, scale_zero: torch.Tensor, group: int, planes: int) -> torch.Tensor:
    """Wt (K, N) bf16: the dequantized weight of a packed (N, planes * K) INT4 layer, transposed.

    The result is a view of a per-thread scratch buffer, valid until this thread's next call:
    the model never holds more than one layer's bf16 weight."""
    n, kw = packed.shape[0], packed.shape[1] * 2
    ka = kw // planes
    wt = scratch_bf16(n * ka).view(ka, n)
    with profiled("edgellm::int4_unpack_bf16"):
        _library().edgellm_int4_unpack_bf16(packed.data_ptr(), scale_zero.data_ptr(), n, kw, group, planes,
                                            wt.data_ptr(), torch.get_num_threads())
    return wt


def attention_supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `attention` takes these (1, H, T, D) queries and (1, Hkv, S, D) keys."""
    h, d, hkv = q.shape[1], q.shape[3], k.shape[1]
    return (q.shape[0] == 1 and d % 32 == 0 and h % hkv == 0 and q.dtype == k.dtype == torch.float32
            and q.stride(3) == k.stride(3) == 1)


def attention_bf16_values() -> bool:
    """Whether `attention` multiplies probabilities by V in bf16 (CPUs with AVX512-BF16)."""
    return bool(_library().edgellm_attention_bf16_values())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T · scale) v for q (1, H, T, D), k and v (1, Hkv, S, D), as (1, H, T, D) fp32.

    Scores and softmax in fp32; P·V in bf16 where the CPU has AVX512-BF16 (see attention.c).

    mask None = causal, the queries being the last T of the S positions; else (T, S) bool."""
    _, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(1, t, h, d, dtype=torch.float32)
    threads = torch.get_num_threads()
    lib = _library()
    work = torch.empty(lib.edgellm_attention_work(s, hkv, d, threads), dtype=torch.float32)
    mask_bytes = None if mask is None else mask.contiguous().view(torch.uint8)  # kept alive for the call
    mask_ptr = None if mask_bytes is None else mask_bytes.data_ptr()
    with profiled("edgellm::attention"):
        lib.edgellm_attention(q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(1),
                              k.stride(2), t, s, h, hkv, d, scale, mask_ptr, out.data_ptr(), work.data_ptr(),
                              threads)
    return out.transpose(1, 2)


_ACT_CODES = {"silu": 0, "gelu_tanh": 1}
GATED_ACT_MIN_ROWS = 2  # one row (a decode step off the native layer) is cheaper in PyTorch


def gated_act_supports(gate_up: torch.Tensor) -> bool:
    rows = gate_up.numel() // gate_up.shape[-1]
    return available() and gate_up.shape[-1] % 32 == 0 and rows >= GATED_ACT_MIN_ROWS


def gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for a fused (..., 2I) bf16 gate|up, as (..., I) bf16."""
    inter = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=torch.bfloat16)
    with profiled("edgellm::gated_act"):
        _library().edgellm_gated_act_bf16(gate_up.data_ptr(), rows, inter, _ACT_CODES[activation], out.data_ptr(),
                                          torch.get_num_threads())
    return out


def norm_rope_supports(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x (1, T, H, D) fp32 with contiguous heads; cos (T, 1, D) contiguous."""
    return (available() and x.dim() == 4 and x.shape[0] == 1 and x.dtype == torch.float32 and x.shape[3] % 32 == 0
            and x.stride(3) == 1 and x.stride(2) == x.shape[3] and cos.dim() == 3 and cos.is_contiguous())


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
              eps: float = 0.0) -> torch.Tensor:
    """In place on x (1, T, H, D): RMSNorm per head (when weight is given), then rotate-half RoPE."""
    _, t, h, d = x.shape
    with profiled("edgellm::norm_rope"):
        _library().edgellm_norm_rope(x.data_ptr(), t, h, d, x.stride(1), None if weight is None else weight.data_ptr(),
                                     eps, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    return x
