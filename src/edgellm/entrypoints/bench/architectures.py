"""`edgellm bench --architectures`: decode and prefill speed of every supported architecture on
the same machine, per weight byte, against the Llama architecture.

No real checkpoints exist here for most families, and none is needed to time them: each is
written as a synthetic GGUF of one size (SmolLM2's layer shapes, random Q8_0 weights, the
family's own tensors: biases, q/k norms, fused projections, extra norms), loaded and timed like
any model. Decode reads every weight once per token, so tok/s x weight bytes is the speed a
family gets out of memory bandwidth; the ratio to Llama's says what its variations cost."""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import numpy as np

from edgellm import families
from edgellm.entrypoints.bench.shapes import byte_vocabulary

ARCHITECTURES = families.names()
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 576, 9, 3, 64, 1536, 32_000


def write_synthetic(path: Path, arch: str, layers: int = 12, seed: int = 0) -> Path:
    """A random-weight GGUF of `arch` with SmolLM2's layer shapes (Q8_0 matrices)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_key_length, HEAD_DIM), (writer.add_value_length, HEAD_DIM),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 10000.0)):
        add(value)
    family = families.get(arch)
    if family.runner == "gemma":
        writer.add_sliding_window(4096)
    if "attn_logit_softcapping" in family.config_keys:  # Gemma 2's caps
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    byte_vocabulary(writer, VOCAB)
    for name, shape in _tensor_shapes(arch, layers):
        if len(shape) == 1:
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            w = (0.05 * rng.standard_normal(shape)).astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensor_shapes(arch: str, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and (rows, columns) shapes of `arch`, as llama.cpp's converter names them."""
    shapes = [("token_embd.weight", (VOCAB, HIDDEN)), ("output_norm.weight", (HIDDEN,))]
    for i in range(layers):
        shapes += families.get(arch).block_tensors(i, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN)
    return shapes


def weight_bytes(path: Path) -> int:
    """Bytes of the weights one decode step reads: every matrix (the tied head is the embedding)."""
    from edgellm.io.gguf import open_gguf

    with open_gguf(path) as f:
        return sum(info.nbytes for info in f.tensors.values())


def time_model(path: Path, prompt_tokens: int = 128, gen_tokens: int = 32, repeat: int = 3) -> dict:
    """Median prefill and decode tok/s of one model file (fast mode, greedy, EOS ignored)."""
    import torch

    import edgellm
    from edgellm.kv import KVConfig

    prompt = list(np.random.default_rng(1).integers(3, 259, prompt_tokens))
    prefill, decode = [], []
    with edgellm.load(str(path), kv=KVConfig(prefix_cache_bytes=0)) as model, torch.inference_mode():
        model.generate(prompt[:16], max_tokens=4, ignore_eos=True)  # warm-up: kernels, buffers
        for _ in range(repeat):
            done = model.generate(prompt, max_tokens=gen_tokens, ignore_eos=True)
            prefill.append(prompt_tokens / done.timings.prefill_s)
            decode.append((len(done.token_ids) - 1) / done.timings.decode_s)
    return dict(prefill_tok_s=round(statistics.median(prefill), 1), decode_tok_s=round(statistics.median(decode), 1))


def architecture_report(architectures=ARCHITECTURES, layers: int = 12, rounds: int = 3,
                        progress=lambda line: None) -> dict:
    """Per architecture: weight MB, prefill and decode tok/s (medians over `rounds` in which the
    families take turns: a shared host's speed drifts by ±15 % over minutes), and decode / prefill
    speed per weight byte relative to Llama's."""
    runs: dict[str, list[dict]] = {arch: [] for arch in architectures}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {arch: write_synthetic(Path(tmp) / f"{arch}.gguf", arch, layers) for arch in architectures}
        for r in range(rounds):
            for arch, path in paths.items():
                runs[arch].append(time_model(path))
                progress(f"round {r + 1}/{rounds} {arch}: {runs[arch][-1]}")
        rows = {arch: dict(weight_mb=round(weight_bytes(paths[arch]) / 2**20, 1),
                           **{k: statistics.median(run[k] for run in runs[arch]) for k in runs[arch][0]})
                for arch in architectures}
    base = rows.get("llama")
    if base is not None:
        for row in rows.values():
            for kind in ("decode", "prefill"):
                per_byte = row[f"{kind}_tok_s"] * row["weight_mb"]
                row[f"{kind}_per_byte_vs_llama"] = round(per_byte / (base[f"{kind}_tok_s"] * base["weight_mb"]), 3)
    return dict(layers=layers, shapes=dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                           ffn=FFN, vocab=VOCAB), weights="Q8_0", architectures=rows)
