"""Linears and embeddings over edgellm's own schemes (quant/schemes.py).

INT8 runs on torch's `_weight_int8pack_mm` straight from the file's int8 rows (zero-copy);
INT4 on `_weight_int4pack_mm_for_cpu` after a fast repack of the nibbles into the kernel's
ISA-specific layout. Parts of a fused projection that share a scheme become one matmul;
parts that do not (a mixed recipe with int8 q/k/v but int4 elsewhere is fine, q int8 with
k int4 is not fusable) run one matmul each and are concatenated."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from edgellm.quant.linear import DenseLinear, Int4Linear
from edgellm.quant.schemes import QuantizedWeight


class Int8Linear(nn.Module):
    """y = x @ (q · s)^T with q int8 (N, K) per-output-channel scales; bf16 activations."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16).contiguous())
        self.out_features, self.in_features = q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)
        return y.reshape(*lead, self.out_features)


class ConcatLinear(nn.Module):
    """Several linears over the same input whose outputs are concatenated."""

    def __init__(self, parts: Sequence[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [p(x) for p in self.parts]
        dtype = torch.float32 if any(o.dtype == torch.float32 for o in outs) else torch.bfloat16
        return torch.cat([o.to(dtype) for o in outs], dim=-1)


def make_quantized_linear(parts: Sequence[QuantizedWeight], mode: str) -> nn.Module:
    """One linear for parts stacked along N; `out_splits` lists each part's N."""
    if mode == "exact":
        module: nn.Module = DenseLinear(torch.cat([p.dequantize() for p in parts]), torch.float32)
    elif len({p.scheme for p in parts}) == 1:
        module = _one_kernel(parts)
    else:
        return concat_linears([make_quantized_linear([p], mode) for p in parts])
    module.out_splits = [p.shape[0] for p in parts]
    return module


def concat_linears(linears: Sequence[nn.Module]) -> nn.Module:
    module = ConcatLinear(linears)
    module.out_splits = [p.out_features for p in linears]
    return module


def _one_kernel(parts: Sequence[QuantizedWeight]) -> nn.Module:
    scheme = parts[0].scheme
    cat = lambda ts: ts[0] if len(ts) == 1 else torch.cat(ts)  # noqa: E731
    if scheme.kind == "int8":
        return Int8Linear(cat([p.q for p in parts]), cat([p.scale for p in parts]))
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    if not Int4Linear.supports(n, k, scheme.group):  # odd N: the kernel's row blocking cannot take it
        return DenseLinear(cat([p.dequantize() for p in parts]), torch.bfloat16)
    scale = cat([p.scale for p in parts])
    zero = cat([p.zero if p.zero is not None else torch.zeros_like(p.scale) for p in parts])
    q = cat([p.values() for p in parts])
    # The kernel computes (q - 8)·s + z, exactly our storage form.
    return Int4Linear(q, scale, zero, group=scheme.group)


class QuantizedEmbedding(nn.Module):
    """Embedding rows looked up from a QuantizedWeight (the file's mapped bytes); only the
    rows asked for are dequantized."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.take_rows(ids.reshape(-1))
        return rows.dequantize().reshape(*ids.shape, self.dim)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes
