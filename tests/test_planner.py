"""The memory planner and the budget it sets, on the real model files."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import edgellm
from edgellm.errors import InvalidRequest, OutOfMemoryBudget
from edgellm.kv import KVConfig
from edgellm.api.planner import parse_bytes, plan_file


@pytest.mark.parametrize("text, value", [("1.5GB", int(1.5 * 2**30)), ("800MB", 800 * 2**20), ("512MiB", 512 * 2**20),
                                         ("2g", 2 * 2**30), ("1000", 1000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_nonsense():
    with pytest.raises(InvalidRequest):
        parse_bytes("lots")


def test_kv_bytes_per_token_follow_the_formula(smollm2_path, gemma3_path):
    smol = {o.precision: o.bytes_per_token for o in plan_file(smollm2_path, "4GB").options}
    assert smol["f16"] == 2 * 30 * 3 * 64 * 2  # 2 x layers x kv_heads x head_dim x bytes
    gemma = plan_file(gemma3_path, "4GB")
    assert {o.precision: o.bytes_per_token for o in gemma.options}["f16"] == 2 * 3 * 1 * 256 * 2  # 3 global layers
    assert gemma.context_length == 32768 and gemma.kv_precision == "f16"


def test_tight_budget_picks_lower_kv_precision_and_says_so(smollm2_path):
    result = plan_file(smollm2_path, "600MB")
    assert result.fits and result.kv_precision in ("int8", "int4")
    assert result.context_length == 8192
    total = (result.runtime_bytes + result.weights_bytes + result.tokenizer_bytes + result.scratch_bytes
             + result.margin_bytes + result.kv_bytes)
    assert total <= result.budget_bytes


def test_too_small_budget_does_not_fit_and_says_what_would(gemma3_path):
    result = plan_file(gemma3_path, "500MB")
    assert not result.fits and result.context_length == 0
    assert "does not fit" in result.advice[0] and "MiB" in result.advice[0]


def test_load_with_budget_enforces_it(smollm2_path):
    with edgellm.load(smollm2_path, memory_budget="600MB") as model:
        assert model.kv.config.budget_bytes is not None and model.kv.config.k_precision != "f16"
        assert model.generate("Hello", max_tokens=4).finish_reason == "length"
    with pytest.raises(OutOfMemoryBudget):
        edgellm.load(smollm2_path, memory_budget="300MB")


def test_request_over_the_kv_budget_is_refused_before_any_work(smollm2_path):
    with edgellm.load(smollm2_path, kv=KVConfig(budget_bytes=3 * 2**20)) as model:
        with pytest.raises(OutOfMemoryBudget) as info:
            model.generate("word " * 300, max_tokens=50)
        assert info.value.needed_bytes > info.value.available_bytes
        assert model.kv.live_bytes == 0  # nothing was taken
        assert model.generate("Hi", max_tokens=4).token_ids  # small requests still run


def test_plan_cli(smollm2_path, gemma3_path):
    ok = subprocess.run([sys.executable, "-m", "edgellm", "plan", "--memory", "1GB", "--model", str(smollm2_path),
                         "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["fits"] is True
    no = subprocess.run([sys.executable, "-m", "edgellm", "plan", "--memory", "500MB", "--model", "gemma3-270m"],
                        capture_output=True, text=True)
    assert no.returncode == 6 and "does NOT fit" in no.stdout and "smollm2-135m" in no.stdout


def test_run_with_kv_flags(smollm2_path):
    out = subprocess.run([sys.executable, "-m", "edgellm", "run", "Hi", "--model", str(smollm2_path), "-n", "4",
                          "--kv-precision", "int8:int4", "--kv-window", "128"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    bad = subprocess.run([sys.executable, "-m", "edgellm", "run", "Hi", "--kv-precision", "int3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "int3" in bad.stderr
