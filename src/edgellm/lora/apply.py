"""An adapter applied without merging, on the PyTorch layers: each adapted projection computes
y = W x + s B (A x) on its part of the output (a fused q|k|v or gate|up holds several parts),
and the base weights stay as they are, shared and quantized.

The native decode layers (kernels/, fast mode) do not add the low-rank products yet: a model
that decodes natively is refused rather than silently decoded without its adapter."""
from __future__ import annotations

import torch
from torch import nn

from edgellm.errors import UnsupportedModel
from edgellm.lora.adapter import Adapter, LoRAPair, projection_shapes


class LoRAProjection(nn.Module):
    """`base` plus, on output columns [offset, offset + size) of each adapted part, s B (A x)."""

    def __init__(self, base: nn.Module, parts: list[tuple[int, int, LoRAPair]], scale: float):
        super().__init__()
        self.base, self.parts, self.scale = base, parts, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        delta = torch.zeros(y.shape, dtype=torch.float32)
        xf = x.float()
        for offset, size, pair in self.parts:
            delta[..., offset:offset + size] = (xf @ pair.a.T) @ pair.b.T
        return y + (self.scale * delta).to(y.dtype)


def apply_adapter(net: nn.Module, adapter: Adapter) -> None:
    """Wrap `net`'s adapted projections (a Llama- or Gemma-family network) with the adapter."""
    if getattr(net, "decoder", None) is not None:
        raise UnsupportedModel("LoRA adapters run on the PyTorch layers only so far: load the model with mode='exact'")
    shapes = projection_shapes(net.config)
    layout = {"qkv_proj": ("q", "k", "v"), "o_proj": ("o",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
    for i, block in enumerate(net.blocks):
        for owner in (block.attn, block.mlp):
            for attribute, projections in layout.items():
                if not hasattr(owner, attribute):
                    continue
                parts, offset = [], 0
                for p in projections:
                    pair = adapter.pairs.get((i, p))
                    if pair is not None:
                        parts.append((offset, shapes[p][0], pair))
                    offset += shapes[p][0]
                if parts:
                    setattr(owner, attribute, LoRAProjection(getattr(owner, attribute), parts, adapter.scale))
