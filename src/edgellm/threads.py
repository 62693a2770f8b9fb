"""Thread settings: one intra-op thread per physical core unless told otherwise."""
from __future__ import annotations

import psutil
import torch

from edgellm.errors import InvalidRequest


def default_threads() -> int:
    # Physical, not logical: SMT siblings share the FPUs and slow GEMV down.
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def configure_threads(threads: int | None = None) -> int:
    if threads is not None and threads < 1:
        raise InvalidRequest(f"threads must be >= 1, got {threads}")
    n = threads or default_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
