"""The service API apps hold directly: sessions, asyncio use, fallbacks."""
from __future__ import annotations

import asyncio

import pytest

import edgellm
from edgellm.generation import Completion
from edgellm.kv import KVConfig
from edgellm.serving.service import Request, Service


@pytest.fixture(scope="module")
def service(smollm2_path):
    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=128 * 2**20))
    svc = Service(model, queue_limit=3)
    yield svc
    svc.close()
    model.close()


def _done(handle) -> Completion:
    return [e for e in handle if isinstance(e, Completion)][0]


def test_session_keeps_the_conversation_and_its_kv_until_release(service):
    pool = service.model.kv.pool
    before = pool.used_bytes
    session = service.init(system="You are terse.", max_tokens=16, temperature=0)
    first = _done(session.infer("My name is Ada."))
    assert session.messages[-1] == {"role": "assistant", "content": first.text}
    second = _done(session.infer("What is my name?"))
    assert second.timings.prefix_hit_tokens > 0  # the first turn's KV was reused
    assert len(session.messages) == 5 and session.kv_bytes > 0
    held = pool.used_bytes
    freed = session.release()
    assert freed > 0 and pool.used_bytes == held - freed  # freed at once
    assert pool.used_bytes >= before
    with pytest.raises(edgellm.InvalidRequest):
        session.infer("again?")


def test_two_sessions_share_the_weights_with_separate_conversations(service):
    a = service.init(max_tokens=8, temperature=0)
    b = service.init(max_tokens=8, temperature=0)
    _done(a.infer("Hello from A"))
    _done(b.infer("Hello from B"))
    assert a.messages[0]["content"] == "Hello from A" and b.messages[0]["content"] == "Hello from B"
    a.release()
    b.release()


def test_service_is_usable_from_asyncio(service):
    async def run():
        handle = service.submit(Request("Once upon a time", {"max_tokens": 8, "temperature": 0}))
        return [event async for event in handle]
    events = asyncio.run(run())
    assert isinstance(events[-1], Completion) and len(events[-1].token_ids) == 8


def test_context_overflow_falls_back_to_dropping_old_turns(smollm2_path):
    model = edgellm.load(smollm2_path, context_length=256)
    svc = Service(model)
    try:
        history = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"},
                   {"role": "user", "content": "Say hi."}]
        handle = svc.submit(Request(history, {"max_tokens": 4}, chat=True))
        done = _done(handle)
        assert "context_truncated" in handle.degraded and done.token_ids
    finally:
        svc.close()
        model.close()


def test_kv_budget_falls_back_to_int4_kv(smollm2_path):
    # 2 MiB holds ~90 tokens of f16 KV (the default) but ~290 of INT4
    model = edgellm.load(smollm2_path, kv=KVConfig(budget_bytes=2 * 2**20))
    svc = Service(model)
    try:
        handle = svc.submit(Request("word " * 120, {"max_tokens": 8}))
        done = _done(handle)
        assert handle.degraded == ["kv_int4_fallback"] and len(done.token_ids) == 8
        assert handle.plan.kv_precision == "int4" and model.kv.config.k_precision == "f16"  # the model is untouched
    finally:
        svc.close()
        model.close()


def test_a_request_that_fits_alone_but_not_beside_the_running_one_waits_for_it(smollm2_path):
    """Admission's shortfall is a value: the second request waits, first in line, while the first
    one's reservation holds the budget, then runs; neither fails."""
    # 2 MiB holds ~90 tokens of f16 KV (blocks of 32): one request of ~40 tokens, not two
    model = edgellm.load(smollm2_path, kv=KVConfig(budget_bytes=2 * 2**20, prefix_cache_bytes=0))
    svc = Service(model, max_batch=2, fallbacks=())
    try:
        first = svc.submit(Request("The lighthouse at the end of the harbour", {"max_tokens": 30, "temperature": 0.0}))
        second = svc.submit(Request("The town still spoke of it", {"max_tokens": 30, "temperature": 0.0}))
        for _ in first:
            # read in this order: once the second has started, the first must have ended already
            second_state, first_state = second.state.value, first.state.value
            assert second_state == "waiting" or first_state not in ("prefilling", "decoding")
        assert len(_done(second).token_ids) == 30 and second.degraded == []
    finally:
        svc.close()
        model.close()


def test_throughput_mode_batches_and_matches_latency_mode(smollm2_path):
    model = edgellm.load(smollm2_path)
    prompts = ["Once upon a time", "The capital of France is", "def add(a, b):"]
    alone = [model.generate(p, max_tokens=12).token_ids for p in prompts]
    svc = Service(model, max_batch=4, queue_limit=4)
    try:
        handles = [svc.submit(Request(p, {"max_tokens": 12, "temperature": 0})) for p in prompts]
        results = [_done(h).token_ids for h in handles]
        assert results == alone  # batching changes nothing under greedy
        late = svc.submit(Request("Once upon a time", {"max_tokens": 2000, "temperature": 0}, timeout_s=0.5))
        done = _done(late)
        assert done.finish_reason == "timeout" and done.token_ids
        assert model.kv.live_bytes == 0 and not svc.busy
    finally:
        svc.close()
        model.close()


BURST = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):", "Once upon a time there"]


def test_a_burst_of_short_prompts_joins_in_shared_calls_and_reads_as_alone(smollm2_path):
    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=0))
    alone = [model.generate(p, max_tokens=10).token_ids for p in BURST]
    assert len({ids[0] for ids in alone}) == len(BURST)  # each newcomer must read its own row of the call
    svc = Service(model, max_batch=4, queue_limit=4)
    steps = []
    run = svc.engine.step
    svc.engine.step = lambda step: steps.append([n for _, n in step.prefill]) or run(step)  # observes only
    try:
        handles = [svc.submit(Request(p, {"max_tokens": 10, "temperature": 0})) for p in BURST]
        assert [_done(h).token_ids for h in handles] == alone  # prompt rows of several newcomers in one call
        assert any(len(prefill) > 1 for prefill in steps)  # newcomers shared a step's free rows
        trickled = 1 + sum(-(-len(model.prompt_ids(p)) // 3) for p in BURST[1:])  # 3 tokens a step, one by one
        assert sum(1 for prefill in steps if prefill) < trickled
    finally:
        svc.close()
        model.close()


def test_a_newcomer_whose_sampling_fails_ends_alone_in_a_shared_call(smollm2_path, monkeypatch):
    from edgellm.generation.generator import Generation

    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=0))
    alone = [model.generate(p, max_tokens=10).token_ids for p in BURST]
    accept = Generation.accept

    def breaks_for_the_third(self, logits):  # a sampler failing for one request only
        if "def add" in model.tokenizer.decode(list(self.prompt_ids)):
            raise RuntimeError("this request's sampler broke")
        return accept(self, logits)

    monkeypatch.setattr(Generation, "accept", breaks_for_the_third)
    svc = Service(model, max_batch=4, queue_limit=4)
    try:
        handles = [svc.submit(Request(p, {"max_tokens": 10, "temperature": 0})) for p in BURST]
        for i, handle in enumerate(handles):
            if i == 2:
                with pytest.raises(RuntimeError, match="sampler broke"):
                    _done(handle)
            else:
                assert _done(handle).token_ids == alone[i]  # the others in its calls go on untouched
        assert model.kv.live_bytes == 0
    finally:
        svc.close()
        model.close()


def test_fallback_chain_reaches_the_smaller_model_and_is_configurable(smollm2_path, gemma3_path):
    # Gemma 3 with a KV budget too small even for INT4 KV; SmolLM2 is the configured smaller model.
    big = edgellm.load(gemma3_path, kv=KVConfig(budget_bytes=64 * 2**10))
    small = edgellm.load(smollm2_path)
    svc = Service(big, fallback_model=small)
    strict = Service(big, fallbacks=("shorter_context",))
    try:
        handle = svc.submit(Request("Hello there", {"max_tokens": 4}))
        done = _done(handle)
        assert handle.degraded == ["kv_int4_fallback", "smaller_model"] and len(done.token_ids) == 4
        with pytest.raises(edgellm.EdgeLLMError):
            _done(strict.submit(Request("Hello there", {"max_tokens": 4})))
    finally:
        svc.close()
        strict.close()
        big.close()
        small.close()


def test_unknown_fallback_name_is_rejected(service):
    with pytest.raises(edgellm.InvalidRequest):
        Service(service.model, fallbacks=("pray",), start=False)


def test_throughput_mode_throttles_while_hot(smollm2_path, tmp_path):
    from edgellm.serving.thermal import ThermalGovernor

    sensor = tmp_path / "temp"
    sensor.write_text("40")
    model = edgellm.load(smollm2_path)
    svc = Service(model, max_batch=2, thermal=ThermalGovernor(sensor, poll_s=0))
    try:
        body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
        cool = _done(svc.submit(Request("Once upon a time", body)))
        sensor.write_text("95")
        hot_handle = svc.submit(Request("Once upon a time", body))
        hot = _done(hot_handle)
        assert "thermal_throttle" in hot_handle.degraded and "thermal_kv_fallback" in hot_handle.degraded
        assert hot.timings.decode_s > cool.timings.decode_s * 1.2
    finally:
        svc.close()
        model.close()


def test_fallbacks_apply_in_throughput_mode_too(smollm2_path):
    model = edgellm.load(smollm2_path, kv=KVConfig(budget_bytes=2 * 2**20, prefix_cache_bytes=0))
    svc = Service(model, max_batch=4)
    try:
        handles = [svc.submit(Request("word " * 120, {"max_tokens": 8})) for _ in range(2)]
        for handle in handles:
            assert len(_done(handle).token_ids) == 8
        assert [h.degraded for h in handles] == [["kv_int4_fallback"]] * 2
        assert model.kv.live_bytes == 0
    finally:
        svc.close()
        model.close()


def test_a_long_prompt_is_prefilled_between_the_decode_steps_of_a_running_stream(smollm2_path):
    from edgellm.generation import TokenEvent
    from edgellm.serving.scheduler import StepBudget

    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=0))
    prompt = "The harbour light turns. " * 150
    alone = model.generate(prompt, max_tokens=1).token_ids
    svc = Service(model, max_batch=2, queue_limit=2, step_budget=StepBudget(interleaved_prompt=7))
    try:
        running = svc.submit(Request("1, 2, 3,", {"max_tokens": 4000, "ignore_eos": True, "temperature": 0},
                                     timeout_s=300))
        tokens = iter(running)
        for _ in range(5):
            next(tokens)  # the stream is decoding
        long = svc.submit(Request(prompt, {"max_tokens": 1, "temperature": 0}, timeout_s=300))
        during = 0
        while long.state.value in ("waiting", "prefilling"):
            assert isinstance(next(tokens), TokenEvent)  # the stream keeps its pace meanwhile
            during += 1
        done = _done(long)
        running.cancel()
        assert done.timings.prompt_tokens > 700 and during >= done.timings.prompt_tokens // 7 - 2  # 7 prompt tokens a step
        assert done.token_ids == alone  # chunked beside a decode step, the prompt reads the same
    finally:
        svc.close()
        model.close()


def test_the_deadline_counts_from_acceptance_not_from_the_start_of_work(smollm2_path):
    model = edgellm.load(smollm2_path)
    svc = Service(model, queue_limit=2)
    try:
        body = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
        first = svc.submit(Request("Once upon a time", body, timeout_s=60))
        queued = svc.submit(Request("Once upon a time", body, timeout_s=0.3))
        _done(first)
        late = _done(queued)
        assert late.finish_reason == "timeout" and late.token_ids == ()  # its time ran out in the queue
    finally:
        svc.close()
        model.close()


def test_closing_the_service_ends_every_request_and_frees_their_kv(smollm2_path):
    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=0))
    svc = Service(model, queue_limit=3)
    body = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    running = svc.submit(Request("1, 2, 3,", body, timeout_s=300))
    waiting = svc.submit(Request("4, 5, 6,", body, timeout_s=300))
    next(iter(running))  # it is decoding
    svc.close()
    assert _done(running).finish_reason == "cancelled"
    with pytest.raises(edgellm.errors.ServiceClosed):
        list(waiting)
    with pytest.raises(edgellm.errors.ServiceClosed):
        svc.submit(Request("again", body))
    assert model.kv.live_bytes == 0
    model.close()


def test_a_failing_app_callback_never_stops_the_engine(service):
    calls = []

    def broken(handle, done):
        calls.append(done)
        raise RuntimeError("the app's bug")

    first = service.submit(Request("Hello", {"max_tokens": 2}), on_done=broken)
    assert _done(first).token_ids and calls
    assert _done(service.submit(Request("Hello again", {"max_tokens": 2}))).token_ids  # still serving
