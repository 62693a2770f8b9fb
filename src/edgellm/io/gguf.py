"""GGUF reader: map the file once, validate every header field, hand out tensors as views.

Layout (little-endian): magic "GGUF", u32 version, u64 tensor_count, u64 kv_count,
kv_count × (string key, u32 value_type, value), tensor_count × (string name, u32 n_dims,
u64 dims[n_dims], u32 ggml_type, u64 offset), padding to `general.alignment`, tensor data.
A string is u64 length + UTF-8 bytes; an array is u32 element type + u64 count + elements.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgellm.errors import ModelFormatError
from edgellm.io.mapped import MappedFile, check_no_overlap
from edgellm.io.strings import StringArray
from edgellm.kernels.scan import first_bad_utf8, gguf_string_ends
from edgellm.quant.ggml import GGMLType, tensor_nbytes

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
_MAX_NESTING = 4
_U64 = struct.Struct("<Q")
_COMPACT_STRINGS = 1024  # string arrays this long (vocabularies, merges) are kept as StringArray

# value_type -> (struct code, numpy dtype) for the fixed-size scalar types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "<u1"), 1: ("b", "<i1"), 2: ("H", "<u2"), 3: ("h", "<i2"),
    4: ("I", "<u4"), 5: ("i", "<i4"), 6: ("f", "<f4"), 7: ("?", "<u1"),
    10: ("Q", "<u8"), 11: ("q", "<i8"), 12: ("d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: outermost first (GGUF stores innermost first)
    ggml_type: int
    offset: int  # absolute, from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLType(self.ggml_type).name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class _Cursor:
    """Bounds-checked sequential reads over the mapped header."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated: {what} at byte {self.pos} needs {n} bytes, file has {self.size}")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, code: str, what: str) -> Any:
        start = self.take(struct.calcsize(code), what)
        return struct.unpack_from("<" + code, self.buf, start)[0]

    def string(self, what: str) -> str:
        length = self.scalar("Q", what)
        start = self.take(length, what)
        try:
            return self.buf[start:start + length].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {start + e.start})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and depth < _MAX_NESTING:
            return self.array(what, depth + 1)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def check_utf8(self, spans: np.ndarray, what: str) -> None:
        bad = first_bad_utf8(np.frombuffer(self.buf, np.uint8), spans)
        if bad is None:
            bad = self._first_bad_utf8(spans)
        if bad >= 0:
            start, end = spans[bad].tolist()
            try:
                self.buf[start:end].decode("utf-8")
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{bad}] is not valid UTF-8 ({e.reason})") from None
            raise self.fail(f"{what}[{bad}] is not valid UTF-8")

    def _first_bad_utf8(self, spans: np.ndarray) -> int:
        """check_utf8's test in Python, where the native library cannot run: the whole run at
        once, its 8-byte length fields (between consecutive strings) blanked to ASCII spaces, so a
        string cut mid-character still fails against its neighbour; string by string only then."""
        base, stop = int(spans[0, 0]), int(spans[-1, 1])
        run = np.frombuffer(self.buf, np.uint8, count=stop - base, offset=base).copy()
        fields = spans[1:, 0] - base - 8
        for k in range(8):
            run[fields + k] = 0x20
        try:
            str(memoryview(run), "utf-8")
            return -1
        except UnicodeDecodeError:
            pass
        for i, (start, end) in enumerate(spans.tolist()):
            try:
                self.buf[start:end].decode("utf-8")
            except UnicodeDecodeError:
                return i
        return -1

    def array(self, what: str, depth: int) -> Any:
        etype = self.scalar("I", what)
        count = self.scalar("Q", what)
        if etype in _SCALARS:
            code, dtype = _SCALARS[etype]
            start = self.take(count * struct.calcsize(code), what)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).copy()
            return values.astype(bool) if etype == 7 else values
        least = 8 if etype == _STRING else 1  # bytes an element takes at the least (a string: its length)
        if count * least > self.size - self.pos:
            raise self.fail(f"{what} claims {count} elements, more than the file can hold")
        if etype == _STRING and count >= _COMPACT_STRINGS:
            return self.strings(count, what)
        return [self.value(etype, f"{what}[{i}]", depth) for i in range(count)]

    def strings(self, count: int, what: str) -> StringArray:
        """A long string array (a vocabulary, merges) as one compact StringArray, each element
        checked to be UTF-8 as string() does."""
        first = self.pos
        scanned = gguf_string_ends(np.frombuffer(self.buf, np.uint8), first, count)
        if scanned is None:
            stops = self._string_ends(count, what)
        else:
            stops, bad = scanned
            if bad >= 0:
                at = int(stops[bad - 1]) if bad else first
                raise self.fail(f"truncated: {what}[{bad}] at byte {at}")
        self.pos = int(stops[-1])
        starts = np.concatenate(([first], stops[:-1])) + 8  # each string follows its 8-byte length
        spans = np.stack([starts, stops], axis=1)
        self.check_utf8(spans, what)
        return StringArray.from_spans(self.buf, spans)

    def _string_ends(self, count: int, what: str) -> np.ndarray:
        """strings()' walk in Python, where the native library is not ready."""
        buf, pos, size, length_at = self.buf, self.pos, self.size, _U64.unpack_from
        ends = np.empty(count, np.int64)  # pages taken as filled: a false count fails before it costs
        i = 0
        try:
            for i in range(count):  # one read and one add a string
                pos += 8 + length_at(buf, pos)[0]
                ends[i] = pos
        except (struct.error, OverflowError):  # a length field past the end of the file
            raise self.fail(f"truncated: {what}[{i}] at byte {pos}") from None
        if pos > size:
            raise self.fail(f"truncated: {what} ends at byte {pos}, file has {size}")
        return ends


class GGUFFile(MappedFile):
    """A memory-mapped, validated GGUF file. Tensors are zero-copy views into the mapping."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- parsing -------------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(self._map, self.path)
        if self._map[:4] != MAGIC:
            raise cur.fail("not a GGUF file (bad magic)")
        if cur.size < 24:
            raise cur.fail(f"truncated: {cur.size} bytes is smaller than a GGUF header")
        cur.take(4, "magic")
        self.version = cur.scalar("I", "version")
        if self.version not in SUPPORTED_VERSIONS:
            raise cur.fail(f"unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.scalar("Q", "tensor count")
        n_kv = cur.scalar("Q", "metadata count")
        # Each entry needs well over 8 bytes; bigger counts are corruption, not large models.
        if n_tensors > cur.size // 8 or n_kv > cur.size // 8:
            raise cur.fail(f"implausible counts: {n_tensors} tensors, {n_kv} metadata entries")
        self.metadata = self._read_metadata(cur, n_kv)
        self.alignment = self._alignment(cur)
        infos = [self._read_tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = self._place_tensors(cur, infos)

    def _read_metadata(self, cur: _Cursor, n_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in metadata:
                raise cur.fail(f"duplicate metadata key {key!r}")
            vtype = cur.scalar("I", f"type of {key!r}")
            metadata[key] = cur.value(vtype, f"metadata {key!r}")
        return metadata

    def _alignment(self, cur: _Cursor) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment {alignment!r} is not a positive power of two")
        return alignment

    def _read_tensor_info(self, cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string(f"tensor name #{index}")
        n_dims = cur.scalar("I", f"dims of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        dims = [cur.scalar("Q", f"dims of {name!r}") for _ in range(n_dims)]
        if any(d == 0 or d > cur.size * 256 for d in dims):
            raise cur.fail(f"tensor {name!r} has impossible dimensions {dims}")
        ggml_type = cur.scalar("I", f"type of {name!r}")
        offset = cur.scalar("Q", f"offset of {name!r}")
        return name, tuple(reversed(dims)), ggml_type, offset

    def _place_tensors(self, cur: _Cursor, infos: list) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            if name in tensors:
                raise cur.fail(f"duplicate tensor name {name!r}")
            try:
                nbytes = tensor_nbytes(ggml_type, int(np.prod(shape, dtype=np.uint64)))
            except ValueError as e:
                raise cur.fail(f"tensor {name!r}: {e}") from None
            if offset % self.alignment:
                raise cur.fail(f"tensor {name!r} offset {offset} is not aligned to {self.alignment}")
            start = self.data_offset + offset
            if start + nbytes > cur.size:
                raise cur.fail(
                    f"truncated: tensor {name!r} needs bytes {start}..{start + nbytes}, "
                    f"file has {cur.size}")
            tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
        check_no_overlap(((t.name, t.offset, t.nbytes) for t in tensors.values()), cur.fail)
        return tensors

    # -- access --------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a 1-D uint8 view into the mapping (no copy)."""
        info = self.tensors[name]
        return self.view(info.offset, info.nbytes)

    def drop_pages(self, names: list[str] | None = None) -> None:
        """Let the OS drop these tensors' (default: all) resident pages (MappedFile.advise_dontneed)."""
        chosen = [(self.data_offset, self.file_size)] if names is None else [
            (self.tensors[n].offset, self.tensors[n].offset + self.tensors[n].nbytes) for n in names]
        self.advise_dontneed(chosen)


def open_gguf(path: str | Path) -> GGUFFile:
    """Map and validate a GGUF file; raises ModelFormatError naming the file and the problem."""
    return GGUFFile(path)
