"""Adapters written in PEFT's folder format (adapter_config.json + adapter_model.safetensors),
which transformers + PEFT load unchanged: keys base_model.model.model.layers.{i}.{module}.lora_A
/ lora_B.weight, A (r, in) and B (out, r) in Hugging Face's row order (edgellm's layers already
hold q and k rows in that order)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from edgellm.atomic import atomic_path

HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def save_peft(out: str | Path, pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], rank: int,
              alpha: float, base_model: str, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write (layer, projection) -> (A, B) as a PEFT LoRA folder at `out` (other files there stay)."""
    from safetensors.torch import save_file

    out = Path(out)
    tensors = {}
    for (layer, part), (a, b) in sorted(pairs.items()):
        key = f"base_model.model.model.layers.{layer}.{HF_MODULES[part]}"
        tensors[f"{key}.lora_A.weight"] = a.detach().float().contiguous()
        tensors[f"{key}.lora_B.weight"] = b.detach().float().contiguous()
    targets = sorted({HF_MODULES[part].split(".")[1] for _, part in pairs})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
              "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "use_dora": False, "inference_mode": True, "base_model_name_or_path": base_model}
    out.mkdir(parents=True, exist_ok=True)
    # each file written beside itself and renamed (the weights first: a reader never finds a config
    # without its weights; a killed writer leaves the previous files whole)
    with atomic_path(out / "adapter_model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    for name, data in (extra_files or {}).items():
        with atomic_path(out / name) as tmp:
            tmp.write_bytes(data)
    with atomic_path(out / "adapter_config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2))
    return out


def random_adapter(out: str | Path, config, rank: int = 16, alpha: float | None = None,
                   targets: tuple[str, ...] = tuple(HF_MODULES), seed: int = 0, std: float = 0.02) -> Path:
    """A random rank-`rank` PEFT adapter on `targets` of every layer of a model of `config`
    (benchmarks and tests: what matters is its shapes and that it changes the outputs; std 0.05
    changes SmolLM2's answers and leaves it writing English)."""
    from edgellm.lora.adapter import projection_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    pairs = {(i, part): (torch.randn(rank, shapes[part][1], generator=g) * std,
                         torch.randn(shapes[part][0], rank, generator=g) * std)
             for i in range(config.n_layers) for part in targets}
    return save_peft(out, pairs, rank, float(alpha if alpha is not None else rank), "random")
