"""One file per architecture family; `build_model` picks the class from the file's metadata."""
from __future__ import annotations

from torch import nn

from edgellm.errors import UnsupportedModel
from edgellm.models.gemma3 import Gemma3, Gemma3Config
from edgellm.models.llama import Llama, LlamaConfig
from edgellm.models.weights import TensorSource, Weights

ARCHITECTURES = {
    "llama": (LlamaConfig, Llama),
    "qwen2": (LlamaConfig, Llama),
    "gemma3": (Gemma3Config, Gemma3),
}


def build_model(source: TensorSource, vocab_size: int, mode: str = "fast") -> nn.Module:
    """Config from the file's metadata, weights through `quant/`; returns an eval-mode model."""
    arch = source.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise UnsupportedModel(f"{source.path}: architecture {arch!r} is not supported ({supported})")
    config_cls, model_cls = ARCHITECTURES[arch]
    config = config_cls.from_gguf(source.metadata, vocab_size)
    return model_cls(config, Weights(source, mode)).eval()
