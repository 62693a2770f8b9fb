"""Qwen3: the Llama block with an RMSNorm over each head of q and k before RoPE."""
from edgellm.families import Family
from edgellm.families._common import LLAMA_LAYER, QK_NORMS, llama_like_config

FAMILY = Family(
    arch="qwen3", model_type="qwen3", hf_class="Qwen3ForCausalLM", hf_config_class="Qwen3Config", runner="llama",
    layer_names=LLAMA_LAYER | QK_NORMS,
    config_from_metadata=lambda get, config: llama_like_config(get, config),
    tiny_hf_config=lambda head_dim, **_: {"rope_theta": 10000.0, "attention_bias": False},
    tiny_vocab="qwen2",
)
