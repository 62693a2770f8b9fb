"""A model's converted linears kept on disk, so the next load maps them instead of packing.

Converting GGUF blocks into edgellm's INT4 layout is most of a fast-mode load. The result
depends on the file, the mode, edgellm's pack and layout versions (quant/int4_pack.py: the same
bytes on every machine) and the compute dtype of dense layers (bf16 only on CPUs with native
bf16): all of it is in the key. A missing, stale or damaged cache is simply rebuilt."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from edgellm.atomic import atomic_path
from edgellm.quant.int4_pack import LAYOUT_VERSION
from edgellm.quant.linear import DenseLinear, Int4Linear, fast_dtype
from edgellm.registry import cache_dir

# 2: Q8_0 heads stay in the file; 3: so do all Q8_0 / Q5_0 linears (quant/blocks.py); 4: edgellm's
# own INT4 layout instead of torch's
PACK_VERSION = 4


def cache_key(path: str | Path, mode: str) -> str:
    stat = Path(path).stat()
    dense = str(fast_dtype()).removeprefix("torch.")
    text = f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{mode}|{PACK_VERSION}|{LAYOUT_VERSION}|{dense}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class PackCache:
    """name -> converted linear, loaded from and saved to one safetensors file."""

    def __init__(self, path: Path):
        self.path, self.dirty = path, False
        self._tensors: dict[str, torch.Tensor] = {}
        self._meta: dict[str, dict] = {}
        if path.is_file():
            self._load()

    def _load(self) -> None:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                self._meta = json.loads(f.metadata()["linears"])
                self._tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception:  # damaged or from an incompatible build: convert again
            self._tensors, self._meta = {}, {}

    def get(self, key: str) -> nn.Module | None:
        meta = self._meta.get(key)
        if meta is None:
            return None
        if meta["kind"] == "int4":
            linear = Int4Linear.empty(meta["out"], meta["in"], meta["planes"])
            linear.packed, linear.scale_zero = self._tensors[f"{key}.packed"], self._tensors[f"{key}.scale_zero"]
        else:
            linear = DenseLinear(self._tensors[f"{key}.weight"], getattr(torch, meta["dtype"]))
        if "out_splits" in meta:
            linear.out_splits = meta["out_splits"]
        return linear

    def put(self, key: str, linear: nn.Module) -> None:
        meta: dict = {"out_splits": getattr(linear, "out_splits", None)}
        if isinstance(linear, Int4Linear):
            meta |= {"kind": "int4", "in": linear.in_features, "out": linear.out_features, "planes": linear.planes}
            self._tensors |= {f"{key}.packed": linear.packed, f"{key}.scale_zero": linear.scale_zero}
        elif isinstance(linear, DenseLinear):
            meta |= {"kind": "dense", "dtype": str(linear.compute_dtype).removeprefix("torch.")}
            self._tensors[f"{key}.weight"] = linear.weight
        else:
            return
        self._meta[key] = meta
        self.dirty = True

    def save(self) -> None:
        """Write atomically; a read-only or full cache directory only costs the next load time."""
        if not self.dirty:
            return
        from safetensors.torch import save_file

        try:
            with atomic_path(self.path) as tmp:
                save_file(self._tensors, str(tmp), metadata={"linears": json.dumps(self._meta)})
        except OSError:
            pass
        self.dirty = False
        self._tensors = {}  # the modules own them now


def pack_cache_for(path: str | Path, mode: str) -> PackCache | None:
    """The cache for a model file in fast mode; None when disabled (EDGELLM_PACK_CACHE=0) or
    for exact mode, whose fp32 weights are as quick to convert as to read."""
    if mode != "fast" or os.environ.get("EDGELLM_PACK_CACHE", "1") == "0":
        return None
    return PackCache(cache_dir() / "packed" / f"{cache_key(path, mode)}.safetensors")
