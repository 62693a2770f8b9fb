"""Gemma 3 (text): four norms per block and q/k norms, GELU, √d embeddings, five sliding-window
layers (their own RoPE base) per global one."""
from __future__ import annotations

from typing import Any

from edgellm.families import Family, _gemma
from edgellm.families._common import GEMMA_LAYER, QK_NORMS

PATTERN = 6  # every sixth layer attends globally


def _metadata(config) -> dict[str, Any]:
    _gemma.check_layout(config, PATTERN, softcaps=False)
    return {}


def _hf_config(get, config: dict[str, Any]) -> dict[str, Any]:
    fields = _gemma.hf_config(get, config, PATTERN)
    base, local = float(get("rope.freq_base", 10_000.0)), float(get("rope.local.freq_base", 10_000.0))
    fields["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": base},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return fields


FAMILY = Family(
    arch="gemma3", model_type="gemma3_text", hf_class="Gemma3ForCausalLM", hf_config_class="Gemma3TextConfig",
    runner="gemma",
    layer_names=GEMMA_LAYER | QK_NORMS,
    norms_plus_one=True,
    config_keys=_gemma.CONFIG_KEYS,
    metadata_from_config=_metadata,
    runtime=lambda get, context_length: {"sliding_pattern": PATTERN, "default_rope_base": 1_000_000.0,
                                         "default_local_rope_base": 10_000.0},
    config_from_metadata=_hf_config,
    tiny_metadata=lambda head_dim, sliding_window=8, **_: {"gemma3.attention.sliding_window": sliding_window},
    tiny_hf_config=_gemma.tiny_hf_config,
    tiny_vocab="llama-spm",
)
