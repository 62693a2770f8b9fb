"""Process memory: keep resident memory equal to what is really in use.

Loading a model makes many large short-lived temporaries (dequantized blocks, packing
buffers). glibc's malloc raises its mmap threshold after such frees and then keeps later
ones on its heap, so RSS stays hundreds of MB above the live data. A fixed threshold makes
every large buffer its own mapping, returned to the OS the moment it is freed."""
from __future__ import annotations

import ctypes
import ctypes.util
import resource
from functools import lru_cache

import psutil

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
LARGE_ALLOCATION = 1 << 20  # bytes; at or above this, malloc maps pages directly


@lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def return_large_frees_to_os() -> bool:
    """Pin glibc's mmap threshold (no-op elsewhere); returns whether it applied."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION) == 1
    return ok and libc.mallopt(_M_TRIM_THRESHOLD, 4 * LARGE_ALLOCATION) == 1


def trim() -> None:
    """Hand freed heap pages back to the OS (after a load's temporaries are gone)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """High-water mark of resident memory for this process."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
