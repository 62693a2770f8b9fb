"""Building and loading the native library: the C sources in this folder, compiled with the
system compiler (`cc -O3 -march=native -fopenmp`, about a second) into edgellm's cache
directory, keyed by the sources and the CPU. Machines without a compiler, AVX-512 VNNI or
torch's AVX-512 INT4 packing get None and keep PyTorch's kernels; EDGELLM_KERNELS=0 too."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from contextlib import nullcontext
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

SOURCES = ("activations.h", "vec_math.h", "int4_pack.h", "layer_ops.h", "int4_gemv.c", "block_gemv.c", "dequant.c", "attention.c",
           "act.c", "rope.c", "norm.c", "layer_ops.c", "llama_layer.c", "gemma3_layer.c")

_p, _i, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# exported function -> (return type, argument types); layer functions are typed in decode.py
_SIGNATURES = {
    "edgellm_int4_gemv": (None, [_p, _i, _i64, _p, _p, _i64, _i64, _i64, _p, _p, _i]),
    "edgellm_block_gemv": (None, [_p, _i, _i64, _p, _i, _i64, _p, _p, _i]),
    "edgellm_blocks_to_bf16": (None, [_p, _i, _i64, _i64, _p, _i]),
    "edgellm_int4_unpack_bf16": (None, [_p, _p, _i64, _i64, _i64, _i, _i64, _i64, _p, _i]),
    "edgellm_attention": (None, [_p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _p, _i64, _p,
                                 _p, _i]),
    "edgellm_attention_work": (_i64, [_i64, _i64, _i64, _i]),
    "edgellm_attention_bf16_values": (_i, []),
    "edgellm_gated_act_bf16": (None, [_p, _i64, _i64, _i, _p, _i]),
    "edgellm_norm_rope": (None, [_p, _i64, _i64, _i64, _i64, _p, _f32, _p, _p, _i]),
    "edgellm_rms_norm_bf16": (None, [_p, _i64, _i64, _p, _f32, _p, _i]),
    "edgellm_add_rms_norm": (None, [_p, _p, _i64, _i64, _p, _f32, _p, _i]),
}


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
def library() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where it cannot run."""
    if os.environ.get("EDGELLM_KERNELS", "1") == "0":
        return None
    if not {"avx512f", "avx512bw", "avx512_vnni"} <= _cpu_flags():
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None  # torch packs INT4 differently for AVX2: int4_gemv.c's layout would be wrong
    from edgellm.registry import cache_dir

    sources = {name: resources.files("edgellm.kernels").joinpath(name).read_bytes() for name in SOURCES}
    cpu = open("/proc/cpuinfo", "rb").read().split(b"\n\n")[0]
    key = hashlib.sha256(b"".join(sources.values()) + cpu).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"edgellm_{key}.so"
    try:
        if not target.is_file():
            _build(sources, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def available() -> bool:
    return library() is not None


def profiled(label: str):
    """A record_function naming a native call in `bench --profile`; free when not profiling."""
    return torch.profiler.record_function(label) if torch.autograd.profiler._is_profiler_enabled else nullcontext()
