"""The packed-weight cache: a second load maps converted linears instead of converting,
and produces exactly the same model; a damaged cache is rebuilt; entries no load can use
again are removed when a new one is written."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import edgellm
from edgellm import kernels
from edgellm.io.pack import cache_path, wait_for_writes
from edgellm.quant.linear import Int4Linear


def _packed_files(root):
    return sorted((root / "packed").glob("*.safetensors"))


def _views(array, path: Path) -> bool:
    """Whether `array` lies in a mapping of the file at `path` (/proc/self/maps)."""
    address = array.ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[-1] == str(path) if len(rest) >= 5 else False
    return False


def test_second_load_uses_the_cache_and_matches(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    first = edgellm.load(smollm2_path)
    wait_for_writes()  # the entry is written behind the load
    (cache_file,) = _packed_files(tmp_path)
    reference = first.generate("The lighthouse keeper", max_tokens=12).token_ids
    logits = first.logits([1, 2, 3, 4])
    first.close()
    stamp = cache_file.stat().st_mtime_ns

    second = edgellm.load(smollm2_path)
    assert cache_file.stat().st_mtime_ns == stamp  # read, not rewritten
    assert any(isinstance(m, Int4Linear) for m in second.net.modules())
    head = second.net.lm_head  # the tied Q8_0 table's Q8R16 copy: a view of the cache file, and the embedding's
    assert head.types == [kernels.Q8R16] and _views(head.parts[0].rows, cache_file)
    assert second.net.embed.rows.ctypes.data == head.parts[0].rows.ctypes.data
    assert second.generate("The lighthouse keeper", max_tokens=12).token_ids == reference
    assert torch.equal(second.logits([1, 2, 3, 4]), logits)
    second.close()


def test_damaged_cache_is_rebuilt(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    edgellm.load(smollm2_path).close()
    (cache_file,) = _packed_files(tmp_path)
    cache_file.write_bytes(cache_file.read_bytes()[:1000])
    model = edgellm.load(smollm2_path)
    assert model.generate("Hello", max_tokens=4).token_ids
    model.close()
    assert cache_file.stat().st_size > 1000  # written again


def test_cache_can_be_disabled(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    monkeypatch.setenv("EDGELLM_PACK_CACHE", "0")
    edgellm.load(smollm2_path).close()
    assert _packed_files(tmp_path) == []


def _copy(model: Path, folder: Path) -> Path:
    folder.mkdir()
    return Path(shutil.copy2(model, folder / model.name))


def test_a_rewritten_model_file_replaces_its_entry(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "cache"))
    model = _copy(smollm2_path, tmp_path / "models")
    edgellm.load(model).close()
    (old,) = _packed_files(tmp_path / "cache")
    later = model.stat().st_mtime_ns + 10**9  # as a new download or `edgellm quantize` to the same path
    os.utime(model, ns=(time.time_ns(), later))
    edgellm.load(model).close()
    (new,) = _packed_files(tmp_path / "cache")
    assert new != old and not old.exists()


def test_entries_of_removed_files_and_older_builds_go_and_others_stay(smollm2_path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGELLM_CACHE", str(cache))
    first = _copy(smollm2_path, tmp_path / "models")
    second, third = first.with_name("second.gguf"), first.with_name("third.gguf")
    os.link(first, second), os.link(first, third)  # three paths: three entries
    of_first, of_second, of_third = (cache_path(path, "fast") for path in (first, second, third))
    for path in (first, second):
        edgellm.load(path).close()
    assert _packed_files(cache) == sorted([of_first, of_second])
    first.unlink()  # a test's temp copy, a model moved away
    older = cache / "packed" / ("0123456789abcdef" * 2 + ".safetensors")  # an older edgellm's entry
    older.write_bytes(b"not a safetensors file of this build")
    partial = cache / "packed" / f".{of_third.name}.x.partial"  # another process mid-write
    partial.write_bytes(b"")
    edgellm.load(third).close()
    assert _packed_files(cache) == sorted([of_second, of_third]) and partial.exists()
    stamp = of_second.stat().st_mtime_ns
    edgellm.load(second).close()
    assert of_second.stat().st_mtime_ns == stamp  # still read, not rewritten


def test_the_entry_is_written_behind_the_load_and_before_the_process_ends(smollm2_path, tmp_path, monkeypatch):
    """A first load returns before its conversions reach the disk: a process that never closes the
    model still leaves the whole entry behind, and a load right after a first one in the same
    process maps the entry rather than converting again."""
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "a"))
    script = f"import edgellm; m = edgellm.load({str(smollm2_path)!r}); print(m.generate('Hi', max_tokens=2).token_ids)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _packed_files(tmp_path / "a") == [cache_path(smollm2_path, "fast")]
    assert not list((tmp_path / "a" / "packed").glob("*.partial"))

    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "b"))
    first, second = edgellm.load(smollm2_path), edgellm.load(smollm2_path)
    assert _views(second.net.lm_head.parts[0].rows, cache_path(smollm2_path, "fast"))
    first.close()
    second.close()
