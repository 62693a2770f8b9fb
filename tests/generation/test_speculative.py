"""Speculative decoding: every drafter gives plain decoding's exact tokens under greedy (both
real models; Gemma 3's sliding-window rings wrap while guesses are rejected), the target's own
distribution under sampling (chi-square against plain sampling on a tiny model), and typed
errors for drafts that cannot draft."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

import edgellm
from edgellm.errors import DraftMismatch, InvalidRequest, OutOfMemoryBudget
from edgellm.generation.drafters import PromptLookup
from edgellm.generation.speculative import JUDGE_AFTER, AdaptiveSpeculation, SpeculationCosts
from edgellm.kv.cache import RingCache
from edgellm.kv.codecs import codec

DOCUMENT = ("edgellm loads a small quantized model, fits it into the memory it is given, generates fast on "
            "the CPUs people have and serves it through an OpenAI-compatible local API. Install it with "
            "`make install`, run the tests with `make test`, and start the server with `edgellm serve`. ")
REWRITE = [{"role": "user", "content": DOCUMENT * 3 + "\n\nRepeat the text above word for word."}]
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def _plain_from_the_cache(model, conversation, max_tokens: int):
    """Plain decoding of `conversation` once its prompt's blocks are cached, as the speculative
    run after it finds them (where prompt GEMMs run in bf16, a fresh prompt's logits differ from
    a cached one's by ~1e-2: enough to flip a near-tie)."""
    model.chat(conversation, max_tokens=1)
    return model.chat(conversation, max_tokens=max_tokens)


def test_prompt_lookup_continues_the_most_recent_longest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 3) == ([7, 8, 5], None)  # the later 1 2 3
    assert lookup.propose([4, 5, 6, 9, 9, 6], 2) == ([9, 9], None)  # only the 1-gram 6 occurred before
    assert lookup.propose([1, 2, 3, 4], 4) == ([], None)  # nothing repeats: no guess, a plain step


def test_the_policy_picks_the_draft_length_that_maximizes_tokens_per_second():
    policy = AdaptiveSpeculation(known=SpeculationCosts(plain_s=0.010, guess_s=0.004))
    assert policy.draft_length() == 4  # no yardstick step needed: the costs are known
    for _ in range(20):  # every guess kept: the longest draft pays most
        policy.record_check(0.010 + 7 * 0.004, 7, 7)
    assert policy.k == 7
    for _ in range(30):  # no guess kept: one token per pass cannot pay for 4 ms a guess
        policy.record_check(0.010 + 3 * 0.004, 3, 0)
    assert policy.draft_length() == 0  # plain decoding for a while


def test_a_draft_model_whose_guess_costs_a_whole_step_is_not_retried_soon():
    costs = SpeculationCosts(plain_s=0.010, guess_s=0.012)
    assert costs.never_pays
    policy = AdaptiveSpeculation(known=costs, max_wait=512)
    assert all(policy.draft_length() == 0 for _ in range(512)) and policy.draft_length() > 0


def test_a_draft_models_verdict_that_no_length_pays_holds_for_the_next_generation():
    costs = SpeculationCosts(plain_s=0.010, guess_s=0.008)  # a guess cheaper than a step...
    policy = AdaptiveSpeculation(known=costs, max_wait=512)
    assert policy.draft_length() == 4
    for _ in range(JUDGE_AFTER):  # ...but none kept: no draft length pays
        policy.record_check(0.010 + 4 * 0.008, 4, 0)
    assert policy.pays is False and policy.draft_length() == 0
    costs.pays = policy.pays  # what Speculator.close hands on
    later = AdaptiveSpeculation(known=costs, max_wait=512)  # its first check would catch up on a whole prompt
    assert all(later.draft_length() == 0 for _ in range(512)) and later.draft_length() > 0
    assert AdaptiveSpeculation(known=costs, free_guesses=True).draft_length() > 0  # prompt lookup checks again


def test_a_verdict_that_free_guesses_do_not_pay_is_checked_again_cheaply_by_the_next_generation():
    costs = SpeculationCosts(plain_s=0.010, guess_s=0.012)
    policy = AdaptiveSpeculation(known=costs, retry_every=32, max_wait=512, free_guesses=True)
    assert all(policy.draft_length() == 0 for _ in range(32)) and policy.draft_length() == 1  # one guess a pass
    for _ in range(JUDGE_AFTER):  # a guess that does cost a whole step: plain for the longest wait
        policy.record_check(0.010 + 0.012, 1, 0)
    assert all(policy.draft_length() == 0 for _ in range(512)) and policy.draft_length() == 1

    # the verdict came from an unlucky moment: guesses cost 4 ms and are kept, so longer drafts follow
    policy = AdaptiveSpeculation(known=costs, retry_every=32, free_guesses=True)
    assert all(policy.draft_length() == 0 for _ in range(32))
    for _ in range(JUDGE_AFTER):
        policy.record_check(0.010 + 0.004, 1, 1)
    assert policy.draft_length() > 1


def test_prompt_lookups_index_finds_what_a_plain_scan_finds_as_the_context_grows():
    def scan(ids, k, longest=4, shortest=2):  # the definition: search backwards, longest n-gram first
        for n in range(min(longest, len(ids) - 1), shortest - 1, -1):
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == ids[-n:]:
                    return ids[start + n:start + n + k]
        return []

    rng = random.Random(0)
    for _ in range(100):
        context, lookup = [rng.randrange(6) for _ in range(rng.randrange(1, 5))], PromptLookup()
        for _ in range(30):  # one growing list, as a generation's history is
            assert lookup.propose(context, 5)[0] == scan(context, 5), context
            context.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with edgellm.load(smollm2_path) as model:
        model.self_draft_layers = 15  # a draft that guesses (measured, none pays on SmolLM2: see below)
        yield model


@pytest.mark.parametrize("conversation, kind", [(REWRITE, "lookup"), (STORY, "self"), (REWRITE, "self")])
def test_greedy_speculation_gives_plain_decodings_tokens_on_smollm2(smollm2, conversation, kind):
    smollm2.forget_speculation_costs()  # an earlier test's verdict (a self-draft does not pay) would keep it plain
    plain = _plain_from_the_cache(smollm2, conversation, 80)
    fast = smollm2.chat(conversation, max_tokens=80, speculative=kind)
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    timings = fast.timings
    assert timings.speculative == kind and timings.drafted_tokens > 0
    assert timings.target_passes < plain.timings.completion_tokens if kind == "lookup" else timings.target_passes > 0


def test_exact_mode_checks_guesses_on_the_pytorch_path_with_the_same_tokens(smollm2_path):
    copy = [{"role": "user", "content": DOCUMENT + "\n\nRepeat the text above word for word."}]
    with edgellm.load(smollm2_path, mode="exact") as model:  # no native decoder: rows go through PyTorch
        assert model.net.decoder is None
        plain = model.chat(copy, max_tokens=30)
        fast = model.chat(copy, max_tokens=30, speculative="lookup")
    assert fast.token_ids == plain.token_ids
    assert fast.timings.accepted_tokens > 0 and fast.timings.target_passes < plain.timings.completion_tokens


def test_a_draft_model_gives_plain_decodings_tokens(smollm2, smollm2_path):
    with edgellm.load(smollm2_path, mode="fast", draft=smollm2_path) as target:
        plain = _plain_from_the_cache(target, STORY, 60)
        drafted = target.chat(STORY, max_tokens=60, speculative="draft")
    assert drafted.token_ids == plain.token_ids
    assert drafted.timings.accepted_tokens > 0.9 * drafted.timings.drafted_tokens  # the same weights: it agrees
    assert target.draft.net is None  # the draft load() loaded closes with its model


def test_greedy_speculation_on_gemma3_survives_its_rings_wrapping(gemma3_path):
    # a prompt beyond the 512-token window: sliding layers overwrite slots with guesses, and a
    # rejection must give the older tokens back
    long_rewrite = [{"role": "user", "content": DOCUMENT * 8 + "\n\nRepeat the text above word for word."}]
    with edgellm.load(gemma3_path) as model:
        model.self_draft_layers = 9
        assert len(model.template.encode_chat(long_rewrite)) > 512
        model.attach_draft(model)  # Gemma 3 has no smaller sibling here: itself, on its own KV
        for conversation, kind in ((long_rewrite, "lookup"), (STORY, "self"), (long_rewrite, "draft")):
            plain = _plain_from_the_cache(model, conversation, 60)
            fast = model.chat(conversation, max_tokens=60, speculative=kind)
            assert fast.token_ids == plain.token_ids, kind
            assert fast.timings.drafted_tokens > 0


def test_self_speculation_measures_its_early_exit_and_stays_plain_where_it_cannot_pay(smollm2_path):
    with edgellm.load(smollm2_path) as model:
        plain = _plain_from_the_cache(model, STORY, 20)
        done = model.chat(STORY, max_tokens=20, speculative="self")
        agreement = model.self_draft_agreement
    # SmolLM2's early exits pick the model's token at most ~60 % of the time, at 29 of 30 layers
    # (a guess costing nearly a whole step): no draft length pays, so nothing is drafted
    assert set(agreement) == {15, 22, 28, 29} and max(agreement.values()) < 0.8
    assert done.timings.speculative == "self" and done.timings.drafted_tokens == 0
    assert done.token_ids == plain.token_ids


def test_trimming_a_ring_gives_back_the_slots_guesses_overwrote():
    f32 = codec("f32")
    ring = RingCache(f32, f32, kv_heads=1, head_dim=4, window=4)
    k = torch.arange(24, dtype=torch.float32).reshape(1, 1, 6, 4)
    ring.update_and_fetch(k[:, :, :4], k[:, :, :4])  # positions 0-3 fill the ring
    before = (ring.k.read(0, 4).clone(), ring.positions.copy())
    ring.keep_overwritten(2)
    ring.update_and_fetch(k[:, :, 4:6], k[:, :, 4:6])  # two guesses overwrite positions 0 and 1
    assert ring.trim(2) == 2
    torch.testing.assert_close(ring.k.read(0, 4), before[0])
    assert (ring.positions == before[1]).all() and ring.offset == 4


def _chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories both samples share enough of."""
    n_a, n_b = sum(a.values()), sum(b.values())
    keys = [key for key in set(a) | set(b) if a[key] + b[key] >= 10]
    stat = sum((math.sqrt(n_b / n_a) * a[k] - math.sqrt(n_a / n_b) * b[k]) ** 2 / (a[k] + b[k]) for k in keys)
    return stat, len(keys) - 1


@pytest.mark.parametrize("kind", ["self", "lookup"])
def test_speculative_sampling_keeps_the_targets_distribution(tmp_path, kind):
    import gguf

    from tests.tiny import random_weights, write_gguf

    path = write_gguf(tmp_path / "tiny.gguf", "llama", random_weights("llama", seed=3, head_dim=32, layers=4),
                      head_dim=32, layers=4, tokenizer="llama", qtype=gguf.GGMLQuantizationType.Q8_0)
    with edgellm.load(path) as model:
        model.self_draft_layers = 1
        samples, drafted = {}, 0
        for spec in (None, kind):
            seen = Counter()
            for seed in range(300):
                model.forget_speculation_costs()  # speculate in each: a tiny model's steps are all overhead
                done = model.generate([5, 9, 5, 9, 5], max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True,
                                      speculative=spec)
                seen.update((i, t) for i, t in enumerate(done.token_ids[1:]))  # tokens after the first
                drafted += done.timings.drafted_tokens
            samples[spec] = seen
    # the speculative samples were drawn with guesses checked: one or more per generation on average
    # (measured 1,552 for self, 791 for lookup)
    assert drafted >= 300
    stat, dof = _chi_square(samples[None], samples[kind])
    assert dof >= 5
    assert stat < dof + 4 * math.sqrt(2 * dof)  # ~ the 99.9th percentile of chi-square(dof)


def test_a_draft_with_another_vocabulary_is_refused_naming_both(smollm2_path, gemma3_path):
    with pytest.raises(DraftMismatch, match=r"vocab_size=262144.*vocab_size=49152"):
        edgellm.load(smollm2_path, draft=gemma3_path)


def test_a_draft_that_does_not_fit_the_memory_budget_is_refused_by_the_planner(smollm2_path):
    with pytest.raises(OutOfMemoryBudget, match="the speculative draft needs"):
        edgellm.load(smollm2_path, memory_budget="600MB", draft=smollm2_path)
    with edgellm.load(smollm2_path, memory_budget="1GB", draft=smollm2_path) as model:  # both fit: both bounded
        assert model.kv.config.budget_bytes and model.draft.kv.config.budget_bytes


def test_bad_speculative_settings_are_refused(smollm2):
    with pytest.raises(InvalidRequest, match="lookup, draft, self or off"):
        smollm2.generate("Hi", speculative="magic")
    with pytest.raises(InvalidRequest, match="needs a draft model"):
        smollm2.generate("Hi", speculative="draft")
