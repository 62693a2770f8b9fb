"""safetensors reader: map the file once, validate the header, hand out zero-copy views.

Layout: u64 little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data; offsets are relative to the end of the header. Writing goes through the
`safetensors` library; reading is ours so that views stay zero-copy and every problem
becomes a ModelFormatError naming the file."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgellm.extras import torch

from edgellm.errors import ModelFormatError
from edgellm.io.gguf import TensorInfo
from edgellm.io.mapped import MappedFile, check_no_overlap
from edgellm.quant.ggml import GGMLType

# a safetensors dtype -> the numpy dtype of its bytes (bf16's as uint16 bits) and PyTorch's name for it
DTYPES: dict[str, tuple[type, str]] = {
    "F32": (np.float32, "float32"), "F16": (np.float16, "float16"), "BF16": (np.uint16, "bfloat16"),
    "I8": (np.int8, "int8"), "U8": (np.uint8, "uint8"), "I16": (np.int16, "int16"), "U16": (np.uint16, "uint16"),
    "I32": (np.int32, "int32"), "I64": (np.int64, "int64"),
}
_MAX_HEADER = 100 * 2**20
_GGML_FLOAT = {"F32": GGMLType.F32, "F16": GGMLType.F16, "BF16": GGMLType.BF16}


def torch_dtype(code: str) -> torch.dtype:
    """PyTorch's dtype for a safetensors dtype ("BF16" -> torch.bfloat16)."""
    return getattr(torch, DTYPES[code][1])


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # the file's: F32, BF16, U8, ...
    shape: tuple[int, ...]
    offset: int  # absolute, from the start of the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    def as_float_info(self, name: str) -> TensorInfo | None:
        """A GGUF-style TensorInfo (what models read) under `name`, or None if not a float dtype."""
        kind = _GGML_FLOAT.get(self.dtype)
        return None if kind is None else TensorInfo(name, self.shape, int(kind), self.offset, self.nbytes)


class SafetensorsFile(MappedFile):
    """A memory-mapped, validated safetensors file."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        try:
            self.metadata, self.entries = self._parse()
        except BaseException:
            self.close()
            raise

    def _fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def _parse(self) -> tuple[dict[str, str], dict[str, Entry]]:
        size = len(self._map)
        if size < 8:
            raise self._fail(f"truncated: {size} bytes is smaller than a safetensors header")
        (length,) = struct.unpack_from("<Q", self._map, 0)
        if length > min(_MAX_HEADER, size - 8):
            raise self._fail(f"header length {length} does not fit the {size}-byte file")
        try:
            header = json.loads(self._map[8:8 + length].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + length
        entries = {name: self._entry(name, spec, data_start, size) for name, spec in header.items()}
        check_no_overlap(((e.name, e.offset, e.nbytes) for e in entries.values()), self._fail)
        return metadata, entries

    def _entry(self, name: str, spec, data_start: int, size: int) -> Entry:
        try:
            dtype = spec["dtype"]
            itemsize = np.dtype(DTYPES[dtype][0]).itemsize
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self._fail(f"tensor {name!r} has a malformed header entry {spec!r}") from None
        if any(d < 0 for d in shape):
            raise self._fail(f"tensor {name!r} has a negative dimension {shape}")
        nbytes = math.prod(shape) * itemsize
        if end - begin != nbytes or begin < 0:
            raise self._fail(f"tensor {name!r}: offsets {begin}..{end} do not hold {shape} {spec['dtype']}")
        if data_start + end > size:
            raise self._fail(f"truncated: tensor {name!r} needs bytes up to {data_start + end}, file has {size}")
        return Entry(name, dtype, shape, data_start + begin, nbytes)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a 1-D uint8 tensor viewing the mapping (no copy): safetensors
        files (Hugging Face folders, edgellm's quantized files) are read on PyTorch."""
        e = self.entries[name]
        return torch.from_numpy(self.view(e.offset, e.nbytes))

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor itself, typed and shaped; a view when its offset is aligned for the dtype."""
        e = self.entries[name]
        raw = self.raw(name)
        if e.offset % np.dtype(DTYPES[e.dtype][0]).itemsize:
            raw = raw.clone()
        return raw.view(torch_dtype(e.dtype)).reshape(e.shape)

    def array(self, name: str) -> np.ndarray:
        """The tensor as a typed, shaped numpy array (bf16 as uint16 bits): a view of the mapping
        when its offset is aligned for the dtype, else a copy."""
        e = self.entries[name]
        raw = self.view(e.offset, e.nbytes)
        dtype = np.dtype(DTYPES[e.dtype][0])
        if e.offset % dtype.itemsize:
            raw = raw.copy()
        return raw.view(dtype).reshape(e.shape)

    def drop_pages(self, names: list[str] | None = None) -> None:
        """Let the OS drop these tensors' (default: all) resident pages (MappedFile.advise_dontneed)."""
        chosen = self.entries.values() if names is None else [self.entries[n] for n in names]
        self.advise_dontneed((e.offset, e.offset + e.nbytes) for e in chosen)


_TORCH_CODES = {name: code for code, (_, name) in DTYPES.items()}
_NUMPY_CODES = {np.dtype(dtype).name: code for code, (dtype, _) in DTYPES.items() if code != "BF16"}
PAD_PREFIX = "__pad__."


def _coded(tensor) -> tuple[str, np.ndarray]:
    """A tensor's or array's safetensors dtype and its bytes as a contiguous array."""
    if isinstance(tensor, np.ndarray):
        return _NUMPY_CODES[tensor.dtype.name], np.ascontiguousarray(tensor)
    code = _TORCH_CODES[str(tensor.dtype).removeprefix("torch.")]
    tensor = tensor.contiguous()
    return code, (tensor.view(torch.int16).numpy().view(np.uint16) if code == "BF16" else tensor.numpy())


def write_safetensors(path: str | Path, tensors: dict, metadata: dict[str, str], align: int = 64) -> None:
    """Write a standard safetensors file of tensors or numpy arrays (uint16 arrays as U16) whose
    tensors all start `align`-byte aligned in the file (so mapped views suit aligned vector loads):
    small `__pad__.N` uint8 tensors fill the gaps, and the header is padded with spaces, both
    allowed by the format."""
    header: dict[str, object] = {"__metadata__": metadata}
    order: list[tuple[str, str, np.ndarray]] = []
    offset = 0
    for name, tensor in tensors.items():
        if offset % align:
            pad = np.zeros(align - offset % align, dtype=np.uint8)
            order.append((f"{PAD_PREFIX}{len(order)}", "U8", pad))
            offset += pad.size
        code, data = _coded(tensor)
        order.append((name, code, data))
        offset += data.nbytes
    offset = 0
    for name, code, data in order:
        header[name] = {"dtype": code, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % align)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, data in order:
            if data.size:
                f.write(memoryview(data.reshape(-1).view(np.uint8)))
