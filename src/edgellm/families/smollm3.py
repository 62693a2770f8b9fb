"""SmolLM3: the Llama block, with RoPE left out of every fourth layer (NoPE)."""
from __future__ import annotations

from typing import Any, Mapping

from edgellm.families import Family
from edgellm.families._common import LLAMA_LAYER


def _metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    if config.get("no_rope_layers") is None:
        return {}
    return {"smollm3.rope_layers": [bool(x) for x in config["no_rope_layers"]]}  # 1: the layer uses RoPE


def _runtime(get, context_length: int | None) -> dict[str, Any]:
    """Which layers rotate q and k: as a Hugging Face config lists them, else llama.cpp's rule
    (every fourth layer without RoPE, which SmolLM3 GGUFs do not record)."""
    listed, n = get("rope_layers"), int(get("block_count"))
    return {"rope_layers": tuple(bool(x) for x in listed) if listed is not None else
            tuple((i + 1) % 4 != 0 for i in range(n))}


FAMILY = Family(
    arch="smollm3", model_type="smollm3", hf_class="SmolLM3ForCausalLM", hf_config_class="SmolLM3Config",
    runner="llama",
    layer_names=LLAMA_LAYER,
    permuted_qk=True,
    writable=False,  # its NoPE layers are not written back yet
    metadata_from_config=_metadata,
    runtime=_runtime,
    tiny_hf_config=lambda head_dim, **_: {"rope_theta": 10000.0, "pad_token_id": None, "bos_token_id": 1,
                                          "eos_token_id": 0},
)
