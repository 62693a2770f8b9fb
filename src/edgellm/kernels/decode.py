"""A Llama decode step with one native call per layer (llama_layer.c) instead of ~70 eager ops.

It applies when everything the C layer assumes holds: one sequence, one new token, every
projection on edgellm's INT4 kernel (`Int4Linear.native`), a SiLU MLP, and fp32 dense KV
stores (the default KVConfig). Otherwise `step` returns None and the model runs its own
PyTorch code — which stays the reference: tests/quant/test_decode.py checks the two agree."""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from edgellm import kernels
from edgellm.kv.cache import DenseCache
from edgellm.kv.codecs import FloatCodec
from edgellm.quant.linear import Int4Linear


class _Int4Weight(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("scale_zero", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("kw", ctypes.c_int64), ("ka", ctypes.c_int64), ("group", ctypes.c_int64)]


class _LlamaLayer(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("n_heads", ctypes.c_int64), ("n_kv", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("max_len", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", _Int4Weight), ("o", _Int4Weight), ("gate_up", _Int4Weight), ("down", _Int4Weight)]


def _weight(linear: Int4Linear) -> _Int4Weight:
    return _Int4Weight(linear.packed.data_ptr(), linear.scale_zero.data_ptr(), linear.out_features,
                       linear.planes * linear.in_features, linear.in_features, linear.group)


def _eligible(block) -> bool:
    linears = (block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj)
    return all(isinstance(m, Int4Linear) and m.native for m in linears) and block.mlp.activation is F.silu


class FusedLlamaDecoder:
    """Holds the per-layer descriptors (and keeps every tensor they point into alive)."""

    def __init__(self, net, max_len: int):
        cfg = net.config
        self.net, self.lib, self.max_len = net, kernels.library(), max_len
        self._keep = []
        self.layers = [self._describe(block, cfg) for block in net.blocks]
        floats = self.lib.edgellm_llama_layer_floats(ctypes.byref(self.layers[0]))
        self.buf = torch.empty(floats, dtype=torch.float32)
        widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.n_heads * cfg.head_dim)
        self.work = torch.empty(widest // 2 + 2 * widest // 2 + 64, dtype=torch.int32)

    @classmethod
    def build(cls, net, max_len: int) -> FusedLlamaDecoder | None:
        lib = kernels.library()
        if lib is None or not all(_eligible(b) for b in net.blocks):
            return None
        lib.edgellm_llama_layer_floats.restype = ctypes.c_int64
        lib.edgellm_llama_layer.restype = None
        return cls(net, max_len)

    def _describe(self, block, cfg) -> _LlamaLayer:
        attn, mlp = block.attn, block.mlp
        bias = attn.qkv_bias.float().contiguous() if attn.qkv_bias is not None else None
        self._keep += [block.attn_norm.weight, block.mlp_norm.weight, bias]
        return _LlamaLayer(
            cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size, self.max_len,
            block.attn_norm.eps, attn.scale, block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            _weight(attn.qkv_proj), _weight(attn.o_proj), _weight(mlp.gate_up_proj), _weight(mlp.down_proj))

    def step(self, tokens: torch.Tensor, caches) -> torch.Tensor | None:
        """Logits (1, 1, V) for one token of one sequence, or None if the caches do not fit."""
        layers = getattr(caches, "layers", None)
        if tokens.shape != (1, 1) or not layers or not all(_plain_fp32(c) for c in layers):
            return None
        pos = layers[0].offset
        if pos >= self.max_len:
            return None
        cos, sin = (t.reshape(-1).contiguous() for t in self.net.rotary(caches.positions(1)))
        x = self.net.embed(tokens).reshape(-1).float().contiguous()
        threads = torch.get_num_threads()
        for desc, cache in zip(self.layers, layers):
            cache.k.ensure(pos + 1)
            cache.v.ensure(pos + 1)
            kc, vc = cache.k.parts["x"], cache.v.parts["x"]
            self.lib.edgellm_llama_layer(
                ctypes.byref(desc), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(cos.data_ptr()),
                ctypes.c_void_p(sin.data_ptr()), ctypes.c_void_p(kc.data_ptr()), ctypes.c_void_p(vc.data_ptr()),
                ctypes.c_int64(pos), ctypes.c_int64(kc.shape[2]), ctypes.c_void_p(self.buf.data_ptr()),
                ctypes.c_void_p(self.work.data_ptr()), ctypes.c_int(threads))
            cache.offset = pos + 1
        return self.net.lm_head(self.net.norm(x.view(1, 1, -1))).float()


def _plain_fp32(cache) -> bool:
    return (type(cache) is DenseCache and cache.k.batch == 1 and isinstance(cache.k.codec, FloatCodec)
            and isinstance(cache.v.codec, FloatCodec) and cache.k.codec.dtype == torch.float32
            and cache.v.codec.dtype == torch.float32)
