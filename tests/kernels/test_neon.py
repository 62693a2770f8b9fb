"""The NEON variant, checked on an x86 machine: the kernels cross-compiled for aarch64 (NEON with
dotprod, and the scalar reference), compared kernel by kernel under `qemu-aarch64 -cpu max` by a
small C driver (variant_driver.c). Needs Debian's gcc-aarch64-linux-gnu and qemu-user (the
Makefile installs them where it can); skipped with that reason where they are absent."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from edgellm.kernels.build import _sources, build
from edgellm.kernels.isa import Variant

CROSS_CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", Path("/usr/aarch64-linux-gnu")
DRIVER = Path(__file__).with_name("variant_driver.c")


def _tools() -> str | None:
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing or not SYSROOT.is_dir():
        return f"needs {' and '.join(missing) or SYSROOT} (apt install gcc-aarch64-linux-gnu qemu-user)"
    return None


@pytest.fixture(scope="module")
def arm_build(tmp_path_factory, monkeypatch_module):
    why = _tools()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("aarch64")
    monkeypatch_module.setenv("CC", CROSS_CC)
    libs = {}
    for variant in (Variant("neon"), Variant("scalar")):
        libs[variant.name] = out / f"{variant.name}.so"
        build(_sources(), variant.compiler_flags(), libs[variant.name])
    driver = out / "variant_driver"
    subprocess.run([CROSS_CC, "-O2", str(DRIVER), "-o", str(driver), "-ldl", "-lm"], check=True, capture_output=True)
    return driver, libs


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_neon_build_uses_dot_product_instructions(arm_build):
    _, libs = arm_build
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump is None:
        pytest.skip("needs aarch64-linux-gnu-objdump (binutils-aarch64-linux-gnu)")
    text = subprocess.run([objdump, "-d", str(libs["neon"])], capture_output=True, text=True, check=True).stdout
    assert "sdot" in text  # the integer GEMVs run on dotprod, not widened multiplies


def test_every_neon_kernel_matches_the_scalar_reference_under_qemu(arm_build):
    driver, libs = arm_build
    done = subprocess.run([QEMU, "-cpu", "max", "-L", str(SYSROOT), str(driver), str(libs["neon"]), str(libs["scalar"])],
                          capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    checked = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    # every kernel: GEMVs of all formats, unpacking, attention (and a sequence's rows in one call as each
    # alone, bit for bit, in either build), row kernels, KV codecs, a decode layer
    for name in ("int4_gemv", "int4_unpack", "block_gemv Q5_K", "block_gemv I8", "blocks_to_float Q6_K",
                 "attention", "rows of one sequence", "gated_act", "norm_rope", "add_rms_norm", "kv_encode int4",
                 "llama_layer", "gemma_layer"):
        assert any(name in line for line in checked), name
