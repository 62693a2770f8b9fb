"""A KV codec's parts (kv/codecs.py) as the C decode layers' KVStore sees them, for the kernel tests."""
from __future__ import annotations

import torch

from edgellm.models.native import structs

CODES = {"f32": 0, "f16": 1, "int8": 2, "int4": 3, "bf16": 4}  # layer_types.h


def kv_store(parts: dict[str, torch.Tensor], name: str) -> structs.KVStore:
    """The store of one page's keys or values in codec `name`: its codes, and scales / mins if any."""
    main = parts.get("x", parts.get("q"))
    scale, low = parts.get("scale"), parts.get("min")
    return structs.KVStore(main.data_ptr(), None if scale is None else scale.data_ptr(),
                           None if low is None else low.data_ptr(), CODES[name])
