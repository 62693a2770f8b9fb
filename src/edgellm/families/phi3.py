"""Phi-3 / 3.5 mini and Phi-4-mini: q|k|v and gate|up fused in the file, LongRoPE with its attention
factor, a sliding window over every layer, and (Phi-4-mini) RoPE over only part of each head."""
from __future__ import annotations

from typing import Any, Mapping

from edgellm.families import Family
from edgellm.families._common import longrope_attention_factor, rope_spec

LAYER = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# a tiny model's LongRoPE: a context 4x the original one (so an attention factor applies); the short
# factors are what runs at a test's few dozen tokens
TINY_CONTEXT, TINY_ORIGINAL = 256, 64


def _metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    """The sliding window and LongRoPE as llama.cpp's converter records them (the factors, tensors
    in a GGUF, as lists here), and a partial rotation's dims."""
    meta: dict[str, Any] = {"phi3.attention.sliding_window": config.get("sliding_window") or 0}
    share = float(config.get("partial_rotary_factor", rope_spec(config).get("partial_rotary_factor", 1.0)))
    if share != 1.0:  # Phi-4-mini rotates 3/4 of each head
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        meta["phi3.rope.dimension_count"] = int(head_dim * share)
    spec = rope_spec(config)
    if spec.get("rope_type", spec.get("type")) in ("longrope", "su"):
        original = int(spec.get("original_max_position_embeddings", config.get("original_max_position_embeddings")))
        factor = spec.get("attention_factor") or longrope_attention_factor(config["max_position_embeddings"], original)
        meta |= {"phi3.rope.scaling.original_context_length": original, "phi3.rope.scaling.attn_factor": float(factor),
                 "phi3.rope.scaling.short_factor": [float(x) for x in spec["short_factor"]],
                 "phi3.rope.scaling.long_factor": [float(x) for x in spec["long_factor"]]}
    return meta


def _runtime(get, wanted: int | None) -> dict[str, Any]:
    """The sliding window and LongRoPE. Like llama.cpp, the factors follow the context the model is
    loaded for: the short ones within the original context (the default: the range on-device
    prompts live in, and transformers' choice for them), the long ones beyond it."""
    window = int(get("attention.sliding_window", 0) or 0)
    fields: dict[str, Any] = {"sliding_window": window or None}
    original = get("rope.scaling.original_context_length")
    if original is not None:
        original, full = int(original), int(get("context_length", original))
        kind = "long" if wanted is not None and wanted > original else "short"
        fields["longrope"] = (original, float(get("rope.scaling.attn_factor", 1.0)), kind)
        fields["context_length"] = full if kind == "long" else min(full, original)
        listed = get(f"rope.scaling.{kind}_factor")
        fields["longrope_factors"] = None if listed is None else tuple(float(x) for x in listed)
    return fields


def tiny_rope(head_dim: int, partial_rotary: float = 1.0) -> dict[str, Any]:
    """A tiny model's LongRoPE parameters, as transformers takes them."""
    pairs = int(head_dim * partial_rotary) // 2
    return {"rope_type": "longrope", "original_max_position_embeddings": TINY_ORIGINAL,
            "short_factor": [1.0 + 0.3 * i for i in range(pairs)], "long_factor": [4.0] * pairs}


def _tiny_metadata(head_dim: int, sliding_window: int = 8, partial_rotary: float = 1.0, **_) -> dict[str, Any]:
    """What llama.cpp's converter writes for the tiny model (the factors go in as tensors)."""
    return {"phi3.attention.sliding_window": sliding_window,
            "phi3.rope.scaling.original_context_length": TINY_ORIGINAL,
            "phi3.rope.scaling.attn_factor": longrope_attention_factor(TINY_CONTEXT, TINY_ORIGINAL),
            "phi3.rope.dimension_count": int(head_dim * partial_rotary)}


def _tiny_tensors(head_dim: int, partial_rotary: float = 1.0, **_) -> dict[str, Any]:
    """LongRoPE's factors, which llama.cpp's converter writes as tensors."""
    import numpy as np

    rope = tiny_rope(head_dim, partial_rotary)
    return {f"rope_factors_{kind}.weight": np.array(rope[f"{kind}_factor"], dtype=np.float32) for kind in ("short", "long")}


def _tiny_hf_config(head_dim: int, sliding_window: int = 8, partial_rotary: float = 1.0, **_) -> dict[str, Any]:
    return {"max_position_embeddings": TINY_CONTEXT, "sliding_window": sliding_window,
            "original_max_position_embeddings": TINY_ORIGINAL,
            "rope_parameters": {"rope_theta": 10000.0, **tiny_rope(head_dim, partial_rotary),
                                "partial_rotary_factor": partial_rotary},
            "partial_rotary_factor": partial_rotary, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 0}


FAMILY = Family(
    arch="phi3", model_type="phi3", hf_class="Phi3ForCausalLM", hf_config_class="Phi3Config", runner="llama",
    layer_names=LAYER,
    writable=False,  # LongRoPE is not written back yet
    metadata_from_config=_metadata,
    runtime=_runtime,
    tiny_metadata=_tiny_metadata,
    tiny_tensors=_tiny_tensors,
    tiny_hf_config=_tiny_hf_config,
    tiny_vocab="phi-3",
)
