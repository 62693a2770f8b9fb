"""A decode step with one native call for all layers (edgellm_decoder_layers running the model's
llama_layer.c or gemma_layer.c function per layer) instead of ~70 eager ops per layer, for one
sequence or a batch of up to MAX_SEQS.

A model owns its decoder (`model.decoder`, built by `FusedDecoder.build`) and tells it what it
needs through public parts only (the `NativeModel` protocol below): the name of its C layer
function and the MLP activation that function applies, its embedding scale, the RoPE tables of
each layer, and per block its four projections and the vectors (norms, biases) the layer
struct points to, in the C struct's order. Caches are read through their public `pages`,
`page_tokens`, `slot_positions` and `capacity`, and told with `mark_written` what the C layers
appended; a dense cache's pages are its KV blocks, which sequences with a common prefix share.

It applies in fast mode when everything the C layers assume holds: at most MAX_SEQS rows (one
new token per decoding sequence, or a few prompt tokens of one sequence: `step_rows`),
every projection on edgellm's INT4 kernel (`Int4Linear`), on GGUF blocks or INT8 rows in place
(`BlockLinear`) or dense, the model's MLP activation, and KV stores in f32, f16, bf16, int8 or
int4 (kv/codecs.py), dense or sliding rings. Rows may run under LoRA adapters (int8 pairs of a
rank up to MAX_LORA_RANK on widths of whole vectors: lora_ops.h), each row its own.
Otherwise `step` returns None and the model runs its PyTorch code — which stays the
reference: tests/kernels/test_decode.py checks that the two agree."""
from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Protocol, Sequence

import torch

from edgellm import kernels
from edgellm.kernels.gemv import BLOCK_TYPES, I8, Q8R16
from edgellm.kv.cache import DenseCache, RingCache
from edgellm.kv.codecs import FloatCodec, Int4Codec, Int8Codec
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.embedding import BlockEmbedding
from edgellm.quant.linear import DenseLinear, Int4Linear

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

MAX_SEQS = 8  # layer_ops.h
_WEIGHT_INT4, _WEIGHT_BF16, _WEIGHT_F32 = -1, -2, -3  # else a ggml block type read in place (layer_ops.h)
_MAX_PARTS = 3
_KV_F32, _KV_F16, _KV_INT8, _KV_INT4, _KV_BF16 = 0, 1, 2, 3, 4  # layer_types.h
_FP32 = 0  # simd.h's dtype code for float


class _WeightPart(ctypes.Structure):
    _fields_ = [("kind", _i64), ("data", _p), ("scale_zero", _p), ("n", _i64), ("kw", _i64), ("ka", _i64),
                ("group", _i64)]


class _Projection(ctypes.Structure):
    _fields_ = [("parts", _WeightPart * _MAX_PARTS), ("count", _i64)]


class _KVStore(ctypes.Structure):
    _fields_ = [("q", _p), ("scale", _p), ("min", _p), ("codec", _i64)]


class _KVPage(ctypes.Structure):
    _fields_ = [("k", _KVStore), ("v", _KVStore)]


class _KVSlots(ctypes.Structure):
    _fields_ = [("pages", _p), ("page_tokens", _i64), ("capacity", _i64), ("slot_pos", _p), ("used", _i64)]



class _LoraPair(ctypes.Structure):
    _fields_ = [("a", _p), ("bt", _p), ("a_scale", _p), ("bt_scale", _p), ("rank", _i64), ("scale", _f32)]


_LORA_PARTS = ("q", "k", "v", "o", "gate", "up", "down")  # layer_types.h's LORA_Q ... LORA_DOWN
_MAX_LORA_RANK = 256


class _LoraLayer(ctypes.Structure):
    _fields_ = [("part", _LoraPair * len(_LORA_PARTS))]


class _LayerDims(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("n_heads", _i64), ("n_kv", _i64), ("head_dim", _i64), ("inter", _i64),
                ("max_len", _i64), ("eps", _f32), ("scale", _f32), ("softcap", _f32)]


_WEIGHTS = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection)]


@functools.cache
def _layer_struct(n_vectors: int) -> type[ctypes.Structure]:
    """A C layer struct: dims, the block's vectors (norm weights, biases; NULL where absent),
    then the four projections (llama_layer.c: 5 vectors, gemma_layer.c: 6)."""
    fields = [("dims", _LayerDims)] + [(f"vector{i}", _p) for i in range(n_vectors)] + _WEIGHTS
    return type(f"_Layer{n_vectors}", (ctypes.Structure,), {"_fields_": fields})


class NativeBlock(Protocol):
    attn_norm: torch.nn.Module  # its eps is the layer's
    attn: torch.nn.Module  # attn.scale, attn.qkv_proj, attn.o_proj
    mlp: torch.nn.Module  # mlp.activation, mlp.gate_up_proj, mlp.down_proj

    def native_vectors(self) -> list[torch.Tensor | None]: ...


class NativeModel(Protocol):
    native_layer: str  # the exported C function running one block's decode step
    native_activation: str  # the MLP activation that function applies
    embed_scale: float
    blocks: Sequence[NativeBlock]

    def rope_per_layer(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]: ...
    def head(self, x: torch.Tensor) -> torch.Tensor: ...  # final hidden states -> fp32 logits


def _weight(linear) -> _Projection:
    if isinstance(linear, BlockLinear):
        parts = [_WeightPart(p.type, p.rows.data_ptr(), None if p.scale is None else p.scale.data_ptr(),
                             p.rows.shape[0], linear.in_features, linear.in_features, 32) for p in linear.parts]
    elif isinstance(linear, DenseLinear):  # formats with no INT4 or block kernel, in the compute dtype
        kind = _WEIGHT_BF16 if linear.compute_dtype == torch.bfloat16 else _WEIGHT_F32
        parts = [_WeightPart(kind, linear.weight.data_ptr(), None, linear.out_features, linear.in_features,
                             linear.in_features, 0)]
    else:
        parts = [_WeightPart(_WEIGHT_INT4, linear.packed.data_ptr(), linear.scale_zero.data_ptr(),
                             linear.out_features, linear.planes * linear.in_features, linear.in_features,
                             linear.group)]
    return _Projection((_WeightPart * _MAX_PARTS)(*parts), len(parts))


def _native(linear) -> bool:
    if isinstance(linear, BlockLinear):
        return len(linear.parts) <= _MAX_PARTS
    if isinstance(linear, DenseLinear):
        return linear.compute_dtype in (torch.bfloat16, torch.float32) and linear.in_features % 16 == 0
    return isinstance(linear, Int4Linear)


def _linears(block) -> list:
    return [block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj]


class FusedDecoder:
    """Per-layer descriptors for one model (keeping alive every tensor they point into)."""

    def __init__(self, net: NativeModel, max_len: int):
        cfg, self.net, self.lib = net.config, net, kernels.library()
        self._keep: list = []
        self.layers = [self._describe(block, cfg, max_len) for block in net.blocks]
        # the architecture's layer function, which edgellm_decoder_layers calls for every layer
        self.run_layer = _p(ctypes.cast(getattr(self.lib, net.native_layer), _p).value)
        self.run_layers = self.lib.edgellm_decoder_layers
        self.run_layers.restype = None
        self._layer_addresses = (_p * len(self.layers))(*(ctypes.addressof(desc) for desc in self.layers))
        self.buf = torch.empty(self.lib.edgellm_layer_floats(ctypes.byref(self.layers[0].dims), MAX_SEQS),
                               dtype=torch.float32)
        widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.n_heads * cfg.head_dim)
        self.work = torch.empty(self.lib.edgellm_block_gemv_work(MAX_SEQS, widest), dtype=torch.uint8)
        self.max_len = max_len
        # per cache: whether the C layers read it, and its KVSlots (rebuilt only when its pages
        # change: rebuilding ~30 per sequence every step cost ~1 ms)
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # per sequence (by its first layer's cache): its layers' KVSlots as one array for the C layers
        self._sequences: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # per adapter: the address of its LoraLayer for each layer (None: the C layers cannot take it)
        self._adapters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._rope_chunks: dict[int, _RopeChunk] = {}  # by position // _ROPE_CHUNK, oldest first

    @classmethod
    def build(cls, net: NativeModel, mode: str) -> FusedDecoder | None:
        """The decoder for `net`, or None where the PyTorch layers must run: exact mode (the
        reference), no compiler, or weights and shapes the C layers do not read."""
        if mode != "fast" or net.config.head_dim % 32:
            return None  # RoPE works on half-heads of 16-float vectors
        for block in net.blocks:
            if not all(_native(m) for m in _linears(block)) or block.mlp.activation != net.native_activation:
                return None
        if kernels.library() is None or not hasattr(kernels.library(), net.native_layer):
            return None
        return cls(net, net.config.context_length)

    def _describe(self, block: NativeBlock, cfg, max_len: int):
        dims = _LayerDims(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size,
                          max_len, block.attn_norm.eps, block.attn.scale, getattr(block.attn, "softcap", None) or 0.0)
        vectors = [None if v is None else v.float().contiguous() for v in block.native_vectors()]
        self._keep += vectors
        pointers = [None if v is None else v.data_ptr() for v in vectors]
        return _layer_struct(len(vectors))(dims, *pointers, *(_weight(m) for m in _linears(block)))

    def step(self, tokens: torch.Tensor, caches, last_only: bool = True) -> torch.Tensor | None:
        """Logits (B, 1, V) for one token of each of B sequences, or for a piece of up to MAX_SEQS
        tokens of one sequence (1, 1 or T, V); None if the caches do not fit."""
        per_seq = _sequence_layers(caches)
        if per_seq is None or tokens.shape[0] != len(per_seq) or (tokens.shape[1] > 1 and len(per_seq) > 1):
            return None
        adapters = [getattr(s, "adapter", None) for s in _sequences(caches)]
        work = [(layers, [int(t) for t in row]) for layers, row in zip(per_seq, tokens)]
        logits = self.step_rows(work, every_row=not last_only, adapters=adapters)
        if logits is None:
            return None
        return logits.unsqueeze(0) if tokens.shape[1] > 1 and not last_only else logits.unsqueeze(1)

    def step_rows(self, work: Sequence[tuple[Sequence, Sequence[int]]], every_row: bool = False,
                  adapters: Sequence | None = None) -> torch.Tensor | None:
        """One native call for several sequences' next tokens through every layer: (a sequence's per-layer
        caches, its tokens), one token for a decode step or a few for a prompt chunk or a
        speculative check (rows of one sequence are written and attended in order, so each sees
        the ones before it: causal). At most MAX_SEQS rows in all. `adapters`: each entry's LoRA
        adapter (None: the base). Returns (len(work), V) logits of each entry's last token
        (every_row: (rows, V), each row's), or None if the caches or adapters do not fit."""
        rows = [(layers, layers[0].offset + j, t) for layers, tokens in work for j, t in enumerate(tokens)]
        m = len(rows)
        lora = self._lora_rows(work, adapters)
        if not 0 < m <= MAX_SEQS or not self._fits(work) or lora is False:
            return None
        for layers, tokens in work:  # grow before any KVSlots points into the stores
            for cache in layers:
                cache.reserve(layers[0].offset + len(tokens))
        cos, sin, keep = self._ropes([p for _, p, _ in rows])
        x = self._embed([t for _, _, t in rows])
        positions = (_i64 * m)(*(p for _, p, _ in rows))
        n = len(self.layers)
        slots = (_p * m)(*(self._sequence_slots(layers) for layers, _, _ in rows))
        adapted = None if lora is None else \
            (_p * (n * m))(*(None if a is None else a[i] for i in range(n) for a in lora))
        with kernels.profiled("edgellm::decode_layers"):
            self.run_layers(self.run_layer, self._layer_addresses, n, _p(x.data_ptr()), m, cos, sin, slots, positions,
                            _p(self.buf.data_ptr()), _p(self.work.data_ptr()), torch.get_num_threads(), adapted)
        for layers, _, _ in rows:
            for cache in layers:
                cache.mark_written(1)
        if not every_row and len(work) < m:  # only each entry's last row goes through the head
            x = x[torch.tensor(_last_rows(work))]
        return self.net.head(x.view(x.shape[0], 1, -1))[:, 0]

    def _embed(self, tokens: list[int]) -> torch.Tensor:
        """The rows' embeddings (m, hidden) fp32, scaled: GGUF rows dequantized in C, straight from
        the table (the eager dequantization took ~0.1 ms a step; a Q8R16 table is read by one call)."""
        table = self.net.embed
        if isinstance(table, BlockEmbedding) and table.ggml_type in BLOCK_TYPES and table.ggml_type not in (I8, Q8R16) \
                and all(0 <= t < table.num_embeddings for t in tokens):  # else the table's own IndexError
            x = torch.empty(len(tokens), table.dim)
            row_bytes, base, out = table.rows.stride(0), table.rows.data_ptr(), x.data_ptr()
            for i, t in enumerate(tokens):
                self.lib.edgellm_blocks_to_float(base + t * row_bytes, table.ggml_type, 1, table.dim, None,
                                                 out + 4 * i * table.dim, _FP32, 1)
        else:
            x = table(torch.tensor([tokens])).reshape(len(tokens), -1).float().contiguous()
        return x if self.net.embed_scale == 1.0 else x * self.net.embed_scale

    def _lora_rows(self, work, adapters: Sequence | None) -> list | None | bool:
        """Per row, its adapter's per-layer LoraLayer addresses (None: the base alone); None when
        no row has an adapter, False when one cannot run natively."""
        if adapters is None or all(a is None for a in adapters):
            return None
        per_entry = [None if a is None else self._native_adapter(a) for a in adapters]
        if any(a is not None and p is None for a, p in zip(adapters, per_entry)):
            return False
        return [p for p, (_, tokens) in zip(per_entry, work) for _ in tokens]

    def _native_adapter(self, adapter) -> list[int] | None:
        if adapter not in self._adapters:
            self._adapters[adapter] = _describe_adapter(adapter, len(self.layers))
        described = self._adapters[adapter]
        return None if described is None else described[1]

    def _fits(self, work) -> bool:
        for layers, tokens in work:
            if not layers or not all(self._view(c).native for c in layers):
                return False
            start = layers[0].offset
            if start + len(tokens) > self.max_len or any(c.offset != start for c in layers):
                return False
        return True

    def _view(self, cache) -> _CacheView:
        view = self._views.get(cache)
        if view is None:
            view = self._views[cache] = _CacheView(_native_cache(cache))
        return view

    def _sequence_slots(self, layers: Sequence) -> int:
        """The address of an array of a sequence's per-layer KVSlots, rebuilt only when one of its
        caches changes pages (building 30 structs per sequence every step cost ~0.1 ms each)."""
        versions = [c.version for c in layers]
        entry = self._sequences.get(layers[0])
        if entry is None or entry.versions != versions:
            entry = self._sequences[layers[0]] = _SequenceSlots(
                (_KVSlots * len(layers))(*(self._slots(c) for c in layers)), versions,
                [i for i, c in enumerate(layers) if hasattr(c, "used_slots")])
        for i in entry.rings:  # a ring's written slots grow every step
            entry.array[i].used = layers[i].used_slots
        return ctypes.addressof(entry.array)

    def _slots(self, cache) -> _KVSlots:
        view = self._view(cache)
        if view.version != cache.version or view.slots is None:
            view.version, (view.slots, view.pages) = cache.version, _slots(cache)
        view.slots.used = getattr(cache, "used_slots", 0)  # a ring's written slots grow every step
        return view.slots

    def _ropes(self, positions: list[int]) -> tuple[ctypes.Array, ctypes.Array, list]:
        """Per layer, the addresses of cos and sin (m, D) for the rows' positions, and the tensors
        to keep alive until the call returns. A decode step reads one row of a table computed for
        _ROPE_CHUNK positions at a time (computing each step's angles cost ~0.3 ms)."""
        chunks = [self._rope_chunk(p // _ROPE_CHUNK) for p in positions]
        layer_table, d = chunks[0].layer_table, chunks[0].head_dim
        if len(positions) == 1:
            row = (positions[0] % _ROPE_CHUNK) * d * 4
            per_table = [(c.data_ptr() + row, s.data_ptr() + row) for c, s in chunks[0].tables]
            keep = chunks
        else:
            keep = [tuple(torch.stack([chunk.tables[u][half][p % _ROPE_CHUNK] for chunk, p in zip(chunks, positions)])
                          for half in (0, 1)) for u in range(len(chunks[0].tables))]
            per_table = [(c.data_ptr(), s.data_ptr()) for c, s in keep]
        cos = (_p * len(layer_table))(*(per_table[u][0] for u in layer_table))
        sin = (_p * len(layer_table))(*(per_table[u][1] for u in layer_table))
        return cos, sin, keep

    def _rope_chunk(self, index: int) -> _RopeChunk:
        chunk = self._rope_chunks.get(index)
        if chunk is None:
            if len(self._rope_chunks) >= _ROPE_CHUNKS_KEPT:
                self._rope_chunks.pop(next(iter(self._rope_chunks)))  # the oldest
            chunk = self._rope_chunks[index] = _RopeChunk(
                self.net.rope_per_layer(torch.arange(index * _ROPE_CHUNK, (index + 1) * _ROPE_CHUNK)))
        return chunk


_ROPE_CHUNK = 64  # positions per cached RoPE table
_ROPE_CHUNKS_KEPT = 16  # tables kept: up to MAX_SEQS sequences, each near a chunk boundary


class _RopeChunk:
    """cos and sin (_ROPE_CHUNK, D) of a run of positions, once per distinct table of the model
    (Gemma: local and global), and which table each layer uses."""

    def __init__(self, per_layer: list[tuple[torch.Tensor, torch.Tensor]]):
        index: dict[int, int] = {}
        self.tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        for pair in per_layer:
            if id(pair) not in index:
                index[id(pair)] = len(self.tables)
                self.tables.append(tuple(t.reshape(_ROPE_CHUNK, -1).contiguous() for t in pair))
        self.layer_table = [index[id(pair)] for pair in per_layer]
        self.head_dim = self.tables[0][0].shape[1]


def _describe_adapter(adapter, n_layers: int) -> tuple[ctypes.Array, list[int]] | None:
    """An adapter as one LoraLayer per layer (pointing into its int8 tensors and scales) and
    their addresses; None where the C layers cannot read it."""
    vector = 16  # the widest ISA's floats per vector: every length a multiple of it
    for pair in adapter.pairs.values():  # int8 pairs are in lora_ops.h's layout (LoRAPair.stored_as)
        if pair.a.dtype != torch.int8 or pair.rank > _MAX_LORA_RANK or pair.in_features % vector \
                or pair.out_features % vector:
            return None
    layers = (_LoraLayer * n_layers)()
    for (i, part), pair in adapter.pairs.items():
        if i < n_layers:
            layers[i].part[_LORA_PARTS.index(part)] = _LoraPair(pair.a.data_ptr(), pair.b_t.data_ptr(),
                                                                 pair.a_scale.data_ptr(), pair.b_scale.data_ptr(),
                                                                 pair.rank, adapter.scale)
    size = ctypes.sizeof(_LoraLayer)
    return layers, [ctypes.addressof(layers) + i * size for i in range(n_layers)]


def _last_rows(work) -> list[int]:
    """Row index of each entry's last token."""
    end, last = 0, []
    for _, tokens in work:
        end += len(tokens)
        last.append(end - 1)
    return last


def _sequences(caches) -> list:
    """The sequences of a step: one SequenceKV, or those of a BatchKV."""
    return getattr(caches, "sequences", [caches])


def _sequence_layers(caches) -> list[list] | None:
    """Each sequence's per-layer caches."""
    per_seq = [getattr(s, "layers", None) for s in _sequences(caches)]
    return per_seq if all(per_seq) else None


def _store(store) -> _KVStore:
    """A TokenStore (kv/store.py) as kv_codec.h's KVStore."""
    values, scale, low = store.buffers()
    return _KVStore(values.data_ptr(), None if scale is None else scale.data_ptr(),
                    None if low is None else low.data_ptr(), _codec_code(store.codec))


class _SequenceSlots:
    """One sequence's per-layer KVSlots in one array, and the caches' versions it was built at."""

    def __init__(self, array: ctypes.Array, versions: list[int], rings: list[int]):
        self.array, self.versions, self.rings = array, versions, rings


class _CacheView:
    """What the decoder knows of one layer cache."""

    def __init__(self, native: bool):
        self.native = native
        self.version = -1  # the cache's `version` when `slots` was built
        self.slots: _KVSlots | None = None
        self.pages = None  # the page table `slots` points to


def _slots(cache) -> tuple[_KVSlots, ctypes.Array]:
    """The cache as layer_types.h's KVSlots, and its page table (keep it alive as long)."""
    pages = (_KVPage * len(cache.pages))(*(_KVPage(_store(p.k), _store(p.v)) for p in cache.pages))
    ring = cache.slot_positions
    slots = _KVSlots(ctypes.addressof(pages), cache.page_tokens, cache.capacity, None if ring is None else ring.data_ptr())
    return slots, pages


def _codec_code(codec) -> int | None:
    if isinstance(codec, FloatCodec):
        return {torch.float32: _KV_F32, torch.float16: _KV_F16, torch.bfloat16: _KV_BF16}.get(codec.dtype)
    if isinstance(codec, Int8Codec):
        return _KV_INT8
    return _KV_INT4 if isinstance(codec, Int4Codec) else None


def _native_cache(cache) -> bool:
    return type(cache) in (DenseCache, RingCache) and all(_codec_code(c) is not None for c in cache.codecs)


def fused_step(decoder: FusedDecoder | None, tokens: torch.Tensor, caches, last_only: bool = True) -> torch.Tensor | None:
    """The native step when the model has a decoder and the step is one token per sequence, or a
    short piece of one sequence's prompt: up to MAX_SEQS tokens as rows of the decode GEMVs cost
    about half what the prompt path's eager layers do (SmolLM2, 8 tokens: ~10 against ~20 ms)."""
    if decoder is None or tokens.dim() != 2 or not 1 <= tokens.shape[1] <= MAX_SEQS:
        return None
    return decoder.step(tokens, caches, last_only)
