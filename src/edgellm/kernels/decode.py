"""A decode step with one native call per layer (llama_layer.c, gemma3_layer.c) instead of
~70 eager ops per layer.

It applies when everything the C layers assume holds: one sequence, one new token, every
projection on edgellm's INT4 kernel (`Int4Linear.native`), on GGUF blocks in place
(`BlockLinear`) or dense bf16, the architecture's own MLP activation, and fp16 (the default) or
fp32 KV stores, dense or Gemma's sliding rings.
Otherwise `step` returns None and the model runs its PyTorch code — which stays the
reference: tests/quant/test_decode.py checks that the two agree."""
from __future__ import annotations

import ctypes
import math

import torch

from edgellm import kernels
from edgellm.kv.cache import DenseCache, RingCache
from edgellm.kv.codecs import FloatCodec
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.linear import DenseLinear, Int4Linear

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


_WEIGHT_INT4, _WEIGHT_BF16 = -1, -2  # else a ggml block type read in place (layer_ops.h)
_MAX_PARTS = 3


class _WeightPart(ctypes.Structure):
    _fields_ = [("kind", _i64), ("data", _p), ("scale_zero", _p), ("n", _i64), ("kw", _i64), ("ka", _i64),
                ("group", _i64)]


class _Projection(ctypes.Structure):
    _fields_ = [("parts", _WeightPart * _MAX_PARTS), ("count", _i64)]


class _KVSlots(ctypes.Structure):
    _fields_ = [("k", _p), ("v", _p), ("capacity", _i64), ("slot_pos", _p), ("half", _i64)]


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
        parts = [_WeightPart(t, rows.data_ptr(), None, rows.shape[0], linear.in_features, linear.in_features, 32)
                 for rows, t in zip(linear.rows, linear.types)]
    elif isinstance(linear, DenseLinear):  # bf16 (N, K): formats with no INT4 or block kernel
        parts = [_WeightPart(_WEIGHT_BF16, linear.weight.data_ptr(), None, linear.out_features, linear.in_features,
                             linear.in_features, 0)]
    else:
        parts = [_WeightPart(_WEIGHT_INT4, linear.packed.data_ptr(), linear.scale_zero.data_ptr(),
                             linear.out_features, linear.planes * linear.in_features, linear.in_features,
                             linear.group)]
    return _Projection((_WeightPart * _MAX_PARTS)(*parts), len(parts))


def _native(linear) -> bool:
    if isinstance(linear, BlockLinear):
        return len(linear.types) <= _MAX_PARTS
    if isinstance(linear, DenseLinear):
        return linear.compute_dtype == torch.bfloat16 and linear.in_features % 16 == 0
    return isinstance(linear, Int4Linear) and linear.native


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
        self.lib.edgellm_layer_floats.restype = _i64
        self.buf = torch.empty(self.lib.edgellm_layer_floats(ctypes.byref(self.layers[0].dims)), dtype=torch.float32)
        widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.n_heads * cfg.head_dim)
        self.work = torch.empty(2 * widest + 64, dtype=torch.int32)
        self.max_len = max_len

    @classmethod
    def build(cls, net, max_len: int) -> FusedDecoder | None:
        activation = "gelu_tanh" if net.config.architecture == "gemma3" else "silu"
        if net.config.head_dim % 16:
            return None  # the attention dot product works in 16-float vectors
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
        """Logits (1, 1, V) for one token of one sequence, or None if the caches do not fit."""
        layers = getattr(caches, "layers", None)
        if tokens.shape != (1, 1) or not layers or not all(_plain_float(c) for c in layers):
            return None
        pos = layers[0].offset
        if pos >= self.max_len or any(c.offset != pos for c in layers):
            return None
        ropes = self._ropes(caches.positions(1))
        x = self.net.embed(tokens).reshape(-1).float()
        if self.gemma:
            x = x * math.sqrt(self.net.config.hidden_size)
        x = x.contiguous()
        threads, buf, work = torch.get_num_threads(), _p(self.buf.data_ptr()), _p(self.work.data_ptr())
        for desc, block, cache in zip(self.layers, self.net.blocks, layers):
            cos, sin = ropes[getattr(block, "sliding", False)]
            slots = _slots(cache, pos)
            with kernels.profiled("edgellm::decode_layer"):
                self.run_layer(ctypes.byref(desc), _p(x.data_ptr()), _p(cos.data_ptr()), _p(sin.data_ptr()),
                               ctypes.byref(slots), _i64(pos), buf, work, ctypes.c_int(threads))
            cache.offset = pos + 1
        return self.net.lm_head(self.net.norm(x.view(1, 1, -1))).float()

    def _ropes(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of this position, keyed by 'sliding layer?' (Gemma's two RoPE bases)."""
        flat = lambda pair: tuple(t.reshape(-1).contiguous() for t in pair)  # noqa: E731
        if self.gemma:
            return {True: flat(self.net.rotary_local(positions)), False: flat(self.net.rotary_global(positions))}
        both = flat(self.net.rotary(positions))
        return {False: both, True: both}


def _slots(cache, pos: int) -> _KVSlots:
    half = int(cache.k.codec.dtype == torch.float16)
    if isinstance(cache, RingCache):
        return _KVSlots(cache.k.parts["x"].data_ptr(), cache.v.parts["x"].data_ptr(), cache.window,
                        cache.positions.data_ptr(), half)
    cache.reserve(pos + 1)  # already done by SequenceKV.prepare; not by callers passing bare caches
    k = cache.k.parts["x"]
    return _KVSlots(k.data_ptr(), cache.v.parts["x"].data_ptr(), k.shape[2], None, half)


_NATIVE_KV = (torch.float32, torch.float16)  # what layer_ops.h's KVSlots can hold


def _plain_float(cache) -> bool:
    if type(cache) not in (DenseCache, RingCache) or cache.k.batch != 1:
        return False
    k, v = cache.k.codec, cache.v.codec
    return isinstance(k, FloatCodec) and isinstance(v, FloatCodec) and k.dtype == v.dtype and k.dtype in _NATIVE_KV


def fused_step(net, tokens: torch.Tensor, caches) -> torch.Tensor | None:
    """The native decode step for `net` if it applies (decoder built once per model)."""
    if tokens.shape != (1, 1):
        return None
    if "_fused" not in net.__dict__:
        net.__dict__["_fused"] = FusedDecoder.build(net, net.config.context_length)
    decoder = net.__dict__["_fused"]
    return decoder.step(tokens, caches) if decoder is not None else None
