"""Building and loading the native library: the C sources in this folder, compiled for one ISA
variant (isa.py) with the system compiler (`cc -O3 -fopenmp -pthread`, a unit per core, ~10 s on
two) into edgellm's cache directory, keyed by the sources, the variant's flags and the CPU. A
build removes the libraries no process has loaded for UNUSED_FOR_S (each edgellm version leaves
one per variant behind; a loaded library's mtime says when it was last used).

A platform wheel carries its variants compiled (`prebuilt/`, made by tools/wheels.py): a library
compiled from these very sources with exactly the flags a local build would use (less
`-mtune=native`) is loaded from there, with no compiler and nothing written. Where neither a
prebuilt library nor a compiler is at hand, `library()` is None and the models run their PyTorch
layers (one line on stderr says what to install, once); EDGELLM_KERNELS=0 asks for that on purpose."""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import lru_cache
from importlib import resources
from pathlib import Path

from edgellm.atomic import remove_files
from edgellm.extras import torch, torch_loaded
from edgellm.kernels.isa import Variant, cpu_features, machine, selected

# Every C file and header of this package: a new native layer file (e.g. <family>_layer.c) is
# compiled without being listed anywhere.
SOURCES = tuple(sorted(r.name for r in resources.files("edgellm.kernels").iterdir() if r.name.endswith((".c", ".h"))))
COMMON_FLAGS = ["-O3", "-shared", "-fPIC"]
UNUSED_FOR_S = 30 * 24 * 3600
PREBUILT = "prebuilt"  # the package folder where a platform wheel keeps its compiled variants
MANIFEST = "manifest.json"  # in it: the sources' digest, the machine, and each library's flags
# Each flag set is carried twice: on the system's OpenMP (libgomp; the prompt kernels' teams hand over
# to PyTorch's GEMM threads for free), and on edgellm's pool alone, for a system without libgomp.
PREBUILT_KINDS = ("openmp", "pool")
WHEEL_MACHINES = ("x86_64", "aarch64")  # those tools/wheels.py makes platform wheels for

_p, _i, _i64, _f32, _f64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_double
# exported function -> (return type, argument types), checked against the C definitions by
# tests/kernels/test_signatures.py; the layer functions are called through edgellm_decoder_layers
_SIGNATURES = {
    "edgellm_int4_gemv": (None, [_p, _i, _i64, _p, _p, _i64, _i64, _i64, _p, _i64, _p, _i]),
    "edgellm_int4_gemv_work": (_i64, [_i, _i64, _i64]),
    "edgellm_block_gemv": (None, [_p, _i, _i64, _p, _i, _i64, _p, _p, _i64, _p, _i]),
    "edgellm_block_gemv_work": (_i64, [_i, _i64]),
    "edgellm_blocks_to_float": (None, [_p, _i, _i64, _i64, _p, _p, _i, _i]),
    "edgellm_q5_0_to_q8_0": (None, [_p, _i64, _p]),
    "edgellm_q8_0_to_q8r16": (None, [_p, _i64, _i64, _p, _i]),
    "edgellm_q8r16_rows": (None, [_p, _i64, _p, _i64, _p]),
    "edgellm_i4r64_from_blocks": (_i, [_p, _i, _i64, _i64, _i, _p, _p, _i64, _i64, _i]),
    "edgellm_affine_rows_to_float": (_i, [_p, _i, _i64, _p, _i64, _p]),
    "edgellm_gguf_string_ends": (_i64, [_p, _i64, _i64, _i64, _p]),
    "edgellm_first_bad_utf8": (_i64, [_p, _p, _p, _i64]),
    "edgellm_int4_unpack": (None, [_p, _p, _i64, _i64, _i64, _i, _i64, _i64, _p, _i, _i]),
    "edgellm_attention": (None, [_p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _p, _i64, _p,
                                 _p, _i]),
    "edgellm_attention_work": (_i64, [_i64, _i64, _i64, _i]),
    "edgellm_attention_bf16_values": (_i, [_i64]),
    "edgellm_gated_act": (None, [_p, _i64, _i64, _i, _p, _i, _i]),
    "edgellm_norm_rope": (None, [_p, _i64, _i64, _i64, _i64, _p, _f32, _p, _p, _i]),
    "edgellm_rms_norm": (None, [_p, _i64, _i64, _p, _f32, _p, _i, _i]),
    "edgellm_add_rms_norm": (None, [_p, _p, _i64, _i64, _p, _f32, _p, _i, _i]),
    "edgellm_kv_encode": (None, [_p, _i64, _i64, _p, _p, _p, _i64]),
    "edgellm_decode_attention": (_i64, [_p, _p, _i, _i64, _i64, _i64, _f32, _f32, _p, _p, _p, _p, _i]),
    "edgellm_decode_attention_floats": (_i64, [_i64, _i64, _i64, _i64, _i, _i]),
    "edgellm_decode_attention_max_group_floats": (_i64, []),
    "edgellm_decoder_layers": (None, [_p, _p, _i, _p, _i, _p, _p, _p, _p, _p, _p, _i, _p]),
    "edgellm_layer_floats": (_i64, [_p, _i]),
    "edgellm_layer_work_bytes": (_i64, [_p, _i]),
    "edgellm_max_prompt_rows": (_i, []),
    "edgellm_int16_gemm_native": (_i, []),
    "edgellm_int16_gemm_panel_bytes": (_i64, [_i64, _i64]),
    "edgellm_int16_gemm_work_bytes": (_i64, [_i64, _i64]),
    "edgellm_int16_gemm_pack": (None, [_p, _i64, _i64, _i64, _i64, _p, _i]),
    "edgellm_int16_gemm": (None, [_p, _i64, _i64, _p, _i64, _p, _i64, _p, _i]),
    "edgellm_int8_gemm_native": (_i, []),
    "edgellm_int8_gemm_takes": (_i, [_i]),
    "edgellm_int8_panel_bytes": (_i64, [_i64, _i64]),
    "edgellm_int8_act_bytes": (_i64, [_i64, _i64]),
    "edgellm_int8_pack_i4r64": (None, [_p, _p, _i64, _i64, _i64, _i64, _p, _i]),
    "edgellm_int8_pack_q8r16": (None, [_p, _i64, _i64, _p, _i]),
    "edgellm_int8_pack_q6_k": (None, [_p, _i64, _i64, _p, _i]),
    "edgellm_int8_quantize": (_i64, [_p, _i64, _i64, _i, _p, _p, _p, _p, _i]),
    "edgellm_int8_quantize_pooled": (_i64, [_p, _i64, _i64, _i, _p, _p, _p, _p, _i]),
    "edgellm_argmax": (_i64, [_p, _i64]),
    "edgellm_exp_sum": (_f64, [_p, _i64, _f32, _f32]),
    "edgellm_draw": (_i64, [_p, _i64, _f32, _f32, _f64]),
    "edgellm_top_logits": (_i64, [_p, _i64, _i64, _p, _p]),
    "edgellm_int8_gemm": (None, [_p, _i64, _i64, _p, _i64, _i, _p, _i64, _p, _i64, _p, _p, _i, _i]),
    "edgellm_int8_gemm_weight": (None, [_p, _i64, _i64, _p, _p, _i64, _i, _p, _i64, _p, _i64, _p, _p, _i, _i]),
    "edgellm_int8_pack_strip": (None, [_p, _p, _i64, _i64, _i64, _i, _p]),
}


class BuildError(OSError):
    """The C compiler is missing or failed; the message says which."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _sources() -> dict[str, bytes]:
    return {name: resources.files("edgellm.kernels").joinpath(name).read_bytes() for name in SOURCES}


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _compile(cc: str, units: list[str], flags: list[str], out: Path) -> subprocess.CompletedProcess:
    """Each unit to its object file, as many at once as there are cores (one `cc` for all of them
    took ~17 s on one core of two), then one link; the first failure, if any."""
    objects = [f"{unit[:-2]}.o" for unit in units]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=cores) as pool:  # the cores this process may use, not the host's
        compiled = list(pool.map(_run, ([cc, *COMMON_FLAGS, *flags, "-c", unit, "-o", obj]
                                        for unit, obj in zip(units, objects))))
    failed = next((done for done in compiled if done.returncode != 0), None)
    return failed or _run([cc, *COMMON_FLAGS, *flags, *objects, "-o", str(out), "-lm"])


def build(sources: dict[str, bytes], flags: list[str], target: Path, cc: str | None = None,
          openmp: bool = True) -> None:
    """Compile `sources` with `flags` into the shared library `target` (atomically), with `cc`
    (a cross compiler, for a wheel) or the system's; `openmp`: the prompt kernels' teams on the
    compiler's OpenMP where it has one, else on edgellm's pool."""
    cc = cc or compiler()
    if cc is None:
        raise BuildError("no C compiler (cc, gcc or clang) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_bytes(text)
        units = [str(Path(tmp) / n) for n in sources if n.endswith(".c")]
        out = Path(tmp) / target.name
        done = _compile(cc, units, [*flags, "-fopenmp", "-pthread"], out) if openmp else None
        if done is None or done.returncode != 0:  # a compiler without OpenMP: the prompt kernels share edgellm's pool (pool.h)
            done = _compile(cc, units, [*flags, "-pthread"], out)
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
            raise BuildError(f"{cc} failed: {first}")
        os.replace(out, target)  # a concurrent process sees the whole library or none


def _cpu_identity() -> bytes:
    try:
        return open("/proc/cpuinfo", "rb").read().split(b"\n\n")[0]
    except OSError:
        return b""


def _flags(variant: Variant) -> list[str]:
    return (["-mtune=native"] if variant.name in ("avx512", "avx2") else []) + portable_flags(variant, cpu_features())


def portable_flags(variant: Variant, features: frozenset[str]) -> list[str]:
    """The flags that decide what a variant's library computes on a CPU with `features`: the
    variant's own and the CPU's tuning below (a local build adds only `-mtune=native`). A prebuilt
    library compiled with the same flags is the same code."""
    return variant.compiler_flags() + _tuning(variant, features)


def _tuning(variant: Variant, features: frozenset[str]) -> list[str]:
    """What a CPU adds beyond the variant's baseline: Intel's AMX cores run AVX512-BF16's vdpbf16ps
    at half the fp32 FMA rate (attention.c then multiplies P·V in fp32); AVX512-VBMI's vpermb (Ice
    Lake and later, Zen 4) unpacks INT4 weights in fewer instructions than Cascade Lake's baseline."""
    flags = ["-DEDGELLM_HALF_RATE_BF16_DOT"] if variant.bf16 and "amx_bf16" in features else []
    if variant.name == "avx512" and "avx512vbmi" in features:
        flags.append("-mavx512vbmi")
    return flags


def library_path(variant: Variant) -> Path:
    from edgellm.registry import cache_dir

    sources, flags = _sources(), _flags(variant)
    key = hashlib.sha256(b"".join(sources.values()) + " ".join(flags).encode() + _cpu_identity()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"edgellm_{variant.label}_{key}.so"


def sources_digest() -> str:
    """What a prebuilt library must have been compiled from: these sources, by name and content."""
    digest = hashlib.sha256()
    for name, text in sorted(_sources().items()):
        digest.update(name.encode() + b"\0" + hashlib.sha256(text).digest())
    return digest.hexdigest()


def prebuilt_folder() -> Path:
    return Path(str(resources.files("edgellm.kernels").joinpath(PREBUILT)))


def prebuilt_paths(variant: Variant) -> list[Path]:
    """The wheel's libraries of `variant` for this CPU, best first (on the system's OpenMP, then on
    edgellm's pool alone for a system without libgomp), where the package carries them compiled from
    its own sources, for this machine, with the flags a local build would use (less -mtune)."""
    folder = prebuilt_folder()
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    if manifest.get("sources") != sources_digest() or manifest.get("machine") != machine():
        return []  # sources edited after the wheel was made, or another machine's wheel
    builds = manifest.get("libraries", {}).get(" ".join(portable_flags(variant, cpu_features())), {})
    return [folder / builds[kind] for kind in PREBUILT_KINDS if kind in builds and (folder / builds[kind]).is_file()]


@lru_cache(maxsize=None)
def library_for(variant: Variant) -> ctypes.CDLL:
    """The library of one variant: the wheel's, else compiled here on first use; raises BuildError."""
    unloadable = None
    for prebuilt in prebuilt_paths(variant):
        try:
            return load(prebuilt)
        except OSError as error:  # its OpenMP runtime is missing here: the next one has none
            unloadable = error
    target = library_path(variant)
    if target.is_file():
        _mark_used(target)
    else:
        if compiler() is None:
            carried = f"its compiled {variant.label} kernels do not load ({unloadable})" if unloadable \
                else f"this install carries no compiled {variant.label} kernels"
            raise BuildError(f"{carried} and no C compiler (cc, gcc or clang) is on PATH")
        # ~10 s a user would otherwise spend wondering (once per machine and version)
        sys.stderr.write(f"edgellm: compiling the {variant.label} kernels for this CPU (once, ~10 s)\n")
        build(_sources(), _flags(variant), target)
        remove_unused(target.parent, keep=target)
    return load(target)


def _mark_used(library: Path) -> None:
    try:
        os.utime(library)
    except OSError:  # a read-only cache: it is only never swept
        pass


def remove_unused(folder: Path, keep: Path) -> int:
    """Remove the libraries in `folder` that no process loaded for UNUSED_FOR_S (an older edgellm's,
    a variant no longer run), never `keep`; returns how many went."""
    now = time.time()
    return remove_files(folder.glob("edgellm_*.so"),
                        lambda library: library != keep and now - library.stat().st_mtime > UNUSED_FOR_S)


def load(path: Path) -> ctypes.CDLL:
    """A built library, its functions typed."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The selected variant's library, or None where it cannot run (then said once on stderr)."""
    if os.environ.get("EDGELLM_KERNELS", "1") == "0":
        return None
    try:
        return library_for(selected())
    except (OSError, subprocess.SubprocessError) as e:
        wheel = f"edgellm's wheel for {machine()} (`pip install --force-reinstall --no-deps edgellm`) or " \
            if machine() in WHEEL_MACHINES else ""
        sys.stderr.write(f"edgellm: native kernels unavailable ({e}); running the slow PyTorch path. For the fast "
                         f"one, install {wheel}a C compiler (e.g. `apt install gcc`).\n")
        return None


def library_if_ready() -> ctypes.CDLL | None:
    """The selected variant's library where having it takes no compile (loaded already, carried by
    the wheel, or compiled here before), else None: for work it only speeds up, such as reading a
    file's header, where waiting ~10 s for a compile would cost more than it saves."""
    if library.cache_info().currsize or os.environ.get("EDGELLM_KERNELS", "1") == "0":
        return library()
    variant = selected()
    return library() if prebuilt_paths(variant) or library_path(variant).is_file() else None


def available() -> bool:
    return library() is not None


def describe() -> str:
    """What runs here, in a few words: the kernel variant (or why none) and the prompt GEMMs' arithmetic."""
    dtype = "bf16" if selected().bf16 else "fp32"
    if available():
        # int8 on 4-bit / Q5_0 / Q6_K codes (the native layers' prompt pieces, and PyTorch's prompt path
        # without native bf16), int16 on the rest there (AVX-VNNI)
        kinds = [kind for kind in ("int8", "int16") if getattr(library(), f"edgellm_{kind}_gemm_native")()]
        if dtype == "bf16":
            kinds = kinds[:1] if kinds[:1] == ["int8"] else []
        dtype = " + ".join(kinds) or dtype
        return f"{selected().label} native kernels, {dtype} prompt GEMMs"
    why = "EDGELLM_KERNELS=0" if os.environ.get("EDGELLM_KERNELS", "1") == "0" else "no working C compiler"
    return f"PyTorch layers only ({why}), {dtype} GEMMs"


def compute_dtype() -> torch.dtype:
    """The dtype fast mode multiplies in: bf16 only where the CPU multiplies bf16 natively, since
    elsewhere PyTorch's bf16 GEMM is ~90x slower than its fp32 one."""
    return getattr(torch, compute_dtype_name())


def compute_dtype_name() -> str:
    """compute_dtype's name, without PyTorch."""
    return "bfloat16" if selected().bf16 else "float32"


def profiled(label: str):
    """A record_function naming a native call in `bench --op-times`; free when not profiling."""
    if not torch_loaded() or not torch.autograd.profiler._is_profiler_enabled:
        return nullcontext()
    return torch.profiler.record_function(label)
