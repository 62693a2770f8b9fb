"""The arithmetic of the model families: llama.py runs the Llama-like ones, gemma.py Gemma's (each
family, in families/, names its runner); `build_model` picks the class from the file's metadata."""
from __future__ import annotations

import copy
from dataclasses import replace

from edgellm import families
from edgellm.errors import InvalidRequest
from edgellm.models.gemma import Gemma, GemmaConfig
from edgellm.models.llama import Llama, LlamaConfig
from edgellm.models.weights import TensorSource, Weights
from edgellm.module import Module

RUNNERS = {"llama": (LlamaConfig, Llama), "gemma": (GemmaConfig, Gemma)}  # a family's `runner` -> its classes


def build_model(source: TensorSource, vocab_size: int, mode: str = "fast", cache=None,
                context_length: int | None = None) -> Module:
    """Config from the file's metadata, weights through `quant/` (or a PackCache of earlier
    conversions). `context_length`: what the model is loaded for
    (None: the default; Phi-3's LongRoPE picks its factors by it)."""
    family = families.get(str(source.metadata.get("general.architecture")))
    config_cls, model_cls = RUNNERS[family.runner]
    config = config_cls.from_gguf(source.metadata, vocab_size, context_length)
    return model_cls(config, Weights(source, mode, cache))


def model_config(metadata):
    """A model's config straight from its metadata (no weights): shapes for planning, adapters."""
    family = families.get(str(metadata.get("general.architecture")))
    return RUNNERS[family.runner][0].from_gguf(metadata, vocab_size=0)


def layer_specs(metadata) -> list:
    """Per-layer KV shapes straight from metadata (no weights), for memory planning."""
    from edgellm.kv.config import LayerSpec

    config = model_config(metadata)
    sliding = getattr(config, "is_sliding", lambda i: False)
    window = getattr(config, "sliding_window", None)
    return [LayerSpec(config.n_kv_heads, config.head_dim, window if sliding(i) else None, None)
            for i in range(config.n_layers)]


def first_layers(net: Module, n: int) -> Module:
    """The model's first n blocks under its own embedding, final norm and head: the
    self-speculative draft. It shares every weight; only its KV cache is its own."""
    from edgellm.models.native.decoder import FusedDecoder

    if not 0 < n < len(net.blocks):
        raise InvalidRequest(f"a self-speculative draft takes 1 to {len(net.blocks) - 1} layers, got {n}")
    draft = copy.copy(net)  # the same layers, but its own list of blocks
    draft.blocks = list(net.blocks)[:n]
    config = replace(net.config, n_layers=n)
    if getattr(config, "rope_layers", None):
        config = replace(config, rope_layers=config.rope_layers[:n])
    draft.config = config
    draft.decoder = FusedDecoder.build(draft, net.mode)
    return draft
