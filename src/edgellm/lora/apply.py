"""Adapters applied without merging on the PyTorch layers (prompts, exact mode, and whatever the
native decoder does not take): each adapted projection adds s B (A x) to its part of the output
(a fused q|k|v or gate|up holds several parts side by side), per row of the batch under that
row's own adapter. The base weights stay as they are, shared and quantized.

A sequence carries the adapter its KV was computed under (`SequenceKV.adapter`, set by the KV
manager that created it), so a model's forward finds each row's adapter in its caches."""
from __future__ import annotations

from typing import Sequence

from edgellm.extras import torch

from edgellm.lora.adapter import Adapter


class RowAdapters:
    """The adapter of each row of a batch (None: that row runs the base alone)."""

    def __init__(self, adapters: Sequence[Adapter | None]):
        self.adapters = list(adapters)
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for row, adapter in enumerate(self.adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(row)
        whole = len(groups) == 1 and None not in self.adapters
        # rows sharing an adapter share one matmul; one adapter for every row: no gather at all
        self.groups = [(a, slice(None) if whole else rows) for a, rows in groups.values()]

    @classmethod
    def of(cls, caches) -> RowAdapters | None:
        """Each row's adapter from a SequenceKV or a BatchKV; None where no row has one."""
        adapters = [getattr(s, "adapter", None) for s in getattr(caches, "sequences", [caches])]
        return cls(adapters) if any(a is not None for a in adapters) else None

    def layer(self, i: int) -> LayerAdapters:
        return LayerAdapters(self, i)


class LayerAdapters:
    """RowAdapters at one layer: what a block's projections call."""

    def __init__(self, rows: RowAdapters, layer: int):
        self.rows, self.i = rows, layer

    def add(self, parts: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (B, T, sum of the parts' widths) = the base's output of x (B, T, in) for the fused
        `parts` (e.g. ("q", "k", "v")), plus each row's s B (A x) on each adapted part."""
        y = y.clone()
        for adapter, rows in self.rows.groups:
            xs, offset = x[rows].float(), 0
            for part in parts:
                width, pair = adapter.widths[part], adapter.pairs.get((self.i, part))
                if pair is not None:
                    a, b_t = (torch.as_tensor(t) for t in pair.dense())  # numpy pairs viewed, training tensors as they are
                    delta = adapter.scale * ((xs @ a.T) @ b_t)
                    y[rows, :, offset:offset + width] += delta.to(y.dtype)
                offset += width
        return y


def add_lora(lora: LayerAdapters | None, parts: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y plus the rows' adapters on `parts` (unchanged where there are none)."""
    return y if lora is None else lora.add(parts, x, y)
