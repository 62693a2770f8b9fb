"""The bridge from a model file to modules: names in, norms / linears / embeddings out.

Models ask for weights by their GGUF names; they never see bytes or files."""
from __future__ import annotations

from itertools import groupby
from typing import Any, Mapping, Protocol

import numpy as np

from edgellm import kernels
from edgellm.errors import ModelFormatError
from edgellm.kernels.buffers import as_array
from edgellm.module import Module
from edgellm.quant.embedding import BlockEmbedding
from edgellm.quant.ggml import AFFINE_BITS, float_vector
from edgellm.quant.linear import make_fused_linear
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.packed import QuantizedEmbedding, concat_linears, make_quantized_linear
from edgellm.quant.schemes import QuantizedWeight


class TensorSource(Protocol):
    """What a format reader offers (GGUFFile does): metadata, tensor infos, raw bytes."""

    path: Any
    metadata: Mapping[str, Any]
    tensors: Mapping[str, Any]

    def raw(self, name: str): ...  # uint8, 1-D: a numpy view (GGUF) or a tensor (safetensors files)

    # Optional (edgellm's quantized files): a weight in one of our own schemes, else None.
    # def quantized(self, name: str) -> QuantizedWeight | None: ...


class Weights:
    """Hands out a model's weights in the representation `mode` asks for.

    mode "exact": fp32 everything (reference grade); "fast": 4-bit formats stay packed
    INT4, others become bf16, and matmul inputs are bf16. Weights in edgellm's own schemes
    (quantized files) run on the kernel their scheme names (quant/packed.py)."""

    def __init__(self, source: TensorSource, mode: str, cache=None):
        if mode not in ("exact", "fast"):
            raise ValueError(f"unknown precision mode {mode!r} (exact, fast)")
        self.source, self.mode, self.cache = source, mode, cache  # cache: formats.pack.PackCache

    def has(self, name: str) -> bool:
        return name in self.source.tensors

    def _info(self, name: str):
        info = self.source.tensors.get(name)
        if info is None:
            raise ModelFormatError(self.source.path, f"missing tensor {name!r}")
        return info

    def _part(self, name: str, rows: np.ndarray | None = None) -> tuple:
        info = self._info(name)
        raw = self.source.raw(name)
        if rows is not None:  # reorder output rows; each row is whole blocks, so lossless
            raw = raw.reshape(info.shape[0], -1)[rows].reshape(-1)
        return raw, info.ggml_type, info.shape

    def vector(self, name: str) -> np.ndarray:
        """A norm weight, bias or factor table as float32 numpy."""
        raw, ggml_type, shape = self._part(name)
        return float_vector(raw if isinstance(raw, np.ndarray) else as_array(raw), ggml_type, shape)

    def linear(self, *names: str, rows: Mapping[str, np.ndarray] | None = None) -> Module:
        """One linear for one name; several names are fused along the output dimension."""
        key = "+".join(names)
        rows = rows or {}
        infos = [self.source.tensors.get(n) for n in names]
        groups = self._kernel_groups(names, infos)
        if len(groups) > 1:
            return concat_linears([self.linear(*group, rows=rows) for group in groups])
        cached = self.cache.get(key) if self.cache is not None else None
        if self.mode == "fast" and all(i is not None and BlockLinear.supports(i.ggml_type, i.shape) for i in infos):
            if isinstance(cached, BlockLinear):
                return cached  # its Q8R16 copies, mapped
            linear = BlockLinear([self._part(n, rows.get(n)) for n in names],  # the file's blocks (Q8_0 interleaved)
                                 drop_source=getattr(self.source, "drop_view", None))
            if self.cache is not None:
                self.cache.put(key, linear)  # kept only where the parts are copies (io/pack.py)
            return linear
        if cached is not None:
            return cached
        quantized = [self._quantized(n, rows.get(n)) for n in names]
        if all(q is not None for q in quantized):
            return self._keep(key, names, make_quantized_linear(quantized, self.mode))
        if any(q is not None for q in quantized):  # a recipe kept some parts float: one matmul each
            linears = [make_quantized_linear([q], self.mode) if q is not None
                       else make_fused_linear([self._part(n, rows.get(n))], mode=self.mode)
                       for n, q in zip(names, quantized)]
            return self._keep(key, names, concat_linears(linears))
        parts = [self._part(n, rows.get(n)) for n in names]
        for n, (_, _, shape) in zip(names, parts):
            if len(shape) != 2:
                raise ModelFormatError(self.source.path, f"tensor {n!r} has shape {shape}, expected 2-D")
        return self._keep(key, names, make_fused_linear(parts, mode=self.mode))

    def _kernel_groups(self, names: tuple[str, ...], infos: list) -> list[tuple[str, ...]]:
        """The runs of `names` one kernel can multiply fused. One run, unless the parts need different
        kernels: llama.cpp's Q4_K_M keeps attn_v in Q6_K on some layers, and a q/k/v of Q4_K, Q4_K, Q6_K
        fused would otherwise become dense (as bf16: 16 bits a weight read instead of 4.5 and 6.6)."""
        if self.mode != "fast" or any(i is None or len(i.shape) != 2 for i in infos):
            return [names]
        in_blocks = [BlockLinear.supports(i.ggml_type, i.shape) for i in infos]
        if all(in_blocks) or all(i.ggml_type in AFFINE_BITS for i in infos):
            return [names]
        pairs = list(zip(names, in_blocks))
        return [tuple(n for n, _ in run) for _, run in groupby(pairs, key=lambda pair: pair[1])]

    def _keep(self, key: str, names, linear: Module) -> Module:
        self._release(names)
        if self.cache is not None:
            self.cache.put(key, linear)
        return linear

    def _quantized(self, name: str, rows: np.ndarray | None) -> QuantizedWeight | None:
        find = getattr(self.source, "quantized", None)
        weight = find(name) if find is not None else None
        return weight.take_rows(rows) if weight is not None and rows is not None else weight

    def _release(self, names) -> None:
        # The linear holds its own converted copy: the file pages need not stay resident.
        drop = getattr(self.source, "drop_pages", None)
        if drop is not None:
            drop(list(names))

    def bias(self, *names: str) -> np.ndarray | None:
        if not all(self.has(n) for n in names):
            return None
        return np.concatenate([self.vector(n) for n in names])

    def embedding(self, name: str, tied_head: Module | None = None) -> BlockEmbedding | QuantizedEmbedding:
        """The table `name`; where `tied_head` (the output head of the same tensor) holds it as a
        Q8R16 copy, the lookups read that copy: one table resident, not the copy and the file."""
        weight = self._quantized(name, None)
        if weight is not None:
            return QuantizedEmbedding(weight)
        raw, ggml_type, shape = self._part(name)
        if isinstance(tied_head, BlockLinear) and tied_head.types == [kernels.Q8R16]:
            return BlockEmbedding(tied_head.parts[0].rows, kernels.Q8R16, shape)
        return BlockEmbedding(raw, ggml_type, shape)
