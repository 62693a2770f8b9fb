"""layer_types.h in ctypes: the structs the native decoder layers read, and how edgellm's weights
(INT4, GGUF blocks, dense) and LoRA adapters are described in them. The KV caches' side is
caches.py; the decoder that fills both is decoder.py."""
from __future__ import annotations

import ctypes

import numpy as np

from edgellm.extras import torch

from edgellm.kernels.buffers import address
from edgellm.kernels.gemv import Q8R16
from edgellm.kernels.int8_prompt import STRIP, int8_takes_i4r64
from edgellm.kernels.limits import MAX_LORA_RANK, MAX_PARTS
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.ggml import GGMLType
from edgellm.quant.linear import DenseLinear, Int4Linear
from edgellm.quant.packed import ConcatLinear

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

WEIGHT_INT4, WEIGHT_BF16, WEIGHT_F32 = -1, -2, -3  # else a ggml block type read in place (layer_types.h)


class WeightPart(ctypes.Structure):
    _fields_ = [("kind", _i64), ("data", _p), ("scale_zero", _p), ("n", _i64), ("kw", _i64), ("ka", _i64),
                ("group", _i64), ("int8_form", _i64)]


class Projection(ctypes.Structure):
    _fields_ = [("parts", WeightPart * MAX_PARTS), ("count", _i64)]


class KVStore(ctypes.Structure):
    _fields_ = [("q", _p), ("scale", _p), ("min", _p), ("codec", _i64)]


class KVPage(ctypes.Structure):
    _fields_ = [("k", KVStore), ("v", KVStore)]


class KVSlots(ctypes.Structure):
    _fields_ = [("pages", _p), ("page_tokens", _i64), ("capacity", _i64), ("slot_pos", _p), ("used", _i64)]


class LoraPair(ctypes.Structure):
    _fields_ = [("a", _p), ("bt", _p), ("a_scale", _p), ("bt_scale", _p), ("rank", _i64), ("scale", _f32)]


LORA_PARTS = ("q", "k", "v", "o", "gate", "up", "down")  # layer_types.h's LORA_Q ... LORA_DOWN


class LoraLayer(ctypes.Structure):
    _fields_ = [("part", LoraPair * len(LORA_PARTS))]


class LayerDims(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("n_heads", _i64), ("n_kv", _i64), ("head_dim", _i64), ("inter", _i64),
                ("max_len", _i64), ("eps", _f32), ("scale", _f32), ("softcap", _f32)]


_WEIGHTS = [("qkv", Projection), ("o", Projection), ("gate_up", Projection), ("down", Projection)]


class LlamaLayer(ctypes.Structure):
    """llama_layer.c's layer: its vectors NULL where a family has none (Qwen2 the bias, Qwen3 the norms)."""
    _fields_ = [("dims", LayerDims), ("attn_norm", _p), ("mlp_norm", _p), ("qkv_bias", _p), ("q_norm", _p),
                ("k_norm", _p)] + _WEIGHTS


class GemmaLayer(ctypes.Structure):
    """gemma_layer.c's layer: four norms per block, and the q/k norms (NULL for Gemma 2)."""
    _fields_ = [("dims", LayerDims), ("attn_norm", _p), ("post_attn_norm", _p), ("mlp_norm", _p),
                ("post_mlp_norm", _p), ("q_norm", _p), ("k_norm", _p)] + _WEIGHTS


LAYER_STRUCTS = {"edgellm_llama_layer": LlamaLayer, "edgellm_gemma_layer": GemmaLayer}  # by layer function


def layer_vectors(struct: type[ctypes.Structure]) -> list[str]:
    """The names of a layer struct's vectors, in order (what a block's native_vectors() fills)."""
    return [name for name, kind in struct._fields_ if kind is _p]


def projection(linear) -> Projection:
    parts = weight_parts(linear)
    return Projection((WeightPart * MAX_PARTS)(*parts), len(parts))


def weight_parts(linear) -> list[WeightPart]:
    """The C parts of one linear, side by side along its output (a ConcatLinear's, in order)."""
    if isinstance(linear, ConcatLinear):
        return [part for sub in linear.parts for part in weight_parts(sub)]
    if isinstance(linear, BlockLinear):
        k = linear.in_features
        return [WeightPart(p.type, address(p.rows), address(p.scale), p.rows.shape[0], k, k, 32, _block_form(p, k))
                for p in linear.parts]
    if isinstance(linear, DenseLinear):  # formats with no INT4 or block kernel, in the compute dtype
        kind = WEIGHT_BF16 if linear.compute_dtype == torch.bfloat16 else WEIGHT_F32
        return [WeightPart(kind, linear.weight.data_ptr(), None, linear.out_features, linear.in_features,
                           linear.in_features, 0, 0)]
    one_plane = int8_takes_i4r64(linear.out_features, linear.in_features, linear.group, linear.planes)
    return [WeightPart(WEIGHT_INT4, address(linear.packed), address(linear.scale_zero),
                       linear.out_features, linear.planes * linear.in_features, linear.in_features,
                       linear.group, 4 if one_plane else 0)]


def _block_form(part, k: int) -> int:
    """The form in which the int8 prompt GEMM takes a part of GGUF blocks (layer_types.h int8_form): Q8R16
    blocks of widened Q5_0 (5) or of a real Q8_0 (8: where the build takes byte codes,
    edgellm_int8_gemm_takes), Q6_K (6) or Q5_K (13) in whole strips, else 0."""
    if part.type == Q8R16:
        return 5 if part.q5_0 else 8
    whole_strips = part.rows.shape[0] % STRIP == 0 and k % 256 == 0
    return _K_FORMS.get(part.type, 0) if whole_strips else 0


# int8_layout.h's forms of the K-quants the int8 GEMM takes: Q6_K by its codes' width, Q5_K by ggml's number
_K_FORMS = {GGMLType.Q6_K: 6, GGMLType.Q5_K: 13}


def native_linear(linear) -> bool:
    if isinstance(linear, ConcatLinear):  # a fused projection whose parts need different kernels
        return all(native_linear(p) for p in linear.parts) and len(weight_parts(linear)) <= MAX_PARTS
    if isinstance(linear, BlockLinear):
        return len(linear.parts) <= MAX_PARTS
    if isinstance(linear, DenseLinear):
        return linear.compute_dtype in (torch.bfloat16, torch.float32) and linear.in_features % 16 == 0
    return isinstance(linear, Int4Linear)


def linears(block) -> list:
    return [block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj]


def describe_adapter(adapter, n_layers: int) -> tuple[ctypes.Array, list[int]] | None:
    """An adapter as one LoraLayer per layer (pointing into its int8 arrays and scales) and
    their addresses; None where the C layers cannot read it."""
    vector = 16  # the widest ISA's floats per vector: every length a multiple of it
    for pair in adapter.pairs.values():  # int8 pairs are in lora_ops.h's layout (LoRAPair.stored_as)
        if not isinstance(pair.a, np.ndarray) or pair.a.dtype != np.int8 or pair.rank > MAX_LORA_RANK \
                or pair.in_features % vector or pair.out_features % vector:
            return None
    layers = (LoraLayer * n_layers)()
    for (i, part), pair in adapter.pairs.items():
        if i < n_layers:
            layers[i].part[LORA_PARTS.index(part)] = LoraPair(address(pair.a), address(pair.b_t),
                                                                 address(pair.a_scale), address(pair.b_scale),
                                                                 pair.rank, adapter.scale)
    size = ctypes.sizeof(LoraLayer)
    return layers, [ctypes.addressof(layers) + i * size for i in range(n_layers)]
