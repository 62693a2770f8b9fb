"""Resident memory follows the tokens held, never the configured maximum context.
Each measurement runs in a fresh process (bench.memory_report)."""
from __future__ import annotations

from edgellm.entrypoints.bench.memory import kv_decode_speed, memory_report

MiB = 2**20


def test_rss_does_not_depend_on_configured_context_and_kv_grows_by_blocks(smollm2_path):
    small = memory_report(str(smollm2_path), precisions=("int8",), contexts=(10, 100), context_length=512)
    large = memory_report(str(smollm2_path), precisions=("int8",), contexts=(10, 100), context_length=8192)
    (s10, s100), (l10, l100) = small["curves"][0]["points"], large["curves"][0]["points"]
    block = s10["kv_bytes"]  # one 32-token block at 10 tokens
    assert s100["kv_bytes"] == l100["kv_bytes"] == 4 * block  # 100 tokens -> 4 blocks, whatever the maximum
    # same RSS whether the maximum is 512 or 8192 tokens (within one block + allocator noise)
    assert abs(l100["rss_bytes"] - s100["rss_bytes"]) <= block + 3 * MiB
    assert abs(l10["rss_bytes"] - s10["rss_bytes"]) <= block + 3 * MiB
    # each point also times decode after that context with that KV precision
    assert all(p["decode_tokens_per_s"] > 0 for p in (s10, s100, l10, l100))


def test_kv_decode_speed_reports_each_precision_against_the_first(smollm2_path):
    report = kv_decode_speed(str(smollm2_path), precisions=("f16", "int8"), contexts=(40,), tokens=4, rounds=1)
    (point,) = report["points"]
    assert point["tokens"] == 40 and point["ratio"]["f16"] == 1.0
    assert point["decode_tokens_per_s"]["int8"] > 0 and point["ratio"]["int8"] > 0
