"""PyTorch, which the core runtime does without: modules that use it on some paths (exact mode,
the prompt path's PyTorch layers, quantize / convert / eval, LoRA training) take `torch` from here,
a stand-in that imports it at its first attribute read. A fast-mode run on the native kernels never
reads one, so it never pays torch's ~1 s import and ~190 MB; a machine without torch that reaches
such a path gets `ToolsNeeded`, one line saying what to install."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

from edgellm.errors import EdgeLLMError

INSTALL_TOOLS = "pip install 'edgellm[tools]'"
TOOLS_MODULES = ("torch", "rich", "safetensors", "tokenizers")  # what the tools extra installs


class ToolsNeeded(EdgeLLMError, ImportError):
    """What was asked for runs on the `tools` extra (PyTorch and what only tools use), not installed."""

    def __init__(self, module: str):
        what = "PyTorch" if module == "torch" else module
        super().__init__(f"this needs {what}, which is not installed (the tools extra): {INSTALL_TOOLS}")

    @classmethod
    def of(cls, error: ModuleNotFoundError) -> ToolsNeeded | None:
        """The tools extra's missing module behind an import error, else None."""
        name = (error.name or "").split(".")[0]
        return cls(name) if name in TOOLS_MODULES else None


class _Lazy(types.ModuleType):
    """A module imported at the first read of one of its attributes; afterwards its attributes are
    this object's own (a plain dict lookup, no __getattr__ on hot paths)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_module"] = None

    def _load(self) -> types.ModuleType:
        module = self.__dict__["_module"]
        if module is None:
            try:
                module = importlib.import_module(self.__name__)
            except ImportError:
                raise ToolsNeeded(self.__name__.split(".")[0]) from None
            self.__dict__.update({k: v for k, v in vars(module).items() if k not in ("__name__", "__spec__")})
            self.__dict__["_module"] = module
        return module

    def __getattr__(self, name: str):
        return getattr(self._load(), name)  # attributes torch gains after the copy (submodules) too


def lazy(name: str) -> types.ModuleType:
    """`name` (torch, torch.nn.functional, ...) imported at first use; the module itself where it
    is imported already."""
    return sys.modules.get(name) or _Lazy(name)


def torch_loaded() -> bool:
    """Whether PyTorch is in this process (nothing here imports it to find out)."""
    return sys.modules.get("torch") is not None


def has_torch() -> bool:
    """Whether PyTorch can be imported (without importing it)."""
    if torch_loaded():
        return True
    if "torch" in sys.modules:  # None: imports of it are blocked
        return False
    return importlib.util.find_spec("torch") is not None


torch = lazy("torch")


def inference():
    """torch.inference_mode() where PyTorch is loaded (its layers record no autograd graph), else
    nothing to switch off."""
    if not torch_loaded():
        return contextlib.nullcontext()
    return sys.modules["torch"].inference_mode()
