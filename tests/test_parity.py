"""Parity with Hugging Face transformers (fp32) loading the same GGUF file.

"exact" mode (fp32 everywhere) must reproduce the reference: greedy tokens, logits and
teacher-forced top-1. "fast" mode (native kernels, bf16, fp32 or integer prompt GEMMs) is held to a stated
distance from it: teacher-forced top-1 >= 96 % and mean KL < 2e-3, for the prompt path on the
machine's variant and for the decode path (one token per step) on every ISA variant it can run. For scale, llama.cpp on the
same files measures top-1 95.5 % / KL 2.6e-3 (SmolLM2) and 96.5 % / 6.5e-3 (Gemma 3)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import edgellm
from edgellm.kernels.isa import cpu_features
from tests.agreement import agreement

pytestmark = pytest.mark.slow

GREEDY_TOKENS = 32
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
               "量子计算机的基本原理是"]
CHAT_PROMPTS = ["List three benefits of regular exercise.", "Translate to French: The weather is nice today.",
                "Write a haiku about the sea. 🌊"]
HELDOUT = (Path(edgellm.__file__).parent / "data" / "heldout.txt").read_text()
TEACHER_FORCED_TOKENS = 1000
DECODED_TOKENS = 256


class Reference:
    def __init__(self, path: Path):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}  # the tests ask for the same ids again

    def greedy(self, ids: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return out[0, len(ids):].tolist()

    def logits(self, ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in self._logits:
            with torch.inference_mode():
                self._logits[tuple(ids)] = self.model(torch.tensor([ids])).logits[0]
        return self._logits[tuple(ids)]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def pair(request):
    path = request.getfixturevalue("smollm2_path" if request.param.startswith("smollm2") else "gemma3_path")
    reference = Reference(path)
    exact, fast = edgellm.load(path, mode="exact"), edgellm.load(path, mode="fast")
    yield request.param, reference, exact, fast
    exact.close()
    fast.close()


def _prompts(model) -> list[list[int]]:
    raw = [model.tokenizer.encode(p) for p in RAW_PROMPTS]
    chat = [model.template.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return raw + chat


def _expected(reference: Reference, ids: list[int], eos_ids) -> list[int]:
    """The reference's greedy continuation, cut where edgellm stops (at an end token)."""
    tokens = reference.greedy(ids, GREEDY_TOKENS)
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i]
    return tokens


def test_exact_greedy_tokens_equal_reference(pair):
    _, reference, exact, _ = pair
    for ids in _prompts(exact):
        expected = _expected(reference, ids, exact.tokenizer.eos_ids)
        got = list(exact.generate(ids, max_tokens=GREEDY_TOKENS).token_ids)
        assert got == expected, exact.tokenizer.decode(ids)


def test_exact_last_position_logits_close(pair):
    _, reference, exact, _ = pair
    for ids in _prompts(exact):
        ours, ref = exact.logits(ids)[-1], reference.logits(ids)[-1]
        assert (ours - ref).abs().max() < 1e-3 * max(1.0, ref.abs().max().item())


def _teacher_forced(model, reference):
    ids = model.tokenizer.encode(HELDOUT)[:TEACHER_FORCED_TOKENS]
    assert len(ids) == TEACHER_FORCED_TOKENS
    return agreement(model.logits(ids), reference.logits(ids))


def _decoded_logits(model, ids: list[int]) -> torch.Tensor:
    """Each position's logits from one-token steps: the native decode layers and GEMVs."""
    seq, _ = model.kv.new_sequence()
    rows = []
    with torch.inference_mode():
        for token in ids:
            seq.prepare(1)
            rows.append(model.net(torch.tensor([[token]]), seq, last_only=True)[0, -1].float())
            seq.advance([token])
    seq.release()
    return torch.stack(rows)


def _fast_variants() -> list[str]:
    from edgellm import kernels

    if not kernels.available():
        return []
    return [v.label for v in kernels.runnable() if v.name != "scalar"]  # scalar: tested per kernel


@pytest.mark.parametrize("variant", _fast_variants())
def test_fast_decode_agreement_per_variant(pair, variant, monkeypatch):
    from edgellm.kernels import build, isa

    name, reference, _, fast = pair
    monkeypatch.setenv("EDGELLM_ISA", variant)
    isa.selected.cache_clear()
    build.library.cache_clear()
    try:
        model = edgellm.load(fast.path, mode="fast")
        ids = model.tokenizer.encode(HELDOUT)[:DECODED_TOKENS]
        top1, kl = agreement(_decoded_logits(model, ids), reference.logits(ids))
        model.close()
    finally:
        isa.selected.cache_clear()  # the next test selects again, under its own environment
        build.library.cache_clear()
    print(f"\n{name} fast decode on {variant}: top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= 0.96 and kl < 2e-3


def test_exact_teacher_forcedagreement(pair):
    name, reference, exact, _ = pair
    top1, kl = _teacher_forced(exact, reference)
    print(f"\n{name} exact: top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= 0.99 and kl < 1e-5


def test_fast_teacher_forcedagreement(pair):
    name, reference, _, fast = pair
    top1, kl = _teacher_forced(fast, reference)
    from edgellm import kernels

    print(f"\n{name} fast ({kernels.describe()}): top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= 0.96 and kl < 2e-3


INTEGER_GEMMS = [("avx2+vnni", "int8 + int16", {"avx_vnni"}), ("avx2", "int8", {"avx2", "fma", "f16c"}),
                 ("avx512", "int8", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})]


@pytest.mark.parametrize("variant, gemm, needs", INTEGER_GEMMS, ids=[v for v, _, _ in INTEGER_GEMMS])
def test_fast_prompt_agreement_with_integer_gemms(pair, variant, gemm, needs, monkeypatch):
    """The prompt path on a variant without native bf16, whose GEMMs are int8_gemm.c's (4-bit, Q5_0 and
    Q6_K codes; on AVX-512 in zmm) and, with AVX-VNNI, int16_gemm.c's for the other weights, agrees
    with the reference."""
    from edgellm import kernels
    from edgellm.kernels import build, isa

    if not needs <= cpu_features():
        pytest.skip(f"the CPU cannot run the {variant} kernels: the {gemm} prompt GEMM does not run here")
    if kernels.available() and kernels.selected().label == variant:
        pytest.skip(f"{variant} is this CPU's own variant: test_fast_teacher_forced_agreement checks its {gemm} GEMMs")
    name, reference, _, fast = pair
    monkeypatch.setenv("EDGELLM_ISA", variant)
    isa.selected.cache_clear()
    build.library.cache_clear()
    try:
        model = edgellm.load(fast.path, mode="fast")
        assert f"{gemm} prompt GEMMs" in kernels.describe()
        top1, kl = _teacher_forced(model, reference)
        model.close()
    finally:
        isa.selected.cache_clear()
        build.library.cache_clear()
    print(f"\n{name} fast prompt with {gemm} GEMMs: top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= 0.96 and kl < 2e-3
