"""Token embeddings that stay in their file format: rows are dequantized when looked up."""
from __future__ import annotations

import numpy as np

from edgellm import kernels
from edgellm.extras import torch
from edgellm.kernels.buffers import as_array
from edgellm.module import Module
from edgellm.quant.ggml import dequantize


class BlockEmbedding(Module):
    """An embedding table kept as raw GGUF rows (any block type whose blocks tile a row), or as
    the Q8R16 copy a tied output head holds (kernels/q8r16.c: one table for both).

    Only the looked-up rows are ever dequantized, so a 262k-row table costs its file
    bytes, not 4 bytes per weight."""

    def __init__(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int]):
        self.ggml_type = ggml_type
        self.num_embeddings, self.dim = shape
        self.rows = as_array(raw).reshape(self.num_embeddings, -1)  # (V, bytes per row), still a view

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.ggml_type == kernels.Q8R16:
            return kernels.q8r16_rows(self.rows, self.dim, flat).reshape(*ids.shape, self.dim)
        picked = torch.from_numpy(self.rows).index_select(0, flat).reshape(-1)
        out = dequantize(picked, self.ggml_type, (flat.numel(), self.dim))
        return out.reshape(*ids.shape, self.dim)

    def dequantized(self) -> torch.Tensor:
        """The whole table in fp32 (for a tied output head)."""
        if self.ggml_type == kernels.Q8R16:
            out = torch.empty(self.num_embeddings, self.dim)
            return kernels.blocks_to_float(self.rows, self.ggml_type, self.dim, out=out)
        return dequantize(self.rows.reshape(-1), self.ggml_type, (self.num_embeddings, self.dim))

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes
