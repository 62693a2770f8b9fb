"""The scheduler's policy as pure functions: admission by one byte budget, the fallback chain,
thermal rules, conversation trimming and what each engine step runs. No model needed."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from edgellm.errors import ContextOverflow, InvalidRequest, OutOfMemoryBudget
from edgellm.serving.scheduler import (Ask, DeviceState, ModelRoom, Policy, RequestState, RunningRequest, Shortfall,
                                       StepBudget, next_step, plan_request, turns_to_drop)

BYTES_PER_TOKEN = {"f16": 100, "int8": 50, "int4": 25}


def room(free: int | None, context: int = 1000, precision: str = "f16", scale: int = 1) -> ModelRoom:
    return ModelRoom(context, precision, lambda p, n: BYTES_PER_TOKEN[p] * n * scale, free)


ASK = Ask(prompt_tokens=300, max_tokens=100)  # 400 tokens of KV: f16 40,000 B, int4 10,000 B


def test_a_request_that_fits_runs_as_configured():
    plan = plan_request(ASK, room(free=None), None, DeviceState())
    assert (plan.fallback_model, plan.kv_precision, plan.degraded) == (False, "f16", ())
    assert plan_request(ASK, room(free=40_000), None, DeviceState()).kv_precision == "f16"


def test_short_budget_takes_int4_kv_then_the_smaller_model():
    plan = plan_request(ASK, room(free=20_000), None, DeviceState())
    assert (plan.kv_precision, plan.degraded) == ("int4", ("kv_int4_fallback",))
    plan = plan_request(ASK, room(free=5_000), room(free=None, scale=0), DeviceState())
    assert plan.fallback_model and plan.kv_precision == "f16"
    assert plan.degraded == ("kv_int4_fallback", "smaller_model")


def test_the_policy_decides_which_fallbacks_apply():
    strict = Policy(fallbacks=("shorter_context",))
    assert plan_request(ASK, room(free=20_000), room(free=None), DeviceState(), strict) == Shortfall(40_000, 20_000)
    # nothing fits even the smaller model
    assert isinstance(plan_request(ASK, room(free=5_000), room(free=5_000), DeviceState()), Shortfall)
    error = Shortfall(40_000, 20_000).error()  # what a request that never fits is refused with
    assert isinstance(error, OutOfMemoryBudget) and error.needed_bytes == 40_000 and error.available_bytes == 20_000
    with pytest.raises(InvalidRequest):
        Policy(fallbacks=("pray",))


def test_hot_device_gets_the_hot_precision_and_the_smaller_model():
    policy = Policy(hot_precision="int8")
    plan = plan_request(ASK, room(free=None), None, DeviceState(hot=True), policy)
    assert (plan.fallback_model, plan.kv_precision, plan.degraded) == (False, "int8", ("thermal_kv_fallback",))
    plan = plan_request(ASK, room(free=None), room(free=None), DeviceState(hot=True), policy)
    assert plan.fallback_model and set(plan.degraded) == {"smaller_model", "thermal_kv_fallback"}
    assert plan_request(ASK, room(free=None), None, DeviceState(hot=True), Policy(hot_precision=None)).degraded == ()


def test_generation_budget_stops_at_the_context():
    # 990 prompt tokens in a 1,000 context: at most 10 generated, so 1,000 tokens of KV
    assert plan_request(Ask(990, 500), room(free=100_000), None, DeviceState()).kv_precision == "f16"
    assert isinstance(plan_request(Ask(990, 500), room(free=99_999), None, DeviceState(), Policy(fallbacks=())), Shortfall)


def test_turns_to_drop_finds_the_fewest_oldest_turns():
    assert turns_to_drop(900, [300, 300, 300], context=1000, allowed=True) == 0
    assert turns_to_drop(1500, [300, 300, 300], context=1000, allowed=True) == 2  # 1500 -> 1200 -> 900
    with pytest.raises(ContextOverflow) as info:
        turns_to_drop(1500, [100, 100], context=1000, allowed=True)
    assert info.value.prompt_tokens == 1500  # the error names the whole prompt
    with pytest.raises(ContextOverflow):
        turns_to_drop(1500, [300, 300, 300], context=1000, allowed=False)


@dataclass
class Prompt:
    """The one thing the scheduler reads of a generation (scheduler.Stepwise)."""
    prompt_left: int


def _running(state: RequestState, prompt_left: int = 0, batch="main") -> RunningRequest:
    request = RunningRequest(handle=None, generation=Prompt(prompt_left), deadline=0, batch=batch)
    request.state = state
    return request


def test_steps_decode_everyone_and_prefill_the_oldest_newcomer_in_chunks():
    budget = StepBudget(prefill_chunk=512, interleaved_prompt=5)
    a, b = _running(RequestState.DECODING), _running(RequestState.DECODING)
    new, newer = _running(RequestState.PREFILLING, 2000), _running(RequestState.PREFILLING, 10)
    step = next_step([a, new, b, newer], budget)
    assert step.decode == [a, b] and step.prefill == [(new, 5), (newer, 1)]  # 2 decode rows, 6 prompt tokens
    five = [_running(RequestState.DECODING) for _ in range(5)]
    assert next_step(five + [new], budget).prefill == [(new, 3)]  # the 8 rows of one native call
    crowded = [_running(RequestState.DECODING) for _ in range(8)] + [new]
    assert next_step(crowded, budget).prefill == [(new, 64)]  # no row free in the call: a chunk of its own
    alone_model = _running(RequestState.PREFILLING, 2000, batch=None)  # no native decoder: it runs on its own
    apart = next_step([a, alone_model], StepBudget(separate_chunk=64))
    assert apart.prefill == [(alone_model, 64)]  # not one native call: a chunk worth its fixed cost
    alone = next_step([new, newer], budget)
    assert alone.decode == [] and alone.prefill == [(new, 512)]
    assert next_step([newer], budget).prefill == [(newer, 10)]
    assert next_step([], budget).prefill == [] and next_step([], budget).decode == []


def test_newcomers_share_the_free_rows_of_the_decode_call_oldest_first():
    budget = StepBudget(interleaved_prompt=3, step_rows=8)
    a = _running(RequestState.DECODING)
    b, c, d = (_running(RequestState.PREFILLING, 9) for _ in range(3))
    assert next_step([a, b, c, d], budget).prefill == [(b, 3), (c, 3), (d, 1)]  # 1 + 7 rows
    b.generation.prompt_left = 2
    assert next_step([a, b, c, d], budget).prefill == [(b, 2), (c, 3), (d, 2)]
    c.batch = "int4 KV"  # another KV precision: another native call
    other = next_step([a, b, c, d], budget)
    assert other.prefill == [(b, 2), (d, 3)]  # one the call cannot take waits; the next one rides instead
    c.batch = "main"
    six = [_running(RequestState.DECODING) for _ in range(6)]
    assert next_step(six + [b, c], budget).prefill == [(b, 2)]  # no row left for c: it waits


def test_one_pool_and_budget_serve_every_kv_precision():
    from edgellm.kv import KVConfig, KVManager, LayerSpec

    specs = [LayerSpec(kv_heads=2, head_dim=64, window=None, rotate=None)] * 4
    f16 = KVManager(specs, KVConfig(block_size=16, budget_bytes=2_000_000, prefix_cache_bytes=50_000), 4096)
    int4 = f16.for_precision("int4")
    assert int4.pool is f16.pool and int4.prefix is f16.prefix and f16.for_precision("int4") is int4
    assert int4.block_bytes < f16.block_bytes
    a, _ = f16.new_sequence()
    a.prepare(300)
    b, _ = int4.new_sequence()
    b.prepare(300)
    assert f16.pool.used_bytes == len(a.blocks) * f16.block_bytes + len(b.blocks) * int4.block_bytes
    with pytest.raises(OutOfMemoryBudget):  # the two precisions share one budget
        f16.new_sequence()[0].prepare(1000)
    a.release()
    b.release()
    assert f16.pool.used_bytes == 0


def test_a_cached_prefix_costs_no_new_blocks_and_a_failed_request_gives_everything_back():
    from edgellm.kv import KVConfig, KVManager, LayerSpec

    specs = [LayerSpec(kv_heads=1, head_dim=32, window=None, rotate=None)] * 2
    kv = KVManager(specs, KVConfig(k_precision="f32", v_precision="f32", block_size=4, budget_bytes=40 * 1024,
                                   prefix_cache_bytes=40 * 1024), 4096)
    prompt = list(range(33))
    seq, _ = kv.new_sequence(prompt)
    seq.prepare(len(prompt))
    seq.advance(prompt)  # 8 full blocks are remembered
    seq.release()
    cached = kv.pool.used_bytes
    hog = kv.take((kv.pool.available_bytes()) // kv.block_bytes)  # the rest of the budget
    seq, reused = kv.new_sequence(prompt)  # the cached blocks are shared in place: no room needed
    assert reused == 32 and kv.pool.used_bytes == cached + len(hog) * kv.block_bytes
    with pytest.raises(OutOfMemoryBudget):
        seq.prepare(1)  # the last prompt token needs a block of its own: there is none
    seq.release()
    assert kv.prefix.evictable_bytes == cached  # no pin left behind
    kv.pool.free(hog)
    assert kv.pool.used_bytes == cached


def test_the_fallback_model_is_planned_in_its_own_tokens():
    # 300 prompt tokens for the main model, 900 in the fallback's coarser tokenizer
    small_tokens = ModelRoom(1000, "f16", lambda p, n: BYTES_PER_TOKEN[p] * n, 50_000, prompt_tokens=900)
    # 1,000 tokens of f16 KV (900 + the 100 that fit) > 50,000 B
    assert isinstance(plan_request(ASK, room(free=5_000), small_tokens, DeviceState(), Policy(fallbacks=("smaller_model",))),
                      Shortfall)
    fits = ModelRoom(1000, "f16", lambda p, n: BYTES_PER_TOKEN[p] * n, 50_000, prompt_tokens=200)
    assert plan_request(ASK, room(free=5_000), fits, DeviceState(), Policy(fallbacks=("smaller_model",))).fallback_model


def test_a_reservation_keeps_its_room_until_the_sequence_is_released():
    """Admission (free_bytes) counts what a running request may still grow into as taken, across
    precisions on the one pool, and gives it back as blocks replace it and at release."""
    from edgellm.kv import KVConfig, KVManager, LayerSpec

    specs = [LayerSpec(kv_heads=2, head_dim=64, window=None, rotate=None)] * 4
    f16 = KVManager(specs, KVConfig(block_size=16, budget_bytes=2_000_000, prefix_cache_bytes=0), 4096)
    int4 = f16.for_precision("int4")
    empty = f16.free_bytes()
    seq, _ = int4.new_sequence()
    int4.reserve(seq, 320)  # 20 blocks of int4 KV, none held yet
    assert f16.free_bytes() == empty - int4.bytes_needed(320)
    seq.prepare(160)  # half of it now held as blocks: the same room taken
    assert f16.free_bytes() == empty - int4.bytes_needed(320)
    seq.prepare(480)  # past its reservation: what it holds counts, nothing more
    assert f16.free_bytes() == empty - len(seq.blocks) * int4.block_bytes
    seq.release()
    assert f16.free_bytes() == empty
