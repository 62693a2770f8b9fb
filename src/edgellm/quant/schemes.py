"""Quantization schemes of our own: INT8 per output channel, INT4 in groups along K.

Every scheme is stored in the form the CPU kernels consume, so a quantized file maps
straight into them:

    int8          w[n, k] = q[n, k] · s[n]                       q ∈ [-127, 127]
    int4-gG       w[n, k] = (q[n, k] - 8) · s[n, g] + z[n, g]    q ∈ [0, 15], g = k // G

Symmetric INT4 has z = 0 and takes its scale from the group's largest-magnitude value,
which lands exactly on -8 (the sign of s absorbs the direction), as llama.cpp's Q4_0 does.
Asymmetric INT4 spans [min, max] with 16 levels. Scales and offsets are bf16 — what the
kernels read — and q is rounded against the bf16 values, so dequantize() here equals what
the kernels multiply by."""
from __future__ import annotations

import re
from dataclasses import dataclass

from edgellm.extras import torch

GROUPS = (32, 64, 128)
FLOAT_SCHEMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}  # PyTorch's dtype names
_INT4 = re.compile(r"^int4-g(\d+)(?:-(sym|asym))?$")


@dataclass(frozen=True)
class Scheme:
    """One weight format: 'int8', 'int4-g64' (symmetric), 'int4-g32-asym', or a float dtype."""

    kind: str  # "int8" | "int4" | "float"
    group: int = 0  # int4 only
    symmetric: bool = True
    dtype: str = ""  # float only: f32 | f16 | bf16

    @classmethod
    def parse(cls, text: str) -> Scheme:
        text = text.strip().lower()
        if text == "int8":
            return cls("int8")
        if text in FLOAT_SCHEMES:
            return cls("float", dtype=text)
        m = _INT4.match(text)
        if m and int(m.group(1)) in GROUPS:
            return cls("int4", int(m.group(1)), m.group(2) != "asym")
        raise ValueError(f"unknown weight scheme {text!r} (int8, int4-g32|g64|g128[-sym|-asym], bf16, f16, f32)")

    @property
    def name(self) -> str:
        if self.kind == "int4":
            return f"int4-g{self.group}" + ("" if self.symmetric else "-asym")
        return self.dtype if self.kind == "float" else self.kind

    def with_group(self, group: int) -> Scheme:
        return Scheme(self.kind, group, self.symmetric, self.dtype)

    def __str__(self) -> str:
        return self.name


@dataclass
class QuantizedWeight:
    """An (N, K) weight in an integer scheme. int8: q int8 (N, K), scale (N,). int4: q uint8
    (N, K // 2) with column 2j in the low nibble of byte j, scale and zero (N, K // group)."""

    scheme: Scheme
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, packed_k = self.q.shape
        return n, packed_k * (2 if self.scheme.kind == "int4" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero) if t is not None)

    def values(self) -> torch.Tensor:
        """q as integers (N, K): int8 values, or int4 values 0..15."""
        if self.scheme.kind == "int8":
            return self.q
        return torch.stack([self.q & 15, self.q >> 4], dim=-1).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        """fp32 (N, K)."""
        if self.scheme.kind == "int8":
            return self.q.float() * self.scale.float()[:, None]
        n, k = self.shape
        g = self.scheme.group
        q = self.values().float().view(n, k // g, g) - 8
        w = q * self.scale.float()[..., None]
        if self.zero is not None:
            w = w + self.zero.float()[..., None]
        return w.reshape(n, k)

    def take_rows(self, rows) -> QuantizedWeight:
        """The same weight with its output rows (an index array or tensor) reordered (each row is
        self-contained)."""
        index = torch.as_tensor(rows)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return QuantizedWeight(self.scheme, pick(self.q), pick(self.scale), pick(self.zero))


def quantize(w: torch.Tensor, scheme: Scheme) -> QuantizedWeight:
    """Quantize an (N, K) float weight; K must be a multiple of the group."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    w = w.float()
    if scheme.kind == "int8":
        return _int8(w)
    if scheme.kind == "int4":
        if w.shape[1] % scheme.group:
            raise ValueError(f"K = {w.shape[1]} is not a multiple of the group {scheme.group}")
        return _int4(w, scheme)
    raise ValueError(f"{scheme} is not an integer scheme")


def _int8(w: torch.Tensor) -> QuantizedWeight:
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(Scheme("int8"), q, scale)


def _int4(w: torch.Tensor, scheme: Scheme) -> QuantizedWeight:
    n, k = w.shape
    groups = w.view(n, k // scheme.group, scheme.group)
    if scheme.symmetric:
        extreme = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        scale = _nonzero(-extreme / 8).to(torch.bfloat16)
        zero = None
        q = groups / scale.float()[..., None] + 8
    else:
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = _nonzero((high - low) / 15).to(torch.bfloat16)
        zero = (low + 8 * scale.float()).to(torch.bfloat16)
        q = (groups - zero.float()[..., None]) / scale.float()[..., None] + 8
    q = torch.round(q).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return QuantizedWeight(scheme, q[:, 0::2] | (q[:, 1::2] << 4), scale, zero)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero group would divide by zero; any scale reproduces it exactly.
    return torch.where(scale == 0, torch.ones_like(scale), scale)
