"""How Hugging Face checkpoints name things, next to how GGUF (and so edgellm) names them.

Both directions: tensor names (`model.layers.3.self_attn.q_proj.weight` <-> `blk.3.attn_q.weight`)
and config.json fields (`hidden_size` <-> `llama.embedding_length`). What differs per family (its
block's tensor names, its own config fields and quirks) lives in its module in families/; this
module holds what they share. Models only ever see GGUF names; readers and writers translate at the
file's edge."""
from __future__ import annotations

import re
from typing import Any, Mapping

from edgellm import families
from edgellm.errors import UnsupportedModel
from edgellm.families._common import rope_spec

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
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
    base = families.get(arch).layer_names.get(part)
    return None if base is None else f"model.layers.{layer}.{base}.{kind}"


def gguf_name(arch: str, hf: str) -> str | None:
    """The inverse of hf_name; None for tensors edgellm does not use (e.g. rotary caches)."""
    m = _HF_NAME.match(hf)
    if m is None:
        return None
    layer, base, kind = m.groups()
    table = _GLOBAL if layer is None else families.get(arch).layer_names
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
def metadata_from_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """GGUF-style metadata (what the models read) from an HF config.json."""
    if config.get("model_type") == "gemma3" and "text_config" in config:
        raise UnsupportedModel("multimodal Gemma 3 checkpoints are not supported; use the text-only model")
    family = families.by_model_type(config.get("model_type"))
    arch = family.arch
    meta: dict[str, Any] = {"general.architecture": arch}
    if config.get("_name_or_path"):
        meta["general.name"] = config["_name_or_path"]
    for suffix, field in (_CONFIG_KEYS | family.config_keys).items():
        if config.get(field) is not None:
            meta[f"{arch}.{suffix}"] = config[field]
    global_base, local_base = _rope_bases(config)
    meta[f"{arch}.rope.freq_base"] = global_base
    meta |= {f"{arch}.rope.scaling.{key}": value for key, value in _llama3_scaling(config).items()}
    if local_base is not None:
        meta[f"{arch}.rope.local.freq_base"] = local_base
    return meta | family.metadata_from_config(config)


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


def _llama3_scaling(config: Mapping[str, Any]) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling as GGUF-style keys (llama.cpp's names where it has them)."""
    spec = rope_spec(config)
    if spec.get("rope_type", spec.get("type")) != "llama3":
        return {}
    return {"type": "llama3", "factor": float(spec["factor"]), "low_freq_factor": float(spec["low_freq_factor"]),
            "high_freq_factor": float(spec["high_freq_factor"]),
            "original_context_length": int(spec["original_max_position_embeddings"])}


def config_from_metadata(meta: Mapping[str, Any], vocab_size: int, tied: bool, dtype: str,
                         bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """An HF config.json for a model described by GGUF-style metadata."""
    family = families.get(meta["general.architecture"])
    if not family.writable:
        writable = ", ".join(a for a in families.names() if families.get(a).writable)
        raise UnsupportedModel(f"cannot write architecture {family.arch!r} as a Hugging Face model ({writable})")
    config: dict[str, Any] = {"architectures": [family.hf_class], "model_type": family.model_type}
    for suffix, field in (_CONFIG_KEYS | family.config_keys).items():
        if f"{family.arch}.{suffix}" in meta:
            config[field] = meta[f"{family.arch}.{suffix}"]
    heads = config["num_attention_heads"]
    config.setdefault("num_key_value_heads", heads)
    config.setdefault("head_dim", config["hidden_size"] // heads)
    config |= {"vocab_size": vocab_size, "tie_word_embeddings": tied, "dtype": dtype,
               "bos_token_id": bos_id, "eos_token_id": eos_id}
    get = lambda key, default=None: meta.get(f"{family.arch}.{key}", default)  # noqa: E731
    return config | family.config_from_metadata(get, config)


def unpermute_rows(n_heads: int, head_dim: int):
    """llama.cpp's converter interleaves each head's rotary pairs for Llama q/k weights;
    this row order (an int64 numpy array; it indexes tensors too) restores the rotate-half layout
    (row h·d + s·d/2 + i <- h·d + 2i + s)."""
    import numpy as np

    h, s, i = np.meshgrid(np.arange(n_heads), np.arange(2), np.arange(head_dim // 2), indexing="ij")
    return (h * head_dim + 2 * i + s).reshape(-1).astype(np.int64)
