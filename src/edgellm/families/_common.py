"""What several families share: the Llama block's tensor names, and RoPE parameters as config.json
states them."""
from __future__ import annotations

import math
from typing import Any, Mapping

LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA_LAYER = {k: v for k, v in LLAMA_LAYER.items() if k != "ffn_norm"} | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def rope_spec(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A flat config's RoPE parameters: transformers 5's rope_parameters, or the older rope_scaling."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def llama_like_config(get, config: dict[str, Any], *, qkv_bias: bool = False) -> dict[str, Any]:
    """config.json fields of a Llama-like family written from GGUF metadata."""
    base = float(get("rope.freq_base", 10_000.0))
    return {"hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": base},
            "rope_theta": base, "attention_bias": qkv_bias}


def longrope_attention_factor(context: int, original: int) -> float:
    """LongRoPE's default attention factor for a context `context / original` times the original."""
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
