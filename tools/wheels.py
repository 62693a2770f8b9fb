"""Platform wheels that carry their kernels: the pure wheel pip builds from this tree, plus each
kernel variant compiled for the CPUs a machine's wheel serves, in `edgellm/kernels/prebuilt/`.

    python tools/wheels.py [--out dist] [--machine x86_64 --machine aarch64]

x86-64 is compiled with the system compiler, aarch64 with Debian's cross compiler
(`aarch64-linux-gnu-gcc`, `make arm-tools`). A library is compiled with exactly the flags a local
build on such a CPU would use, less `-mtune=native` (kernels/build.py `portable_flags`), so the
installed package loads it instead of compiling. The wheel's platform tag names the newest glibc
symbol version its libraries need."""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from edgellm.kernels import build
from edgellm.kernels import isa
from edgellm.kernels.isa import _ARM, _X86

REPO = Path(__file__).resolve().parents[1]

# The CPU families each machine's wheel serves, by the features that change a build: every distinct
# flag set of every variant these CPUs run (with and without their extras) is compiled once.
_AVX2 = frozenset(_X86["avx2"][0])
_AVX512 = _AVX2 | _X86["avx512"][0]
CPUS = {
    "x86_64": {
        "any x86-64": frozenset(),
        "Zen 3, Haswell..Comet Lake": _AVX2,
        "Alder Lake and later client cores": _AVX2 | {"avx_vnni"},
        "Cascade Lake": _AVX512,
        "Ice Lake server": _AVX512 | {"avx512vbmi"},
        "Cooper Lake": _AVX512 | {"avx512_bf16"},
        "Zen 4, Zen 5": _AVX512 | {"avx512vbmi", "avx512_bf16"},
        "Sapphire Rapids and later": _AVX512 | {"avx512vbmi", "avx512_bf16", "amx_bf16"},
    },
    "aarch64": {
        "any ARMv8": frozenset(),
        "ARMv8.2 with dotprod (Cortex-A55/A76, Graviton 2, Apple M)": frozenset(_ARM["neon"][0]),
    },
}
TUNING = {"-mavx512vbmi": "vbmi", "-DEDGELLM_HALF_RATE_BF16_DOT": "half-rate"}  # a file name's words for them
COMPILERS = {"x86_64": ("cc", "gcc"), "aarch64": ("aarch64-linux-gnu-gcc",)}
# Prepended to every build's flags: the scalar library must not take the build host's default -march
# (x86-64-v2 on some distributions); a variant's own -march comes later and wins.
BASELINE = {"x86_64": ["-march=x86-64", "-mtune=generic"], "aarch64": ["-march=armv8-a"]}


def flag_sets(machine: str) -> dict[str, str]:
    """Every distinct set of portable flags the machine's CPUs would build -> its libraries' stem,
    which names the variant and what the CPU's tuning adds (e.g. `edgellm_05_avx512-bf16_vbmi`)."""
    sets: dict[str, str] = {}
    for features in CPUS[machine].values():
        for variant in isa.runnable(features, machine):
            flags = build.portable_flags(variant, features)
            tuning = [TUNING[f] for f in flags if f not in variant.compiler_flags()]
            label = "_".join([variant.label.replace("+", "-"), *tuning])
            sets.setdefault(" ".join(flags), f"edgellm_{len(sets):02d}_{label}")
    return sets


def compile_prebuilt(machine: str, folder: Path, wanted: Callable[[str], bool] = lambda flags: True) -> list[Path]:
    """The machine's libraries (those of the flag sets `wanted` takes) and their manifest in `folder`;
    returns the files written."""
    cc = next((found for name in COMPILERS[machine] if (found := shutil.which(name))), None)
    if cc is None:
        raise SystemExit(f"no compiler for {machine}: install {COMPILERS[machine][0]} (make arm-tools)")
    folder.mkdir(parents=True, exist_ok=True)
    libraries = {flags: {kind: f"{stem}_{kind}.so" for kind in build.PREBUILT_KINDS}
                 for flags, stem in flag_sets(machine).items() if wanted(flags)}
    for flags, names in libraries.items():
        for kind, name in names.items():
            print(f"  {machine}: {name} ({flags})", file=sys.stderr)
            build.build(build._sources(), BASELINE[machine] + flags.split(), folder / name, cc=cc,
                        openmp=kind == "openmp")
    manifest = {"sources": build.sources_digest(), "machine": machine, "libraries": libraries}
    (folder / build.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return [folder / name for names in libraries.values() for name in names.values()] + [folder / build.MANIFEST]


def glibc_needed(libraries: list[Path]) -> tuple[int, int]:
    """The newest GLIBC_x.y symbol version the libraries ask for (their version-need strings)."""
    minors = [int(minor) for lib in libraries for minor in re.findall(rb"GLIBC_2\.(\d+)", lib.read_bytes())]
    return 2, max([17, *minors])


def pure_wheel(out: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pip wheel failed:\n{done.stderr[-2000:]}")
    return next(out.glob("edgellm-*-py3-none-any.whl"))


def _record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def platform_wheel(pure: Path, machine: str, extra: dict[str, bytes], glibc: tuple[int, int], out: Path) -> Path:
    """`pure` with `extra` files added, marked as not pure and tagged for `machine` and `glibc`."""
    tag = f"py3-none-manylinux_{glibc[0]}_{glibc[1]}_{machine}"
    name = pure.name.replace("py3-none-any", tag)
    target = out / name
    with zipfile.ZipFile(pure) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as wheel:
        entries = {info.filename: source.read(info) for info in source.infolist()}
        info_dir = next(n.split("/")[0] for n in entries if n.endswith(".dist-info/WHEEL"))
        record_name = f"{info_dir}/RECORD"
        entries.pop(record_name)
        wheel_file = entries[f"{info_dir}/WHEEL"].decode()
        wheel_file = wheel_file.replace("Root-Is-Purelib: true", "Root-Is-Purelib: false")
        wheel_file = re.sub(r"^Tag: .*$", f"Tag: {tag}", wheel_file, flags=re.M)
        entries[f"{info_dir}/WHEEL"] = wheel_file.encode()
        entries.update(extra)
        record = io.StringIO()
        writer = csv.writer(record, lineterminator="\n")
        for entry, data in entries.items():
            wheel.writestr(zipfile.ZipInfo(entry, date_time=(2026, 1, 1, 0, 0, 0)) if not entry.endswith(".so")
                           else _executable(entry), data, compress_type=zipfile.ZIP_DEFLATED)
            writer.writerow(_record_line(entry, data))
        writer.writerow([record_name, "", ""])
        wheel.writestr(record_name, record.getvalue())
    return target


def _executable(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
    info.external_attr = 0o755 << 16
    return info


def make_wheels(out: Path, machines: list[str], wanted: Callable[[str], bool] = lambda flags: True) -> list[Path]:
    """A platform wheel per machine in `out`; `wanted`: only the flag sets it takes (a quicker wheel
    for one CPU)."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    with tempfile.TemporaryDirectory() as tmp:
        pure = pure_wheel(Path(tmp))
        for machine in machines:
            files = compile_prebuilt(machine, Path(tmp) / machine, wanted)
            extra = {f"edgellm/kernels/{build.PREBUILT}/{f.name}": f.read_bytes() for f in files}
            made.append(platform_wheel(pure, machine, extra, glibc_needed(files[:-1]), out))
            print(f"{made[-1]} ({made[-1].stat().st_size / 1e6:.1f} MB)")
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "dist")
    parser.add_argument("--machine", action="append", choices=sorted(CPUS), help="default: both")
    args = parser.parse_args()
    make_wheels(args.out, args.machine or sorted(CPUS))


if __name__ == "__main__":
    main()
