"""The base of edgellm's layers in place of torch.nn.Module, which would import PyTorch: calling a
layer runs its `forward`, and `modules()` walks the layers it holds. Weights are plain attributes
(numpy arrays the C library reads, or tensors on PyTorch's paths), never trained: a LoRA adapter
is the only thing edgellm trains, and it holds its own parameters (lora/train.py)."""
from __future__ import annotations

from typing import Iterator


class _Hook:
    def __init__(self, hooks: list, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


class Module:
    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        for hook in self.__dict__.get("_forward_hooks", ()):
            replaced = hook(self, args, out)
            out = out if replaced is None else replaced
        return out

    def register_forward_hook(self, hook) -> _Hook:
        """Call hook(layer, args, output) after each forward (a result other than None replaces
        the output), as torch.nn.Module does: what measurements that watch a layer use (AWQ's
        calibration, the self-draft's early exits). Returns a handle whose remove() undoes it."""
        hooks = self.__dict__.setdefault("_forward_hooks", [])
        hooks.append(hook)
        return _Hook(hooks, hook)

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
