"""KV behaviour on the real models: prefix reuse, quantized KV quality, the sliding window,
saving and loading prefixes."""
from __future__ import annotations

from importlib import resources

import pytest
import torch

import edgellm
from edgellm.errors import KVStateMismatch
from edgellm.generation.passes import prefill, prefill_chunk
from edgellm.kv import KVConfig
from tests.agreement import agreement

SYSTEM = ("You are a careful assistant for a lighthouse maintenance team. " * 12).strip()
PREFIX_CACHE = 256 * 2**20


@pytest.fixture(scope="module")
def smol(smollm2_path):
    model = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=PREFIX_CACHE))
    yield model
    model.close()


@pytest.fixture(scope="module")
def smol_cold(smollm2_path):
    model = edgellm.load(smollm2_path)
    yield model
    model.close()


def _chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_prefix_hits_give_the_same_greedy_output_as_a_cold_run(smol, smol_cold):
    first = smol.chat(_chat("How often should the lens be cleaned?"), max_tokens=24)
    assert first.timings.prefix_hit_tokens == 0
    second = smol.chat(_chat("What tools do I need for the motor?"), max_tokens=24)
    cold = smol_cold.chat(_chat("What tools do I need for the motor?"), max_tokens=24)
    assert second.timings.prefix_hit_tokens >= 96  # the shared system prompt, in whole blocks
    assert second.token_ids == cold.token_ids
    stats = smol.kv.prefix.stats
    assert stats.hit_tokens >= 96 and stats.miss_tokens > 0


def test_sequence_blocks_return_to_the_pool_after_each_request(smol):
    smol.generate("Once upon a time", max_tokens=8)
    assert smol.kv.pool.used_blocks == len(smol.kv.prefix)  # only cached prefix blocks remain


def test_saved_prefix_loads_into_a_new_process_model(smollm2_path, tmp_path, smol_cold):
    path = tmp_path / "system.kv"
    saved = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=PREFIX_CACHE))
    n = saved.save_prefix(_chat("x")[:1], path)
    saved.close()
    assert n >= 96 and path.stat().st_size > 0
    fresh = edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=PREFIX_CACHE))
    assert fresh.load_prefix(path) == n
    done = fresh.chat(_chat("Is the beam visible in fog?"), max_tokens=16)
    assert done.timings.prefix_hit_tokens == n
    assert done.token_ids == smol_cold.chat(_chat("Is the beam visible in fog?"), max_tokens=16).token_ids
    fresh.close()


def test_saved_prefix_is_refused_by_another_setup(smollm2_path, gemma3_path, tmp_path):
    path = tmp_path / "p.kv"
    with edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=PREFIX_CACHE)) as m:
        m.save_prefix(SYSTEM, path)
    with edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=PREFIX_CACHE, k_precision="int8")) as m:
        with pytest.raises(KVStateMismatch, match="k_precision"):
            m.load_prefix(path)
    with edgellm.load(gemma3_path, kv=KVConfig(prefix_cache_bytes=PREFIX_CACHE)) as m:
        with pytest.raises(KVStateMismatch, match="model"):
            m.load_prefix(path)
    broken = tmp_path / "broken.kv"
    broken.write_bytes(path.read_bytes()[:200])
    with edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=PREFIX_CACHE)) as m:
        with pytest.raises(KVStateMismatch):
            m.load_prefix(broken)


def test_sliding_window_generates_past_the_window_in_bounded_memory(smollm2_path):
    window = KVConfig(max_tokens=128, sinks=4, block_size=32)
    with edgellm.load(smollm2_path, kv=window) as model:
        done = model.generate("Tell me a long story about the sea.", max_tokens=400, ignore_eos=True,
                              repetition_penalty=1.1)
    assert len(done.token_ids) == 400
    per_token = model.kv.bytes_per_token
    assert done.timings.kv_bytes <= per_token * (128 + 32)  # the window plus at most one block
    assert len(set(done.token_ids[-100:])) > 20  # still producing varied text, not a stuck token


def _teacher_forced(model, kv: KVConfig, ids):
    return model.logits(ids, kv=kv)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_int8_kv_stays_close_to_bf16_kv(name):
    text = resources.files("edgellm").joinpath("data/heldout.txt").read_text()
    with edgellm.load(name) as model:
        ids = model.tokenizer.encode(text)[:1000]
        ref = _teacher_forced(model, KVConfig(k_precision="bf16", v_precision="bf16"), ids)
        for precision in ("int8", "int4"):
            out = _teacher_forced(model, KVConfig(k_precision=precision, v_precision=precision), ids)
            top1, kl = agreement(out, ref)
            print(f"\n{name} {precision} KV vs bf16 KV: mean KL {kl:.4f}, top-1 {top1:.4f}")
            if precision == "int8":
                # top-1 over all positions moves ±0.5 % with any change of float order (near-ties:
                # 97.4-98.4 % measured at the same KL); where the reference is decided by half a
                # logit or more, INT8 KV must never flip it
                top2 = ref.topk(2, dim=-1).values
                decided = top2[..., 0] - top2[..., 1] >= 0.5
                assert kl <= 0.01 and top1 >= 0.97
                assert (out.argmax(-1) == ref.argmax(-1))[decided].float().mean().item() >= 0.995


def _next_logits(model, ids: list[int]) -> tuple[torch.Tensor, int]:
    """The logits after `ids` and how many of them came from the prefix cache."""
    seq, reused = model.kv.new_sequence(ids)
    try:
        with torch.inference_mode():
            logits = torch.from_numpy(prefill(model.net, seq, ids[reused:], prefill_chunk(model.kv)))
    finally:
        seq.release()
    return logits.reshape(-1, logits.shape[-1])[-1], reused


def test_model_chat_reuses_earlier_turns_by_default(smollm2_path):
    with edgellm.load(smollm2_path) as model:  # no KV options: prefix reuse is on
        messages = [{"role": "system", "content": "You are a patient tutor. " * 20},
                    {"role": "user", "content": "What is a prime number?"}]
        first = model.chat(messages, max_tokens=24, temperature=0)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Give an example."}]
        second = model.chat(messages, max_tokens=8, temperature=0)
        assert second.timings.prefix_hit_tokens >= first.timings.prompt_tokens // 32 * 32
        reused, hit = _next_logits(model, model.chat_ids(messages))
        assert hit == second.timings.prefix_hit_tokens
    with edgellm.load(smollm2_path, kv=KVConfig(prefix_cache_bytes=0)) as without:
        fresh, none = _next_logits(without, without.chat_ids(messages))
        assert none == 0 and without.kv.prefix is None
    # The same answer, to rounding: the fresh prompt runs bf16 GEMMs over all of it, the reused one
    # the int16 GEMVs over its last few tokens (their top two logits here are 0.04 apart: a token
    # comparison would test that near-tie, not the reuse).
    difference = (reused - fresh).abs().max()
    assert difference < 0.02 * fresh.abs().max()  # measured: 1.2 % bf16, 0.9 % int8, 0.03 % fp32 GEMMs
    top2 = fresh.topk(2).values
    if top2[0] - top2[1] > 2 * difference:
        assert int(reused.argmax()) == int(fresh.argmax())


def test_a_prompt_resumed_inside_a_block_is_remembered_whole_on_gemmas_rings(gemma3_path):
    """Throughput mode prefills a newcomer a few tokens a step beside running streams, then in
    chunks of a ring's window (512) once it runs alone: the KV block the chunk began in must still
    be in the sliding layers' rings when it is remembered for prefix reuse (it used to raise
    "positions ... are no longer in the ring")."""
    with edgellm.load(gemma3_path) as model:
        ids = model.tokenizer.encode(SYSTEM * 6)
        assert len(ids) > 600
        seq, _ = model.kv.new_sequence(ids)
        try:
            with torch.inference_mode():
                prefill(model.net, seq, ids[:5], prefill_chunk(model.kv))  # the interleaved few tokens
                prefill(model.net, seq, ids[5:], prefill_chunk(model.kv))
        finally:
            seq.release()
        again, reused = model.kv.new_sequence(ids)
        again.release()
    assert reused == (len(ids) - 1) // 32 * 32  # every finished block was remembered
