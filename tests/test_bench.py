"""`edgellm bench` as a user runs it: a real subprocess per engine, JSON out, a PNG plot."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from edgellm.entrypoints.bench.runner import _ratios, _summarize


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm", "bench", *args], capture_output=True, text=True,
                          timeout=600)


def test_bench_json_and_plot(tmp_path, smollm2_path):
    png = tmp_path / "speed.png"
    result = _bench("--model", str(smollm2_path), "--prompt-tokens", "16,32", "--gen-tokens", "8", "--repeat", "2",
                    "--threads", "1,2", "--no-llama-cpp", "--json", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [r["threads"] for r in report["results"]] == [1, 2]
    ours = report["results"][0]["engines"]["edgellm"]
    assert set(ours["by_prompt"]) == {"16", "32"}
    for m in ours["by_prompt"].values():
        assert m["ttft_s"] > 0 and m["prefill_tok_s"] > 0 and m["decode_tok_s"] > 0
    assert ours["peak_rss_mb"] > ours["runtime_rss_mb"] > 50
    assert 0 < ours["load_s"] < ours["cold_start_s"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_profile_lists_op_types(smollm2_path):
    from edgellm import kernels

    result = _bench("--model", str(smollm2_path), "--op-times", "--prompt-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert f"kernels: {kernels.describe()}" in result.stdout  # the variant that ran
    if kernels.available():  # the native decoder layers and head (norm + the Q8_0 head's GEMV) are named
        assert "edgellm::decode_layers" in result.stdout and "edgellm::head" in result.stdout
    else:  # PyTorch's layers: its own ops
        assert "aten::" in result.stdout and "edgellm::" not in result.stdout
    assert "per decode step" in result.stdout


def test_bench_rejects_bad_lists():
    result = _bench("--prompt-tokens", "12,x")
    assert result.returncode == 2 and "comma-separated" in result.stderr


def test_medians_and_ratios_are_computed_from_runs():
    def raw(ttfts, decodes):
        runs = [dict(ttft_s=t, decode_s=d, generated=11) for t, d in zip(ttfts, decodes)]
        return dict(load_s=0.1, cold_start_s=1.0, peak_rss_bytes=300 * 2**20, runtime_rss_bytes=200 * 2**20,
                    runs={"100": runs})
    ours = _summarize([raw([0.1, 0.5, 0.2], [0.1, 1.0, 0.2])], 11)
    assert ours["by_prompt"]["100"]["ttft_s"] == 0.2  # median, not mean
    assert ours["by_prompt"]["100"]["decode_tok_s"] == pytest.approx(50.0)  # 10 steps / 0.2 s
    theirs = _summarize([raw([0.4] * 3, [0.5] * 3)], 11)
    ratio = _ratios(ours, theirs)
    assert ratio["100"]["prefill"] == pytest.approx(2.0) and ratio["100"]["decode"] == pytest.approx(2.5)
    assert ratio["rss_above_runtime_vs_their_peak"] == pytest.approx(100 / 300)


def test_rounds_pool_their_runs_and_keep_the_highest_peak():
    def raw(ttfts, peak_mb, load_s):
        runs = [dict(ttft_s=t, decode_s=1.0, generated=11) for t in ttfts]
        return dict(load_s=load_s, cold_start_s=1.0, peak_rss_bytes=peak_mb * 2**20, runtime_rss_bytes=200 * 2**20,
                    runs={"100": runs})
    pooled = _summarize([raw([0.1, 0.2], 300, 0.5), raw([0.9, 0.3, 0.4], 320, 0.1), raw([0.25, 0.05], 310, 0.2)], 11)
    assert pooled["by_prompt"]["100"]["ttft_s"] == 0.25  # the median of all seven runs
    assert pooled["peak_rss_mb"] == 320 and pooled["load_s"] == 0.2


@pytest.mark.skipif(find_spec("llama_cpp") is None, reason="llama-cpp-python (the bench extra) is not installed")
def test_bench_against_llama_cpp(smollm2_path):
    result = _bench("--model", str(smollm2_path), "--prompt-tokens", "16", "--gen-tokens", "8", "--repeat", "1",
                    "--rounds", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("round 2/2") == 2  # both engines, taking turns
    entry = json.loads(result.stdout)["results"][0]
    assert set(entry["engines"]) == {"edgellm", "llama.cpp"}
    assert entry["ratio_vs_llama_cpp"]["16"]["decode"] > 0


def test_bench_architectures_times_each_family_per_weight_byte_against_llama():
    from edgellm.entrypoints.bench.architectures import architecture_report

    report = architecture_report(("llama", "qwen3", "phi3", "gemma2"), layers=1, rounds=1)
    rows = report["architectures"]
    assert set(rows) == {"llama", "qwen3", "phi3", "gemma2"}
    assert rows["llama"]["decode_per_byte_vs_llama"] == 1.0
    for row in rows.values():
        assert row["weight_mb"] > 0 and row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
        assert row["decode_per_byte_vs_llama"] > 0


def test_bench_speculative_compares_each_prompt_against_plain_decoding(smollm2_path, tmp_path):
    import edgellm
    from edgellm.entrypoints.bench.speculative import _compare, format_speculative

    copy = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog near the river bank. " * 3
             + "Repeat the text above word for word."}]
    with edgellm.load(smollm2_path) as model:
        result = _compare(model, "lookup", [copy, copy], gen_tokens=24, repeat=1, progress=lambda line: None)
    assert result["same_tokens"] and len(result["prompts"]) == 2 and result["drafted_tokens"] > 0
    assert all(p["plain_decode_tokens_per_s"] > 0 and p["speedup"] > 0 for p in result["prompts"])
    table = format_speculative({"model": "m", "gen_tokens": 24, "repeat": 1,
                                "workloads": {"lookup": result, "self": result | {"early_exit_agreement": {15: 0.1},
                                                                                  "layers": 30}}})
    assert "geometric mean" in table and "15/30 layers 10%" in table
    from edgellm.entrypoints.bench.speculative import plot_speculative

    png = plot_speculative({"model": "m", "gen_tokens": 24, "workloads": {"lookup": result}}, tmp_path / "spec.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_footprint_measures_the_install_the_import_and_a_whole_run(smollm2_path):
    result = _bench("--footprint", "--model", str(smollm2_path), "--repeat", "1", "--threads", "1", "--no-llama-cpp",
                    "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    ours = report["engines"]["edgellm"]
    assert {"edgellm", "numpy", "jinja2"} <= set(ours["by_distribution"])
    assert "pytest" not in ours["by_distribution"] and "transformers" not in ours["by_distribution"]  # extras' only
    assert ours["installed_mb"] == pytest.approx(sum(ours["by_distribution"].values()))
    assert 0 < ours["import_s"] < 60
    [run] = report["runs"]
    assert run["model"] == str(smollm2_path) and set(run["engines"]) == {"edgellm"}
    assert run["engines"]["edgellm"]["wall_s"] > 0 and run["engines"]["edgellm"]["peak_rss_mb"] > 50


def test_bench_serve_memory_samples_a_real_servers_rss_and_kv_gauges(smollm2_path):
    """A real `edgellm serve` answers distinct prompts; each sample reads its RSS and /metrics' KV gauges,
    which grow as the prefix cache keeps each prompt's blocks, and the report sets RSS growth beside them."""
    result = _bench("--serve-memory", "5", "--model", str(smollm2_path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    first, last = report["samples"][0], report["samples"][-1]
    assert report["requests"] == 5 and first["requests"] == 1 and last["requests"] == 5
    assert last["kv_mib"] > first["kv_mib"] > 0 and last["prefix_cache_mib"] > first["prefix_cache_mib"]
    assert first["rss_mib"] > 50
    assert report["accounted_growth_mib"] == pytest.approx(last["kv_mib"] - first["kv_mib"], abs=0.2)
    assert report["rss_growth_mib"] == pytest.approx(last["rss_mib"] - first["rss_mib"], abs=0.2)


def test_bench_store_times_pulls_and_hot_swaps(smollm2_path, gemma3_path):
    result = _bench("--store", "-m", "smollm2-135m,gemma3-270m", "--repeat", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [p["model"] for p in report["pull"]] == ["smollm2-135m", "gemma3-270m"]
    assert report["pull"][0]["bytes"] == smollm2_path.stat().st_size
    assert all(p["mb_per_s"] > 0 and 0 < p["download_s"] <= p["seconds"] for p in report["pull"])
    assert [s["model"] for s in report["swap"]] == ["smollm2-135m", "gemma3-270m"]
    assert all(s["load_s"] > 0 and s["canary_s"] > 0 and s["switch_s"] >= 0 for s in report["swap"])


def test_bench_embeddings_counts_vectors_a_second(smollm2_path):
    result = _bench("--embeddings", "-m", "smollm2-135m", "--repeat", "1", "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)["results"][0]
    assert row["model"] == "smollm2-135m" and row["dimensions"] == 576
    assert row["long"]["tokens_per_text"] > row["short"]["tokens_per_text"] > 0
    assert row["short"]["texts_per_s"] > row["long"]["texts_per_s"] > 0
