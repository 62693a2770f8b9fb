"""Linears multiplied on a GGUF file's own Q5_0 / Q5_K / Q6_K blocks in place, on its Q8_0 blocks
in edgellm's Q8R16 layout (the same bytes, 16 rows interleaved: kernels/q8r16.c), and on edgellm's
INT8 rows (a quantized file's int8 weights, one bf16 scale per row).

Decode-sized inputs (up to kernels.MAX_ROWS rows) go to the native block GEMV
(kernels.block_gemv, one call per fused part); larger ones (prompts, teacher-forced
evaluation) dequantize up to kernels.SCRATCH_ROWS rows at a time into a scratch of the compute
dtype and run PyTorch's GEMM. Used for the tied embedding / output head of both models (Gemma 3:
262k x 640, read by the embedding lookup from the same bytes) and for Gemma 3's Q5_0 / Q8_0 / Q6_K
projections, which as two INT4 planes would read 10 bits per weight instead of 5.5 or 8.5, and as
bf16 (Q6_K) 16 instead of 6.6. One exception, on the x86 kernels: Q5_0 blocks are held as Q8_0
blocks of the same values (widens_q5_0), and so in Q8R16 too."""
from __future__ import annotations

from itertools import groupby
from typing import Callable, NamedTuple, Sequence

import numpy as np

from edgellm import kernels
from edgellm.extras import torch
from edgellm.kernels.buffers import as_array
from edgellm.module import Module
from edgellm.quant.ggml import GGMLType

# ggml type -> (weights, bytes) per block; I8 is edgellm's INT8 rows (scales kept apart)
BLOCKS = {GGMLType.Q8_0: (32, 34), GGMLType.Q5_0: (32, 22), GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210),
          GGMLType.I8: (32, 32)}


def widens_q5_0() -> bool:
    """Whether Q5_0 weights are held as Q8_0 blocks (kernels.q5_0_as_q8_0: the same values, 34 bytes a block
    instead of 22). On the AVX2 kernels unpacking the fifth bits costs more than reading the wider
    blocks: a Q5_0 GEMV streams ~7.5 GB/s where Q8_0 streams ~20 (Zen 3, 2 threads), and Gemma 3
    decodes 3-8 % faster for 22 MB more (AMD EPYC Zen 3, December 2026). On AVX-512 one sequence decodes as
    fast either way, but widened they become Q8R16, whose batch rows cost one vpdpwssd per 16 rows:
    Gemma 3 with 4 streams 142 -> 163-166 tok/s (one stream 59-62 both). NEON is not measured."""
    return kernels.available() and kernels.selected().name in ("avx2", "avx512")


class BlockPart(NamedTuple):
    rows: np.ndarray  # (N, row bytes) uint8: views of the file, or a copy (Q8R16, widened Q5_0)
    type: int  # ggml type number, or kernels.Q8R16
    scale: np.ndarray | None  # I8 only: (N,) bf16 per-row scales (uint16 bits)
    q5_0: bool = False  # Q8R16 blocks holding a widened Q5_0's values (-16..15): the int8 prompt GEMM takes them


INTERLEAVE_CHUNK = 4096  # rows converted to Q8R16 at a time, their file pages dropped after each


def _held(rows: np.ndarray, ggml_type: int, k: int, drop_source) -> BlockPart:
    """A part as the kernels read it best: Q5_0 widened to Q8_0 where that pays (widens_q5_0),
    Q8_0 interleaved into Q8R16."""
    q5_0 = ggml_type == GGMLType.Q5_0 and widens_q5_0()
    if q5_0:
        rows, ggml_type, drop_source = kernels.q5_0_as_q8_0(rows), int(GGMLType.Q8_0), None  # a copy already
    if ggml_type != GGMLType.Q8_0 or rows.shape[0] % kernels.Q8R16_ROWS:
        return BlockPart(rows, ggml_type, None)
    out = np.empty_like(rows)
    for start in range(0, rows.shape[0], INTERLEAVE_CHUNK):
        chunk = rows[start:start + INTERLEAVE_CHUNK]
        kernels.q8_0_as_q8r16(chunk, k, out=out[start:start + INTERLEAVE_CHUNK])
        if drop_source is not None:
            drop_source(chunk)
    return BlockPart(out, kernels.Q8R16, None, q5_0)



class BlockLinear(Module):
    """y = x @ W^T, W the stacked parts sharing K: GGUF (raw blocks, ggml type, (N, K)) weights.

    Q8_0 parts of whole groups of 16 rows are held in edgellm's Q8R16 layout (kernels/q8r16.c: the
    same bytes, 16 rows interleaved), a copy made at load: a decode GEMV then multiplies 16 rows per
    instruction instead of summing each block of each row on its own (Gemma 3's head with 4 rows
    15.7 -> 9.7 ms). `drop_source(view)`, where given, lets the file pages of each converted chunk
    go, so a 178 MB table is never resident twice."""

    def __init__(self, parts: Sequence[tuple[np.ndarray, int, tuple[int, int]]],
                 drop_source: Callable[[np.ndarray], None] | None = None):
        k = parts[0][2][1]
        self._set_parts(k, [_held(as_array(raw).reshape(n, k // BLOCKS[t][0] * BLOCKS[t][1]), int(t), k, drop_source)
                            for raw, t, (n, _) in parts])

    @classmethod
    def from_int8(cls, weights: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> BlockLinear:
        """From (q int8 (N, K), scale (N,)) pairs of edgellm's INT8 scheme, stacked."""
        out = cls.__new__(cls)
        k = weights[0][0].shape[1]
        out._set_parts(k, [BlockPart(as_array(q.contiguous()).view(np.uint8), int(GGMLType.I8),
                                     as_array(scale.to(torch.bfloat16).contiguous())) for q, scale in weights])
        return out

    @classmethod
    def of_parts(cls, k: int, parts: list[BlockPart]) -> BlockLinear:
        """From parts already held as the kernels read them (a pack cache's Q8R16 copies)."""
        out = cls.__new__(cls)
        out._set_parts(k, parts)
        return out

    @property
    def interleaved(self) -> bool:
        """Whether every part is a Q8R16 copy made at load (what a pack cache keeps: the other
        types are read in place from the model file)."""
        return all(p.type == kernels.Q8R16 for p in self.parts)

    def _set_parts(self, k: int, parts: list[BlockPart]) -> None:
        self.in_features, self.parts = k, parts
        self.out_splits = [p.rows.shape[0] for p in parts]
        self.out_features = sum(self.out_splits)

    @property
    def types(self) -> list[int]:
        return [p.type for p in self.parts]

    @staticmethod
    def supports(ggml_type: int, shape: tuple[int, ...]) -> bool:
        return (ggml_type in BLOCKS and ggml_type != GGMLType.I8 and len(shape) == 2
                and shape[1] % BLOCKS[ggml_type][0] == 0 and kernels.available())

    @property
    def nbytes(self) -> int:
        return sum(p.rows.nbytes + (0 if p.scale is None else p.scale.nbytes) for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= kernels.MAX_ROWS:
            outs = [kernels.block_gemv(x2, p.rows, p.type, self.in_features, p.scale) for p in self.parts]
        else:
            outs = self._prompt(x2.to(kernels.compute_dtype()))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y.reshape(*lead, self.out_features)

    def _int8(self, part: BlockPart) -> bool:
        """Whether the int8 prompt GEMM takes the part: widened Q5_0, or Q6_K in whole strips of 16 rows."""
        return part.q5_0 or (part.type == GGMLType.Q6_K and part.rows.shape[0] % 16 == 0 and self.in_features % 256 == 0)

    def _prompt(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each part's product with a prompt's rows: widened Q5_0 and Q6_K parts in the int8 GEMM where this
        build has it (kernels/int8_prompt.py), written in place into one output, the others (or all)
        dequantized for the float GEMM."""
        if x.dtype != torch.float32 or not any(map(self._int8, self.parts)) or not kernels.int8_gemm_native():
            return [kernels.prompt_matmul(x, self._dequantized(chunk)) for chunk in self._chunks(self.parts)]
        int8, y, column = kernels.Int8Prompt(x), torch.empty(x.shape[0], self.out_features), 0
        for integer, parts in groupby(self.parts, key=self._int8):
            if integer:
                for piece in self._pieces(list(parts)):
                    n = piece.rows.shape[0]
                    times = int8.times_q5_0 if piece.q5_0 else int8.times_q6_k
                    times(piece.rows, out=y[:, column:column + n])
                    column += n
            else:
                for chunk in self._chunks(list(parts)):
                    n = sum(piece.rows.shape[0] for piece in chunk)
                    y[:, column:column + n] = kernels.prompt_matmul(x, self._dequantized(chunk))
                    column += n
        return [y]

    @staticmethod
    def _pieces(parts: list[BlockPart]) -> list[BlockPart]:
        """The parts cut into pieces of at most kernels.SCRATCH_ROWS rows."""
        step = kernels.SCRATCH_ROWS
        return [BlockPart(p.rows[start:start + step], p.type, None if p.scale is None else p.scale[start:start + step],
                          p.q5_0) for p in parts for start in range(0, p.rows.shape[0], step)]

    def _chunks(self, parts: list[BlockPart]) -> list[list[BlockPart]]:
        """The parts' rows in order, cut into chunks of at most kernels.SCRATCH_ROWS: one GEMM each."""
        chunks, current, size = [], [], 0
        for part in parts:
            for piece in self._pieces([part]):
                if size + piece.rows.shape[0] > kernels.SCRATCH_ROWS and current:
                    chunks.append(current)
                    current, size = [], 0
                current.append(piece)
                size += piece.rows.shape[0]
        return chunks + [current]

    def _dequantized(self, chunk: list[BlockPart]) -> torch.Tensor:
        n = sum(piece.rows.shape[0] for piece in chunk)
        w = kernels.scratch(n * self.in_features, kernels.compute_dtype()).view(n, self.in_features)
        row = 0
        for piece in chunk:
            end = row + piece.rows.shape[0]
            kernels.blocks_to_float(piece.rows, piece.type, self.in_features, out=w[row:end], row_scale=piece.scale)
            row = end
        return w

    def __repr__(self) -> str:
        names = "+".join("Q8R16" if t == kernels.Q8R16 else GGMLType(t).name for t in self.types)
        return f"BlockLinear(in={self.in_features}, out={self.out_features}, {names})"
