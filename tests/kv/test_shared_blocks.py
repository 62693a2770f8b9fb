"""Shared KV blocks on the real model: sequences with a common prefix hold the prefix cache's
blocks in place (the same pages, reference-counted in the pool), copy a shared block before
writing into it, and give it back when they end or are cancelled."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import edgellm
from edgellm.entrypoints.bench.memory import shared_prompt_kv
from edgellm.generation import Completion
from edgellm.generation.passes import prefill
from edgellm.kv import KVConfig
from edgellm.serving.service import Request, Service

SYSTEM = ("You are a careful assistant for a lighthouse maintenance team. " * 24).strip()  # ~9 blocks
BLOCK = 32


@pytest.fixture(scope="module")
def smol(smollm2_path):
    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=64 * 2**20))
    yield model
    model.close()


@pytest.fixture(scope="module")
def unshared(smollm2_path):
    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=0))
    yield model
    model.close()


def _ids(model, question: str) -> list[int]:
    return model.template.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def _greedy(model, ids: list[int], steps: int, seq=None) -> list[int]:
    """Greedy continuation of `ids` (prefilled into `seq`, or into a fresh sequence released after)."""
    if seq is None:
        seq, _ = model.kv.new_sequence(ids)
        try:
            return _greedy(model, ids, steps, seq)
        finally:
            seq.release()
    with torch.inference_mode():
        logits = prefill(model.net, seq, ids[len(seq.token_ids):])
        out = []
        for _ in range(steps):
            out.append(int(logits.argmax()))
            seq.prepare(1)
            logits = model.net(torch.tensor([[out[-1]]]), seq, last_only=True)[0, -1]
            seq.advance(out[-1:])
    return out


def _bytes(page) -> list:
    return [a.copy() for a in page.export().values()]


def test_sequences_with_a_common_prefix_hold_the_same_blocks_and_pages(smol):
    first = _ids(smol, "How often should the lens be cleaned?")
    second = _ids(smol, "What tools do I need for the motor?")
    a, _ = smol.kv.new_sequence(first)
    with torch.inference_mode():
        prefill(smol.net, a, first)
    b, reused = smol.kv.new_sequence(second)
    try:
        shared = reused // BLOCK
        assert shared >= 6  # the system prompt, in whole blocks
        assert b.blocks[:shared] == a.blocks[:shared]
        assert all(smol.kv.pool.refcount(block) == 3 for block in b.blocks[:shared])  # a, b and the cache
        for layer_a, layer_b in zip(a.layers, b.layers):
            assert all(pa is pb for pa, pb in zip(layer_a.pages[:shared], layer_b.pages[:shared]))
    finally:
        a.release()
        b.release()
    assert smol.kv.live_bytes == 0


def test_writing_into_a_shared_block_copies_it_and_leaves_the_cache_intact(smol, unshared):
    ids = _ids(smol, "Is the beam visible in fog?")
    expected = _greedy(unshared, ids, 12)
    _greedy(smol, ids, 1)  # the prompt's blocks are now cached
    seq, reused = smol.kv.new_sequence(ids)
    try:
        assert reused >= 6 * BLOCK
        back = reused - BLOCK // 2  # into the middle of the last shared block
        b = back // BLOCK
        cached_block, cached_pages = seq.blocks[b], [layer.pages[b] for layer in seq.layers]
        before = [_bytes(page) for page in cached_pages]
        seq.trim(reused - back)
        assert seq.offset == back and seq.blocks[b] == cached_block  # trimming alone copies nothing
        continuation = _greedy(smol, ids, 12, seq)  # rewrites the block's second half
        assert seq.blocks[b] != cached_block and seq.layers[0].pages[b] is not cached_pages[0]
        assert smol.kv.pool.refcount(cached_block) == 1  # the cache's block, now held by it alone
        assert all(np.array_equal(x, y) for page, old in zip(cached_pages, before) for x, y in zip(_bytes(page), old))
        assert continuation == expected  # same output as never shared
    finally:
        seq.release()
    assert _greedy(smol, ids, 12) == expected  # a later request reading the cached blocks too


def test_cancelling_a_request_whose_blocks_are_shared_leaves_the_others_whole(smollm2_path, unshared):
    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=64 * 2**20))
    messages = lambda q: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]  # noqa: E731
    alone = unshared.chat(messages("Which bulb does the lamp take?"), max_tokens=16, temperature=0).token_ids
    svc = Service(model, max_batch=2, queue_limit=3)
    try:
        model.chat(messages("Warm the cache."), max_tokens=1)
        body = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        doomed = svc.submit(Request(messages("Tell me everything about lenses."), body, chat=True, timeout_s=300))
        next(iter(doomed))  # it decodes, holding the system prompt's blocks with the cache
        kept = svc.submit(Request(messages("Which bulb does the lamp take?"), {"max_tokens": 16, "temperature": 0},
                                  chat=True, timeout_s=300))
        events = iter(kept)
        next(events)
        doomed.cancel()
        done = [e for e in events if isinstance(e, Completion)][0]
        assert [e for e in doomed if isinstance(e, Completion)][0].finish_reason == "cancelled"
        assert done.timings.prefix_hit_tokens >= 6 * BLOCK and done.token_ids == alone
        assert model.kv.live_bytes == 0  # both gave their blocks back; the cached ones stay cached
        assert model.kv.pool.used_bytes == model.kv.prefix.nbytes > 0
        again = model.chat(messages("Which bulb does the lamp take?"), max_tokens=16, temperature=0)
        assert again.timings.prefix_hit_tokens >= 6 * BLOCK and again.token_ids == alone
    finally:
        svc.close()
        model.close()


def test_eight_sessions_sharing_a_system_prompt_hold_at_most_one_and_a_half_sessions_of_kv():
    report = shared_prompt_kv("smollm2-135m", sessions=8, prompt_tokens=1000)
    assert report["ratio"] <= 1.5, report  # 8.0 if every session held its own copy


def test_admission_counts_no_room_for_prefix_blocks_a_running_request_shares(smollm2_path, unshared):
    a_ids, b_ids = _ids(unshared, "Tell me everything about lenses."), _ids(unshared, "Which bulb?")
    common = next(i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y) // BLOCK
    a_blocks, b_blocks = -(-(len(a_ids) + 200) // BLOCK), -(-(len(b_ids) + 16) // BLOCK)
    budget = a_blocks + b_blocks - common + 1  # both fit only if b's shared blocks are not counted again
    assert b_blocks > budget - a_blocks and common >= 6
    model = edgellm.load(smollm2_path, kv=KVConfig(budget_bytes=budget * unshared.kv.block_bytes))
    svc = Service(model, max_batch=2, queue_limit=3)
    try:
        a = svc.submit(Request(a_ids, {"max_tokens": 200, "ignore_eos": True, "temperature": 0}, timeout_s=300))
        next(iter(a))  # decoding, its prompt's blocks cached and held
        b = svc.submit(Request(b_ids, {"max_tokens": 16, "temperature": 0}, timeout_s=300))
        next(iter(b))
        assert a.state.value == "decoding"  # b was admitted beside a, not after it
        assert [e for e in b if isinstance(e, Completion)][0].timings.prefix_hit_tokens == common * BLOCK
        a.cancel()
    finally:
        svc.close()
        model.close()


def test_block_hashes_kept_token_by_token_equal_the_whole_prefix_hashed_again(smol):
    """A sequence chains each new block's hash onto the last instead of hashing its history again
    at every token: through a reused prefix, decode steps across block ends, and a trim, its hashes
    stay those of its tokens, and the blocks it completed while decoding are found by the next."""
    ids = _ids(smol, "Which lamp needs oil first?")
    _greedy(smol, ids, 1)  # the system prompt's blocks into the prefix cache
    seq, reused = smol.kv.new_sequence(ids)
    try:
        assert reused >= 8 * BLOCK
        out = _greedy(smol, ids, 2 * BLOCK + 5, seq)
        assert seq.block_hashes() == smol.kv.hashes(seq.token_ids)
        seq.trim(BLOCK // 2 + 7)  # back across a block end
        assert seq.block_hashes() == smol.kv.hashes(seq.token_ids)
        tokens = list(seq.token_ids)
        next_seq, next_reused = smol.kv.new_sequence(tokens + out[:1])
        next_seq.release()
        assert next_reused == len(tokens) // BLOCK * BLOCK
    finally:
        seq.release()
