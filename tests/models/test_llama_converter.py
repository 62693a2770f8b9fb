"""GGUF files made by llama.cpp's own `convert_hf_to_gguf.py` (from the llama-cpp-python 0.3.36
sdist) out of tiny transformers models of every architecture, each saved with a real tokenizer
rebuilt from llama.cpp's vocab fixtures — what a user's downloaded GGUF is, without downloading
one. edgellm must run them exactly like transformers and tokenize them like llama.cpp's tests."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgellm import families
from edgellm.io.gguf import open_gguf
from edgellm.kv import fresh_sequence
from edgellm.models import build_model
from edgellm.tokenizer import Tokenizer
from tests.llama_fixtures import converter_script, models_dir, transformers_tokenizer, vocab_cases
from tests.tiny import hf_model, random_weights

# architecture -> the real tokenizer its tiny model gets (byte-level BPE ones are recognised by
# the converter's pre-tokenizer hash; SentencePiece ones travel as tokenizer.model)
TOKENIZERS = {arch: families.get(arch).tiny_vocab for arch in families.names() if families.get(arch).gguf_from_llama_cpp}
SENTENCEPIECE = {"phi-3", "llama-spm"}
SLIDING_WINDOW = 8  # Phi-3's and Gemma's, fewer than TEXT's tokens
TEXT = "The converter wrote this file; edgellm reads it. 数字 12345, emoji 🦙 and code: def f(x): return x"

pytestmark = pytest.mark.slow


def _vocab_gguf(name: str) -> Path:
    return models_dir() / f"ggml-vocab-{name}.gguf"


def _save_tokenizer(folder: Path, name: str) -> int:
    """Write the tokenizer files the converter reads; returns the vocabulary size."""
    with open_gguf(_vocab_gguf(name)) as vocab:
        metadata = vocab.metadata
    if name in SENTENCEPIECE:
        _write_sentencepiece_model(folder / "tokenizer.model", metadata)
    else:
        _save_bpe_tokenizer(folder, name, metadata)
    return len(metadata["tokenizer.ggml.tokens"])


def _save_bpe_tokenizer(folder: Path, name: str, metadata: dict) -> None:
    """transformers' rebuild of the GGUF tokenizer, mended where it differs from the original
    (the converter recognises a tokenizer by the ids it gives): Llama 3's tokenizer.json sets
    ignore_merges and prepends BOS, and no added token lies beyond the vocabulary."""
    transformers_tokenizer(name).save_pretrained(folder)
    vocab_size = len(metadata["tokenizer.ggml.tokens"])
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["ignore_merges"] = name == "llama-bpe"
    if name == "llama-bpe":
        spec["post_processor"] = _prepend(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.bos_token_id"])
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < vocab_size]
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {i: t for i, t in config.get("added_tokens_decoder", {}).items()
                                      if int(i) < vocab_size}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


def _prepend(tokens: list[str], bos_id: int) -> dict:
    """A tokenizer.json post-processor that puts BOS before every text."""
    bos = {"SpecialToken": {"id": tokens[bos_id], "type_id": 0}}
    return {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {tokens[bos_id]: {"id": tokens[bos_id], "ids": [bos_id], "tokens": [tokens[bos_id]]}}}


def _write_sentencepiece_model(path: Path, metadata: dict) -> None:
    """A SentencePiece model proto with the GGUF vocabulary's pieces, scores and types (the GGUF
    token types are SentencePiece's piece types), a BPE model with byte fallback."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    proto = spm.ModelProto()
    proto.trainer_spec.model_type = spm.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    proto.trainer_spec.bos_id = metadata.get("tokenizer.ggml.bos_token_id", 1)
    proto.trainer_spec.eos_id = metadata.get("tokenizer.ggml.eos_token_id", 2)
    proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    kinds = metadata["tokenizer.ggml.token_type"]
    for i, (token, score, kind) in enumerate(zip(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"], kinds)):
        if kind == spm.ModelProto.SentencePiece.UNKNOWN and i != proto.trainer_spec.unk_id:
            kind = spm.ModelProto.SentencePiece.UNUSED  # padding llama.cpp typed as unknown; a proto has one
        proto.pieces.add(piece=token, score=score, type=kind)
    path.write_bytes(proto.SerializeToString())


def _convert(folder: Path, outtypes: list[str]) -> list[Path]:
    """One GGUF per outtype (folder / f"{outtype}.gguf"), the converter runs side by side (each
    spends most of its ~8 s importing torch and transformers)."""
    outs = [folder / f"{outtype}.gguf" for outtype in outtypes]
    runs = [subprocess.Popen([sys.executable, str(converter_script()), str(folder), "--outfile", str(out),
                              "--outtype", outtype], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for out, outtype in zip(outs, outtypes)]
    for run in runs:
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
    return outs


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """name -> (folder with its tokenizer files, vocabulary size); transformers takes ~25 s to
    rebuild a 128k-token tokenizer from a GGUF, so each is built once."""
    made = {}

    def files(name: str) -> tuple[Path, int]:
        if name not in made:
            folder = tmp_path_factory.mktemp(f"tokenizer-{name}")
            made[name] = folder, _save_tokenizer(folder, name)
        return made[name]
    return files


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def converted(request, tmp_path_factory, tokenizer_files):
    """(architecture, transformers model, f32 GGUF and Q8_0 GGUF written by llama.cpp's converter)."""
    arch, folder = request.param, tmp_path_factory.mktemp(request.param)
    files, vocab = tokenizer_files(TOKENIZERS[arch])
    shutil.copytree(files, folder, dirs_exist_ok=True)
    # 4 layers: SmolLM3's fourth has no RoPE
    reference = hf_model(arch, random_weights(arch, vocab=vocab, layers=4), layers=4, sliding_window=SLIDING_WINDOW)
    reference.save_pretrained(folder)
    return (arch, reference, *_convert(folder, ["f32", "q8_0"]))


def _logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens]), fresh_sequence(model))[0]


def test_a_converted_gguf_tokenizes_like_llama_cpps_tests(converted):
    arch, _, path, _ = converted
    name = TOKENIZERS[arch]
    with open_gguf(path) as source:
        assert source.metadata["general.architecture"] == arch
        tokenizer = Tokenizer.from_gguf_metadata(source.metadata)
        source_tokens = list(source.metadata["tokenizer.ggml.tokens"])
        scores = source.metadata.get("tokenizer.ggml.scores")
    if arch.startswith("gemma"):  # Gemma's converter writes the vocabulary as is, without a prefix space
        with open_gguf(_vocab_gguf(name)) as vocab:
            assert source_tokens == list(vocab.metadata["tokenizer.ggml.tokens"])
            assert list(scores) == list(vocab.metadata["tokenizer.ggml.scores"])
        assert tokenizer.encode("Hello", add_special_tokens=False) == [source_tokens.index("Hello")]
        return
    wrong = [text for text, want in vocab_cases(name) if tokenizer.encode(text, add_special_tokens=False) != want]
    assert not wrong, wrong[:3]


def test_exact_mode_runs_a_converted_gguf_like_transformers(converted):
    arch, reference, path, _ = converted
    with open_gguf(path) as source:
        tokens = Tokenizer.from_gguf_metadata(source.metadata).encode(TEXT, add_special_tokens=False)
        ours = _logits(build_model(source, reference.config.vocab_size, "exact"), tokens)
    with torch.inference_mode():
        expected = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_fast_mode_on_the_converters_q8_0_stays_close_to_exact(converted):
    arch, reference, _, path = converted
    with open_gguf(path) as source:
        tokens = Tokenizer.from_gguf_metadata(source.metadata).encode(TEXT, add_special_tokens=False)
        exact = _logits(build_model(source, reference.config.vocab_size, "exact"), tokens)
        fast = _logits(build_model(source, reference.config.vocab_size, "fast"), tokens)
    assert (fast - exact).abs().max() < 0.03 * exact.abs().max() + 0.02


def _llama_cpp(path: Path, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """llama.cpp's logits at every position (the bench extra's llama-cpp-python) and the context
    it ran with (it rounds n_ctx up to 256, which picks Phi-3's long RoPE factors)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval(tokens)
    return torch.from_numpy(llm.scores[:len(tokens)].copy()), llm.n_ctx()


def _ours_and_llama_cpps(arch: str, path: Path, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    with open_gguf(path) as source:
        tokens = Tokenizer.from_gguf_metadata(source.metadata).encode(TEXT, add_special_tokens=False)
        theirs, context = _llama_cpp(path, tokens)
        ours = _logits(build_model(source, theirs.shape[1], mode, context_length=context), tokens)
    if arch == "phi3":  # llama.cpp turns Phi-3's sliding window off (src/models/phi3.cpp); edgellm keeps
        return ours[:SLIDING_WINDOW], theirs[:SLIDING_WINDOW]  # it, as transformers does
    return ours, theirs


def test_llama_cpp_computes_the_same_logits_as_exact_mode_on_the_converters_f32(converted):
    arch, _, path, _ = converted
    ours, theirs = _ours_and_llama_cpps(arch, path, "exact")
    assert (ours - theirs).abs().max() < 2e-3 * theirs.abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_llama_cpp_and_fast_mode_agree_on_the_converters_q8_0(converted):
    # both quantize activations (llama.cpp to 8 bits, fast mode to bf16), so on a random model a
    # few near-tied positions may go either way; a wrong block layout would differ by the whole range
    arch, _, _, path = converted
    ours, theirs = _ours_and_llama_cpps(arch, path, "fast")
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_phi3_with_partial_rotary_embeddings_converted_by_llama_cpp_runs_like_transformers(tmp_path, tokenizer_files):
    """Phi-4-mini's shape (RoPE over 3/4 of each head, LongRoPE, GQA 4:2), as llama.cpp converts it."""
    files, vocab = tokenizer_files(TOKENIZERS["phi3"])
    shutil.copytree(files, tmp_path, dirs_exist_ok=True)
    reference = hf_model("phi3", random_weights("phi3", vocab=vocab, layers=2), layers=2,
                         sliding_window=SLIDING_WINDOW, partial_rotary=0.75)
    reference.save_pretrained(tmp_path)
    path, = _convert(tmp_path, ["f32"])
    with open_gguf(path) as source:
        assert source.metadata["phi3.rope.dimension_count"] == 12
        tokens = Tokenizer.from_gguf_metadata(source.metadata).encode(TEXT, add_special_tokens=False)
        ours = _logits(build_model(source, vocab, "exact"), tokens)
    with torch.inference_mode():
        expected = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
