"""Samplers: pure functions on logits (numpy arrays, or tensors read in place), and a seeded
generator for reproducibility."""
from __future__ import annotations

import numpy as np
import pytest

from edgellm.errors import InvalidRequest
from edgellm.generation.sampling import (NothingToDraw, Sampler, SamplingParams, apply_repetition_penalty, greedy,
                                       keep_min_p, keep_top_k, keep_top_p, softmax)

LOGITS = np.array([2.0, 1.0, 0.5, -1.0, 3.0], dtype=np.float32)


def _kept(logits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_top_k_keeps_the_k_best():
    assert _kept(keep_top_k(LOGITS, 2)) == {0, 4}
    assert _kept(keep_top_k(LOGITS, 0)) == set(range(5))


def test_top_p_keeps_smallest_set_reaching_p():
    probs = softmax(LOGITS)  # order: 4 (0.61), 0 (0.22), 1 (0.08), 2, 3
    assert _kept(keep_top_p(LOGITS, 0.5)) == {4}
    assert _kept(keep_top_p(LOGITS, float(probs[4] + probs[0]) - 1e-4)) == {4, 0}
    assert _kept(keep_top_p(LOGITS, 0.9)) == {4, 0, 1}


def test_min_p_drops_tokens_far_below_the_best():
    probs = softmax(LOGITS)
    kept = _kept(keep_min_p(LOGITS, 0.1))
    assert kept == {i for i in range(5) if probs[i] >= 0.1 * probs.max()}


def test_repetition_penalty_lowers_seen_tokens_both_signs():
    out = apply_repetition_penalty(LOGITS, [0, 3], 2.0)
    assert out[0] == 1.0 and out[3] == -2.0 and out[4] == 3.0


def test_greedy_is_argmax_and_ignores_seed():
    assert Sampler(SamplingParams(temperature=0))(LOGITS, []) == 4


@pytest.mark.parametrize("n", [5, 49152, 262144, 128256, 6145])
def test_greedy_picks_the_first_maximum_as_argmax_does(n):
    gen = _rng(n)
    for trial in range(20):
        logits = gen.standard_normal(n, dtype=np.float32)
        if trial % 2:  # ties: the first of equal maxima wins, wherever they fall (the tail too)
            spots = gen.integers(0, n, 3)
            logits[spots] = logits.max() + 1
            logits[-1] = logits.max()
        assert greedy(logits) == int(np.argmax(logits))
        assert greedy(logits[::-1]) == int(np.argmax(logits[::-1]))  # strided: numpy's argmax


def test_a_tensors_logits_are_read_in_place():
    torch = pytest.importorskip("torch")
    logits = torch.from_numpy(LOGITS.copy())
    assert greedy(logits) == 4 and Sampler(SamplingParams(temperature=1.0, top_k=1, seed=1))(logits, []) == 4
    assert greedy(logits.bfloat16()) == 4


def test_same_seed_same_samples_different_seed_differs():
    logits = _rng(0).standard_normal(1000, dtype=np.float32)
    draw = lambda seed: [Sampler(SamplingParams(temperature=1.0, seed=seed))(logits, []) for _ in range(1)] + \
        (lambda s: [s(logits, []) for _ in range(20)])(Sampler(SamplingParams(temperature=1.0, seed=seed)))  # noqa: E731
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_unseeded_samplers_leave_numpys_global_generator_alone():
    np.random.seed(1234)
    expected = np.random.rand(3)
    np.random.seed(1234)
    a, b = Sampler(SamplingParams(temperature=1.0)), Sampler(SamplingParams(temperature=1.0))
    assert np.array_equal(np.random.rand(3), expected)  # the caller's seeded stream goes on undisturbed
    probs = np.full(1000, 1e-3)
    assert [a.draw(probs) for _ in range(8)] != [b.draw(probs) for _ in range(8)]  # each its own seed


def test_seeds_of_the_whole_64_bit_range_are_streams_of_their_own():
    draws = {seed: [Sampler(SamplingParams(temperature=1.0, seed=seed)).uniform()] for seed in (-2**63, -1, 0, 2**64 - 2)}
    assert len({tuple(d) for d in draws.values()}) == 4


def test_draw_takes_unnormalized_weights_and_never_a_token_of_weight_zero():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    weights = np.array([0.0, 3.0, 0.0, 1.0, 0.0])
    drawn = [sampler.draw(weights) for _ in range(4000)]
    assert set(drawn) == {1, 3} and 0.72 < drawn.count(1) / 4000 < 0.78
    with pytest.raises(NothingToDraw):
        sampler.draw(np.zeros(5))


def test_sampling_respects_filters():
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=2, seed=3))
    assert {sampler(LOGITS, []) for _ in range(200)} <= {0, 4}


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=-3), dict(max_tokens=-1), dict(repetition_penalty=0),
                                 dict(stop=("",))])
def test_invalid_parameters_raise_typed_error(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad)


# The native path (kernels/sample.c): the same distribution as probs(), drawn without torch's
# parallel reductions. Logits shaped like a language model's: a few tokens far above the rest.
def _peaked(n: int, seed: int) -> np.ndarray:
    gen = _rng(seed)
    logits = gen.standard_normal(n, dtype=np.float32) * 1.5
    logits[gen.permutation(n)[:12]] = np.linspace(14, 17, 12)
    return logits


def _needs_kernels():
    from edgellm.kernels.build import library
    if library() is None:
        pytest.skip("no native kernels here")


NATIVE_FILTERS = [dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=40), dict(temperature=1.0, min_p=0.05),
                  dict(temperature=0.6, top_p=0.95, top_k=50, min_p=0.02), dict(temperature=1.3, top_p=0.5)]


@pytest.mark.parametrize("n", [49152, 262144, 100])
@pytest.mark.parametrize("filters", NATIVE_FILTERS)
def test_native_candidates_are_the_tokens_and_probabilities_probs_gives(n, filters):
    _needs_kernels()
    logits = _peaked(n, seed=n)
    logits[_rng(1).permutation(n)[: n // 3]] = -np.inf  # a grammar's mask
    sampler = Sampler(SamplingParams(**filters))
    ids, probs = sampler.candidates(logits)
    reference = sampler.probs(logits, [])
    assert set(ids.tolist()) == set(np.flatnonzero(reference).tolist())
    assert np.allclose(probs, reference[ids], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("nucleus", [500, 3000])
@pytest.mark.parametrize("filters", [dict(temperature=1.0, top_p=0.9), dict(temperature=0.9, top_k=1000)])
def test_a_nucleus_of_hundreds_or_thousands_of_tokens_is_drawn_natively(nucleus, filters):
    _needs_kernels()
    gen = _rng(nucleus)
    logits = gen.standard_normal(49152, dtype=np.float32) - 12.0  # a tail holding ~nothing
    logits[gen.permutation(49152)[:nucleus]] = gen.standard_normal(nucleus, dtype=np.float32) * 0.5
    sampler = Sampler(SamplingParams(seed=3, **filters))
    found = sampler.candidates(logits)
    assert found is not None, "the wider try must cover it"
    ids, probs = found
    reference = sampler.probs(logits, [])
    assert len(ids) > 256 and set(ids.tolist()) == set(np.flatnonzero(reference).tolist())
    assert np.allclose(probs, reference[ids], rtol=1e-4, atol=1e-7)


def test_filters_reaching_past_the_candidates_leave_it_to_the_whole_vocabulary():
    _needs_kernels()
    flat = _rng(2).standard_normal(49152, dtype=np.float32) * 0.1  # a nucleus of ~44k tokens
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=1))
    assert sampler.candidates(flat) is None
    nucleus = np.flatnonzero(sampler.probs(flat, [])).tolist()
    assert {sampler(flat, []) for _ in range(50)} <= set(nucleus)


@pytest.mark.parametrize("filters", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=5)])
def test_native_draws_follow_the_distribution(filters):
    _needs_kernels()
    logits = _peaked(49152, seed=5)
    sampler = Sampler(SamplingParams(seed=11, **filters))
    probs = sampler.probs(logits, []).astype(np.float64)
    draws = 6000
    counts = np.bincount([sampler(logits, []) for _ in range(draws)], minlength=logits.size).astype(np.float64)
    assert counts[probs == 0].sum() == 0  # never a token the filters dropped
    likely = probs > 0.02
    spread = 5 * np.sqrt(probs[likely] * (1 - probs[likely]) / draws) + 1e-3  # 5 sigma: a seeded, fixed test
    assert (np.abs(counts[likely] / draws - probs[likely]) <= spread).all()


def test_the_whole_vocabulary_draw_never_picks_a_masked_token():
    _needs_kernels()
    logits = np.full(262144, -np.inf, dtype=np.float32)
    allowed = [3, 1030, 70000, 262143]  # in several of the kernel's blocks, the last one too
    logits[allowed] = [0.0, 1.0, -2.0, 0.5]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=4))
    assert {sampler(logits, []) for _ in range(300)} == set(allowed)


def test_without_kernels_sampling_takes_numpys_path(monkeypatch):
    from edgellm.generation import sampling
    monkeypatch.setattr(sampling, "library", lambda: None)
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=2, seed=3))
    assert {sampler(LOGITS, []) for _ in range(200)} == {0, 4}


def test_a_repetition_penalty_keeps_the_native_draw_on_the_penalized_distribution():
    _needs_kernels()
    logits = _peaked(49152, seed=9)
    history = np.argsort(-logits)[:3].tolist() + [5, 77]  # the favourites were said already
    sampler = Sampler(SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=2))
    ids, probs = sampler.candidates(sampler._penalized(logits, history))
    reference = sampler.probs(logits, history)
    assert set(ids.tolist()) == set(np.flatnonzero(reference).tolist())
    assert np.allclose(probs, reference[ids], rtol=1e-4, atol=1e-7)
    assert np.array_equal(logits, _peaked(49152, seed=9))  # the caller's logits are left as they were
    greedy_sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=1.3))
    penalized = apply_repetition_penalty(logits, sorted(set(history)), 1.3)
    assert greedy_sampler(logits, history) == int(np.argmax(penalized))


def test_candidates_of_logits_the_kernels_cannot_read_are_left_to_numpy():
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=5, seed=1))
    strided = _peaked(2 * 4096, seed=3).reshape(4096, 2)[:, 0]
    assert sampler.candidates(strided) is None
    assert sampler(strided, []) in set(np.argsort(-strided)[:5].tolist())


def test_logits_with_nothing_left_to_draw_fail_on_either_path(monkeypatch):
    from edgellm.generation import sampling

    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    with pytest.raises(NothingToDraw):
        sampler(np.full(4096, -np.inf, dtype=np.float32), [])
    monkeypatch.setattr(sampling, "library", lambda: None)
    with pytest.raises(NothingToDraw):
        sampler(np.full(4096, -np.inf, dtype=np.float32), [])
