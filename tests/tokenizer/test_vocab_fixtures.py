"""edgellm's tokenizers against llama.cpp's vocab fixtures: the real tokenizers of Llama 3
(llama-bpe), Qwen2.5 / Qwen3 (qwen2), Qwen3.5, GPT-2, StarCoder, Refact, Command R, Falcon,
DeepSeek Coder (byte-level BPE) and Llama 2 / Phi-3 (SentencePiece with a prefix space), each with
llama.cpp's test strings (whitespace runs, CJK, emoji, code, digits, accents) and the ids the
model's own tokenizer gives them."""
from __future__ import annotations

import pytest

from edgellm.errors import TokenizerError
from edgellm.io.gguf import open_gguf
from edgellm.tokenizer import Tokenizer
from tests.llama_fixtures import models_dir, transformers_tokenizer, vocab_cases

BYTE_LEVEL = ["llama-bpe", "qwen2", "qwen35", "gpt-2", "starcoder", "refact", "command-r", "falcon", "deepseek-coder"]
SENTENCEPIECE = ["llama-spm", "phi-3"]


def _tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_gguf(models_dir() / f"ggml-vocab-{name}.gguf").metadata)


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_ids_equal_the_models_own_tokenizer_on_llama_cpp_test_strings(name):
    tokenizer = _tokenizer(name)
    cases = vocab_cases(name)
    assert len(cases) >= 40
    wrong = [(text, want, got) for text, want in cases
             if (got := tokenizer.encode(text, add_special_tokens=False)) != want]
    assert not wrong, wrong[:3]


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_decoding_gives_back_the_text(name):
    tokenizer = _tokenizer(name)
    for text, ids in vocab_cases(name):
        assert tokenizer.decode(ids) == text, text


@pytest.mark.parametrize("name", ["mpt", "deepseek-llm"])
def test_a_split_edgellm_does_not_know_is_refused_naming_the_supported_ones(name):
    with pytest.raises(TokenizerError, match="llama-bpe.*qwen2|qwen2.*llama-bpe"):
        _tokenizer(name)


CORPUS = ["Hello world", "  leading spaces\tand tabs\n\nnew lines", "数字 12345 和 中文", "emoji 🦙🔥 done",
          "def f(x):\n    return x**2  # code", "Ünïcödé façade naïve", "한국어 텍스트", "السلام عليكم", "   ",
          "3.14159 and 1,000,000", "I'm you'RE we'll", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("name", ["qwen2", "gpt-2", "phi-3"])
def test_ids_equal_transformers_on_a_multilingual_corpus(name):
    # transformers rebuilds its tokenizer from the same GGUF; for llama-spm its rebuild differs
    # from the original Llama 2 tokenizer on space runs (the fixture's ids are the original's)
    reference = transformers_tokenizer(name)
    ours = _tokenizer(name)
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False), text


def test_unicode_classes_are_the_reference_tokenizers():
    """The classes pre-tokenizer regexes use, spelled out for Python's re, hold the same code
    points as in Hugging Face tokenizers' regexes (Oniguruma), on any Python's Unicode version."""
    import importlib.util
    from pathlib import Path

    from edgellm.tokenizer.pretokenize import compile_split

    path = Path(__file__).resolve().parents[2] / "tools" / "unicode_classes.py"
    spec = importlib.util.spec_from_file_location("unicode_classes_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    points = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and c != 1]
    for pattern in tool.CLASSES.values():
        ours = compile_split(pattern)
        assert [c for c in points if ours.fullmatch(chr(c))] == tool.members(pattern), pattern
