"""Walking and checking a GGUF file's long string arrays (vocabularies, merges) natively
(gguf_strings.c)."""
from __future__ import annotations

import numpy as np

from edgellm.kernels.build import library_if_ready


def gguf_string_ends(buf: np.ndarray, pos: int, count: int) -> tuple[np.ndarray, int] | None:
    """(ends, first_bad): the end of each of `count` strings laid out from byte `pos` of `buf`
    (uint8), first_bad -1 when all fit in `buf`, else the index of the first that does not (ends
    before it are filled). None where the native library cannot run."""
    lib = library_if_ready()
    if lib is None:
        return None
    ends = np.empty(count, np.int64)
    done = lib.edgellm_gguf_string_ends(buf.ctypes.data, len(buf), pos, count, ends.ctypes.data)
    return ends, (-1 if done >= 0 else -done - 1)


def first_bad_utf8(buf: np.ndarray, spans: np.ndarray) -> int | None:
    """The index of the first span (start, end) of `buf` (uint8) that is not well-formed UTF-8,
    -1 when all are; None where the native library is not ready."""
    lib = library_if_ready()
    if lib is None:
        return None
    starts, ends = np.ascontiguousarray(spans[:, 0], np.int64), np.ascontiguousarray(spans[:, 1], np.int64)
    if len(spans) and (int(starts.min()) < 0 or int(ends.max()) > len(buf) or bool((ends < starts).any())):
        raise ValueError("string spans must lie inside the buffer")
    return int(lib.edgellm_first_bad_utf8(buf.ctypes.data, starts.ctypes.data, ends.ctypes.data, len(spans)))
