"""Linears and embeddings over edgellm's own schemes (quant/schemes.py).

INT8 runs on the native block GEMV straight from the file's int8 rows (zero-copy, quant/blocks.py);
INT4 on the native INT4 kernels after a fast repack of the nibbles into edgellm's I4R64 layout.
Without native kernels both become dense in the compute dtype. Parts of a fused projection that
share a scheme become one matmul; parts that do not (a mixed recipe with int8 q/k/v but int4
elsewhere is fine, q int8 with k int4 is not fusable) run one matmul each and are concatenated."""
from __future__ import annotations

from typing import Sequence

from edgellm import kernels
from edgellm.extras import torch
from edgellm.module import Module
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.linear import DenseLinear, Int4Linear, fast_dtype
from edgellm.quant.schemes import QuantizedWeight


class ConcatLinear(Module):
    """Several linears over the same input whose outputs are concatenated."""

    def __init__(self, parts: Sequence[Module]):
        self.parts = list(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [p(x) for p in self.parts]
        dtype = torch.float32 if any(o.dtype == torch.float32 for o in outs) else outs[0].dtype
        return torch.cat([o.to(dtype) for o in outs], dim=-1)


def make_quantized_linear(parts: Sequence[QuantizedWeight], mode: str) -> Module:
    """One linear for parts stacked along N; `out_splits` lists each part's N."""
    if mode == "exact":
        module: Module = DenseLinear(torch.cat([p.dequantize() for p in parts]), torch.float32)
    elif len({p.scheme for p in parts}) == 1:
        module = _one_kernel(parts)
    else:
        return concat_linears([make_quantized_linear([p], mode) for p in parts])
    module.out_splits = [p.shape[0] for p in parts]
    return module


def concat_linears(linears: Sequence[Module]) -> Module:
    module = ConcatLinear(linears)
    module.out_splits = [n for p in linears for n in getattr(p, "out_splits", [p.out_features])]
    return module


def _one_kernel(parts: Sequence[QuantizedWeight]) -> Module:
    scheme = parts[0].scheme
    cat = lambda ts: ts[0] if len(ts) == 1 else torch.cat(ts)  # noqa: E731
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    if scheme.kind == "int8" and kernels.available() and k % 32 == 0:
        return BlockLinear.from_int8([(p.q, p.scale) for p in parts])
    if scheme.kind == "int8" or not Int4Linear.supports(n, k, scheme.group):  # no kernels, or an odd shape
        return DenseLinear(cat([p.dequantize() for p in parts]), fast_dtype())
    scale = cat([p.scale for p in parts])
    zero = cat([p.zero if p.zero is not None else torch.zeros_like(p.scale) for p in parts])
    q = cat([p.values() for p in parts])
    # The kernel computes (q - 8)·s + z, exactly our storage form.
    return Int4Linear(q, scale, zero, group=scheme.group)


class QuantizedEmbedding(Module):
    """Embedding rows looked up from a QuantizedWeight (the file's mapped bytes); only the
    rows asked for are dequantized."""

    def __init__(self, weight: QuantizedWeight):
        self.weight = weight
        self.num_embeddings, self.dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.take_rows(ids.reshape(-1))
        return rows.dequantize().reshape(*ids.shape, self.dim)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes
