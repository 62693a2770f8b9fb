"""The platform wheels `make wheels` builds (tools/wheels.py): each carries its machine's kernel
variants compiled, and installed where no C compiler can be found it runs SmolLM2 on them — the
x86-64 wheel here, the aarch64 wheel in an aarch64 Python under qemu (tools/arm64-root.sh) — giving
the same greedy tokens as this checkout's own build."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import edgellm
from edgellm.kernels import build, isa

REPO = Path(__file__).resolve().parents[1]
ARM_ROOT = Path(os.environ.get("EDGELLM_ARM64_ROOT", REPO / ".arm64root"))
PROMPT, TOKENS = "The capital of France is", 4  # top-2 logit gaps 2.5, 1.3, 1.4, 1.3 on x86: no near-tie
ARM_PLATFORMS = [f"--platform=manylinux_2_{n}_aarch64" for n in range(17, 40)]

# Both runs without PyTorch. The x86 one runs on this checkout's interpreter, whose environment has it (the
# test extras): its import is made to fail (argv[2] "block"). The aarch64 one sees nothing but the wheel and
# the core install's dependencies: the root's torch (for test_neon_python.py) lies in /opt/site, off its path.
SCRIPT = f"""
import importlib.util, sys
if sys.argv[2:] == ["block"]:
    sys.modules.update(torch=None, rich=None, safetensors=None, tokenizers=None)
torch = importlib.util.find_spec("torch") is not None if "torch" not in sys.modules else False
import json, edgellm
from edgellm import kernels
from edgellm.kernels import build, isa
model = edgellm.load(sys.argv[1])
done = model.generate({PROMPT!r}, max_tokens={TOKENS}, temperature=0)
print(json.dumps(dict(module=edgellm.__file__, variant=isa.selected().label, describe=kernels.describe(),
                      library=build.library()._name, fused=model.net.decoder is not None, ids=list(done.token_ids),
                      torch=torch, torch_loaded="torch" in sys.modules and sys.modules["torch"] is not None)))
"""

pytestmark = pytest.mark.slow


def _tool():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import wheels
    finally:
        sys.path.remove(str(REPO / "tools"))
    return wheels


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """The wheels of every machine whose compiler is here (aarch64's: `make arm-tools`), each with
    the libraries of the CPU they are run on below (this one's selected variant, qemu's NEON) — all of
    them take ~4 minutes on two cores: test_the_wheels_serve_every_cpu_family checks the list."""
    tool = _tool()
    machines = [m for m in sorted(tool.CPUS) if any(shutil.which(cc) for cc in tool.COMPILERS[m])]
    here = " ".join(build.portable_flags(isa.selected(), isa.cpu_features()))
    neon = " ".join(isa.Variant("neon").compiler_flags())
    made = tool.make_wheels(tmp_path_factory.mktemp("dist"), machines, wanted=lambda flags: flags in (here, neon))
    return dict(zip(machines, made))


@pytest.mark.parametrize("machine, libraries", [
    ("x86_64", ["scalar", "avx2", "avx2-vnni", "avx512", "avx512_vbmi", "avx512-bf16", "avx512-bf16_vbmi",
                "avx512-bf16_half-rate_vbmi"]),
    ("aarch64", ["scalar", "neon"])])
def test_the_wheels_serve_every_cpu_family(machine, libraries):
    """One library per distinct flag set of every variant the listed CPUs run (those with extras also
    run the variant without them: EDGELLM_ISA=avx2 on a Zen 4)."""
    stems = _tool().flag_sets(machine).values()
    assert sorted(stem.split("_", 2)[2] for stem in stems) == sorted(libraries)


def _no_compiler(tmp: Path, **env: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EDGELLM_")}
    return clean | dict(CC=str(tmp / "no-cc"), PATH=str(tmp / "no-bin"), EDGELLM_CACHE=str(tmp / "cache")) | env


def _expected_ids(smollm2_path: Path) -> list[int]:
    with edgellm.load(smollm2_path) as model:
        return list(model.generate(PROMPT, max_tokens=TOKENS, temperature=0).token_ids)


def test_a_wheel_is_tagged_for_its_machine_and_holds_its_libraries_on_openmp_and_on_the_pool(wheels):
    assert "x86_64" in wheels
    for machine, wheel in wheels.items():
        assert wheel.name.startswith("edgellm-") and wheel.name.endswith(f"_{machine}.whl")
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            manifest = json.loads(z.read("edgellm/kernels/prebuilt/manifest.json"))
            assert "Root-Is-Purelib: false" in z.read(next(n for n in names if n.endswith("/WHEEL"))).decode()
            libraries = {kind: z.read(f"edgellm/kernels/prebuilt/{name}") for builds in manifest["libraries"].values()
                         for kind, name in builds.items()}
        assert manifest["machine"] == machine and manifest["sources"] == build.sources_digest()
        assert sorted(f"edgellm/kernels/prebuilt/{n}" for b in manifest["libraries"].values() for n in b.values()) == \
            sorted(n for n in names if n.endswith(".so"))
        assert b"libgomp.so.1" in libraries["openmp"] and b"libgomp" not in libraries["pool"]


def test_the_x86_wheel_runs_smollm2_on_its_own_kernels_with_no_compiler(wheels, smollm2_path, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheels["x86_64"])], check=True)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(smollm2_path), "block"], capture_output=True, text=True,
                          timeout=600, env=_no_compiler(tmp_path, PYTHONPATH=str(site)))
    assert done.returncode == 0, done.stderr[-3000:]
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    assert ran["module"].startswith(str(site)) and ran["library"].startswith(str(site / "edgellm/kernels/prebuilt"))
    assert ran["variant"] == isa.selected().label and ran["describe"].startswith(isa.selected().label)
    assert ran["fused"] and "compiling" not in done.stderr and not (tmp_path / "cache" / "kernels").exists()
    assert ran["ids"] == _expected_ids(smollm2_path)


def test_the_aarch64_wheel_runs_smollm2_on_neon_under_qemu_with_no_compiler(wheels, smollm2_path, tmp_path):
    python = ARM_ROOT / "usr/bin/python3.11"
    if "aarch64" not in wheels or shutil.which("qemu-aarch64") is None or not python.exists():
        pytest.skip("needs aarch64-linux-gnu-gcc, qemu-aarch64 and an aarch64 root: make arm-tools arm-python")
    assert not list(ARM_ROOT.glob("usr/bin/*gcc*")) and not (ARM_ROOT / "usr/bin/cc").exists()
    site = tmp_path / "site"  # the wheel and what `run` needs of the core's dependencies, from the root's downloads
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--only-binary=:all:",
                    "--python-version", "3.11", "--implementation", "cp", *ARM_PLATFORMS, "--target", str(site),
                    str(wheels["aarch64"]), *_core_wheels(ARM_ROOT / "var/cache/wheels")], check=True)
    assert not (site / "torch").exists()
    env = _no_compiler(tmp_path, PYTHONPATH=str(site), PYTHONNOUSERSITE="1")
    done = subprocess.run([shutil.which("qemu-aarch64"), "-cpu", "max", "-L", str(ARM_ROOT), str(python), "-c", SCRIPT,
                           str(smollm2_path)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    assert ran["module"].startswith(str(site)) and ran["library"].startswith(str(site / "edgellm/kernels/prebuilt"))
    assert ran["variant"].startswith("neon") and ran["fused"] and "compiling" not in done.stderr
    assert not ran["torch"] and not ran["torch_loaded"]  # no PyTorch on the path at all, as on a board
    assert ran["ids"] == _expected_ids(smollm2_path)


CORE_RUNTIME = ("numpy", "jinja2", "markupsafe", "psutil", "llguidance")  # what `edgellm.load` + generate import


def _core_wheels(folder: Path) -> list[str]:
    wheels = [w for w in folder.glob("*.whl") if w.name.split("-")[0].lower() in CORE_RUNTIME]
    if len(wheels) != len(CORE_RUNTIME):
        pytest.skip(f"the aarch64 root's wheel cache lacks some of {CORE_RUNTIME}: make arm-python again")
    return [str(w) for w in wheels]
