"""A decode step with one native call per layer (llama_layer.c, gemma3_layer.c) instead of
~70 eager ops per layer, for one sequence or a batch of up to MAX_SEQS.

It applies in fast mode when everything the C layers assume holds: one new token per sequence,
every projection on edgellm's INT4 kernel (`Int4Linear`), on GGUF blocks or INT8 rows in place
(`BlockLinear`) or dense, the architecture's own MLP activation, and KV stores in f32, f16, int8
or int4 (kv/codecs.py), dense or Gemma's sliding rings.
Otherwise `step` returns None and the model runs its PyTorch code — which stays the
reference: tests/quant/test_decode.py checks that the two agree."""
from __future__ import annotations

import ctypes
import math
import weakref

import torch

from edgellm import kernels
from edgellm.kv.cache import DenseCache, RingCache
from edgellm.kv.codecs import FloatCodec, Int4Codec, Int8Codec
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.linear import DenseLinear, Int4Linear

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

MAX_SEQS = 8  # layer_ops.h
_WEIGHT_INT4, _WEIGHT_BF16, _WEIGHT_F32 = -1, -2, -3  # else a ggml block type read in place (layer_ops.h)
_MAX_PARTS = 3
_KV_F32, _KV_F16, _KV_INT8, _KV_INT4, _KV_BF16 = 0, 1, 2, 3, 4  # layer_types.h


class _WeightPart(ctypes.Structure):
    _fields_ = [("kind", _i64), ("data", _p), ("scale_zero", _p), ("n", _i64), ("kw", _i64), ("ka", _i64),
                ("group", _i64)]


class _Projection(ctypes.Structure):
    _fields_ = [("parts", _WeightPart * _MAX_PARTS), ("count", _i64)]


class _KVStore(ctypes.Structure):
    _fields_ = [("q", _p), ("scale", _p), ("min", _p), ("codec", _i64)]


class _KVSlots(ctypes.Structure):
    _fields_ = [("k", _KVStore), ("v", _KVStore), ("capacity", _i64), ("slot_pos", _p)]


class _LayerDims(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("n_heads", _i64), ("n_kv", _i64), ("head_dim", _i64), ("inter", _i64),
                ("max_len", _i64), ("eps", _f32), ("scale", _f32)]


_WEIGHTS = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection)]


class _LlamaLayer(ctypes.Structure):
    _fields_ = [("dims", _LayerDims), ("attn_norm", _p), ("mlp_norm", _p), ("qkv_bias", _p)] + _WEIGHTS


class _GemmaLayer(ctypes.Structure):
    _fields_ = [("dims", _LayerDims)] + [(n, _p) for n in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm",
                                          "q_norm", "k_norm")] + _WEIGHTS


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

    def __init__(self, net, max_len: int):
        cfg, self.net, self.lib = net.config, net, kernels.library()
        self.gemma = cfg.architecture == "gemma3"
        self._keep: list = []
        self.layers = [self._describe(block, cfg, max_len) for block in net.blocks]
        name = "edgellm_gemma3_layer" if self.gemma else "edgellm_llama_layer"
        self.run_layer = getattr(self.lib, name)
        self.run_layer.restype = None
        self.buf = torch.empty(self.lib.edgellm_layer_floats(ctypes.byref(self.layers[0].dims), MAX_SEQS),
                               dtype=torch.float32)
        widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.n_heads * cfg.head_dim)
        self.work = torch.empty(self.lib.edgellm_block_gemv_work(MAX_SEQS, widest), dtype=torch.uint8)
        self.max_len = max_len
        # per cache: whether the C layers read it, and its KVSlots with the tensors they point into
        # (rebuilt only when a store grows: rebuilding ~30 per sequence every step cost ~1 ms)
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def build(cls, net, max_len: int) -> FusedDecoder | None:
        activation = "gelu_tanh" if net.config.architecture == "gemma3" else "silu"
        if getattr(net, "mode", "fast") != "fast" or net.config.head_dim % 32:
            return None  # exact mode is PyTorch's; RoPE works on half-heads of 16-float vectors
        for block in net.blocks:
            if not all(_native(m) for m in _linears(block)):
                return None
            if block.mlp.activation != activation:
                return None
        return cls(net, max_len) if kernels.library() is not None else None

    def _describe(self, block, cfg, max_len: int):
        attn = block.attn
        dims = _LayerDims(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size,
                          max_len, block.attn_norm.eps, attn.scale)
        weights = [_weight(m) for m in _linears(block)]
        if self.gemma:
            norms = [block.attn_norm, block.post_attn_norm, block.mlp_norm, block.post_mlp_norm, attn.q_norm,
                     attn.k_norm]
            self._keep += [n.weight for n in norms]
            return _GemmaLayer(dims, *(n.weight.data_ptr() for n in norms), *weights)
        bias = attn.qkv_bias.float().contiguous() if attn.qkv_bias is not None else None
        self._keep += [block.attn_norm.weight, block.mlp_norm.weight, bias]
        return _LlamaLayer(dims, block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr(),
                           bias.data_ptr() if bias is not None else None, *weights)

    def step(self, tokens: torch.Tensor, caches) -> torch.Tensor | None:
        """Logits (B, 1, V) for one token of each of B sequences, or None if the caches do not fit."""
        per_seq = _sequence_layers(caches)
        if per_seq is None or tokens.shape != (len(per_seq), 1) or len(per_seq) > MAX_SEQS:
            return None
        if not all(all(self._view(c).native for c in layers) for layers in per_seq):
            return None
        pos = [layers[0].offset for layers in per_seq]
        if any(p >= self.max_len or any(c.offset != p for c in layers) for p, layers in zip(pos, per_seq)):
            return None
        m = len(per_seq)
        ropes = self._ropes(torch.tensor(pos))
        x = self.net.embed(tokens).reshape(m, -1).float()
        if self.gemma:
            x = x * math.sqrt(self.net.config.hidden_size)
        x = x.contiguous()
        positions = (_i64 * m)(*pos)
        threads, buf, work = torch.get_num_threads(), _p(self.buf.data_ptr()), _p(self.work.data_ptr())
        for i, (desc, block) in enumerate(zip(self.layers, self.net.blocks)):
            cos, sin = ropes[getattr(block, "sliding", False)]
            slots = (_KVSlots * m)(*(self._slots(layers[i], p) for layers, p in zip(per_seq, pos)))
            with kernels.profiled("edgellm::decode_layer"):
                self.run_layer(ctypes.byref(desc), _p(x.data_ptr()), ctypes.c_int(m), _p(cos.data_ptr()),
                               _p(sin.data_ptr()), slots, positions, buf, work, ctypes.c_int(threads))
            for layers, p in zip(per_seq, pos):
                layers[i].offset = p + 1
        return self.net.lm_head(self.net.norm(x.view(m, 1, -1))).float()

    def _view(self, cache) -> _CacheView:
        view = self._views.get(cache)
        if view is None:
            view = self._views[cache] = _CacheView(_native_cache(cache))
        return view

    def _slots(self, cache, pos: int) -> _KVSlots:
        if not isinstance(cache, RingCache):
            cache.reserve(pos + 1)  # already done by SequenceKV.prepare; not by callers passing bare caches
        view, held = self._view(cache), _tensors(cache)
        if len(held) != len(view.held) or any(ref() is not t for ref, t in zip(view.held, held)):
            view.held, view.slots = tuple(weakref.ref(t) for t in held), _slots(cache)
        return view.slots

    def _ropes(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) (B, D) of each sequence's position, keyed by 'sliding layer?' (Gemma's two RoPE bases)."""
        rows = lambda pair: tuple(t.reshape(positions.shape[0], -1).contiguous() for t in pair)  # noqa: E731
        if self.gemma:
            return {True: rows(self.net.rotary_local(positions)), False: rows(self.net.rotary_global(positions))}
        both = rows(self.net.rotary(positions))
        return {False: both, True: both}


def _sequence_layers(caches) -> list[list] | None:
    """Each sequence's per-layer caches: one SequenceKV, or the sequences of a BatchKV."""
    per_seq = [getattr(s, "layers", None) for s in getattr(caches, "sequences", [caches])]
    return per_seq if all(per_seq) else None


def _store(store) -> _KVStore:
    """A TokenStore's parts (kv/store.py) as kv_codec.h's KVStore."""
    parts = store.parts
    main = parts["x"] if "x" in parts else parts["q"]
    scale, low = parts.get("scale"), parts.get("min")
    return _KVStore(main.data_ptr(), None if scale is None else scale.data_ptr(),
                    None if low is None else low.data_ptr(), _codec_code(store.codec))


class _CacheView:
    """What the decoder knows of one layer cache."""

    def __init__(self, native: bool):
        self.native = native
        self.held: tuple = ()  # weak references to the tensors `slots` points into (a grown store has new ones)
        self.slots: _KVSlots | None = None


def _tensors(cache) -> tuple:
    ring = (cache.positions,) if isinstance(cache, RingCache) else ()
    return (*cache.k.parts.values(), *cache.v.parts.values(), *ring)


def _slots(cache) -> _KVSlots:
    if isinstance(cache, RingCache):
        return _KVSlots(_store(cache.k), _store(cache.v), cache.window, cache.positions.data_ptr())
    return _KVSlots(_store(cache.k), _store(cache.v), cache.k.capacity, None)


def _codec_code(codec) -> int | None:
    if isinstance(codec, FloatCodec):
        return {torch.float32: _KV_F32, torch.float16: _KV_F16, torch.bfloat16: _KV_BF16}.get(codec.dtype)
    if isinstance(codec, Int8Codec):
        return _KV_INT8
    return _KV_INT4 if isinstance(codec, Int4Codec) else None


def _native_cache(cache) -> bool:
    return (type(cache) in (DenseCache, RingCache) and cache.k.batch == 1 and _codec_code(cache.k.codec) is not None
            and _codec_code(cache.v.codec) is not None)


def fused_step(net, tokens: torch.Tensor, caches) -> torch.Tensor | None:
    """The native decode step for `net` if it applies (decoder built once per model)."""
    if tokens.dim() != 2 or tokens.shape[1] != 1:
        return None
    if "_fused" not in net.__dict__:
        net.__dict__["_fused"] = FusedDecoder.build(net, net.config.context_length)
    decoder = net.__dict__["_fused"]
    return decoder.step(tokens, caches) if decoder is not None else None
