"""How keys and values are stored: as floats, or quantized per token and head.

INT8: symmetric, one fp16 scale per group of 16 along head_dim — D + D/8 bytes per
head-token (Gemma's normed keys have outlier channels; one scale per head cost 2 % top-1).
INT4: asymmetric, scale and minimum (fp16) per group of 32, two values a
byte — D/2 + D/8 bytes. Attention always reads fp32: a cache is decoded when fetched."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from edgellm.errors import InvalidRequest
from edgellm.extras import torch

GROUP = 32  # elements per quantization group along head_dim
INT8_GROUP = 16  # finer for INT8: scales cost D/8 bytes, and top-1 vs bf16 KV reaches 98 %


# a part's dtype (PyTorch's name) -> how numpy stores it (bf16 as its 16 bits)
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8, "uint8": np.uint8}


def storage_dtype(name: str) -> np.dtype:
    return np.dtype(_STORAGE[name])


def _check_groups(head_dim: int) -> None:
    if head_dim % GROUP:  # a multiple of 32 is one of 16 too
        raise InvalidRequest(f"quantized KV needs head_dim divisible by {GROUP}, got {head_dim}")


class Codec(Protocol):
    name: str

    def part_shapes(self, head_dim: int) -> dict[str, tuple[int, str]]: ...  # name -> (size, dtype name)
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor: ...


class FloatCodec:
    def __init__(self, name: str, dtype: str):
        self.name, self.dtype = name, dtype  # dtype: PyTorch's name for it

    def part_shapes(self, head_dim: int) -> dict[str, tuple[int, str]]:
        return {"x": (head_dim, self.dtype)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts["x"].float()  # a view when stored in fp32


class Int8Codec:
    name = "int8"

    def part_shapes(self, head_dim: int) -> dict[str, tuple[int, str]]:
        _check_groups(head_dim)
        return {"q": (head_dim, "int8"), "scale": (head_dim // INT8_GROUP, "float16")}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        g = x.unflatten(-1, (-1, INT8_GROUP))  # (..., G, 16)
        scale = (g.abs().amax(-1, keepdim=True) / 127.0).half().float().clamp_min(1e-8)
        q = torch.round(g / scale).clamp_(-127, 127).to(torch.int8).flatten(-2)
        return {"q": q, "scale": scale.squeeze(-1).half()}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        g = parts["q"].float().unflatten(-1, (-1, INT8_GROUP))
        return (g * parts["scale"].float().unsqueeze(-1)).flatten(-2)


class Int4Codec:
    name = "int4"

    def part_shapes(self, head_dim: int) -> dict[str, tuple[int, str]]:
        _check_groups(head_dim)
        groups = head_dim // GROUP
        return {"q": (head_dim // 2, "uint8"), "scale": (groups, "float16"), "min": (groups, "float16")}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        g = x.unflatten(-1, (-1, GROUP))  # (..., G, 32)
        low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((high - low) / 15.0).clamp_min(1e-8)
        q = torch.round((g - low) / scale).clamp_(0, 15).to(torch.uint8).flatten(-2)  # (..., D)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
        return {"q": packed, "scale": scale.squeeze(-1).half(), "min": low.squeeze(-1).half()}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        packed = parts["q"]
        q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()  # (..., D)
        g = q.unflatten(-1, (-1, GROUP))
        out = g * parts["scale"].float().unsqueeze(-1) + parts["min"].float().unsqueeze(-1)
        return out.flatten(-2)


CODECS = {
    "f32": lambda: FloatCodec("f32", "float32"),
    "bf16": lambda: FloatCodec("bf16", "bfloat16"),
    "f16": lambda: FloatCodec("f16", "float16"),
    "int8": Int8Codec,
    "int4": Int4Codec,
}


def codec(name: str) -> Codec:
    if name not in CODECS:
        raise InvalidRequest(f"unknown KV precision {name!r} (choose from {', '.join(CODECS)})")
    return CODECS[name]()


def bytes_per_head_token(name: str, head_dim: int) -> int:
    """Storage for one token of one head, for one of K or V."""
    shapes = codec(name).part_shapes(head_dim)
    return sum(size * storage_dtype(dtype).itemsize for size, dtype in shapes.values())
