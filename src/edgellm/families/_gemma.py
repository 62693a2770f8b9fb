"""What Gemma 2 and Gemma 3 share: config keys, the layer layout check, config.json fields."""
from __future__ import annotations

from typing import Any, Mapping

from edgellm.errors import UnsupportedModel

CONFIG_KEYS = {"attention.sliding_window": "sliding_window",
               "attention.query_pre_attn_scalar": "query_pre_attn_scalar"}


def layer_types(pattern: int, n: int) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def check_layout(config: Mapping[str, Any], pattern: int, softcaps: bool) -> None:
    """edgellm runs `pattern - 1` sliding layers then one global one; other layouts would be
    misread, and so would soft-capping in a family that has none."""
    types = config.get("layer_types")
    if types is not None and list(types) != layer_types(pattern, len(types)):
        raise UnsupportedModel(f"Gemma layer_types other than {pattern - 1} sliding : 1 global are not supported")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if not softcaps and config.get(cap):
            raise UnsupportedModel(f"Gemma 3 with {cap} is not supported")


def hf_config(get, config: dict[str, Any], pattern: int) -> dict[str, Any]:
    base = float(get("rope.freq_base", 10_000.0))
    return {"hidden_activation": "gelu_pytorch_tanh", "layer_types": layer_types(pattern, config["num_hidden_layers"]),
            "rope_parameters": {"rope_type": "default", "rope_theta": base}}


def tiny_hf_config(head_dim: int, sliding_window: int = 8, **_) -> dict[str, Any]:
    return {"sliding_window": sliding_window, "query_pre_attn_scalar": head_dim, "rope_theta": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh"}
