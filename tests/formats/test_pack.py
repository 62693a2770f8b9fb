"""The packed-weight cache: a second load maps converted linears instead of converting,
and produces exactly the same model; a damaged cache is rebuilt."""
from __future__ import annotations

import torch

import edgellm
from edgellm.quant.linear import Int4Linear


def _packed_files(root):
    return sorted((root / "packed").glob("*.safetensors"))


def test_second_load_uses_the_cache_and_matches(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    first = edgellm.load(smollm2_path)
    (cache_file,) = _packed_files(tmp_path)
    reference = first.generate("The lighthouse keeper", max_tokens=12).token_ids
    logits = first.logits([1, 2, 3, 4])
    first.close()
    stamp = cache_file.stat().st_mtime_ns

    second = edgellm.load(smollm2_path)
    assert cache_file.stat().st_mtime_ns == stamp  # read, not rewritten
    assert any(isinstance(m, Int4Linear) for m in second.net.modules())
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
