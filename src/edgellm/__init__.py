"""edgellm: on-device LLM inference. `edgellm.load(name_or_path)` is the entry point.

Heavy names (anything touching torch) are imported on first use, so `import edgellm`
and the CLI's argument checking stay fast."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any

if "torch" not in sys.modules:
    # libgomp's workers spin ~300k rounds (milliseconds) after each parallel region. After a
    # sampler's softmax or sort (torch's, every decode step) that spinning took a core from the
    # decode kernels' own threads (kernels/pool.h): sampled decoding ran 85 against 115 tok/s.
    # 10k rounds still carries torch's team from one prompt GEMM over our prompt kernels to the
    # next. It must be set before torch loads libgomp; a value the user set wins.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from edgellm.errors import (ContextOverflow, EdgeLLMError, InvalidRequest, ModelFormatError,  # noqa: E402
                            ModelNotFound, UnsupportedModel)

__version__ = "0.1.0"

_LAZY = {
    "load": "edgellm.loader", "Model": "edgellm.model", "ModelInfo": "edgellm.model",
    "Completion": "edgellm.generate", "SamplingParams": "edgellm.generate",
    "Timings": "edgellm.generate", "TokenEvent": "edgellm.generate",
}
__all__ = ["ContextOverflow", "EdgeLLMError", "InvalidRequest", "ModelFormatError", "ModelNotFound",
           "UnsupportedModel", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")
