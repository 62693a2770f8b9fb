"""Thread settings: one thread per physical core unless told otherwise. edgellm holds the count
its kernels share their work with (`current`); PyTorch, where it is loaded, is told the same."""
from __future__ import annotations

import os
import sys

import psutil

from edgellm.errors import InvalidRequest

_configured: int | None = None
_default: int | None = None  # default_threads(), once (psutil reads /sys)


def default_threads() -> int:
    # Physical, not logical: SMT siblings share the FPUs and slow GEMV down.
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


BUSY_CORE = 50.0  # percent: a core this busy with other work is not free


def free_cores(sample_s: float = 0.3) -> int:
    """Physical cores not busy with other processes right now (at least 1). Measured: with
    another process spinning on one of two cores, 2 threads decoded at 0.8-2 tok/s and 1 thread
    at 18-21 (OpenMP's threads wait for the slowest), so a long-running server starts with the
    cores that are actually free."""
    busy = sum(1 for load in psutil.cpu_percent(interval=sample_s, percpu=True) if load >= BUSY_CORE)
    logical = psutil.cpu_count() or 1
    free_share = max(0, logical - busy) / logical
    return max(1, round(default_threads() * free_share))


def configure_threads(threads: int | None = None) -> int:
    """Set the threads every kernel call takes from now on (default: one per physical core), and
    PyTorch's: at once where it is loaded, else through OMP_NUM_THREADS, which it reads when imported."""
    global _configured
    if threads is not None and threads < 1:
        raise InvalidRequest(f"threads must be >= 1, got {threads}")
    _configured = n = threads or default_threads()
    torch = sys.modules.get("torch")  # never imported for this: the core runtime has no torch
    if torch is None:
        os.environ["OMP_NUM_THREADS"] = str(n)
    elif torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def current() -> int:
    """The threads a kernel call shares its work with: as configured, else one per physical core."""
    global _default
    if _configured:
        return _configured
    if _default is None:
        _default = default_threads()
    return _default
