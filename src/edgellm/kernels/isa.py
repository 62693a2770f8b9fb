"""Which kernel variant this CPU runs: one C source tree compiled per ISA (simd.h), chosen once.

    avx512  x86-64-v4 + AVX512-VNNI     (+bf16: AVX512-BF16 — bf16 prompt GEMMs and P·V)
    avx2    x86-64-v3: AVX2, FMA, F16C  (+vnni: AVX-VNNI's 256-bit vpdpwssd)
    neon    ARMv8.2-A NEON, dotprod, fp16 (+bf16: torch's bf16 GEMM is native there)
    scalar  plain C, any CPU: the reference the others are tested against

The best variant the CPU supports runs, with every extra it has. `EDGELLM_ISA` overrides it
with a name and exactly the extras it lists (`avx2`, `avx2+vnni`, `avx512+bf16`, `scalar`), for
benchmarking a narrower CPU on a wider one; naming one the CPU cannot run is an error."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from edgellm.errors import EdgeLLMError


class UnsupportedISA(EdgeLLMError):
    """EDGELLM_ISA names a kernel variant this CPU cannot run, or none that exists."""


@dataclass(frozen=True)
class Variant:
    name: str  # avx512 | avx2 | neon | scalar
    extras: frozenset[str] = frozenset()

    @property
    def label(self) -> str:
        return "+".join([self.name, *sorted(self.extras)])

    @property
    def bf16(self) -> bool:
        """Whether the CPU multiplies bf16 natively here: only then do fast-mode GEMMs take bf16."""
        return "bf16" in self.extras

    def compiler_flags(self) -> list[str]:
        # scalar: a * b + c stays two roundings wherever it is inlined (GCC fuses it into an FMA in some
        # copies and not others on aarch64, so one attention row's floats depended on its pass's heads)
        arch = {"avx512": ["-march=x86-64-v4", "-mavx512vnni"], "avx2": ["-march=x86-64-v3"],
                "neon": ["-march=armv8.2-a+fp16+dotprod"], "scalar": ["-ffp-contract=off"]}[self.name]
        extra = {"avx512": {"bf16": "-mavx512bf16"}, "avx2": {"vnni": "-mavxvnni"}}.get(self.name, {})
        return arch + [extra[e] for e in sorted(self.extras) if e in extra]


# variant -> (CPU features it needs, optional extras and the features each needs)
_X86 = {
    "avx512": ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx2", "fma", "f16c",
                "bmi2", "movbe"}, {"bf16": {"avx512_bf16"}}),
    "avx2": ({"avx2", "fma", "f16c", "bmi2", "movbe"}, {"vnni": {"avx_vnni"}}),
}
_ARM = {"neon": ({"asimd", "asimddp", "fphp", "asimdhp"}, {"bf16": {"bf16"}})}
_NAMES = ("avx512", "avx2", "neon", "scalar")


def machine() -> str:
    arch = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on ARM)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _table(arch: str) -> dict:
    return {"x86_64": _X86, "aarch64": _ARM}.get(arch, {})


def runnable(features: frozenset[str] | None = None, arch: str | None = None) -> list[Variant]:
    """Every variant this CPU (or one of machine `arch` with `features`) executes, best first, each
    with all the extras it has and (for tests) without them too; scalar last."""
    features = cpu_features() if features is None else features
    out = []
    for name, (needs, extras) in _table(arch or machine()).items():
        if needs <= features:
            have = frozenset(e for e, req in extras.items() if req <= features)
            out += [Variant(name, have)] + ([Variant(name)] if have else [])
    return out + [Variant("scalar")]


def parse(text: str, features: frozenset[str] | None = None) -> Variant:
    """A variant named as `name[+extra...]`, checked against this CPU."""
    name, *extras = text.strip().lower().split("+")
    if name not in _NAMES:
        raise UnsupportedISA(f"EDGELLM_ISA={text!r}: no such kernel variant (choose from {', '.join(_NAMES)})")
    wanted = Variant(name, frozenset(extras))
    best = {v.name: v for v in runnable(features) if v.extras >= wanted.extras}
    if name not in best:
        can = ", ".join(v.label for v in runnable(features))
        raise UnsupportedISA(f"EDGELLM_ISA={text!r}: this CPU cannot run it (it runs {can})")
    return wanted


@lru_cache(maxsize=1)
def selected() -> Variant:
    """The variant this process runs: EDGELLM_ISA, or the best this CPU supports."""
    override = os.environ.get("EDGELLM_ISA", "").strip()
    return parse(override) if override else runnable()[0]
