"""Fit a model into a RAM budget: from the file's real tensor sizes, the runtime baseline,
per-token KV bytes and a safety margin, choose the longest context and the KV precision
that fit — or say plainly that it does not fit and what would.

    total = runtime + weights + tokenizer + scratch + KV(tokens, precision) + margin
    KV    = Σ_global layers 2 · kv_heads · head_dim · bytes(precision) · tokens + Σ_ring layers (window)"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgellm.errors import InvalidRequest
from edgellm.extras import has_torch
from edgellm.io.gguf import GGUFFile
from edgellm.kv.config import KVConfig, fixed_kv_bytes, kv_bytes_per_token
from edgellm.models import layer_specs
from edgellm.quant.ggml import AFFINE_BITS, INT4_TYPES, GGMLType

RUNTIME_BASELINE = 240 * 2**20  # Python + torch, measured 232 MB here (`edgellm bench` reports it)
# Python, numpy, the server's modules and the kernels: a core install, measured 70 MB
CORE_RUNTIME = 80 * 2**20


def runtime_baseline() -> int:
    """What a process holds before any weights: with torch where it can be imported (a long prompt's
    PyTorch layers import it), else the core's."""
    return RUNTIME_BASELINE if has_torch() else CORE_RUNTIME
MARGIN = 0.10  # of the budget, for allocator slack and what estimates miss
PRECISIONS = ("f16", "int8", "int4")  # best quality first (f32 KV doubles f16's bytes for ~no gain)
MIN_USEFUL_CONTEXT = 512
PREFILL_CHUNK = 512


def parse_bytes(text: str | int) -> int:
    """'1.5GB', '800MB', '512MiB', '2g' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?b?)\s*", str(text).lower())
    if not match:
        raise InvalidRequest(f"cannot read {text!r} as a size (e.g. 1.5GB, 800MB)")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit or " "))


def weight_bytes(source: GGUFFile) -> int:
    """Resident bytes of the weights as edgellm holds them in fast mode (see quant/linear.py):
    4-bit formats packed, Q8_0 / Q5_0 / Q6_K read in place from the file (quant/blocks.py, all their
    pages resident; Q5_0 widened to Q8_0 on AVX2), other 5-8-bit ones as two planes, others bf16; the embedding stays mapped."""
    from edgellm.quant.blocks import BlockLinear, widens_q5_0

    total, head = 0, "output.weight" if "output.weight" in source.tensors else "token_embd.weight"
    for name, t in source.tensors.items():
        if name == "token_embd.weight" and head != name:
            continue  # looked up row by row from the mapping
        if BlockLinear.supports(t.ggml_type, t.shape):
            total += t.nbytes * 34 // 22 if t.ggml_type == GGMLType.Q5_0 and widens_q5_0() else t.nbytes
            continue
        if len(t.shape) == 1:
            total += t.n_elements * 4
            continue
        n, k = t.shape[0], t.n_elements // t.shape[0]
        if hasattr(t, "scheme"):  # edgellm's own schemes run as stored
            total += t.nbytes
        elif t.ggml_type in INT4_TYPES:
            total += n * k // 2 + (k // 32) * n * 4
        elif t.ggml_type in AFFINE_BITS:
            total += n * k + (2 * k // 32) * n * 4
        else:
            total += n * k * 2
    return total


def tokenizer_bytes(source: GGUFFile) -> int:
    meta = source.metadata
    vocab = meta if meta.get("tokenizer.ggml.tokens") else (getattr(source, "gguf_vocab", None) or {})
    if vocab.get("tokenizer.ggml.model") in ("llama", "gpt2"):
        # edgellm's own encoders over the GGUF's vocabulary (and merges), measured on Gemma 3 and
        # SmolLM2: 26-43 B/token live, 86-110 at the peak while loading.
        return vocab_size(source) * 128
    # Measured in the tokenizers library: SmolLM2's byte-level BPE (49k tokens) ~30 MB; a
    # tokenizer.json SentencePiece BPE (Gemma's 262k tokens, 515k merges) ~290 MB.
    sentencepiece = meta.get("tokenizer.ggml.model") == "llama"
    return vocab_size(source) * (1100 if sentencepiece else 620)


def vocab_size(source) -> int:
    """From the GGUF's token list, else (HF folders, quantized files) the embedding's rows."""
    tokens = source.metadata.get("tokenizer.ggml.tokens")
    if tokens:
        return len(tokens)
    embedding = source.tensors.get("token_embd.weight")
    return embedding.shape[0] if embedding is not None else 0


def scratch_bytes(source: GGUFFile) -> int:
    """Activations of one prefill chunk (fp32, a few live at once) plus one row of logits."""
    meta, arch = source.metadata, source.metadata.get("general.architecture")
    hidden = int(meta.get(f"{arch}.embedding_length", 0))
    ffn = int(meta.get(f"{arch}.feed_forward_length", 0))
    vocab = vocab_size(source)
    return PREFILL_CHUNK * (hidden * 4 + ffn * 3) * 4 * 2 + vocab * 4 * 2


@dataclass
class KVOption:
    precision: str
    bytes_per_token: int
    max_context: int  # tokens the budget allows, capped at the model's context


@dataclass
class MemoryPlan:
    model: str
    budget_bytes: int
    fits: bool
    context_length: int  # chosen
    kv_precision: str | None
    runtime_bytes: int
    weights_bytes: int
    tokenizer_bytes: int
    scratch_bytes: int
    margin_bytes: int
    adapter_bytes: int  # resident LoRA adapters (lora.resident_bytes)
    kv_bytes: int  # at the chosen context
    model_context: int
    options: list[KVOption] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def kv_budget_bytes(self) -> int:
        """What is left for KV once everything else is paid for."""
        fixed = self.runtime_bytes + self.weights_bytes + self.tokenizer_bytes + self.scratch_bytes + self.adapter_bytes
        return self.budget_bytes - self.margin_bytes - fixed

    def as_dict(self) -> dict:
        return asdict(self) | {"kv_budget_bytes": self.kv_budget_bytes}


def plan(source: GGUFFile, budget: int | str, *, runtime_bytes: int | None = None,
         want_context: int | None = None, name: str | None = None, adapter_bytes: int = 0) -> MemoryPlan:
    """The context and KV precision that fit `budget` beside the runtime, the weights, the
    tokenizer, scratch and `adapter_bytes` of resident LoRA adapters."""
    budget_bytes = parse_bytes(budget)
    runtime_bytes = runtime_baseline() if runtime_bytes is None else runtime_bytes
    meta = source.metadata
    model_context = int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048))
    target = min(want_context or model_context, model_context)
    result = MemoryPlan(model=name or str(source.path), budget_bytes=budget_bytes, fits=False, context_length=0,
                        kv_precision=None, runtime_bytes=runtime_bytes, weights_bytes=weight_bytes(source),
                        tokenizer_bytes=tokenizer_bytes(source), scratch_bytes=scratch_bytes(source),
                        margin_bytes=int(budget_bytes * MARGIN), adapter_bytes=adapter_bytes, kv_bytes=0,
                        model_context=model_context)
    specs = layer_specs(meta)
    for precision in PRECISIONS:
        config = KVConfig(k_precision=precision, v_precision=precision)
        per_token = kv_bytes_per_token(specs, config)
        room = result.kv_budget_bytes - fixed_kv_bytes(specs, config)
        result.options.append(KVOption(precision, per_token, max(0, min(target, room // max(per_token, 1)))))
    _choose(result, target, specs)
    return result


def _choose(result: MemoryPlan, target: int, specs) -> None:
    # The best precision that holds the whole wanted context; else the longest context.
    full = [o for o in result.options if o.max_context >= target]
    best = full[0] if full else max(result.options, key=lambda o: o.max_context)
    if best.max_context >= min(MIN_USEFUL_CONTEXT, target):
        result.fits, result.context_length, result.kv_precision = True, best.max_context, best.precision
        config = KVConfig(k_precision=best.precision, v_precision=best.precision)
        result.kv_bytes = best.bytes_per_token * best.max_context + fixed_kv_bytes(specs, config)
    if not result.fits:
        fixed = result.budget_bytes - result.margin_bytes - result.kv_budget_bytes
        smallest = result.options[-1].bytes_per_token * min(MIN_USEFUL_CONTEXT, target)
        needed = (fixed + smallest) / (1 - MARGIN)
        result.advice.append(f"does not fit: runtime, weights, tokenizer, scratch and adapters alone take "
                             f"{fixed / 2**20:.0f} MiB; "
                             f"with int4 KV and {min(MIN_USEFUL_CONTEXT, target)} tokens it needs about "
                             f"{needed / 2**20:.0f} MiB — give it more memory or choose a smaller model")
    elif not full:
        top = result.options[0]
        result.advice.append(f"the full {target}-token context needs {top.bytes_per_token * target / 2**20:.0f} MiB "
                             f"of {top.precision} KV; {best.precision} KV reaches {best.max_context} tokens in this budget")
    if result.fits and best.precision in ("int8", "int4"):
        result.advice.append(f"{best.precision} KV trades some quality for length (measured in docs/memory.md)")


def plan_file(path: str | Path, budget: int | str, **kwargs) -> MemoryPlan:
    from edgellm.io import open_model

    with open_model(path) as source:
        return plan(source, budget, **kwargs)


def draft_bytes(source: GGUFFile, context: int, kv_precision: str) -> int:
    """What a speculative draft model adds beside its target: its weights, tokenizer and scratch
    (the runtime is shared) and its KV for the target's context at the target's precision."""
    config = KVConfig(k_precision=kv_precision, v_precision=kv_precision)
    specs = layer_specs(source.metadata)
    kv = kv_bytes_per_token(specs, config) * context + fixed_kv_bytes(specs, config)
    return weight_bytes(source) + tokenizer_bytes(source) + scratch_bytes(source) + kv
