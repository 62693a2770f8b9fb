"""Choosing the kernel variant: from the CPU's features, or EDGELLM_ISA; and what it implies for
the arithmetic (bf16 only with native bf16)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from edgellm.kernels import isa
from edgellm.kernels.isa import UnsupportedISA, Variant

ZEN3 = frozenset("avx avx2 fma f16c bmi2 movbe sse4_2".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni avx512_bf16".split())
ALDER_LAKE = ZEN3 | {"avx_vnni"}


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(isa, "machine", lambda: "x86_64")


def test_best_variant_first_with_every_extra_then_without(x86):
    assert isa.runnable(ZEN4) == [Variant("avx512", frozenset({"bf16"})), Variant("avx512"),
                                  Variant("avx2"), Variant("scalar")]
    assert isa.runnable(ZEN3) == [Variant("avx2"), Variant("scalar")]
    assert isa.runnable(ALDER_LAKE)[0] == Variant("avx2", frozenset({"vnni"}))
    assert isa.runnable(frozenset({"sse2"})) == [Variant("scalar")]


def test_arm_needs_dotprod_for_neon(monkeypatch):
    monkeypatch.setattr(isa, "machine", lambda: "aarch64")
    pi5 = frozenset("fp asimd fphp asimdhp asimddp".split())
    assert isa.runnable(pi5)[0] == Variant("neon")
    assert isa.runnable(frozenset("fp asimd".split())) == [Variant("scalar")]  # Cortex-A72: no dotprod


def test_override_names_exactly_the_extras_it_lists(x86):
    assert isa.parse("avx2", ZEN4) == Variant("avx2")
    assert isa.parse("AVX512+bf16", ZEN4) == Variant("avx512", frozenset({"bf16"}))
    assert isa.parse("scalar", ZEN3) == Variant("scalar")
    with pytest.raises(UnsupportedISA, match="cannot run"):
        isa.parse("avx512", ZEN3)
    with pytest.raises(UnsupportedISA, match="cannot run"):
        isa.parse("avx2+vnni", ZEN3)
    with pytest.raises(UnsupportedISA, match="no such"):
        isa.parse("sse9", ZEN4)


def test_bf16_arithmetic_only_where_the_cpu_has_it():
    assert Variant("avx512", frozenset({"bf16"})).bf16
    assert not Variant("avx512").bf16 and not Variant("avx2", frozenset({"vnni"})).bf16
    assert not Variant("scalar").bf16


def test_compiler_flags_per_variant():
    assert Variant("avx2").compiler_flags() == ["-march=x86-64-v3"]
    assert "-mavxvnni" in Variant("avx2", frozenset({"vnni"})).compiler_flags()
    assert "-mavx512bf16" in Variant("avx512", frozenset({"bf16"})).compiler_flags()
    assert Variant("neon").compiler_flags() == ["-march=armv8.2-a+fp16+dotprod"]
    assert Variant("scalar").compiler_flags() == ["-ffp-contract=off"]  # the same roundings in every inlined copy


def _in_subprocess(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_environment_picks_the_variant_and_its_dtype():
    done = _in_subprocess("from edgellm import kernels; print(kernels.selected().label, kernels.compute_dtype())",
                          EDGELLM_ISA="scalar")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["scalar", "torch.float32"]


def test_no_compiler_says_so_once_and_runs_pytorch():
    code = ("import edgellm; m = edgellm.load('smollm2-135m'); "
            "print(m.generate('Hi', max_tokens=2, ignore_eos=True).token_ids)")
    done = _in_subprocess(code, CC="/nonexistent/cc", PATH="/nonexistent", EDGELLM_CACHE=tempfile.mkdtemp())
    if "is not installed" in done.stderr:
        pytest.skip("smollm2-135m is not installed")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "native kernels unavailable" in line]
    assert len(lines) == 1 and "slow PyTorch path" in lines[0] and "C compiler" in lines[0]


def test_the_selected_variant_runs_here():
    assert isa.selected() in isa.runnable()


def test_amx_cores_multiply_attention_values_in_fp32(monkeypatch):
    # their vdpbf16ps runs at half the fp32 FMA rate (measured on Sapphire Rapids): the build says so
    from edgellm.kernels import build

    bf16 = Variant("avx512", frozenset({"bf16"}))
    monkeypatch.setattr(build, "cpu_features", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert "-DEDGELLM_HALF_RATE_BF16_DOT" in build._flags(bf16)
    assert "-DEDGELLM_HALF_RATE_BF16_DOT" not in build._flags(Variant("avx512"))
    monkeypatch.setattr(build, "cpu_features", lambda: frozenset({"avx512_bf16"}))  # a Zen 4
    assert "-DEDGELLM_HALF_RATE_BF16_DOT" not in build._flags(bf16)


def test_vbmi_cpus_build_the_int4_unpacking_with_vpermb(monkeypatch):
    from edgellm.kernels import build

    monkeypatch.setattr(build, "cpu_features", lambda: frozenset({"avx512_vnni", "avx512vbmi"}))
    assert "-mavx512vbmi" in build._flags(Variant("avx512"))
    assert "-mavx512vbmi" not in build._flags(Variant("avx2"))  # the AVX2 variants never take it
    monkeypatch.setattr(build, "cpu_features", lambda: frozenset({"avx512_vnni"}))  # a Cascade Lake
    assert "-mavx512vbmi" not in build._flags(Variant("avx512"))


def test_the_first_build_of_a_variant_says_so_and_the_next_use_does_not(monkeypatch, tmp_path, capsys):
    from edgellm.kernels import build

    compiled = build.library_path(isa.selected())
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "build", lambda sources, flags, target: (target.parent.mkdir(parents=True),
                                                                        target.write_bytes(compiled.read_bytes())))
    for _ in range(2):
        build.library_for.__wrapped__(isa.selected())
    said = [line for line in capsys.readouterr().err.splitlines() if "compiling" in line]
    assert said == [f"edgellm: compiling the {isa.selected().label} kernels for this CPU (once, ~10 s)"]


def test_a_build_removes_libraries_unused_for_a_month_and_a_load_marks_its_use(monkeypatch, tmp_path):
    from edgellm.kernels import build

    compiled = build.library_path(isa.selected())
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "build", lambda sources, flags, target: target.write_bytes(compiled.read_bytes()))
    folder = tmp_path / "kernels"
    folder.mkdir()
    month_ago, day_ago = time.time() - build.UNUSED_FOR_S - 3600, time.time() - 86400
    older_edgellm, other_venv = folder / "edgellm_avx2_0123456789abcdef.so", folder / "edgellm_avx2_fedcba9876543210.so"
    for library, used in ((older_edgellm, month_ago), (other_venv, day_ago)):
        library.write_bytes(b"\x7fELF")
        os.utime(library, (used, used))
    build.library_for.__wrapped__(isa.selected())
    target = build.library_path(isa.selected())
    assert target.is_file() and other_venv.exists() and not older_edgellm.exists()
    os.utime(target, (month_ago, month_ago))
    build.library_for.__wrapped__(isa.selected())  # found, not built: its use is marked
    assert time.time() - target.stat().st_mtime < 60
