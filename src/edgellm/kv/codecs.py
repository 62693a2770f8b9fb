"""How keys and values are stored: as floats, or quantized per token and head.

INT8: symmetric, one fp32 scale per (token, head) — (D + 4) bytes per head-token.
INT4: asymmetric, scale and minimum (fp16) per group of 32 along head_dim, two values a
byte — D/2 + D/8 bytes. Attention always reads fp32: a cache is decoded when fetched."""
from __future__ import annotations

from typing import Protocol

import torch

from edgellm.errors import InvalidRequest

INT4_GROUP = 32


class Codec(Protocol):
    name: str

    def part_shapes(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]: ...
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor: ...


class FloatCodec:
    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def part_shapes(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"x": (head_dim, self.dtype)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts["x"].float()  # a view when stored in fp32


class Int8Codec:
    name = "int8"

    def part_shapes(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"q": (head_dim, torch.int8), "scale": (1, torch.float32)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127.0
        return {"q": torch.round(x / scale).to(torch.int8), "scale": scale}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts["q"].float() * parts["scale"]


class Int4Codec:
    name = "int4"

    def part_shapes(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        if head_dim % INT4_GROUP:
            raise InvalidRequest(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {head_dim}")
        groups = head_dim // INT4_GROUP
        return {"q": (head_dim // 2, torch.uint8), "scale": (groups, torch.float16), "min": (groups, torch.float16)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        g = x.unflatten(-1, (-1, INT4_GROUP))  # (..., G, 32)
        low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((high - low) / 15.0).clamp_min(1e-8)
        q = torch.round((g - low) / scale).clamp_(0, 15).to(torch.uint8).flatten(-2)  # (..., D)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
        return {"q": packed, "scale": scale.squeeze(-1).half(), "min": low.squeeze(-1).half()}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        packed = parts["q"]
        q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()  # (..., D)
        g = q.unflatten(-1, (-1, INT4_GROUP))
        out = g * parts["scale"].float().unsqueeze(-1) + parts["min"].float().unsqueeze(-1)
        return out.flatten(-2)


CODECS = {
    "f32": lambda: FloatCodec("f32", torch.float32),
    "bf16": lambda: FloatCodec("bf16", torch.bfloat16),
    "f16": lambda: FloatCodec("f16", torch.float16),
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
    return sum(size * torch.empty((), dtype=dtype).element_size() for size, dtype in shapes.values())
