"""Decode attention (decode_attention.h, the decode layers' attention) of every variant against fp64:
one query per sequence over its paged cache, for grouped-query shapes whose query heads take one, two
or three passes of HEADS_PER_PASS (3, 1 + 2 ... heads per KV head), caches long enough to split into
several key chunks that start mid-page and off a multiple of four, every KV codec, one and two
threads, and sequences of different lengths in one call."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

from edgellm.kernels import layer_structs as structs
from edgellm.kv.codecs import codec

CODES = {"f32": 0, "f16": 1, "int8": 2, "int4": 3, "bf16": 4}
PAGE = 32


class _PagedCache:
    """One sequence's keys and values in a codec's parts (kv/codecs.py), a page of PAGE slots per
    allocation, as the decode layers read them through their page table."""

    def __init__(self, name: str, kv_heads: int, dim: int, length: int, g: torch.Generator):
        self.codec, self.name = codec(name), name
        pages = -(-length // PAGE)
        x = torch.randn(2, kv_heads, pages * PAGE, dim, generator=g)
        shapes = self.codec.part_shapes(dim)  # the stored dtypes (a float codec's encode leaves fp32)
        self.parts = [{n: t.to(shapes[n][1]) for n, t in self.codec.encode(x[which]).items()} for which in (0, 1)]
        self.pages = [[{n: t[:, p * PAGE:(p + 1) * PAGE].contiguous() for n, t in parts.items()} for parts in self.parts]
                      for p in range(pages)]
        self.table = (structs.KVPage * pages)(*(structs.KVPage(*map(self._store, page)) for page in self.pages))
        self.slots = structs.KVSlots(ctypes.addressof(self.table), PAGE, pages * PAGE, None)

    def _store(self, parts: dict[str, torch.Tensor]) -> structs.KVStore:
        main = parts.get("x", parts.get("q"))
        scale, low = parts.get("scale"), parts.get("min")
        return structs.KVStore(main.data_ptr(), None if scale is None else scale.data_ptr(),
                               None if low is None else low.data_ptr(), CODES[self.name])

    def decoded(self, which: int) -> torch.Tensor:
        return self.codec.decode(self.parts[which]).double()


def _attend(lib, caches, q: torch.Tensor, heads: int, kv_heads: int, dim: int, lengths: list[int], threads: int):
    m = len(caches)
    table = (structs.KVSlots * m)(*(c.slots for c in caches))
    scratch = torch.empty(lib.edgellm_decode_attention_floats(heads, kv_heads, dim, max(lengths), m, threads))
    out = torch.empty(m, heads * dim)
    lib.edgellm_decode_attention(table, q.data_ptr(), m, heads, kv_heads, dim, dim ** -0.5,
                                 (ctypes.c_int64 * m)(*lengths), (ctypes.c_int64 * m)(*(n - 1 for n in lengths)),
                                 scratch.data_ptr(), out.data_ptr(), threads)
    return out.view(m, heads, dim)


def _reference(caches, q: torch.Tensor, heads: int, kv_heads: int, dim: int, lengths: list[int]) -> torch.Tensor:
    out = torch.empty(len(caches), heads, dim, dtype=torch.float64)
    for i, (cache, n) in enumerate(zip(caches, lengths)):
        keys, values = cache.decoded(0)[:, :n], cache.decoded(1)[:, :n]
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = keys[g] @ q[i, h].double() * dim ** -0.5
            out[i, h] = torch.softmax(scores, 0) @ values[g]
    return out


@pytest.mark.parametrize("heads, kv_heads, dim", [(3, 1, 64), (9, 3, 64), (4, 1, 32), (8, 4, 32), (5, 1, 32)])
@pytest.mark.parametrize("kv", ["f16", "int8", "int4", "f32", "bf16"])
def test_decode_attention_matches_fp64(lib, heads, kv_heads, dim, kv):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    lengths = [601, 37, 1]  # 601: 3 chunks of 201 keys (starting mid-page, off a multiple of 4)
    caches = [_PagedCache(kv, kv_heads, dim, n, g) for n in lengths]
    q = torch.randn(len(lengths), heads, dim, generator=g) * 2  # sharp enough softmaxes to tell keys apart
    want = _reference(caches, q, heads, kv_heads, dim, lengths)
    for threads in (1, 2):
        got = _attend(lib, caches, q, heads, kv_heads, dim, lengths, threads).double()
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (threads, (got - want).abs().max().item())
