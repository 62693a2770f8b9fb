"""Mistral (7B v0.1 to v0.3 and the models built on it), as Hugging Face folders name it: the Llama
block, with a sliding window over every layer where the config sets one. (llama.cpp's converter
writes these checkpoints as `llama`, so its GGUFs run as that family.)"""
from edgellm.families import Family
from edgellm.families._common import LLAMA_LAYER, llama_like_config

FAMILY = Family(
    arch="mistral", model_type="mistral", hf_class="MistralForCausalLM", hf_config_class="MistralConfig",
    runner="llama",
    layer_names=LLAMA_LAYER,
    permuted_qk=True,  # as llama.cpp's converter treats a Llama-architecture checkpoint
    config_keys={"attention.sliding_window": "sliding_window"},
    runtime=lambda get, context_length: {"sliding_window": int(get("attention.sliding_window", 0) or 0) or None},
    config_from_metadata=lambda get, config: llama_like_config(get, config),
    tiny_metadata=lambda head_dim, sliding_window=8, **_: {"mistral.attention.sliding_window": sliding_window},
    tiny_hf_config=lambda head_dim, sliding_window=8, **_: {"sliding_window": sliding_window, "rope_theta": 10000.0},
    gguf_from_llama_cpp=False,
)
