"""Process memory: keep resident memory equal to what is really in use, without paying for it
in page faults.

Loading a model makes many large short-lived temporaries (dequantized blocks, packing
buffers). glibc's malloc raises its mmap threshold after such frees and then keeps later
ones on its heap, so RSS stays hundreds of MB above the live data. A fixed threshold makes
every large buffer its own mapping, returned to the OS the moment it is freed.

Inference is the opposite case: a prefill allocates and frees the same few-MB activations in
every layer, and as fresh mappings each is faulted in and zeroed page by page again (Gemma 3,
512 tokens: 250 ms against 176 ms with reused pages). So after loading, buffers up to 16 MB
come from the heap and freed pages stay there for the next layer; a finished generation
trims them (return_freed_heap())."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
import threading
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator

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


def _set_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """glibc's fixed mmap and trim thresholds, process-wide (no-op elsewhere); whether it applied."""
    libc = _libc()
    if libc is None:
        return False
    return libc.mallopt(_M_MMAP_THRESHOLD, mmap_bytes) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1


def return_large_frees_to_os() -> bool:
    """Every buffer from 1 MB on its own mapping, returned the moment it is freed (loading)."""
    return _set_thresholds(LARGE_ALLOCATION, 4 * LARGE_ALLOCATION)


def reuse_freed_pages() -> bool:
    """Buffers up to 16 MB from the heap, up to 32 MB of freed pages kept for reuse (inference)."""
    return _set_thresholds(16 * LARGE_ALLOCATION, 32 * LARGE_ALLOCATION)


def return_freed_heap() -> None:
    """Hand freed heap pages back to the OS (after a load's temporaries are gone)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """High-water mark of resident memory for this process."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


_paused = threading.Lock()
_pause_depth = 0
_collector_was_on = False
_settled_fully = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a model is built (and torch imported, where a path needs
    it): objects that live as long as the process (~40k without torch, ~300k with it), and every
    collection pass on the way walks all those made before it (0.3 s of SmolLM2's 1.4 s load when
    torch was imported by every load). Nested and concurrent loads share one
    pause; the collector's state before the first is restored after the last.

    Where the collector comes back on, the objects the pause made are collected at once
    (`_settle`), not by whichever allocation of a later request comes first."""
    global _pause_depth, _collector_was_on
    with _paused:
        if _pause_depth == 0:
            _collector_was_on = gc.isenabled()
            gc.disable()
        _pause_depth += 1
    try:
        yield
    finally:
        with _paused:
            _pause_depth -= 1
            if _pause_depth == 0 and _collector_was_on:
                _settle()  # before the collector is back on: an allocation would start a pass of its own
                gc.enable()


def _settle() -> None:
    """Collect what a pause made: the first time in a process fully, later young generations only.
    The first pause may end with torch's ~170k objects waiting for a full collection, which, left to
    itself, walks them inside some later request (~90 ms in the second 500-token prefill after a
    SmolLM2 load on a Zen 5). Later loads add 6-16k objects, not a full collection's worth; a full one
    at each would walk everything again per load in a long-lived process (a test run, hot swaps)."""
    global _settled_fully
    if gc.get_count()[0] <= gc.get_threshold()[0]:  # too few to start even a young pass
        return
    gc.collect(1 if _settled_fully else 2)
    _settled_fully = True


def keep_out_of_collections() -> None:
    """For a process that keeps its model for life (the CLI's commands, `edgellm serve`): every
    object so far (~40k: edgellm and the model; ~300k with torch) goes to the collector's permanent generation,
    which it never scans (gc.freeze). Otherwise the first collection after a load scans them all
    (~100 ms, inside the first request) and every full collection after it again. Not for a
    library's callers: a model dropped later would never be collected."""
    gc.freeze()
