"""Linears multiplied in place on a GGUF file's own Q8_0 / Q5_0 / Q6_K blocks: no converted copy.

Decode-sized inputs (up to kernels.MAX_ROWS rows) go to the native VNNI kernel
(kernels.block_gemv, one call per fused part); larger ones (prompts, teacher-forced
evaluation) dequantize up to kernels.SCRATCH_ROWS rows at a time into a bf16 scratch and run the
bf16 GEMM. Used for the tied embedding / output head of both models (Gemma 3: 262k x 640,
read by the embedding lookup from the same bytes) and for Gemma 3's Q5_0 / Q8_0 / Q6_K
projections, which as two INT4 planes read 10 bits per weight instead of 5.5 or 8.5, and as
bf16 (Q6_K) 16 instead of 6.6."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from edgellm import kernels
from edgellm.quant.ggml import GGMLType

# ggml type -> (weights, bytes) per block
BLOCKS = {GGMLType.Q8_0: (32, 34), GGMLType.Q5_0: (32, 22), GGMLType.Q6_K: (256, 210)}


class BlockLinear(nn.Module):
    """y = x @ W^T, W the stacked parts (raw blocks, ggml type, (N, K)) sharing K."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, int, tuple[int, int]]]):
        super().__init__()
        self.in_features = parts[0][2][1]
        self.types = [int(t) for _, t, _ in parts]
        self.out_splits = [n for _, _, (n, _) in parts]
        self.out_features = sum(self.out_splits)
        row_bytes = [self.in_features // BLOCKS[t][0] * BLOCKS[t][1] for t in self.types]
        self.rows = [raw.view(n, b) for (raw, _, (n, _)), b in zip(parts, row_bytes)]  # views of the file

    @staticmethod
    def supports(ggml_type: int, shape: tuple[int, ...]) -> bool:
        return (ggml_type in BLOCKS and len(shape) == 2 and shape[1] % BLOCKS[ggml_type][0] == 0
                and kernels.available())

    @property
    def nbytes(self) -> int:
        return sum(r.numel() for r in self.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= kernels.MAX_ROWS:
            outs = [kernels.block_gemv(x2, rows, t, self.in_features) for rows, t in zip(self.rows, self.types)]
        else:
            xb = x2.to(torch.bfloat16)
            outs = [F.linear(xb, self._dequantized(chunk)) for chunk in self._chunks()]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y.reshape(*lead, self.out_features)

    def _chunks(self) -> list[list[tuple[torch.Tensor, int]]]:
        """The parts' rows in order, cut into chunks of at most kernels.SCRATCH_ROWS: one GEMM each."""
        chunks, current, size = [], [], 0
        for rows, t in zip(self.rows, self.types):
            for start in range(0, rows.shape[0], kernels.SCRATCH_ROWS):
                piece = rows[start:start + kernels.SCRATCH_ROWS]
                if size + piece.shape[0] > kernels.SCRATCH_ROWS and current:
                    chunks.append(current)
                    current, size = [], 0
                current.append((piece, t))
                size += piece.shape[0]
        return chunks + [current]

    def _dequantized(self, chunk: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        n = sum(piece.shape[0] for piece, _ in chunk)
        w = kernels.scratch_bf16(n * self.in_features).view(n, self.in_features)
        row = 0
        for piece, t in chunk:
            kernels.blocks_to_bf16(piece, t, self.in_features, out=w[row:row + piece.shape[0]])
            row += piece.shape[0]
        return w

    def extra_repr(self) -> str:
        names = "+".join(GGMLType(t).name for t in self.types)
        return f"in={self.in_features}, out={self.out_features}, {names} in place"
