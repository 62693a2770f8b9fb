"""What every model-file reader shares: one private memory mapping of the file, zero-copy
views into it, dropping resident pages, and closing it."""
from __future__ import annotations

import mmap
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from edgellm.errors import ModelFormatError


class MappedFile:
    """A file mapped once. ACCESS_COPY: a private mapping, so views are writable buffers without
    a copy (what PyTorch, where it runs, asks of memory it wraps); pages stay shared with the page
    cache until written (never)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            raise ModelFormatError(self.path, "no such file") from None
        except (ValueError, OSError) as e:  # ValueError: an empty file cannot be mapped
            raise ModelFormatError(self.path, f"cannot map file ({e})") from None
        self._base = np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data  # where offset 0 lies

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes offset..offset+nbytes as a 1-D uint8 view into the mapping (no copy)."""
        if not nbytes:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset)

    def advise_dontneed(self, spans: Iterable[tuple[int, int]]) -> None:
        """Tell the OS the pages of these (start, end) byte spans need not stay resident.

        Once load has converted a weight into a packed copy, the file pages it read would
        otherwise count in RSS until memory pressure evicts them. A view still in use (an
        embedding table) simply faults its pages back in, row by row, on access."""
        if self._map.closed or not hasattr(self._map, "madvise"):
            return
        page = mmap.PAGESIZE
        for start, end in spans:
            start = start // page * page
            if end > start:
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def drop_view(self, view: np.ndarray) -> None:
        """advise_dontneed for the bytes of a contiguous view of this mapping (a chunk of a weight
        just converted into a copy); anything else, nothing."""
        if not isinstance(view, np.ndarray):  # a tensor viewing the mapping (safetensors files)
            view = view.numpy()
        start = view.ctypes.data - self._base
        end = start + view.nbytes
        if 0 <= start and end <= len(self._map):
            self.advise_dontneed([(start, end)])

    @property
    def file_size(self) -> int:
        return len(self._map)

    def close(self) -> None:
        """Release the mapping. Views handed out earlier keep their pages alive until freed."""
        mapping = getattr(self, "_map", None)
        if mapping is not None and not mapping.closed:
            try:
                mapping.close()
            except BufferError:  # arrays still export the buffer; the OS unmaps when they die
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_no_overlap(spans: Iterable[tuple[str, int, int]], fail: Callable[[str], Exception]) -> None:
    """Raise fail(...) if two non-empty (name, offset, nbytes) spans share a byte."""
    previous = None
    for name, offset, nbytes in sorted(spans, key=lambda s: s[1]):
        if not nbytes:
            continue
        if previous is not None and offset < previous[1] + previous[2]:
            raise fail(f"tensors {previous[0]!r} and {name!r} overlap")
        previous = (name, offset, nbytes)
