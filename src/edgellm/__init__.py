"""edgellm: on-device LLM inference. `edgellm.load(name_or_path)` is the entry point.

Heavy names (anything touching torch) are imported on first use, so `import edgellm`
and the CLI's argument checking stay fast."""
from __future__ import annotations

import importlib
from typing import Any

from edgellm.errors import (ContextOverflow, EdgeLLMError, InvalidRequest, ModelFormatError,
                            ModelNotFound, UnsupportedModel)

__version__ = "0.1.0"

_LAZY = {
    "load": "edgellm.api.loader", "Model": "edgellm.api.model", "ModelInfo": "edgellm.api.model",
    "Completion": "edgellm.generation", "SamplingParams": "edgellm.generation",
    "Timings": "edgellm.generation", "TokenEvent": "edgellm.generation",
    "Service": "edgellm.serving.service", "Session": "edgellm.serving.session",
}
__all__ = ["ContextOverflow", "EdgeLLMError", "InvalidRequest", "ModelFormatError", "ModelNotFound",
           "UnsupportedModel", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from edgellm.memory import collector_paused

        with collector_paused():  # the import of torch
            value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next use finds it without this function
        return value
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")
