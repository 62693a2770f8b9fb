"""The memory the C library reads and writes, by address: numpy arrays (the core runtime's buffers:
weights, KV pages, activations) or PyTorch tensors (the PyTorch layers', where torch is loaded).
bf16, which numpy lacks, is held as uint16 bit patterns."""
from __future__ import annotations

import numpy as np

from edgellm.extras import torch, torch_loaded


def address(x) -> int | None:
    """Where x's first element lies (None for None)."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    return x.data_ptr()


def aligned_bytes(n: int, alignment: int = 64) -> np.ndarray:
    """n bytes of scratch starting on an `alignment` boundary (a cache line: the C kernels' buffers)."""
    raw = np.empty(n + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + n]


def as_array(x) -> np.ndarray:
    """x as a numpy array sharing its memory (a bf16 tensor as uint16 bits)."""
    if isinstance(x, np.ndarray):
        return x
    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
        return x.numpy().view(np.uint16)
    return x.numpy()


def is_tensor(x) -> bool:
    """Whether x is a PyTorch tensor (without importing torch to find out)."""
    return torch_loaded() and isinstance(x, torch.Tensor)


def as_tensor(x, bf16: bool = False):
    """x as a PyTorch tensor sharing its memory (uint16 bits as bf16 where `bf16`)."""
    if not isinstance(x, np.ndarray):
        return x
    t = torch.from_numpy(x)
    return t.view(torch.bfloat16) if bf16 else t


def like(result: np.ndarray, x):
    """`result` in x's kind: a tensor where x is one, else the array."""
    return torch.from_numpy(result) if is_tensor(x) else result
