"""Gemma 2: Gemma 3's block without q/k norms, sliding and global layers alternating, one RoPE base,
and soft-capped attention scores and final logits (s -> cap · tanh(s / cap))."""
from __future__ import annotations

from typing import Any

from edgellm.families import Family, _gemma
from edgellm.families._common import GEMMA_LAYER

PATTERN = 2  # every second layer attends globally
TINY_SOFTCAPS = (2.0, 3.0)  # small, so that they bite on a tiny model's random weights


def _metadata(config) -> dict[str, Any]:
    _gemma.check_layout(config, PATTERN, softcaps=True)
    return {}


def _tiny_metadata(head_dim: int, sliding_window: int = 8, **_) -> dict[str, Any]:
    return {"gemma2.attention.sliding_window": sliding_window, "gemma2.attn_logit_softcapping": TINY_SOFTCAPS[0],
            "gemma2.final_logit_softcapping": TINY_SOFTCAPS[1]}


def _tiny_hf_config(head_dim: int, sliding_window: int = 8, **_) -> dict[str, Any]:
    return _gemma.tiny_hf_config(head_dim, sliding_window) | {"attn_logit_softcapping": TINY_SOFTCAPS[0],
                                                               "final_logit_softcapping": TINY_SOFTCAPS[1]}


FAMILY = Family(
    arch="gemma2", model_type="gemma2", hf_class="Gemma2ForCausalLM", hf_config_class="Gemma2Config", runner="gemma",
    layer_names=GEMMA_LAYER,
    norms_plus_one=True,
    config_keys=_gemma.CONFIG_KEYS | {"attn_logit_softcapping": "attn_logit_softcapping",
                                      "final_logit_softcapping": "final_logit_softcapping"},
    metadata_from_config=_metadata,
    runtime=lambda get, context_length: {"sliding_pattern": PATTERN, "default_rope_base": 10_000.0,
                                         "default_local_rope_base": None},
    config_from_metadata=lambda get, config: _gemma.hf_config(get, config, PATTERN),
    tiny_metadata=_tiny_metadata,
    tiny_hf_config=_tiny_hf_config,
    tiny_vocab="llama-spm",
)
