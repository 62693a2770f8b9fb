"""Tiny random models of every architecture, written as GGUF and checked against transformers."""
from __future__ import annotations

import pytest
import torch

from edgellm import families
from edgellm.io.gguf import open_gguf
from edgellm.kv import fresh_sequence
from edgellm.models import build_model
from tests.tiny import HEAD_DIM, LLAMA3_ROPE, VOCAB, hf_model, llama3_rope_freqs, random_weights, write_gguf

ARCHS = list(families.names())  # a new family module is checked against transformers here as it lands
TOKENS = torch.randint(2, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))


def _forward(model, tokens, chunks=(None,)) -> torch.Tensor:
    caches, outs, start = fresh_sequence(model), [], 0
    with torch.inference_mode():
        for end in chunks:
            end = end or tokens.shape[1]
            outs.append(model(tokens[:, start:end], caches))
            start = end
    return torch.cat(outs, dim=1)[0]


@pytest.fixture(params=ARCHS)
def tiny(request, tmp_path):
    arch = request.param
    weights = random_weights(arch)
    source = open_gguf(write_gguf(tmp_path / f"{arch}.gguf", arch, weights))
    yield arch, weights, source
    source.close()


def test_exact_mode_matches_transformers(tiny):
    arch, weights, source = tiny
    ours = _forward(build_model(source, VOCAB, "exact"), TOKENS)
    with torch.inference_mode():
        ref = hf_model(arch, weights)(TOKENS).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_incremental_decode_equals_one_pass(tiny):
    _, _, source = tiny
    model = build_model(source, VOCAB, "exact")
    one_pass = _forward(model, TOKENS)
    token_by_token = _forward(model, TOKENS, chunks=range(1, TOKENS.shape[1] + 1))
    chunked = _forward(model, TOKENS, chunks=(5, 13, None))
    torch.testing.assert_close(token_by_token, one_pass, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked, one_pass, atol=1e-4, rtol=1e-4)


def test_last_only_returns_final_position(tiny):
    _, _, source = tiny
    model = build_model(source, VOCAB, "exact")
    with torch.inference_mode():
        last = model(TOKENS, fresh_sequence(model), last_only=True)
    assert last.shape == (1, 1, VOCAB)
    torch.testing.assert_close(last[0, 0], _forward(model, TOKENS)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_mode_with_4bit_weights_stays_close(arch, tmp_path):
    import gguf

    weights = random_weights(arch)
    path = write_gguf(tmp_path / "q4.gguf", arch, weights, qtype=gguf.GGMLQuantizationType.Q4_0)
    with open_gguf(path) as source:
        exact = _forward(build_model(source, VOCAB, "exact"), TOKENS)
        fast_model = build_model(source, VOCAB, "fast")
        fast = _forward(fast_model, TOKENS)
    assert any(type(m).__name__ == "Int4Linear" for m in fast_model.modules()), "Q4_0 must stay 4-bit"
    # bf16 activations: logits agree to ~1 % of their spread
    assert (fast - exact).abs().max() < 0.02 * exact.abs().max() + 0.02


def test_gemma3_sliding_window_hides_old_tokens(tmp_path):
    # Both layers are sliding (every sixth is global); with window 4 each layer looks back 3
    # tokens, so after 2 layers position p depends only on tokens >= p - 6.
    weights = random_weights("gemma3")
    path = write_gguf(tmp_path / "w.gguf", "gemma3", weights, sliding_window=4)
    changed = TOKENS.clone()
    changed[0, 0] = (changed[0, 0] + 1) % VOCAB
    with open_gguf(path) as source:
        model = build_model(source, VOCAB, "exact")
        a, b = _forward(model, TOKENS), _forward(model, changed)
    assert not torch.allclose(a[:7], b[:7])
    torch.testing.assert_close(a[7:], b[7:])
    with torch.inference_mode():
        ref = hf_model("gemma3", weights, sliding_window=4)(TOKENS).logits[0]
    torch.testing.assert_close(a, ref, atol=1e-4, rtol=1e-4)


def test_batched_decode_equals_one_sequence_at_a_time(tiny):
    from edgellm.kv import BatchKV

    _, _, source = tiny
    model = build_model(source, VOCAB, "exact")
    prompts = [TOKENS[:, :5], TOKENS[:, 5:14], TOKENS[:, 14:17]]  # different lengths: different positions
    singles, seqs = [], []
    with torch.inference_mode():
        for p in prompts:
            seq = fresh_sequence(model)
            model(p, seq)
            seqs.append(seq)
            alone = fresh_sequence(model)
            model(p, alone)
            singles.append(model(torch.tensor([[7]]), alone)[0, -1])
        batched = model(torch.tensor([[7], [7], [7]]), BatchKV(seqs))[:, -1]
    torch.testing.assert_close(batched, torch.stack(singles), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_in_fast_mode_equals_one_pass(tiny):
    """Later chunks are CAUSAL at the cache's end: the native kernel and torch agree with one pass."""
    _, _, source = tiny
    model = build_model(source, VOCAB, "fast")
    one_pass = _forward(model, TOKENS)
    chunked = _forward(model, TOKENS, chunks=(5, 13, None))
    # bf16 activations take different kernels at 5, 8 and 24 rows; a wrong mask would differ by O(1)
    assert (chunked - one_pass).abs().max() < 0.03 * one_pass.abs().max()
    assert (chunked.argmax(-1) == one_pass.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3"])
def test_native_decode_steps_match_the_pytorch_layers(arch, tmp_path):
    import gguf

    # head_dim 32: the C layers' RoPE works on 16-float half-heads; 4 layers: SmolLM3's fourth has no RoPE
    weights = random_weights(arch, head_dim=32, layers=4)
    path = write_gguf(tmp_path / "q8.gguf", arch, weights, qtype=gguf.GGMLQuantizationType.Q8_0, head_dim=32,
                      layers=4)
    steps = range(12, TOKENS.shape[1] + 1)  # a 12-token prompt, then one token at a time
    with open_gguf(path) as source:
        model = build_model(source, VOCAB, "fast")
        assert model.decoder is not None, "the native decoder must take this architecture"
        native = _forward(model, TOKENS, chunks=steps)[12:]
        model.decoder = None
        plain = _forward(model, TOKENS, chunks=steps)[12:]
    assert (native - plain).abs().max() < 0.01 * plain.abs().max()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_hugging_face_folder_runs_exactly_like_transformers(arch, tmp_path):
    from edgellm.io.hf import HFFolder

    weights = random_weights(arch)
    reference = hf_model(arch, weights)
    reference.save_pretrained(tmp_path)
    with torch.inference_mode():
        expected = reference(TOKENS).logits[0]
    folder = HFFolder(tmp_path)
    try:
        ours = _forward(build_model(folder, VOCAB, "exact"), TOKENS)
    finally:
        folder.close()
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def _folder_and_gguf(tmp_path, reference, arch: str, weights, **gguf_options):
    """The same weights opened as the saved transformers folder, then as a GGUF (llama.cpp's conventions)."""
    from edgellm.io.hf import HFFolder

    reference.save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "m.gguf", arch, weights, **gguf_options)
    for source in (HFFolder(tmp_path / "hf"), open_gguf(path)):
        with source:
            yield source


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_runs_from_its_hugging_face_folder_and_gguf_like_transformers(tmp_path, arch):
    """What a family module says (tensor names, config fields, conventions, quirks) is all it takes:
    the saved transformers folder and the GGUF llama.cpp's converter would write run alike."""
    weights = random_weights(arch, layers=4)
    reference = hf_model(arch, weights, layers=4)
    with torch.inference_mode():
        expected = reference(TOKENS).logits[0]
    for source in _folder_and_gguf(tmp_path, reference, arch, weights, layers=4):
        torch.testing.assert_close(_forward(build_model(source, VOCAB, "exact"), TOKENS), expected, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers_from_a_folder_and_a_gguf(tmp_path):
    weights = random_weights("llama")
    reference = hf_model("llama", weights, rope=LLAMA3_ROPE)
    with torch.inference_mode():
        expected = reference(TOKENS).logits[0]
        unscaled = hf_model("llama", weights)(TOKENS).logits[0]
    assert (expected - unscaled).abs().max() > 1e-2  # the scaling matters at these positions
    freqs = llama3_rope_freqs(HEAD_DIM, 10000.0, LLAMA3_ROPE)
    for source in _folder_and_gguf(tmp_path, reference, "llama", weights, rope_freqs=freqs):
        ours = _forward(build_model(source, VOCAB, "exact"), TOKENS)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_smollm3_leaves_rope_out_of_every_fourth_layer_like_transformers(tmp_path):
    weights = random_weights("smollm3", layers=4)
    reference = hf_model("smollm3", weights, layers=4)
    assert reference.config.no_rope_layers == [1, 1, 1, 0]
    with torch.inference_mode():
        expected = reference(TOKENS).logits[0]
    for source in _folder_and_gguf(tmp_path, reference, "smollm3", weights, layers=4):
        model = build_model(source, VOCAB, "exact")
        assert model.config.rope_layers == (True, True, True, False)
        torch.testing.assert_close(_forward(model, TOKENS), expected, atol=1e-4, rtol=1e-4)


def test_phi3_fused_weights_longrope_and_sliding_window_match_transformers(tmp_path):
    weights = random_weights("phi3")
    reference = hf_model("phi3", weights, sliding_window=8)  # TOKENS: 24 positions, so the window matters
    with torch.inference_mode():
        expected = reference(TOKENS).logits[0]
    for source in _folder_and_gguf(tmp_path, reference, "phi3", weights, sliding_window=8):
        model = build_model(source, VOCAB, "exact")
        assert model.config.sliding_window == 8 and model.config.context_length == 64  # LongRoPE's short range
        torch.testing.assert_close(_forward(model, TOKENS), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_phi3_with_partial_rotary_embeddings_matches_transformers(tmp_path, mode):
    """Phi-4-mini's shape: RoPE turns 3/4 of each head (12 of 16 dims), LongRoPE, GQA 4:2 (fast mode
    on the PyTorch layers: heads of 16 have no native decoder)."""
    weights = random_weights("phi3")
    reference = hf_model("phi3", weights, sliding_window=8, partial_rotary=0.75)
    with torch.inference_mode():
        expected = reference(TOKENS).logits[0]
        full = hf_model("phi3", weights, sliding_window=8)(TOKENS).logits[0]
    assert (expected - full).abs().max() > 1e-2  # the untouched dims matter at these positions
    for source in _folder_and_gguf(tmp_path, reference, "phi3", weights, sliding_window=8, partial_rotary=0.75):
        model = build_model(source, VOCAB, mode)
        assert model.config.rope_dims == 12
        if mode == "exact":
            torch.testing.assert_close(_forward(model, TOKENS), expected, atol=1e-4, rtol=1e-4)
        else:  # bf16 arithmetic, one token per step: close to the fp32 reference
            ours = _forward(model, TOKENS, chunks=range(1, TOKENS.shape[1] + 1))
            assert (ours - expected).abs().max() < 0.05 * expected.abs().max()


def test_the_native_decoder_turns_a_partial_rotation_like_exact_mode(tmp_path):
    """Heads of 32 (the native decoder's unit), 24 dims turned: the C layers' decode steps against
    exact mode's one pass (transformers' Phi-3 takes no head_dim of its own to compare with here)."""
    weights = random_weights("phi3", head_dim=32)
    with open_gguf(write_gguf(tmp_path / "phi4.gguf", "phi3", weights, head_dim=32, partial_rotary=0.75)) as source:
        fast, exact = build_model(source, VOCAB, "fast"), build_model(source, VOCAB, "exact")
        assert fast.decoder is not None and fast.config.rope_dims == 24
        expected = _forward(exact, TOKENS)
        ours = _forward(fast, TOKENS, chunks=range(1, TOKENS.shape[1] + 1))
    assert (ours - expected).abs().max() < 0.03 * expected.abs().max()


def test_phi3_loaded_for_a_long_context_uses_the_long_factors_like_transformers(tmp_path):
    long = torch.randint(2, VOCAB, (1, 80), generator=torch.Generator().manual_seed(2))  # past the original 64
    weights = random_weights("phi3")
    reference = hf_model("phi3", weights, sliding_window=8)
    with torch.inference_mode():
        expected = reference(long).logits[0]  # transformers switches to the long factors past 64 positions
    for source in _folder_and_gguf(tmp_path, reference, "phi3", weights, sliding_window=8):
        model = build_model(source, VOCAB, "exact", context_length=256)
        assert model.config.context_length == 256 and model.config.longrope[2] == "long"
        torch.testing.assert_close(_forward(model, long), expected, atol=1e-4, rtol=1e-4)


def test_iq4_nl_weights_load_and_run_in_fast_mode(tmp_path):
    import gguf

    weights = random_weights("qwen3")
    path = write_gguf(tmp_path / "iq4.gguf", "qwen3", weights, qtype=gguf.GGMLQuantizationType.IQ4_NL)
    with open_gguf(path) as source:
        exact = _forward(build_model(source, VOCAB, "exact"), TOKENS)  # the IQ4_NL weights, dequantized in fp32
        fast = _forward(build_model(source, VOCAB, "fast"), TOKENS)
    reference = hf_model("qwen3", weights)
    with torch.inference_mode():
        unquantized = reference(TOKENS).logits[0]
    assert (fast - exact).abs().max() < 0.02 * exact.abs().max() + 0.02
    assert (exact - unquantized).abs().max() < 0.1 * unquantized.abs().max()  # 4-bit weights, close to the floats


@pytest.mark.parametrize("window", [5, 24, 40])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gemma2_runs_any_sliding_window_on_every_path_like_transformers(tmp_path, mode, window):
    """Windows shorter than a KV block (32) as well as longer ones: one pass, a prompt prefilled in
    pieces through the prefix cache, and the same prompt again resuming from the cached blocks."""
    import edgellm

    weights = random_weights("gemma2")
    ids = torch.randint(4, VOCAB, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        reference = torch.log_softmax(hf_model("gemma2", weights, sliding_window=window)(torch.tensor([ids])).logits[0], -1)
    expected = float(sum(reference[69 + i, ids[70 + i]] for i in range(5)))
    tolerance = 1e-3 if mode == "exact" else 0.05 * abs(expected)
    path = write_gguf(tmp_path / "gemma2.gguf", "gemma2", weights, sliding_window=window, tokenizer="llama")
    with edgellm.load(path, mode=mode) as model:
        one_pass = torch.log_softmax(model.logits(ids), -1)
        assert (one_pass - reference).abs().max() < (1e-4 if mode == "exact" else 0.05 * reference.abs().max())
        cold = model.continuation_logprobs(ids[:70], [ids[70:75]])[0]
        hits = model.kv.prefix.stats.hit_tokens
        warm = model.continuation_logprobs(ids[:70], [ids[70:75]])[0]
        assert model.kv.prefix.stats.hit_tokens - hits == 64  # two cached blocks of 32
    assert abs(cold - expected) < tolerance and abs(warm - expected) < tolerance
