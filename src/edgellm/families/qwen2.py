"""Qwen2 / Qwen2.5: the Llama block with biases on q, k and v (its GGUFs keep Hugging Face's q/k rows)."""
from edgellm.families import Family
from edgellm.families._common import LLAMA_LAYER, llama_like_config

FAMILY = Family(
    arch="qwen2", model_type="qwen2", hf_class="Qwen2ForCausalLM", hf_config_class="Qwen2Config", runner="llama",
    layer_names=LLAMA_LAYER,
    qkv_bias=True,
    config_from_metadata=lambda get, config: llama_like_config(get, config, qkv_bias=True),
    tiny_hf_config=lambda head_dim, **_: {"rope_theta": 10000.0},
    tiny_vocab="qwen2",
)
