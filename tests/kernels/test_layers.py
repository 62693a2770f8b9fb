"""The one-call decoder layers (llama_layer.c, also with Qwen3's q/k norms; gemma_layer.c) of every variant against an fp64
PyTorch rendering of the same equations: random weights in the formats the models use (INT4
layout, Q8_0, Q5_0, Q5_K blocks), three sequences at different positions in one call, every KV
codec, dense caches in pages (as kv/cache.py's blocks: apart in memory, read through the page
table) and sliding rings. The reference attends over the cache as stored (decoded
from its bytes), so the KV encoder's own rounding is not counted against the layer."""
from __future__ import annotations

import ctypes
import math
import random
import struct

import pytest
import torch

from edgellm.models.native import structs
from edgellm.kv.codecs import codec
from edgellm.lora.adapter import pack_a, pack_b_t
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.ggml import GGMLType
from edgellm.quant.linear import Int4Linear
from tests.kernels.kv_stores import kv_store
from tests.quant import reference

HIDDEN, HEADS, KV_HEADS, DIM, INTER = 128, 4, 2, 32, 256
MAX_LEN, WINDOW, PAGE = 48, 24, 8  # a dense cache: 6 pages; a ring: one of WINDOW
EPS = 1e-5


# fp16 block scales that keep random weights of order 0.05, so activations stay of order 1
SCALES = {"Q8_0": [(0, 4e-4)], "Q5_0": [(0, 4e-3)], "Q5_K": [(0, 3e-5), (2, 3e-5)]}


def _blocks(fmt: str, n: int, k: int, seed: int) -> tuple[BlockLinear, torch.Tensor]:
    data = bytearray(reference.random_tensor(fmt, n * k, random.Random(seed)))
    size = reference.SIZES[fmt][1]
    for start in range(0, len(data), size):
        for offset, value in SCALES[fmt]:
            data[start + offset:start + offset + 2] = struct.pack("<e", value)
    w = torch.tensor(reference.decode(fmt, bytes(data)), dtype=torch.float64).view(n, k)
    return BlockLinear([(torch.frombuffer(data, dtype=torch.uint8), GGMLType[fmt], (n, k))]), w


def _int4(n: int, k: int, seed: int) -> tuple[Int4Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    zero = torch.randn(n, k // 32, generator=g) * 0.01
    expand = lambda t: t.bfloat16().double().repeat_interleave(32, 1)  # noqa: E731
    return Int4Linear(q, scale, zero), (q.double() - 8) * expand(scale) + expand(zero)


class _Layer:
    """A random layer: its ctypes descriptor and its fp64 weights."""

    def __init__(self, family: str, seed: int = 0):
        gemma = family == "gemma3"
        g = torch.Generator().manual_seed(seed)
        width = (HEADS + 2 * KV_HEADS) * DIM
        self.qkv, self.w_qkv = _int4(width, HIDDEN, seed)
        self.o, self.w_o = _blocks("Q8_0", HIDDEN, HEADS * DIM, seed + 1)
        self.gate_up, self.w_gate_up = _blocks("Q5_0", 2 * INTER, HIDDEN, seed + 2)
        self.down, self.w_down = _blocks("Q5_K", HIDDEN, INTER, seed + 3)
        self.norms = [torch.rand(HIDDEN, generator=g) + 0.5 for _ in range(4)]
        self.head_norms = [torch.rand(DIM, generator=g) + 0.5 for _ in range(2)]
        dims = structs.LayerDims(HIDDEN, HEADS, KV_HEADS, DIM, INTER, MAX_LEN, EPS, DIM ** -0.5)
        weights = [structs.projection(m) for m in (self.qkv, self.o, self.gate_up, self.down)]
        if gemma:
            ptrs = [n.data_ptr() for n in self.norms] + [n.data_ptr() for n in self.head_norms]
            self.desc = structs.GemmaLayer(dims, *ptrs, *weights)
        else:
            head_norms = [n.data_ptr() for n in self.head_norms] if family == "qwen3" else [None, None]
            self.desc = structs.LlamaLayer(dims, self.norms[0].data_ptr(), self.norms[2].data_ptr(), None,
                                           *head_norms, *weights)
        self.gemma, self.head_norm = gemma, family != "llama"


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w.double()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _Cache:
    """One sequence's K and V in a codec's parts (kv/codecs.py), in pages allocated one by one,
    as the C layer sees them: a dense cache in pages of PAGE slots, a ring in one page."""

    def __init__(self, k: str, v: str, ring: bool):
        self.codecs = (codec(k), codec(v))
        self.capacity, self.page = (WINDOW, WINDOW) if ring else (MAX_LEN, PAGE)
        self.pages = [[{n: torch.zeros(KV_HEADS, self.page, s, dtype=getattr(torch, t)) for n, (s, t) in c.part_shapes(DIM).items()}
                       for c in self.codecs] for _ in range(self.capacity // self.page)]
        self.slot_pos = torch.full((WINDOW,), -1, dtype=torch.long) if ring else None
        self.names = (k, v)

    def slots(self) -> structs.KVSlots:
        self.table = (structs.KVPage * len(self.pages))(*(structs.KVPage(*map(kv_store, page, self.names))
                                                           for page in self.pages))
        return structs.KVSlots(ctypes.addressof(self.table), self.page, self.capacity,
                               None if self.slot_pos is None else self.slot_pos.data_ptr())

    def decoded(self, which: int) -> torch.Tensor:
        """(Hkv, capacity, D): the pages' slots in order."""
        names = self.pages[0][which]
        parts = {n: torch.cat([page[which][n] for page in self.pages], dim=1) for n in names}
        return self.codecs[which].decode(parts).double()

    def fill(self, upto: int, g: torch.Generator) -> None:
        """Positions 0..upto-1 already cached (random keys and values, encoded)."""
        slots = torch.arange(upto) % self.capacity
        for which in (0, 1):
            x = torch.randn(KV_HEADS, upto, DIM, generator=g)
            for name, value in self.codecs[which].encode(x).items():
                for slot, row in zip(slots.tolist(), range(upto)):
                    part = self.pages[slot // self.page][which][name]
                    part[:, slot % self.page] = value[:, row].to(part.dtype)
        if self.slot_pos is not None:
            self.slot_pos[slots] = torch.arange(upto)


def _reference(layer: _Layer, x: torch.Tensor, cos, sin, caches: list[_Cache], pos: list[int],
               loras: list | None = None) -> torch.Tensor:
    """fp64 layer output for each sequence, attending over the caches as the C layer left them;
    `loras`: per sequence None or an adapter's effective weight changes (_Lora.deltas)."""
    out = []
    for i, (cache, p) in enumerate(zip(caches, pos)):
        w = _effective(layer, None if loras is None else loras[i])
        xi = x[i].double()
        n = _rms(xi, layer.norms[0])
        qkv = (w["qkv"] @ n).view(HEADS + 2 * KV_HEADS, DIM)
        if layer.head_norm:
            qkv[:HEADS] = _rms(qkv[:HEADS], layer.head_norms[0])
            qkv[HEADS:HEADS + KV_HEADS] = _rms(qkv[HEADS:HEADS + KV_HEADS], layer.head_norms[1])
        q = _rope(qkv[:HEADS], cos[i].double(), sin[i].double())
        keys, values = cache.decoded(0), cache.decoded(1)
        held = cache.slot_pos if cache.slot_pos is not None else torch.arange(MAX_LEN)
        window = WINDOW if cache.slot_pos is not None else p + 1
        visible = (held >= 0) & (held <= p) & (p - held < window)
        heads = []
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            scores = keys[kv] @ q[h] * DIM ** -0.5
            scores[~visible] = -math.inf
            heads.append(torch.softmax(scores, 0) @ values[kv])
        attn = w["o"] @ torch.cat(heads)
        h1 = xi + (_rms(attn, layer.norms[1]) if layer.gemma else attn)
        m = _rms(h1, layer.norms[2])
        gate, up = (w["gate_up"] @ m).chunk(2)
        act = torch.nn.functional.gelu(gate, approximate="tanh") if layer.gemma else torch.nn.functional.silu(gate)
        mlp = w["down"] @ (act * up)
        out.append(h1 + (_rms(mlp, layer.norms[3]) if layer.gemma else mlp))
    return torch.stack(out)


def _run_layer(lib, layer: _Layer, caches: list[_Cache], pos: list[int], g: torch.Generator, lora=None):
    """Fill each cache up to its position, then run the C layer once on random rows at those
    positions (`lora`: one adapter pointer per row, or None); returns x, cos, sin and the output."""
    for cache, p in zip(caches, pos):
        cache.fill(p, g)
    x = torch.randn(len(pos), HIDDEN, generator=g)
    angles = torch.tensor(pos, dtype=torch.float64)[:, None] * (1e-2 ** torch.arange(DIM // 2) / (DIM // 2))
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).float().contiguous() for f in (torch.cos, torch.sin))
    ours = x.clone()
    slots = (structs.KVSlots * len(pos))(*(c.slots() for c in caches))
    buf = torch.empty(lib.edgellm_layer_floats(ctypes.byref(layer.desc.dims), len(pos)), dtype=torch.float32)
    work = torch.empty(lib.edgellm_block_gemv_work(8, INTER), dtype=torch.uint8)
    run = lib.edgellm_gemma_layer if layer.gemma else lib.edgellm_llama_layer
    run.restype = None
    run(ctypes.byref(layer.desc), ctypes.c_void_p(ours.data_ptr()), ctypes.c_int(len(pos)), ctypes.c_void_p(cos.data_ptr()),
        ctypes.c_void_p(sin.data_ptr()), slots, (ctypes.c_int64 * len(pos))(*pos), ctypes.c_void_p(buf.data_ptr()),
        ctypes.c_void_p(work.data_ptr()), ctypes.c_int(2), lora)
    return x, cos, sin, ours


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("k, v, ring", [("f16", "f16", False), ("f32", "f32", True), ("int8", "int8", False),
                                        ("int8", "int4", True), ("int4", "int4", False),
                                        ("bf16", "bf16", True)])
def test_decoder_layer_matches_fp64(lib, family, k, v, ring):
    layer = _Layer(family)
    pos = [5, 17, 30] if ring else [5, 40, 0]  # a ring of 24 slots has wrapped at 30; 40: a third page
    caches = [_Cache(k, v, ring) for _ in pos]
    x, cos, sin, ours = _run_layer(lib, layer, caches, pos, torch.Generator().manual_seed(7))
    expected = _reference(layer, x, cos, sin, caches, pos)
    # int16 activations in every GEMV: ~1e-4 of the largest value
    assert (ours.double() - expected).abs().max() < 1e-3 * expected.abs().max()
    if ring:
        assert caches[2].slot_pos[30 % WINDOW] == 30  # the new position took its ring slot


def _effective(layer: _Layer, lora: dict | None) -> dict[str, torch.Tensor]:
    """The layer's fp64 weights, plus s B A on each part an adapter changes."""
    w = {"qkv": layer.w_qkv, "o": layer.w_o, "gate_up": layer.w_gate_up, "down": layer.w_down}
    if lora is None:
        return w
    rows = {"q": ("qkv", 0), "k": ("qkv", HEADS * DIM), "v": ("qkv", (HEADS + KV_HEADS) * DIM), "o": ("o", 0),
            "gate": ("gate_up", 0), "up": ("gate_up", INTER), "down": ("down", 0)}
    w = {k: v.clone() for k, v in w.items()}
    for part, delta in lora.items():
        name, start = rows[part]
        w[name][start:start + delta.shape[0]] += delta
    return w


class _Lora:
    """A random adapter for one layer as the C layer reads it (int8 rows of A and B^T with a scale
    each) and its fp64 changes."""

    SHAPES = {"q": (HEADS * DIM, HIDDEN), "k": (KV_HEADS * DIM, HIDDEN), "v": (KV_HEADS * DIM, HIDDEN),
              "o": (HIDDEN, HEADS * DIM), "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}

    def __init__(self, parts, rank: int, scale: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tensors, self.deltas = [], {}
        self.struct = structs.LoraLayer()
        for part in parts:
            out_dim, in_dim = self.SHAPES[part]
            a = torch.randint(-127, 128, (rank, in_dim), generator=g, dtype=torch.int8)
            b_t = torch.randint(-127, 128, (rank, out_dim), generator=g, dtype=torch.int8)
            a_scale, b_scale = (torch.rand(rank, generator=g) * 1e-3 + 4e-4 for _ in range(2))
            packed = pack_a(a.numpy()), pack_b_t(b_t.numpy())  # the layout lora_ops.h reads
            self.tensors += [*packed, a_scale, b_scale]
            self.struct.part[structs.LORA_PARTS.index(part)] = structs.LoraPair(
                packed[0].ctypes.data, packed[1].ctypes.data, a_scale.data_ptr(), b_scale.data_ptr(), rank, scale)
            self.deltas[part] = scale * (b_t.double() * b_scale.double()[:, None]).T @ (a.double() * a_scale.double()[:, None])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decoder_layer_adds_each_rows_own_lora(lib, family):
    """Three rows in one call: one under an adapter on every projection, one the base alone,
    one under another adapter (other rank and scale) on some projections."""
    layer = _Layer(family)
    loras = [_Lora(structs.LORA_PARTS, 16, 2.0, 1), None, _Lora(("q", "v", "up", "down"), 6, 4.0, 2)]
    pos = [5, 17, 9]
    caches = [_Cache("f32", "f32", False) for _ in pos]
    rows = (ctypes.c_void_p * len(pos))(*(None if l is None else ctypes.addressof(l.struct) for l in loras))
    x, cos, sin, ours = _run_layer(lib, layer, caches, pos, torch.Generator().manual_seed(3), rows)
    expected = _reference(layer, x, cos, sin, caches, pos, [None if l is None else l.deltas for l in loras])
    assert (ours.double() - expected).abs().max() < 1e-3 * expected.abs().max()
    base = _reference(layer, x, cos, sin, caches, pos)
    assert torch.equal(expected[1], base[1])
    assert (expected[0] - base[0]).abs().max() > 0.05 * base[0].abs().max()  # the adapters change their rows
    assert (expected[2] - base[2]).abs().max() > 0.05 * base[2].abs().max()
