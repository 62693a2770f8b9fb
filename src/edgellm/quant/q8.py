"""A GGUF Q8_0 weight multiplied in place: the model file's own blocks, no converted copy.

Decode-sized inputs (up to kernels.MAX_ROWS rows) go to the native VNNI kernel
(kernels.q8_0_gemv); larger ones (teacher-forced evaluation) dequantize the weight in row
chunks and multiply in bf16. Used for the tied embedding / output head, the largest weight
of both models (Gemma 3: 262k x 640), which the embedding lookup reads from the same bytes."""
from __future__ import annotations

import torch
from torch import nn

from edgellm import kernels
from edgellm.quant.ggml import GGMLType, dequantize

BLOCK_BYTES, BLOCK = 34, 32
_CHUNK_ROWS = 8192


class Q8Linear(nn.Module):
    def __init__(self, raw: torch.Tensor, shape: tuple[int, int]):
        super().__init__()
        self.out_features, self.in_features = shape
        self.rows = raw.view(self.out_features, self.in_features // BLOCK * BLOCK_BYTES)  # a view of the file

    @staticmethod
    def supports(ggml_type: int, shape: tuple[int, ...]) -> bool:
        return ggml_type == GGMLType.Q8_0 and len(shape) == 2 and shape[1] % BLOCK == 0 and kernels.available()

    @property
    def nbytes(self) -> int:
        return self.rows.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= kernels.MAX_ROWS:
            y = kernels.q8_0_gemv(x2, self.rows, self.in_features)
        else:
            xb = x2.to(torch.bfloat16)
            y = torch.cat([xb @ self._dequantized(start).T for start in range(0, self.out_features, _CHUNK_ROWS)], -1)
        return y.reshape(*lead, self.out_features)

    def _dequantized(self, start: int) -> torch.Tensor:
        chunk = self.rows[start:start + _CHUNK_ROWS]
        return dequantize(chunk.reshape(-1), GGMLType.Q8_0, (chunk.shape[0], self.in_features)).to(torch.bfloat16)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, Q8_0 in place"
