"""Decode attention (decode_attention.h, the decode layers' attention) of every variant against fp64:
one query per sequence over its paged cache, for grouped-query shapes whose query heads take one, two
or three passes of HEADS_PER_PASS (3, 1 + 2 ... heads per KV head), caches long enough to split into
several key chunks that start mid-page and off a multiple of four (so the prefetch stream runs across
pages), every KV codec and mixed ones, pages of 32 and 30 slots, a sliding ring, soft-capped scores,
one and two threads, and sequences of different lengths in one call."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from edgellm.models.native import structs
from edgellm.models.native.decoder import attention_fits
from edgellm.kv.codecs import codec
from tests.kernels.kv_stores import kv_store


class _PagedCache:
    """One sequence's keys and values in a codec's parts (kv/codecs.py), as the decode layers read
    them through their page table: pages of `page` slots allocated one by one, or (window) one ring
    of `window` slots holding the last `window` of `length` positions."""

    def __init__(self, kv: tuple[str, str], kv_heads: int, dim: int, length: int, g: torch.Generator,
                 page: int = 32, window: int | None = None, written: int | None = None):
        """written: the slots from there on hold NaN (floats, scales) as a sequence's last page does
        past its end, and the keys and values drawn for them are lost."""
        self.names = kv
        self.codecs = [codec(name) for name in kv]
        slots = window if window else -(-length // page) * page
        page = window or page
        x = torch.randn(2, kv_heads, slots, dim, generator=g)
        self.parts = []
        for which, c in enumerate(self.codecs):
            shapes = c.part_shapes(dim)  # the stored dtypes (a float codec's encode leaves fp32)
            self.parts.append({n: t.to(getattr(torch, shapes[n][1])) for n, t in c.encode(x[which]).items()})
            if written is not None:
                for t in self.parts[-1].values():
                    if t.is_floating_point():
                        t[:, written:] = float("nan")
        self.pages = [[{n: t[:, p * page:(p + 1) * page].contiguous() for n, t in parts.items()} for parts in self.parts]
                      for p in range(slots // page)]
        self.table = (structs.KVPage * len(self.pages))(*(structs.KVPage(*map(kv_store, pg, kv)) for pg in self.pages))
        self.slot_pos = None
        if window:  # position p in slot p % window, the last `window` positions of `length`
            positions = torch.arange(length - window, length)
            self.slot_pos = torch.empty(window, dtype=torch.long)
            self.slot_pos[positions % window] = positions
        self.slots = structs.KVSlots(ctypes.addressof(self.table), page, slots,
                                     None if window is None else self.slot_pos.data_ptr(), slots)
        self.scanned = window or length  # the slots a query at the last position scans

    def decoded(self, which: int) -> torch.Tensor:
        """(Hkv, scanned, D): the slots attention sees (their order does not change a softmax)."""
        return self.codecs[which].decode(self.parts[which]).double()[:, :self.scanned]


def _attend(lib, caches, q: torch.Tensor, heads: int, kv_heads: int, dim: int, softcap: float, threads: int):
    m, scanned = len(caches), [c.scanned for c in caches]
    positions = [c.scanned - 1 if c.slot_pos is None else int(c.slot_pos.max()) for c in caches]
    table = (structs.KVSlots * m)(*(c.slots for c in caches))
    scratch = torch.empty(lib.edgellm_decode_attention_floats(heads, kv_heads, dim, max(scanned), m, threads))
    out = torch.empty(m, heads * dim)
    lib.edgellm_decode_attention(table, q.data_ptr(), m, heads, kv_heads, dim, dim ** -0.5, softcap,
                                 (ctypes.c_int64 * m)(*scanned), (ctypes.c_int64 * m)(*positions),
                                 scratch.data_ptr(), out.data_ptr(), threads)
    return out.view(m, heads, dim)


def _reference(caches, q: torch.Tensor, heads: int, kv_heads: int, dim: int, softcap: float) -> torch.Tensor:
    out = torch.empty(len(caches), heads, dim, dtype=torch.float64)
    for i, cache in enumerate(caches):
        keys, values = cache.decoded(0), cache.decoded(1)
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = keys[g] @ q[i, h].double() * dim ** -0.5
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[i, h] = torch.softmax(scores, 0) @ values[g]
    return out


def _check(lib, caches, heads, kv_heads, dim, g, softcap=0.0):
    q = torch.randn(len(caches), heads, dim, generator=g) * 2  # sharp enough softmaxes to tell keys apart
    want = _reference(caches, q, heads, kv_heads, dim, softcap)
    for threads in (1, 2):
        got = _attend(lib, caches, q, heads, kv_heads, dim, softcap, threads).double()
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (threads, (got - want).abs().max().item())


@pytest.mark.parametrize("heads, kv_heads, dim", [(3, 1, 64), (9, 3, 64), (4, 1, 32), (8, 4, 32), (5, 1, 32)])
@pytest.mark.parametrize("kv", ["f16", "int8", "int4", "f32", "bf16"])
def test_decode_attention_matches_fp64(lib, heads, kv_heads, dim, kv):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    lengths = [601, 37, 1]  # 601: 3 chunks of 201 keys (starting mid-page, off a multiple of 4)
    caches = [_PagedCache((kv, kv), kv_heads, dim, n, g) for n in lengths]
    _check(lib, caches, heads, kv_heads, dim, g)


@pytest.mark.parametrize("kv", [("int8", "int4"), ("f16", "int4"), ("int4", "f16"), ("bf16", "int8")])
def test_decode_attention_mixed_codecs_and_odd_pages(lib, kv):
    """Keys and values in different codecs (each prefetched and read in its own), pages of 30 slots."""
    g = torch.Generator().manual_seed(7)
    caches = [_PagedCache(kv, 2, 64, n, g, page=30) for n in (533, 90)]
    _check(lib, caches, 6, 2, 64, g)


@pytest.mark.parametrize("kv", ["f16", "int4"])
def test_decode_attention_over_a_ring_with_soft_capped_scores(lib, kv):
    """A sliding window of 600 slots (one page, slot p % 600 holding position p) after 1,000 tokens,
    beside a dense cache; scores soft-capped as Gemma 2 does."""
    g = torch.Generator().manual_seed(11)
    caches = [_PagedCache((kv, kv), 1, 64, 1000, g, window=600), _PagedCache((kv, kv), 1, 64, 300, g)]
    _check(lib, caches, 4, 1, 64, g, softcap=5.0)


def test_decoder_declines_a_model_whose_queries_per_kv_head_exceed_the_stack_stage(lib):
    """The decode layers stage a KV head's queries on the stack; FusedDecoder.build runs a model
    past that bound on its PyTorch layers (attention_fits says which) instead of overrunning it."""
    limit = lib.edgellm_decode_attention_max_group_floats()
    assert limit >= 2048  # Gemma 1 2B: 8 query heads of 256 on one KV head
    assert attention_fits(SimpleNamespace(n_heads=8, n_kv_heads=1, head_dim=limit // 8), lib)
    assert not attention_fits(SimpleNamespace(n_heads=16, n_kv_heads=1, head_dim=limit // 8), lib)
    assert not attention_fits(SimpleNamespace(n_heads=8, n_kv_heads=1, head_dim=32), None)


def _attend_rows(lib, rows, q: torch.Tensor, heads: int, kv_heads: int, dim: int, threads: int) -> tuple[torch.Tensor, int]:
    """attend_rows over (cache, position) rows, rows of one cache in order of position, all keys
    written: as a native step takes a prompt's piece (or a speculative check's guesses). Its output
    and the (row set, KV head, key chunk) items it ran."""
    m = len(rows)
    table = (structs.KVSlots * m)(*(c.slots for c, _ in rows))
    longest = max(p + 1 for _, p in rows)
    scratch = torch.empty(lib.edgellm_decode_attention_floats(heads, kv_heads, dim, longest, m, threads))
    out = torch.empty(m, heads * dim)
    items = lib.edgellm_decode_attention(table, q.data_ptr(), m, heads, kv_heads, dim, dim ** -0.5, 0.0,
                                         (ctypes.c_int64 * m)(*(p + 1 for _, p in rows)),
                                         (ctypes.c_int64 * m)(*(p for _, p in rows)), scratch.data_ptr(), out.data_ptr(),
                                         threads)
    return out.view(m, heads, dim), items


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 1, 256), (8, 4, 32)])
@pytest.mark.parametrize("kv, page, first", [("f16", 32, 600), ("int8", 32, 250), ("int4", 30, 0), ("f16", 30, 507)])
def test_rows_of_one_sequence_attend_together_as_each_would_alone(lib, heads, kv_heads, dim, kv, page, first):
    """A prompt's piece: 8 rows at consecutive positions of one cache (from the first position, across
    a change of chunking at 256 and 512 slots, on pages of 30) in one call read each chunk's keys once
    for all, and give every row the floats it gets alone — where its page holds NaN past its position,
    as in plain decoding — also beside another sequence's row; causally masked as fp64 says. (A query
    vector set holds 4 rows of 4 x 256 floats: 8 make two sets.)"""
    def cache(written: int) -> _PagedCache:  # the same keys and values up to `written`
        return _PagedCache((kv, kv), kv_heads, dim, first + 8, torch.Generator().manual_seed(first), page=page,
                           written=written)

    g = torch.Generator().manual_seed(first + dim)
    piece, other = cache(first + 8), _PagedCache((kv, kv), kv_heads, dim, 300, g)
    q = torch.randn(9, heads, dim, generator=g) * 2
    rows = [(piece, first + j) for j in range(8)]
    keys, values = piece.decoded(0), piece.decoded(1)
    for threads in (1, 2):
        alone, alone_items = [], []
        for j in range(8):
            out, n = _attend_rows(lib, [(cache(first + j + 1), first + j)], q[j:j + 1].contiguous(), heads, kv_heads,
                                  dim, threads)
            alone.append(out[0])
            alone_items.append(n)
        together, items = _attend_rows(lib, rows, q[:8].contiguous(), heads, kv_heads, dim, threads)
        beside, _ = _attend_rows(lib, [(other, 299)] + rows[:7], torch.cat([q[8:], q[:7]]), heads, kv_heads, dim, threads)
        for j in range(8):
            assert torch.equal(together[j], alone[j]), (threads, j, (together[j] - alone[j]).abs().max().item())
            assert j == 7 or torch.equal(beside[1 + j], alone[j])
        if dim * heads // kv_heads * 8 <= 4096 and first not in (250, 507):  # one set: each chunk read once
            assert items == max(alone_items)
        else:  # two or three sets
            assert items <= 3 * max(alone_items) and items < sum(alone_items)
        for j in range(8):
            seen = first + j + 1
            for h in range(heads):
                kh = h // (heads // kv_heads)
                p = torch.softmax(keys[kh, :seen] @ q[j, h].double() * dim ** -0.5, 0)
                want = p @ values[kh, :seen]
                assert torch.allclose(together[j, h].double(), want, atol=2e-5, rtol=1e-4)


def test_a_later_rows_overflowed_value_stays_out_of_the_rows_before_it(lib):
    """f16 values past 65,504 are inf: an earlier row of the set weighs that slot 0, and 0 x inf would
    be NaN — each head adds only the keys it weighs, so the rows before it get what they get alone."""
    def cache(written: int, overflow: bool) -> _PagedCache:
        made = _PagedCache(("f16", "f16"), 1, 64, 8, torch.Generator().manual_seed(3), written=written)
        if overflow:  # the last row's value: inf in every page's copy of slot 7
            made.pages[0][1]["x"][:, 7] = float("inf")
        return made

    g = torch.Generator().manual_seed(4)
    q = torch.randn(8, 2, 64, generator=g)
    overflowed = cache(8, True)
    together, items = _attend_rows(lib, [(overflowed, j) for j in range(8)], q, 2, 1, 64, 1)
    assert items == 1  # one set, one chunk
    for j in range(7):
        alone, _ = _attend_rows(lib, [(cache(j + 1, False), j)], q[j:j + 1].contiguous(), 2, 1, 64, 1)
        assert torch.isfinite(together[j]).all() and torch.equal(together[j], alone[0]), j
    assert not torch.isfinite(together[7]).all()  # the row that sees it
