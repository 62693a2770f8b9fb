"""Random LoRA adapters in PEFT's folder format, written directly (no peft, no base checkpoint):
for models edgellm reads only as GGUF, e.g. SmolLM2 and Gemma 3."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgellm.lora.adapter import projection_shapes

MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def random_peft_adapter(folder: Path, config, rank: int = 16, alpha: float = 16.0, targets=tuple(MODULES),
                        seed: int = 0, std: float = 0.02) -> Path:
    """A rank-`rank` adapter on `targets` of every layer, A and B drawn with `std` (large enough to
    change the model's outputs, small enough to leave it a language model)."""
    g = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(config), {}
    for i in range(config.n_layers):
        for part in targets:
            out_dim, in_dim = shapes[part]
            key = f"base_model.model.model.layers.{i}.{MODULES[part]}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=g) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                   "target_modules": [MODULES[p].split(".")[1] for p in targets], "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config_json))
    return folder
