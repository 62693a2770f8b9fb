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

import torch

from edgellm.errors import ModelFormatError
from edgellm.formats.gguf import TensorInfo
from edgellm.formats.mapped import MappedFile, check_no_overlap
from edgellm.quant.ggml import GGMLType

DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}
_MAX_HEADER = 100 * 2**20
_GGML_FLOAT = {torch.float32: GGMLType.F32, torch.float16: GGMLType.F16, torch.bfloat16: GGMLType.BF16}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
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
            dtype = DTYPES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self._fail(f"tensor {name!r} has a malformed header entry {spec!r}") from None
        if any(d < 0 for d in shape):
            raise self._fail(f"tensor {name!r} has a negative dimension {shape}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or begin < 0:
            raise self._fail(f"tensor {name!r}: offsets {begin}..{end} do not hold {shape} {spec['dtype']}")
        if data_start + end > size:
            raise self._fail(f"truncated: tensor {name!r} needs bytes up to {data_start + end}, file has {size}")
        return Entry(name, dtype, shape, data_start + begin, nbytes)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a 1-D uint8 view into the mapping (no copy)."""
        e = self.entries[name]
        return self.view(e.offset, e.nbytes)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor itself, typed and shaped; a view when its offset is aligned for the dtype."""
        e = self.entries[name]
        raw = self.raw(name)
        if e.offset % raw.new_empty((), dtype=e.dtype).element_size():
            raw = raw.clone()
        return raw.view(e.dtype).reshape(e.shape)

    def drop_pages(self, names: list[str] | None = None) -> None:
        """Let the OS drop these tensors' (default: all) resident pages (MappedFile.advise_dontneed)."""
        chosen = self.entries.values() if names is None else [self.entries[n] for n in names]
        self.advise_dontneed((e.offset, e.offset + e.nbytes) for e in chosen)


_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
PAD_PREFIX = "__pad__."


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                      align: int = 64) -> None:
    """Write a standard safetensors file whose tensors all start `align`-byte aligned in the
    file (so mapped views suit aligned vector loads): small `__pad__.N` uint8 tensors fill
    the gaps, and the header is padded with spaces, both allowed by the format."""
    header: dict[str, object] = {"__metadata__": metadata}
    order: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, tensor in tensors.items():
        if offset % align:
            pad = torch.zeros(align - offset % align, dtype=torch.uint8)
            order.append((f"{PAD_PREFIX}{len(order)}", pad))
            offset += pad.numel()
        order.append((name, tensor.contiguous()))
        offset += tensor.numel() * tensor.element_size()
    offset = 0
    for name, tensor in order:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % align)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, tensor in order:
            if tensor.numel():
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
