"""How Hugging Face checkpoints name things, next to how GGUF (and so edgellm) names them.

Two tables, both directions: tensor names (`model.layers.3.self_attn.q_proj.weight` <->
`blk.3.attn_q.weight`) and config.json fields (`hidden_size` <-> `llama.embedding_length`).
Models only ever see GGUF names; readers and writers translate at the file's edge."""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

from edgellm.errors import UnsupportedModel

# model_type in config.json -> (GGUF architecture, HF class for `architectures`)
MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
}
GGUF_TO_MODEL_TYPE = {arch: model_type for model_type, (arch, _) in MODEL_TYPES.items()}

# Conventions of llama.cpp's converter that differ from the Hugging Face checkpoint: these
# architectures' q/k rows are interleaved per head for its RoPE, these store norms as (1 + w).
PERMUTED_QK = frozenset({"llama", "smollm3"})
NORMS_PLUS_ONE = frozenset({"gemma2", "gemma3"})

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_LAYER = {
    "llama": _LAYER_COMMON | {"ffn_norm": "post_attention_layernorm"},
    "qwen2": _LAYER_COMMON | {"ffn_norm": "post_attention_layernorm"},
    "qwen3": _LAYER_COMMON | {"ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
                              "attn_k_norm": "self_attn.k_norm"},
    "smollm3": _LAYER_COMMON | {"ffn_norm": "post_attention_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "gemma2": _LAYER_COMMON | {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "gemma3": _LAYER_COMMON | {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
}

_GGUF_NAME = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|bias)$")
_HF_NAME = re.compile(r"^(?:model\.layers\.(\d+)\.)?(.+)\.(weight|bias)$")


def hf_name(arch: str, gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    m = _GGUF_NAME.match(gguf_name)
    if m is None:
        return None
    layer, part, kind = m.groups()
    if layer is None:
        base = _GLOBAL.get(part)
        return None if base is None else f"{base}.{kind}"
    base = _LAYER[arch].get(part)
    return None if base is None else f"model.layers.{layer}.{base}.{kind}"


def gguf_name(arch: str, hf: str) -> str | None:
    """The inverse of hf_name; None for tensors edgellm does not use (e.g. rotary caches)."""
    m = _HF_NAME.match(hf)
    if m is None:
        return None
    layer, base, kind = m.groups()
    table = _GLOBAL if layer is None else _LAYER[arch]
    for part, hf_base in table.items():
        if hf_base == base:
            return f"{part}.{kind}" if layer is None else f"blk.{layer}.{part}.{kind}"
    return None


# -- config.json <-> GGUF metadata ------------------------------------------------------------

# GGUF key suffix (after "<arch>.") <- config.json field
_CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_GEMMA3_KEYS = {
    "attention.sliding_window": "sliding_window",
    "attention.query_pre_attn_scalar": "query_pre_attn_scalar",
}
_GEMMA2_KEYS = _GEMMA3_KEYS | {
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
_ARCH_KEYS = {"gemma3": _GEMMA3_KEYS, "gemma2": _GEMMA2_KEYS}


def metadata_from_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """GGUF-style metadata (what the models read) from an HF config.json."""
    model_type = config.get("model_type")
    if model_type == "gemma3" and "text_config" in config:
        raise UnsupportedModel("multimodal Gemma 3 checkpoints are not supported; use the text-only model")
    if model_type not in MODEL_TYPES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported ({', '.join(MODEL_TYPES)})")
    arch = MODEL_TYPES[model_type][0]
    keys = _CONFIG_KEYS | _ARCH_KEYS.get(arch, {})
    meta: dict[str, Any] = {"general.architecture": arch}
    if config.get("_name_or_path"):
        meta["general.name"] = config["_name_or_path"]
    for suffix, field in keys.items():
        if config.get(field) is not None:
            meta[f"{arch}.{suffix}"] = config[field]
    global_base, local_base = _rope_bases(config)
    meta[f"{arch}.rope.freq_base"] = global_base
    meta |= {f"{arch}.rope.scaling.{key}": value for key, value in _llama3_scaling(config).items()}
    if local_base is not None:
        meta[f"{arch}.rope.local.freq_base"] = local_base
    if arch in ("gemma2", "gemma3"):
        _check_gemma_layout(config, 6 if arch == "gemma3" else 2)
    if arch == "smollm3" and config.get("no_rope_layers") is not None:  # 1: the layer uses RoPE
        meta["smollm3.rope_layers"] = [bool(x) for x in config["no_rope_layers"]]
    if arch == "phi3":
        meta |= _phi3_metadata(config)
    return meta


def _phi3_metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's sliding window and LongRoPE as llama.cpp's converter records them (the factors,
    tensors in a GGUF, as a list here)."""
    meta: dict[str, Any] = {"phi3.attention.sliding_window": config.get("sliding_window") or 0}
    factor = float(config.get("partial_rotary_factor", 1.0))
    if factor != 1.0:  # Phi-4-mini rotates 3/4 of each head
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        meta["phi3.rope.dimension_count"] = int(head_dim * factor)
    spec = _rope_spec(config)
    if spec.get("rope_type", spec.get("type")) in ("longrope", "su"):
        original = int(spec.get("original_max_position_embeddings", config.get("original_max_position_embeddings")))
        scale = config["max_position_embeddings"] / original
        factor = spec.get("attention_factor") or (math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        meta |= {"phi3.rope.scaling.original_context_length": original, "phi3.rope.scaling.attn_factor": float(factor),
                 "phi3.rope.scaling.short_factor": [float(x) for x in spec["short_factor"]],
                 "phi3.rope.scaling.long_factor": [float(x) for x in spec["long_factor"]]}
    return meta


def _rope_bases(config: Mapping[str, Any]) -> tuple[float, float | None]:
    """(global, local) RoPE bases from either config style: rope_theta (+ rope_local_base_freq),
    or transformers 5's rope_parameters (flat, or keyed by layer type)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    if "full_attention" in params:
        full, sliding = params["full_attention"], params.get("sliding_attention", {})
        _check_default_rope(full, sliding)
        return float(full["rope_theta"]), float(sliding.get("rope_theta", 10_000.0))
    _check_default_rope(params, scaling or {})
    base = params.get("rope_theta", config.get("rope_theta", 10_000.0))
    return float(base), config.get("rope_local_base_freq")


def _check_default_rope(*specs: Mapping[str, Any]) -> None:
    for spec in specs:
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", "llama3", "longrope", "su"):
            raise UnsupportedModel(f"RoPE scaling {kind!r} is not supported yet (default, llama3, longrope)")


def _rope_spec(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A flat config's RoPE parameters: transformers 5's rope_parameters, or the older rope_scaling."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _llama3_scaling(config: Mapping[str, Any]) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling as GGUF-style keys (llama.cpp's names where it has them)."""
    spec = _rope_spec(config)
    if spec.get("rope_type", spec.get("type")) != "llama3":
        return {}
    return {"type": "llama3", "factor": float(spec["factor"]), "low_freq_factor": float(spec["low_freq_factor"]),
            "high_freq_factor": float(spec["high_freq_factor"]),
            "original_context_length": int(spec["original_max_position_embeddings"])}


def _check_gemma_layout(config: Mapping[str, Any], pattern: int) -> None:
    # edgellm's Gemma 3 runs five sliding layers then one global, Gemma 2 one and one; other
    # layouts would be misread. Soft-capping is Gemma 2's (a Gemma 3 with it would be misread).
    types = config.get("layer_types")
    if types is not None:
        expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(len(types))]
        if list(types) != expected:
            raise UnsupportedModel(f"Gemma layer_types other than {pattern - 1} sliding : 1 global are not supported")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if pattern == 6 and config.get(cap):
            raise UnsupportedModel(f"Gemma 3 with {cap} is not supported")


# What config_from_metadata writes faithfully (SmolLM3's NoPE layers and Phi-3's LongRoPE: not yet)
_WRITABLE = frozenset({"llama", "qwen2", "qwen3", "gemma2", "gemma3"})


def config_from_metadata(meta: Mapping[str, Any], vocab_size: int, tied: bool, dtype: str,
                         bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """An HF config.json for a model described by GGUF-style metadata."""
    arch = meta["general.architecture"]
    if arch not in _WRITABLE:
        raise UnsupportedModel(f"cannot write architecture {arch!r} as a Hugging Face model ({', '.join(sorted(_WRITABLE))})")
    model_type = GGUF_TO_MODEL_TYPE[arch]
    keys = _CONFIG_KEYS | _ARCH_KEYS.get(arch, {})
    config: dict[str, Any] = {"architectures": [MODEL_TYPES[model_type][1]], "model_type": model_type}
    for suffix, field in keys.items():
        if f"{arch}.{suffix}" in meta:
            config[field] = meta[f"{arch}.{suffix}"]
    heads = config["num_attention_heads"]
    config.setdefault("num_key_value_heads", heads)
    config.setdefault("head_dim", config["hidden_size"] // heads)
    base = float(meta.get(f"{arch}.rope.freq_base", 10_000.0))
    config |= {"vocab_size": vocab_size, "tie_word_embeddings": tied, "dtype": dtype,
               "bos_token_id": bos_id, "eos_token_id": eos_id}
    if arch in ("gemma2", "gemma3"):
        pattern, n = (6 if arch == "gemma3" else 2), config["num_hidden_layers"]
        config |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)],
            "rope_parameters": {"rope_type": "default", "rope_theta": base},
        }
        if arch == "gemma3":
            local = float(meta.get(f"{arch}.rope.local.freq_base", 10_000.0))
            config["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": base},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    else:
        config |= {"hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": base},
                   "rope_theta": base, "attention_bias": arch == "qwen2"}
    return config


def unpermute_rows(n_heads: int, head_dim: int):
    """llama.cpp's converter interleaves each head's rotary pairs for Llama q/k weights;
    this row order (an int64 numpy array; it indexes tensors too) restores the rotate-half layout
    (row h·d + s·d/2 + i <- h·d + 2i + s)."""
    import numpy as np

    h, s, i = np.meshgrid(np.arange(n_heads), np.arange(2), np.arange(head_dim // 2), indexing="ij")
    return (h * head_dim + 2 * i + s).reshape(-1).astype(np.int64)
