"""A model's converted linears kept on disk, so the next load maps them instead of packing.

Converting GGUF blocks into edgellm's INT4 layout is most of a fast-mode load; interleaving Q8_0
linears into Q8R16 (a tied head: Gemma 3's 178 MB) is most of the rest. The result
depends on the file, the mode, edgellm's pack and layout versions (quant/int4_pack.py: the same
bytes on every machine) and the compute dtype of dense layers (bf16 only on CPUs with native
bf16): all of it is in the entry's name. A missing, stale or damaged entry is simply rebuilt.

An entry is named `<what>-<when>`: which conversion of which file, then which bytes of it by
which edgellm. Writing one removes the entries no load can use again (`prune`): the older
conversions of a file that changed, those of files that are gone (a test's temp copy, a model
moved away), those of an older edgellm. Without that, every rewritten or re-quantized model left
its old entry behind (SmolLM2's is 66 MB): a developer's cache grew by ~1.4 GB per test run."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from edgellm.atomic import atomic_path, remove_files
from edgellm.extras import torch
from edgellm.io.safetensors import SafetensorsFile, write_safetensors
from edgellm.kernels.build import compute_dtype_name
from edgellm.kernels.gemv import Q8R16
from edgellm.module import Module
from edgellm.quant.blocks import BlockLinear, BlockPart
from edgellm.quant.int4_pack import LAYOUT_VERSION
from edgellm.quant.linear import DenseLinear, Int4Linear
from edgellm.registry import cache_dir

# 2: Q8_0 heads stay in the file; 3: so do all Q8_0 / Q5_0 linears (quant/blocks.py); 4: edgellm's
# own INT4 layout instead of torch's; 5: written 64-byte aligned and mapped when loaded; 6: Q8R16 copies
# too (kernels/q8r16.c's layout: a change to it needs a new version here)
PACK_VERSION = 6


def _hash(text: str, chars: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:chars]


def entry_name(source: str, mode: str, dense: str) -> str:
    """The cache file's name for `mode`'s conversion of the file at `source` (resolved) with dense
    layers in `dense`, as the file and edgellm are now."""
    stat = Path(source).stat()
    what = _hash(f"{source}|{mode}|{dense}", 32)
    when = _hash(f"{stat.st_size}|{stat.st_mtime_ns}|{PACK_VERSION}|{LAYOUT_VERSION}", 16)
    return f"{what}-{when}.safetensors"


def _still_usable(entry: Path) -> bool:
    """Whether a load could still read this entry: it names the conversion its metadata says it
    holds, of that file as it is now, by this edgellm."""
    try:
        with SafetensorsFile(entry) as f:
            meta = f.metadata
        return entry.name == entry_name(meta["source"], meta["mode"], meta["dense"])
    except Exception:  # unreadable, from an older edgellm, or its file is gone
        return False


def prune(folder: Path, keep: Path) -> int:
    """Remove the entries of `folder` no load can use again, never `keep`; returns how many went.
    Another process's half-written entry is a `.partial` file, not matched here."""
    return remove_files(folder.glob("*.safetensors"), lambda entry: entry != keep and not _still_usable(entry))


class PackCache:
    """name -> converted linear, saved to one safetensors file and loaded by mapping it: an INT4
    layer's arrays are views of the file (nothing is read until a kernel touches it, and its pages
    are the page cache's, shared by every process that loads the model)."""

    def __init__(self, path: Path, identity: dict[str, str]):
        self.path, self.dirty = path, False
        self.identity = identity  # source, mode, dense: written as metadata, read back by prune()
        self._arrays: dict = {}  # to write: numpy arrays (INT4) or tensors (dense)
        self._meta: dict[str, dict] = {}
        self._file: SafetensorsFile | None = None
        if path.is_file():
            self._load()

    def _load(self) -> None:
        try:
            self._file = SafetensorsFile(self.path)
            self._meta = json.loads(self._file.metadata["linears"])
        except Exception:  # damaged or from an incompatible build: convert again
            self._file, self._meta = None, {}

    def get(self, key: str) -> Module | None:
        meta = self._meta.get(key)
        if meta is None or self._file is None:
            return None
        try:
            if meta["kind"] == "int4":
                linear = Int4Linear.empty(0, meta["in"], meta["planes"])
                linear.out_features = meta["out"]
                linear.packed, linear.scale_zero = self._file.array(f"{key}.packed"), self._file.array(f"{key}.scale_zero")
            elif meta["kind"] == "q8r16":
                linear = BlockLinear.of_parts(meta["in"], [BlockPart(self._file.array(f"{key}.part{i}"), Q8R16, None, q5_0)
                                                           for i, q5_0 in enumerate(meta["q5_0"])])
            else:
                linear = DenseLinear(self._file.tensor(f"{key}.weight"), getattr(torch, meta["dtype"]))
        except (KeyError, ValueError):  # an entry that does not hold what its metadata says
            return None
        if "out_splits" in meta:
            linear.out_splits = meta["out_splits"]
        return linear

    def put(self, key: str, linear: Module) -> None:
        meta: dict = {"out_splits": getattr(linear, "out_splits", None)}
        if isinstance(linear, Int4Linear):
            meta |= {"kind": "int4", "in": linear.in_features, "out": linear.out_features, "planes": linear.planes}
            self._arrays |= {f"{key}.packed": linear.packed, f"{key}.scale_zero": linear.scale_zero}
        elif isinstance(linear, DenseLinear):
            meta |= {"kind": "dense", "dtype": str(linear.compute_dtype).removeprefix("torch.")}
            self._arrays[f"{key}.weight"] = linear.weight
        elif isinstance(linear, BlockLinear) and linear.interleaved:  # the Q8R16 copies: no interleaving at the next load
            meta |= {"kind": "q8r16", "in": linear.in_features, "q5_0": [p.q5_0 for p in linear.parts]}
            self._arrays |= {f"{key}.part{i}": p.rows for i, p in enumerate(linear.parts)}
        else:
            return
        self._meta[key] = meta
        self.dirty = True

    def save_behind(self) -> None:
        """save() on a thread of its own: a first load returns before its conversions reach the disk
        (Qwen2.5-1.5B Q4_K_M: 0.7 GB, 1.6-1.9 s of a 3.8 s first load). The thread is not a daemon, so
        the process waits for it at exit; a later load of the same file in this process, and wait(),
        wait for it too."""
        if not self.dirty:
            return
        thread = threading.Thread(target=self.save, name="edgellm-pack-cache")
        with _writing_lock:
            _writing[self.path] = thread
        thread.start()

    def wait(self) -> None:
        """Until a save_behind() of this entry has finished."""
        _wait_for(self.path)

    def save(self) -> None:
        """Write atomically; a read-only or full cache directory only costs the next load time."""
        if not self.dirty:
            return
        try:
            with atomic_path(self.path) as tmp:
                write_safetensors(tmp, self._arrays, metadata={"linears": json.dumps(self._meta), **self.identity})
            prune(self.path.parent, keep=self.path)
        except OSError:
            pass
        self.dirty = False
        self._arrays = {}  # the modules own them now


def pack_cache_for(path: str | Path, mode: str) -> PackCache | None:
    """The cache for a model file in fast mode; None when disabled (EDGELLM_PACK_CACHE=0) or
    for exact mode, whose fp32 weights are as quick to convert as to read."""
    if mode != "fast" or os.environ.get("EDGELLM_PACK_CACHE", "1") == "0":
        return None
    identity = _identity(path, mode)
    entry = _entry_path(identity)
    _wait_for(entry)  # an earlier load in this process may still be writing it
    return PackCache(entry, identity)


_writing: dict[Path, threading.Thread] = {}  # entries being written behind their loads
_writing_lock = threading.Lock()


def wait_for_writes() -> None:
    """Until every entry this process is writing behind its load is written."""
    with _writing_lock:
        entries = list(_writing)
    for entry in entries:
        _wait_for(entry)


def _wait_for(entry: Path) -> None:
    with _writing_lock:
        thread = _writing.get(entry)
    if thread is not None:
        thread.join()
        with _writing_lock:
            if _writing.get(entry) is thread:
                del _writing[entry]


def _identity(path: str | Path, mode: str) -> dict[str, str]:
    """What a conversion is of (kept in its metadata): the file, the mode, the dense layers' dtype."""
    return {"source": str(Path(path).resolve()), "mode": mode, "dense": compute_dtype_name()}


def _entry_path(identity: dict[str, str]) -> Path:
    return cache_dir() / "packed" / entry_name(**identity)


def cache_path(path: str | Path, mode: str) -> Path:
    """Where `mode`'s conversion of the model file at `path` is cached, as the file is now."""
    return _entry_path(_identity(path, mode))
