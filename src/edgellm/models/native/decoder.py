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
import logging
import weakref
from typing import Protocol, Sequence

import numpy as np

from edgellm import kernels, threads
from edgellm.extras import has_torch, torch, torch_loaded
from edgellm.kernels.buffers import address, aligned_bytes
from edgellm.models.native.caches import CacheViews
from edgellm.kernels.gemv import BLOCK_TYPES, I8, Q8R16, REPACK_BLOCKS, affine_rows
from edgellm.kernels.isa import cpu_features
from edgellm.models.native.structs import (LAYER_STRUCTS, LayerDims, describe_adapter, layer_vectors, linears,
                                          native_linear, projection)
from edgellm.kernels.limits import MAX_SEQS
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.embedding import BlockEmbedding
from edgellm.quant.linear import UNPACK_ROWS, Int4Linear

log = logging.getLogger("edgellm.kernels")

_p, _i64 = ctypes.c_void_p, ctypes.c_int64

_FP32 = 0  # simd.h's dtype code for float


class NativeBlock(Protocol):
    attn_norm: object  # its eps is the layer's
    attn: object  # attn.scale, attn.qkv_proj, attn.o_proj
    mlp: object  # mlp.activation, mlp.gate_up_proj, mlp.down_proj

    def native_vectors(self) -> list[np.ndarray | None]: ...  # float32


class NativeModel(Protocol):
    native_layer: str  # the exported C function running one block's decode step
    native_activation: str  # the MLP activation that function applies
    embed_scale: float
    blocks: Sequence[NativeBlock]

    def rope_per_layer(self, positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]: ...
    def head(self, x: torch.Tensor) -> torch.Tensor: ...  # final hidden states -> fp32 logits (PyTorch)
    # (norm, lm_head) where head(x) is lm_head(norm(x)) with norm models/layers.py's RMSNorm, else None
    def head_parts(self) -> tuple | None: ...


def native_prompt_tokens(variant: kernels.Variant, single_plane_int4: bool) -> int:
    """The longest prompt (or what a cached prefix leaves of it) that goes in as pieces of MAX_SEQS
    rows of the native step rather than through the prompt path: as far as the pieces were measured
    faster (SmolLM2 and Gemma 3 on an AMD EPYC Zen 5, December 2026, each variant).

    On AVX-512 the prompt path's fixed cost (unpacking weights for bf16 GEMMs, packing them for the
    int8 ones where bf16 is not native) costs a short prompt as much as ~40 tokens of pieces: they win
    up to ~64 tokens where every layer weight is one plane of 4-bit codes (SmolLM2 48 tokens: 24
    against 54 ms with bf16, 27-31 against 31-35 in int8), to ~32 on other formats (Gemma 3's, 40
    tokens: 41 against 35 with bf16, 31-32 against 30 in int8). On AVX2 the int8 GEMMs take over from
    UNPACK_ROWS rows and win there (SmolLM2, 32 tokens: 27 against 36 ms). NEON and scalar: not
    measured, 32."""
    if variant.name == "avx512":
        return 64 if single_plane_int4 else 32
    return UNPACK_ROWS - 1 if variant.name == "avx2" else 32


def attention_fits(cfg, lib: ctypes.CDLL | None) -> bool:
    """Whether the decode layers' attention takes the model's query heads per KV head x head_dim
    (it stages them on the stack)."""
    return lib is not None and cfg.n_heads // cfg.n_kv_heads * cfg.head_dim <= lib.edgellm_decode_attention_max_group_floats()


class FusedDecoder:
    """Per-layer descriptors for one model (keeping alive every tensor they point into)."""

    def __init__(self, net: NativeModel, max_len: int):
        cfg, self.net, self.lib = net.config, net, kernels.library()
        self._keep: list = []
        self.layers = [self._describe(block, cfg, max_len) for block in net.blocks]
        # the architecture's layer function, which edgellm_decoder_layers calls for every layer
        self.run_layer = _p(ctypes.cast(getattr(self.lib, net.native_layer), _p).value)
        self.run_layers = self.lib.edgellm_decoder_layers
        self._layer_addresses = (_p * len(self.layers))(*(ctypes.addressof(desc) for desc in self.layers))
        # rows one call takes: a prompt's piece up to this many (its projections GEMMs: layer_ops.h prompt_gemm)
        self.max_rows = self.lib.edgellm_max_prompt_rows()
        dims = ctypes.byref(self.layers[0].dims)
        self.buf = np.empty(self.lib.edgellm_layer_floats(dims, self.max_rows), dtype=np.float32)
        self.work = aligned_bytes(self.lib.edgellm_layer_work_bytes(dims, self.max_rows))
        self.max_len = max_len
        self.caches = CacheViews(max_len)  # each sequence's KVSlots for the C layers
        # per adapter: the address of its LoraLayer for each layer (None: the C layers cannot take it)
        self._adapters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._rope_chunks: dict[int, _RopeChunk] = {}  # by position // _ROPE_CHUNK, oldest first
        self._rope_rows: list[tuple] = []  # per table, a call's cos and sin rows (numpy, max_rows x D)
        self._head = _NativeHead.of(net, self.lib)
        single_plane = all(isinstance(m, Int4Linear) and m.planes == 1 for block in net.blocks for m in linears(block))
        self.prompt_tokens = native_prompt_tokens(kernels.selected(), single_plane)
        # Longer pieces multiply in the int8 GEMM (layer_ops.h prompt_gemm); a build without it (scalar,
        # NEON without dot products) multiplies them as GEMVs, and PyTorch's prompt path, where it is
        # installed, is faster there. So may its bf16 GEMMs be on AMX tiles (not measured against the pieces).
        self.prompt_gemm = bool(self.lib.edgellm_int8_gemm_native())
        self.prompt_path = has_torch() and (not self.prompt_gemm or "amx_bf16" in cpu_features())

    def takes_prompt(self, tokens: int) -> bool:
        """Whether a prompt (or its rest) of `tokens` goes in as pieces of this step (passes.prefill's
        choice): a short one, where pieces win, and any where the prompt GEMMs are native or PyTorch is
        missing."""
        return tokens <= self.prompt_tokens or not self.prompt_path

    def piece_rows(self, tokens: int) -> int:
        """The rows of each piece a prompt (or its rest) of `tokens` goes in as: MAX_SEQS, the decode
        GEMVs, for a short one; max_rows, the prompt GEMMs, for a longer one."""
        return MAX_SEQS if tokens <= self.prompt_tokens or not self.prompt_gemm else self.max_rows

    @classmethod
    def build(cls, net: NativeModel, mode: str) -> FusedDecoder | None:
        """The decoder for `net`, or None where the PyTorch layers must run: exact mode (the
        reference), no compiler, or weights and shapes the C layers do not read."""
        cfg = net.config
        if mode != "fast" or cfg.head_dim % 32:
            return None  # RoPE works on half-heads of 16-float vectors
        for block in net.blocks:
            if not all(native_linear(m) for m in linears(block)) or block.mlp.activation != net.native_activation:
                return None
        if kernels.library() is None or not hasattr(kernels.library(), net.native_layer):
            return None
        if not attention_fits(cfg, kernels.library()):
            log.warning("the native decoder takes at most %d query floats per KV head (%d here): PyTorch layers run",
                        kernels.library().edgellm_decode_attention_max_group_floats(),
                        cfg.n_heads // cfg.n_kv_heads * cfg.head_dim)
            return None
        return cls(net, net.config.context_length)

    def _describe(self, block: NativeBlock, cfg, max_len: int):
        dims = LayerDims(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size,
                          max_len, block.attn_norm.eps, block.attn.scale, getattr(block.attn, "softcap", None) or 0.0)
        struct = LAYER_STRUCTS[self.net.native_layer]
        vectors = [None if v is None else np.ascontiguousarray(v, dtype=np.float32) for v in block.native_vectors()]
        if len(vectors) != len(layer_vectors(struct)):
            raise ValueError(f"{type(block).__name__}.native_vectors() gives {len(vectors)} vectors; "
                             f"{struct.__name__} takes {', '.join(layer_vectors(struct))}")
        self._keep += vectors
        pointers = [address(v) for v in vectors]
        return struct(dims, *pointers, *(projection(m) for m in linears(block)))

    def step(self, tokens: np.ndarray, caches, last_only: bool = True) -> np.ndarray | None:
        """Logits (B, 1, V) for one token of each of B sequences (tokens (B, 1)), or for a piece of up
        to max_rows tokens of one sequence (1, 1 or T, V); None if the caches do not fit."""
        per_seq = _sequence_layers(caches)
        if per_seq is None or tokens.shape[0] != len(per_seq) or (tokens.shape[1] > 1 and len(per_seq) > 1):
            return None
        adapters = [getattr(s, "adapter", None) for s in _sequences(caches)]
        if tokens.shape[1] > MAX_SEQS:  # one sequence's run, in the pieces prefill would send it in
            return self._pieces([int(t) for t in tokens[0]], per_seq[0], adapters[0], last_only,
                                self.piece_rows(tokens.shape[1]))
        work = [(layers, [int(t) for t in row]) for layers, row in zip(per_seq, tokens)]
        logits = self.step_rows(work, every_row=not last_only, adapters=adapters)
        if logits is None:
            return None
        return logits[None] if tokens.shape[1] > 1 and not last_only else logits[:, None]

    def _pieces(self, ids: list[int], layers: Sequence, adapter, last_only: bool, rows: int) -> np.ndarray | None:
        """Logits of a run of one sequence's tokens (1, 1 or T, V) in pieces of `rows` (teacher-forced logits, a
        prompt in one call); None, with nothing written, where the caches or the adapter do not fit."""
        if self.caches.sequence(layers, len(ids)) is None or self._lora_rows([(layers, ids)], [adapter]) is False:
            return None
        out = []
        for start in range(0, len(ids), rows):
            piece = ids[start:start + rows]
            last = start + len(piece) == len(ids)
            out.append(self.step_rows([(layers, piece)], every_row=not last_only, adapters=[adapter],
                                      wanted=[last]))
        return out[-1][None] if last_only else np.concatenate(out)[None]

    def step_rows(self, work: Sequence[tuple[Sequence, Sequence[int]]], every_row: bool = False,
                  adapters: Sequence | None = None, wanted: Sequence[bool] | None = None) -> np.ndarray | None:
        """One native call for several sequences' next tokens through every layer: (a sequence's per-layer
        caches, its tokens), one token for a decode step or a few for a prompt chunk or a
        speculative check (rows of one sequence are written and attended in order, so each sees
        the ones before it: causal). At most max_rows rows in all (more than MAX_SEQS: a prompt's piece,
        whose projections are GEMMs). `adapters`: each entry's LoRA
        adapter (None: the base). Returns the logits of each entry's last token, (len(work), V) —
        or of the entries `wanted` says, in order: a prompt's piece whose logits nobody reads skips
        the head (Gemma 3's 262k rows: ~4 ms a call), none wanted is (0, V), the layers alone;
        every_row: (rows, V), each row's — or None if the caches or adapters do not fit."""
        x = self.hidden_rows(work, adapters)
        if x is None:
            return None
        if not every_row:  # only the last row of each entry wanted goes through the head
            last = [row for row, want in zip(_last_rows(work), wanted or [True] * len(work)) if want]
            if not last:
                return np.empty((0, self.net.config.vocab_size), dtype=np.float32)
            if len(last) < x.shape[0]:
                x = x[last]
        if self._head is not None:
            with kernels.profiled("edgellm::head"):
                return self._head(x)
        return self.net.head(torch.from_numpy(x).view(x.shape[0], 1, -1))[:, 0].float().numpy()

    def hidden_rows(self, work: Sequence[tuple[Sequence, Sequence[int]]], adapters: Sequence | None = None,
                    ) -> np.ndarray | None:
        """step_rows' layers alone: every row's last hidden state (rows, hidden), before the final
        norm; None where the caches or adapters do not fit."""
        rows = [(layers, layers[0].offset + j, t) for layers, tokens in work for j, t in enumerate(tokens)]
        m = len(rows)
        lora = self._lora_rows(work, adapters)
        if not 0 < m <= self.max_rows or lora is False:
            return None
        per_entry = [self.caches.sequence(layers, len(tokens)) for layers, tokens in work]
        if None in per_entry:
            return None
        cos, sin, keep = self._ropes([p for _, p, _ in rows])
        x = self._embed([t for _, _, t in rows])
        positions = (_i64 * m)(*(p for _, p, _ in rows))
        n = len(self.layers)
        slots = (_p * m)(*(address for address, (_, tokens) in zip(per_entry, work) for _ in tokens))
        adapted = None if lora is None else \
            (_p * (n * m))(*(None if a is None else a[i] for i in range(n) for a in lora))
        with kernels.profiled("edgellm::decode_layers"):
            self.run_layers(self.run_layer, self._layer_addresses, n, _p(x.ctypes.data), m, cos, sin, slots, positions,
                            _p(self.buf.ctypes.data), _p(self.work.ctypes.data), threads.current(), adapted)
        for layers, _, _ in rows:
            for cache in layers:
                cache.mark_written(1)
        return x

    def _embed(self, tokens: list[int]) -> np.ndarray:
        """The rows' embeddings (m, hidden) fp32, scaled: GGUF rows dequantized in C, straight from
        the table (the eager dequantization took ~0.1 ms a step), a Q8R16 or affine-type (Q4_0, Q4_1,
        Q5_1, Q4_K) table's by one call each."""
        table = self.net.embed
        if isinstance(table, BlockEmbedding) and table.ggml_type in BLOCK_TYPES and table.ggml_type not in (I8, Q8R16) \
                and all(0 <= t < table.num_embeddings for t in tokens):  # else the table's own IndexError
            x = np.empty((len(tokens), table.dim), dtype=np.float32)
            row_bytes, base, out = table.rows.strides[0], table.rows.ctypes.data, x.ctypes.data
            for i, t in enumerate(tokens):
                self.lib.edgellm_blocks_to_float(base + t * row_bytes, table.ggml_type, 1, table.dim, None,
                                                 out + 4 * i * table.dim, _FP32, 1)
        elif isinstance(table, BlockEmbedding) and table.ggml_type == Q8R16 \
                and all(0 <= t < table.num_embeddings for t in tokens):
            x = np.empty((len(tokens), table.dim), dtype=np.float32)
            self.lib.edgellm_q8r16_rows(table.rows.ctypes.data, table.dim, (_i64 * len(tokens))(*tokens), len(tokens),
                                        x.ctypes.data)
        elif isinstance(table, BlockEmbedding) and table.ggml_type in REPACK_BLOCKS \
                and all(0 <= t < table.num_embeddings for t in tokens):  # Q4_K: an untied model's Q4_K_M table
            x = affine_rows(table.rows, table.ggml_type, table.dim, tokens, self.lib)
        else:
            x = np.ascontiguousarray(table(torch.tensor([tokens])).reshape(len(tokens), -1).float().numpy())
        return x if self.net.embed_scale == 1.0 else x * np.float32(self.net.embed_scale)

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
            self._adapters[adapter] = describe_adapter(adapter, len(self.layers))
        described = self._adapters[adapter]
        return None if described is None else described[1]

    def _ropes(self, positions: list[int]) -> tuple[ctypes.Array, ctypes.Array, list]:
        """Per layer, the addresses of cos and sin (m, D) for the rows' positions, and the tensors
        to keep alive until the call returns. A decode step reads one row of a table computed for
        _ROPE_CHUNK positions at a time (computing each step's angles cost ~0.3 ms); a batch's rows
        are copied by numpy into buffers of max_rows rows (torch.stack and an indexing op per row
        took ~0.1 ms a step: torch ops run from caches the weights just swept, and each lets other
        Python threads take the GIL)."""
        chunks = [self._rope_chunk(p // _ROPE_CHUNK) for p in positions]
        layer_table, d = chunks[0].layer_table, chunks[0].head_dim
        if len(positions) == 1:
            row = (positions[0] % _ROPE_CHUNK) * d * 4
            per_table = [(c.ctypes.data + row, s.ctypes.data + row) for c, s in chunks[0].tables]
        else:
            while len(self._rope_rows) < len(chunks[0].tables):
                self._rope_rows.append(tuple(np.empty((self.max_rows, d), dtype=np.float32) for _ in range(2)))
            runs = _runs(positions)
            per_table = []
            for u, buffers in enumerate(self._rope_rows[:len(chunks[0].tables)]):
                for half, rows in enumerate(buffers):
                    for i, n in runs:  # a prompt's piece: a few slices, not a copy per row
                        at = positions[i] % _ROPE_CHUNK
                        rows[i:i + n] = chunks[i].tables[u][half][at:at + n]
                per_table.append([rows.ctypes.data for rows in buffers])
        cos = (_p * len(layer_table))(*(per_table[u][0] for u in layer_table))
        sin = (_p * len(layer_table))(*(per_table[u][1] for u in layer_table))
        return cos, sin, chunks

    def _rope_chunk(self, index: int) -> _RopeChunk:
        chunk = self._rope_chunks.get(index)
        if chunk is None:
            if len(self._rope_chunks) >= _ROPE_CHUNKS_KEPT:
                self._rope_chunks.pop(next(iter(self._rope_chunks)))  # the oldest
            chunk = self._rope_chunks[index] = _RopeChunk(
                self.net.rope_per_layer(np.arange(index * _ROPE_CHUNK, (index + 1) * _ROPE_CHUNK)))
        return chunk


_ROPE_CHUNK = 64  # positions per cached RoPE table
_ROPE_CHUNKS_KEPT = 16  # tables kept: up to MAX_SEQS sequences, each near a chunk boundary


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """(first row, length) of each run of consecutive positions within one RoPE chunk."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1 or positions[i] % _ROPE_CHUNK == 0:
            runs.append((start, i - start))
            start = i
    return runs


class _RopeChunk:
    """cos and sin (_ROPE_CHUNK, D) fp32 of a run of positions, once per distinct table of the model
    (Gemma: local and global), and which table each layer uses."""

    def __init__(self, per_layer: list[tuple]):
        index: dict[int, int] = {}
        self.tables: list[tuple[np.ndarray, np.ndarray]] = []
        for pair in per_layer:
            if id(pair) not in index:
                index[id(pair)] = len(self.tables)
                self.tables.append(tuple(np.ascontiguousarray(np.asarray(t, dtype=np.float32).reshape(_ROPE_CHUNK, -1))
                                         for t in pair))
        self.layer_table = [index[id(pair)] for pair in per_layer]
        self.head_dim = self.tables[0][0].shape[1]


class _NativeHead:
    """Logits (m, V) fp32 of the last hidden states by two native calls, RMSNorm then the GEMV of
    each part, for the common case of a plain RMSNorm before a head of GGUF blocks (a Q8R16 table
    or Q8_0 / K-quant rows). The model's `head` does the same in ~10 torch ops, and each op runs
    from caches the layers' weights have just swept (~0.25 ms a step where the ops alone take
    ~0.03 ms)."""

    def __init__(self, norm, head: BlockLinear, lib):
        self.norm, self.head, self.lib = norm, head, lib
        self.normed = np.empty((MAX_SEQS, head.in_features), dtype=np.float32)
        self.work = np.empty(lib.edgellm_block_gemv_work(MAX_SEQS, head.in_features), dtype=np.uint8)

    @classmethod
    def of(cls, net: NativeModel, lib) -> _NativeHead | None:
        """None where the model's own head must run (another norm or head, soft-capped logits)."""
        parts = net.head_parts()
        if parts is None or type(parts[1]) is not BlockLinear:
            return None
        norm, head = parts
        fits = head.in_features % 16 == 0 and norm.weight.dtype == np.float32 and norm.weight.flags.c_contiguous \
            and norm.weight.shape == (head.in_features,)
        return cls(norm, head, lib) if fits else None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        logits = np.empty((x.shape[0], self.head.out_features), dtype=np.float32)
        for start in range(0, x.shape[0], MAX_SEQS):  # the GEMVs' rows a call
            self._rows(x[start:start + MAX_SEQS], logits[start:start + MAX_SEQS])
        return logits

    def _rows(self, x: np.ndarray, logits: np.ndarray) -> None:
        m, k = x.shape
        self.lib.edgellm_rms_norm(x.ctypes.data, m, k, self.norm.weight.ctypes.data, self.norm.eps,
                                  self.normed.ctypes.data, _FP32, 1)
        column = logits.ctypes.data
        for part in self.head.parts:
            n = part.rows.shape[0]
            self.lib.edgellm_block_gemv(self.normed.ctypes.data, m, k, part.rows.ctypes.data, part.type, n,
                                        address(part.scale), column,
                                        self.head.out_features, self.work.ctypes.data, threads.current())
            column += 4 * n


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


def fused_step(decoder: FusedDecoder | None, tokens, caches, last_only: bool = True):
    """The native step's logits when the model has a decoder and the step is one token per sequence,
    or one sequence's tokens (a prompt's piece, or a whole run in pieces of max_rows): up to MAX_SEQS tokens
    as rows of the decode GEMVs cost about half what the prompt path's eager layers do (SmolLM2, 8 tokens:
    ~10 against ~20 ms), longer pieces go through the int8 prompt GEMMs. numpy without PyTorch in the
    process, else a tensor of the same memory."""
    if decoder is None or len(tokens.shape) != 2 or tokens.shape[1] < 1 or not decoder.takes_prompt(tokens.shape[1]):
        return None
    logits = decoder.step(np.asarray(tokens), caches, last_only)
    if logits is None or not torch_loaded():
        return logits
    return torch.from_numpy(logits)  # where PyTorch runs, a model's forward gives tensors either way (no copy)
