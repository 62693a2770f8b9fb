"""`edgellm bench --sizes` and what it found: random-weight models of real shapes, the machine's
read bandwidth, and llama.cpp's Q4_K_M mix of Q4_K and Q6_K within one fused projection."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest

import edgellm
from edgellm.entrypoints.bench.shapes import SHAPES, Shape, parameter_count, tensor_shapes, write_random_q8_0
from edgellm.entrypoints.bench.sizes import decode_bytes, read_bandwidth
from edgellm.io.gguf import open_gguf
from edgellm.models.native.decoder import FusedDecoder
from edgellm import kernels
from edgellm.models.native.structs import linears, projection, weight_parts
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.ggml import GGMLType
from edgellm.quant.linear import Int4Linear
from edgellm.quant.packed import ConcatLinear
from tests.quant import reference

TINY = Shape("qwen2", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=512)


def test_the_shapes_are_the_models_people_deploy():
    billions = {name: parameter_count(shape) / 1e9 for name, shape in SHAPES.items()}
    assert 0.45 < billions["qwen2.5-0.5b"] < 0.55 and 1.4 < billions["qwen2.5-1.5b"] < 1.6
    assert 1.1 < billions["llama-3.2-1b"] < 1.3 and 7.9 < billions["llama-3.1-8b"] < 8.1
    assert 0.95 < billions["gemma-3-1b"] < 1.05


def test_a_random_model_has_the_shapes_tensors_and_trained_like_weights(tmp_path):
    path = write_random_q8_0(tmp_path / "tiny.gguf", TINY)
    with open_gguf(path) as f:
        shapes = {name: tuple(info.shape) for name, info in f.tensors.items()}
        q = f.raw("blk.0.attn_q.weight")
    expected = dict(tensor_shapes(TINY))
    assert set(shapes) == set(expected) and all(sorted(shapes[n]) == sorted(expected[n]) for n in expected)
    weights = np.array(reference.decode("Q8_0", bytes(np.asarray(q))))
    assert 0.015 < weights.std() < 0.025 and abs(weights.mean()) < 1e-3
    assert decode_bytes(path) == sum(info.nbytes for info in open_gguf(path).tensors.values())
    with edgellm.load(str(path)) as model:  # tied: the head reads the embedding
        done = model.generate(list(range(3, 40)), max_tokens=8, ignore_eos=True)
    assert len(done.token_ids) == 8


def _k_blocks(fmt: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, int]:
    """Random `fmt` blocks with scales that keep the weights near trained ones' size."""
    raw = np.frombuffer(reference.random_tensor(fmt, rows * cols, random.Random(seed)), np.uint8).copy()
    blocks = raw.reshape(-1, {"Q4_K": 144, "Q6_K": 210}[fmt])
    if fmt == "Q4_K":
        blocks[:, 0:4] = np.frombuffer(np.array([1e-4, 1e-4], np.float16).tobytes(), np.uint8)
    else:
        blocks[:, 208:210] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return blocks.reshape(rows, -1), int(GGMLType[fmt])


def test_a_fused_projection_of_q4_k_and_q6_k_parts_runs_each_on_its_kernel(tmp_path):
    """llama.cpp's Q4_K_M keeps attn_v in Q6_K on some layers: q, k and v then need two kernels. Fused
    into one linear they became dense bf16 (the core without torch could not load them at all)."""
    blocks = {}
    for layer in range(TINY.layers):
        for name, fmt in (("attn_q", "Q4_K"), ("attn_k", "Q4_K"), ("attn_v", "Q6_K"), ("ffn_down", "Q6_K")):
            rows, cols = dict(tensor_shapes(TINY))[f"blk.{layer}.{name}.weight"]
            blocks[f"blk.{layer}.{name}.weight"] = _k_blocks(fmt, rows, cols, seed=layer)
    path = write_random_q8_0(tmp_path / "mixed.gguf", TINY, blocks=blocks)
    prompt = list(range(3, 60))
    with edgellm.load(str(path), mode="exact") as exact, edgellm.load(str(path), mode="fast") as fast:
        qkv = fast.net.blocks[0].attn.qkv_proj
        assert isinstance(qkv, ConcatLinear) and qkv.out_splits == [256, 128, 128]
        assert [type(p) for p in qkv.parts] == [Int4Linear, BlockLinear]
        assert projection(qkv).count == 2
        lib = kernels.library()
        for block in fast.net.blocks:  # the Q6_K parts in the int8 prompt GEMM's form for Q6_K (int8_layout.h)
            q6 = [p for m in linears(block) for p in weight_parts(m) if p.kind == GGMLType.Q6_K]
            assert len(q6) == 2 and all(p.int8_form == 6 for p in q6)
            assert all(lib.edgellm_int8_gemm_takes(p.int8_form) for p in q6) == bool(lib.edgellm_int8_gemm_native())
        assert FusedDecoder.build(fast.net, "fast") is not None  # the native layers take it
        want, got = exact.logits(prompt)[-1], fast.logits(prompt)[-1]
        assert np.abs(np.asarray(got) - np.asarray(want)).max() < 0.02 * np.abs(np.asarray(want)).max()
        first = fast.generate(prompt, max_tokens=6, ignore_eos=True).token_ids
        assert exact.generate(prompt, max_tokens=1, ignore_eos=True).token_ids[0] == first[0]


def test_read_bandwidth_is_measured_per_thread_count():
    one, two = read_bandwidth(1, passes=3), read_bandwidth(2, passes=3)
    assert one["threads"] == 1 and two["threads"] == 2
    assert 0.5 < one["median_gb_s"] <= one["best_gb_s"] < 2000


def _sizes(*args: str, cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm", "bench", *args], capture_output=True, text=True,
                          timeout=900, env={**__import__("os").environ, "EDGELLM_CACHE": str(cache)})


def test_bench_sizes_unknown_shape_is_a_clear_error(tmp_path):
    proc = _sizes("--sizes", "qwen9-1t", cache=tmp_path)
    assert proc.returncode != 0 and "unknown shape 'qwen9-1t'" in proc.stderr and "qwen2.5-0.5b" in proc.stderr


@pytest.mark.slow
def test_bench_sizes_times_a_real_sized_model_against_the_bandwidth(tmp_path):
    plot = tmp_path / "sizes.png"
    proc = _sizes("--sizes", "qwen2.5-0.5b", "--weight-types", "Q8_0", "--no-llama-cpp", "--prompt-tokens", "16",
                  "--gen-tokens", "8", "--repeat", "1", "--threads", "2", "--json", "--plot", str(plot), cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    (entry,) = report["results"]
    assert entry["shape"] == "qwen2.5-0.5b" and entry["weight_type"] == "Q8_0"
    assert 500 < entry["decode_bytes_mb"] < 700  # 494M parameters at 8.5 bits
    ours = entry["engines"]["edgellm"]
    assert 0.05 < ours["bandwidth_fraction"] < 2 and entry["first_load"]["load_s"] > 0
    assert report["bandwidth"]["median_gb_s"] > 0 and plot.stat().st_size > 10_000
    assert (tmp_path / "shapes" / "qwen2.5-0.5b-random-Q8_0.gguf").exists()  # made once, cached
    proc = _sizes("--sizes", "qwen2.5-0.5b", "--weight-types", "Q8_0", "--context", "64,128", "--gen-tokens", "4",
                  "--no-llama-cpp", "--threads", "2", "--json", "--plot", str(tmp_path / "context.png"), cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["results"][0]["context"]
    assert [(r["context"], r["kv"]) for r in rows] == [(64, "f16"), (64, "int8"), (128, "f16"), (128, "int8")]
    assert all(r["edgellm"]["decode_tok_s"] > 0 for r in rows) and (tmp_path / "context.png").exists()
