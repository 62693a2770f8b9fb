"""Llama 2 / 3.x (and SmolLM2, which is a Llama): the Llama block; Llama 3.1's RoPE scaling is read
from the file (`rope_freqs`, or its parameters in a folder) by the runner."""
from edgellm.families import Family
from edgellm.families._common import LLAMA_LAYER, llama_like_config

FAMILY = Family(
    arch="llama", model_type="llama", hf_class="LlamaForCausalLM", hf_config_class="LlamaConfig", runner="llama",
    layer_names=LLAMA_LAYER,
    permuted_qk=True,
    config_from_metadata=lambda get, config: llama_like_config(get, config),
    tiny_hf_config=lambda head_dim, **_: {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
)
