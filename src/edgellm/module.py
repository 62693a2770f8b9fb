"""The base of edgellm's layers in place of torch.nn.Module, which would import PyTorch: calling a
layer runs its `forward`, and `modules()` walks the layers it holds. Weights are plain attributes
(numpy arrays the C library reads, or tensors on PyTorch's paths), never trained: a LoRA adapter
is the only thing edgellm trains, and it holds its own parameters (lora/train.py)."""
from __future__ import annotations

from typing import Iterator


class Module:
    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def modules(self) -> Iterator[Module]:
        """This layer, then every layer below it (attributes, and lists or tuples of layers), each once."""
        seen: set[int] = set()
        stack: list[Module] = [self]
        while stack:
            layer = stack.pop()
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            yield layer
            for value in reversed(list(vars(layer).values())):
                items = value if isinstance(value, (list, tuple)) else (value,)
                stack.extend(item for item in reversed(items) if isinstance(item, Module))
