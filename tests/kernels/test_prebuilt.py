"""Kernels a wheel carries compiled (kernels/build.py `prebuilt_paths`, tools/wheels.py): loaded with no
compiler and nothing written, only when compiled from the package's own sources for this machine
with the flags a local build would use; and with neither them nor a compiler, one line saying
what to install."""
from __future__ import annotations

import json
import shutil

import pytest

from edgellm.kernels import build, isa
from edgellm.kernels.build import BuildError


@pytest.fixture
def wheel_folder(tmp_path, monkeypatch):
    """A package folder holding this CPU's selected variant as a wheel would (its library copied from
    a local build, under the manifest tools/wheels.py writes), with no compiler on PATH and an empty
    cache."""
    compiled = build.library_path(isa.selected())
    if not compiled.is_file():
        build.library_for(isa.selected())
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    shutil.copy(compiled, folder / "edgellm_00_selected.so")
    flags = " ".join(build.portable_flags(isa.selected(), isa.cpu_features()))
    manifest = {"sources": build.sources_digest(), "machine": isa.machine(),
                "libraries": {flags: {"openmp": "edgellm_00_selected.so"}}}
    (folder / build.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setattr(build, "prebuilt_folder", lambda: folder)
    monkeypatch.setenv("CC", str(tmp_path / "no-cc"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "cache"))
    return folder


def _rewrite(folder, **changes) -> None:
    manifest = json.loads((folder / build.MANIFEST).read_text())
    (folder / build.MANIFEST).write_text(json.dumps(manifest | changes))


def test_a_prebuilt_library_loads_with_no_compiler_and_writes_nothing(wheel_folder, tmp_path, capsys):
    lib = build.library_for.__wrapped__(isa.selected())
    assert lib._name == str(wheel_folder / "edgellm_00_selected.so")
    assert lib.edgellm_decode_attention_max_group_floats() > 0
    assert not (tmp_path / "cache" / "kernels").exists()
    assert "compiling" not in capsys.readouterr().err


def test_where_the_openmp_build_cannot_load_the_pool_build_does(wheel_folder):
    """A system without libgomp cannot load the build on OpenMP: the wheel's second build of the same
    flags, on edgellm's pool alone, loads instead."""
    (wheel_folder / "edgellm_00_pool.so").write_bytes((wheel_folder / "edgellm_00_selected.so").read_bytes())
    (wheel_folder / "edgellm_00_selected.so").write_bytes(b"\x7fELF not a library")
    manifest = json.loads((wheel_folder / build.MANIFEST).read_text())
    for builds in manifest["libraries"].values():
        builds["pool"] = "edgellm_00_pool.so"
    (wheel_folder / build.MANIFEST).write_text(json.dumps(manifest))
    assert build.library_for.__wrapped__(isa.selected())._name == str(wheel_folder / "edgellm_00_pool.so")


def test_a_prebuilt_library_of_other_sources_or_another_machine_is_not_used(wheel_folder, monkeypatch):
    assert build.prebuilt_paths(isa.selected())
    _rewrite(wheel_folder, sources="0" * 64)  # the package's sources were edited after the wheel was made
    assert not build.prebuilt_paths(isa.selected())
    _rewrite(wheel_folder, sources=build.sources_digest(), machine="riscv64")
    assert not build.prebuilt_paths(isa.selected())
    _rewrite(wheel_folder, machine=isa.machine())
    assert build.prebuilt_paths(isa.selected())


def test_a_variant_the_wheel_lacks_is_compiled_or_else_named_with_what_to_install(wheel_folder):
    """The wheel holds the selected variant only: another one (other flags) needs a compiler, and
    without one the error says that neither is here."""
    other = isa.Variant("scalar") if isa.selected().name != "scalar" else isa.Variant("scalar", frozenset({"x"}))
    assert not build.prebuilt_paths(other)
    with pytest.raises(BuildError, match="carries no compiled .* and no C compiler"):
        build.library_for.__wrapped__(other)


def test_with_neither_the_fallback_line_says_what_to_install(wheel_folder, monkeypatch, capsys):
    (wheel_folder / build.MANIFEST).unlink()
    build.library.cache_clear()
    build.library_for.cache_clear()
    try:
        assert build.library() is None
    finally:
        build.library.cache_clear()
        build.library_for.cache_clear()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "native kernels unavailable" in err[0]
    assert f"edgellm's wheel for {isa.machine()}" in err[0] and "C compiler" in err[0]


def test_a_carried_library_that_does_not_load_is_named_in_the_error(wheel_folder):
    """Libraries a system cannot load (too old a glibc, no libgomp for either build) and no compiler:
    the error says that they do not load, and why, rather than that there are none."""
    (wheel_folder / "edgellm_00_selected.so").write_bytes(b"\x7fELF not a library")
    with pytest.raises(BuildError, match="kernels do not load .*no C compiler"):
        build.library_for.__wrapped__(isa.selected())
