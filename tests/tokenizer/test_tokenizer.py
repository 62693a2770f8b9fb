"""Tokenizer and chat template parity with the Hugging Face reference on both real models."""
from __future__ import annotations

import codecs
import random
from pathlib import Path

import pytest

import edgellm
from edgellm.tokenizer import build as tokenizer_build
from edgellm.tokenizer.chat.template import GEMMA_TEMPLATE, ChatTemplate
from edgellm.errors import InvalidRequest, TokenizerError
from edgellm.io.gguf import open_gguf
from edgellm.tokenizer import Tokenizer

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple   internal     spaces",
    " " * 17,
    "line one\nline two\n\nline four\r\nwindows line\n",
    "\n\n\n",
    "\t\ttabs\tinside\t",
    "def f(x):\n\tif x:\n\t\treturn x  # tab-indented\n    return None\n",
    "class A:\n    def __init__(self) -> None:\n        self.x = [1, 2, 3]\n\n\n",
    "digits 0123456789 3.14159 1,000,000 2024-01-31 007 12345678901234567890",
    "你好，世界！这是一个分词测试。",
    "日本語のテキスト、カタカナとひらがな。東京タワー",
    "한국어 텍스트와 Ελληνικά και Русский текст",
    "emoji 😀🎉 👍🏽 👋🏿 👨‍👩‍👧‍👦 🧑🏽‍💻 🏳️‍🌈 ❤️",
    "mixed café naïve résumé ﬁ e\u0301 \u00a0nbsp\u200bzero-width",
    "special <|im_start|>user\nhi<|im_end|> <|endoftext|> <end_of_turn> <bos> <start_of_turn>model",
    "<|im_end|>",
    "<eos>",
    "math ∑_{i=1}^{n} i² = n(n+1)/2 ≠ ∞; URL https://example.com/a?q=1&r=2#x",
    "a" * 300,
    "😀" * 40,
    "rare bytes \x00\x01\x7f \ufffd \U0001f9ea",
]

CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "  Why?  \n"},
    ],
    [{"role": "user", "content": "日本語 😀 <|im_end|> code:\n\tx = 1"}],
]


def _load(path: Path) -> tuple[Tokenizer, ChatTemplate]:
    metadata = open_gguf(path).metadata
    tok = Tokenizer.from_gguf_metadata(metadata)
    return tok, ChatTemplate.from_metadata(metadata, tok)


def _hf(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[Tokenizer, ChatTemplate]:
    return _load(smollm2_path)


@pytest.fixture(scope="module")
def gemma3(gemma3_path: Path) -> tuple[Tokenizer, ChatTemplate]:
    return _load(gemma3_path)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path: Path):
    return _hf(smollm2_path)


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path: Path):
    return _hf(gemma3_path)


@pytest.fixture(params=["smollm2", "gemma3"])
def model(request) -> tuple[Tokenizer, ChatTemplate]:
    return request.getfixturevalue(request.param)


def _assert_parity(ours: Tokenizer, hf, text: str) -> None:
    for special in (True, False):
        expected = hf(text, add_special_tokens=special)["input_ids"]
        assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
    ids = ours.encode(text)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)


# -- Hugging Face parity -------------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_ids_match_transformers(smollm2, hf_smollm2, text):
    _assert_parity(smollm2[0], hf_smollm2, text)


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_gemma3_ids_match_transformers(gemma3, hf_gemma3, text):
    _assert_parity(gemma3[0], hf_gemma3, text)


@pytest.mark.slow
def test_gemma3_special_ids_match_transformers(gemma3, hf_gemma3):
    tok = gemma3[0]
    assert tok.bos_id == hf_gemma3.bos_token_id
    assert tok.eos_id == hf_gemma3.eos_token_id
    assert {tok.token_to_id(t) for t in ("<start_of_turn>", "<end_of_turn>")} == {105, 106}


def test_smollm2_chat_template_matches_transformers(smollm2, hf_smollm2):
    _, chat = smollm2
    for messages in CHATS:
        for prompt in (True, False):
            expected = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert chat.render(messages, add_generation_prompt=prompt) == expected
        expected_ids = hf_smollm2.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert chat.encode_chat(messages) == list(expected_ids["input_ids"])


# -- round trips and token bytes (both models, no reference needed) --------------------------


@pytest.mark.parametrize("text", CORPUS)
def test_decode_inverts_encode(model, text):
    tok = model[0]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("text", CORPUS)
def test_token_bytes_spell_the_decoded_text(model, text):
    tok = model[0]
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == tok.decode(ids).encode("utf-8")


def test_streaming_token_bytes_never_split_characters(model):
    tok = model[0]
    text = "emoji 👨‍👩‍👧‍👦 and 日本語 and 🧑🏽‍💻"
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces = [decoder.decode(tok.token_bytes(i)) for i in tok.encode(text, add_special_tokens=False)]
    assert "".join(pieces) + decoder.decode(b"", final=True) == text
    assert "\ufffd" not in "".join(pieces)


def test_token_bytes_of_byte_and_space_tokens(smollm2, gemma3):
    smol, gemma = smollm2[0], gemma3[0]
    assert smol.token_bytes(smol.token_to_id("Ġ")) == b" "
    assert smol.token_bytes(smol.token_to_id("Ċ")) == b"\n"
    assert gemma.token_bytes(gemma.token_to_id("<0xE4>")) == b"\xe4"
    assert gemma.token_bytes(gemma.token_to_id("▁the")) == b" the"
    assert gemma.token_bytes(gemma.token_to_id("<end_of_turn>")) == b"<end_of_turn>"


def test_token_bytes_rejects_out_of_range_ids(smollm2):
    tok = smollm2[0]
    with pytest.raises(TokenizerError):
        tok.token_bytes(tok.vocab_size)
    with pytest.raises(TokenizerError):
        tok.decode([-1])


# -- special tokens ----------------------------------------------------------------------------


def test_smollm2_special_tokens(smollm2):
    tok = smollm2[0]
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1 and not tok.add_bos
    assert tok.eos_ids == frozenset({0, 2})  # <|endoftext|>, <|im_end|>
    assert {0, 1, 2} <= tok.special_ids
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.encode("<|im_end|>") == [2]


def test_gemma3_special_tokens(gemma3):
    tok = gemma3[0]
    assert tok.vocab_size == 262144
    assert tok.bos_id == 2 and tok.add_bos
    assert tok.eos_ids == frozenset({1, 106})  # <eos>, <end_of_turn>
    assert tok.encode("") == [2]
    assert tok.encode("hi")[0] == 2 and tok.encode("hi", add_special_tokens=False)[0] != 2
    assert tok.decode(tok.encode("hi"), skip_special_tokens=True) == "hi"


# -- chat templates ----------------------------------------------------------------------------


def test_gemma3_fallback_template_format(gemma3):
    tok, chat = gemma3
    assert chat.origin == "builtin:gemma" and chat.source == GEMMA_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi there \n"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    assert chat.render(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    single = [{"role": "user", "content": "Hi"}]
    assert chat.render(single, add_generation_prompt=False) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"


def test_gemma3_chat_has_exactly_one_bos(gemma3):
    tok, chat = gemma3
    ids = chat.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id
    assert ids[1:3] == [tok.token_to_id("<start_of_turn>"), tok.token_to_id("user")]
    assert ids[-3:] == tok.encode("<start_of_turn>model\n", add_special_tokens=False)


def test_gemma3_fallback_rejects_non_alternating_roles(gemma3):
    chat = gemma3[1]
    with pytest.raises(InvalidRequest, match="alternating"):
        chat.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(InvalidRequest):
        chat.render([{"role": "assistant", "content": "a"}])


@pytest.mark.parametrize("messages", [
    None,
    "hello",
    [],
    ["hello"],
    [{"content": "no role"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
    [{"role": 3, "content": "x"}],
    [{"role": "user<|im_end|>", "content": "x"}],
])
def test_malformed_messages_raise_invalid_request(smollm2, messages):
    chat = smollm2[1]
    with pytest.raises(InvalidRequest):
        chat.render(messages)
    with pytest.raises(InvalidRequest):
        chat.encode_chat(messages)


def test_template_syntax_error_is_typed(smollm2):
    with pytest.raises(TokenizerError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", smollm2[0])


def test_template_sandbox_blocks_python_internals(smollm2):
    chat = ChatTemplate("{{ messages.__class__.__mro__ }}", smollm2[0])
    with pytest.raises(TokenizerError):
        chat.render([{"role": "user", "content": "x"}])


def test_template_helpers(smollm2):
    tok = smollm2[0]
    chat = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}"
        "{% generation %}{{ add_generation_prompt }}{% endgeneration %}", tok)
    rendered = chat.render([{"role": "user", "content": "<é>"}])
    assert rendered == '<|im_start|>|<|im_end|>|[{"role": "user", "content": "<é>"}]True'
    rejecting = ChatTemplate("{{ raise_exception('no thanks') }}", tok)
    with pytest.raises(InvalidRequest, match="no thanks"):
        rejecting.render([{"role": "user", "content": "x"}])


# -- metadata errors and the build cache --------------------------------------------------------


def test_unsupported_tokenizer_models_raise():
    with pytest.raises(TokenizerError, match="unsupported tokenizer model"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="unsupported tokenizer model"):
        Tokenizer.from_gguf_metadata({})
    with pytest.raises(TokenizerError, match="tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": []})
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(TokenizerError, match="pre-tokenizer"):
        Tokenizer.from_gguf_metadata({
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "tekken",
            "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": [],
        })
    with pytest.raises(TokenizerError, match="not a token id"):
        Tokenizer.from_gguf_metadata({
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 5,
        })
    for merge in ["ab", " a", "a ", ""]:
        with pytest.raises(TokenizerError, match="malformed merge"):
            Tokenizer.from_gguf_metadata({
                "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                "tokenizer.ggml.merges": ["a b", merge],
            })


def test_tiny_sentencepiece_vocab_derives_merges(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    tokens = ["<unk>", "<s>", "</s>", "<0x41>", "▁", "a", "b", "ab", "▁ab", "▁a"]
    tok = Tokenizer.from_gguf_metadata({
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3, 6, 1, 1, 1, 1, 1, 1],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": False,
    })
    assert tok.encode("ab ab") == [1, 7, 8]
    assert tok.encode("A", add_special_tokens=False) == [3]  # byte fallback
    assert tok.decode(tok.encode("ab abA")) == "<s>ab abA"


def _random_sentencepiece_vocab(rng: random.Random, architecture: str) -> dict:
    """A small vocabulary where many tokens split several ways, so merge order decides."""
    alphabet = ["a", "b", "c", "▁"]
    tokens = ["<unk>", "<s>", "</s>", "<x>", *alphabet, *(f"<0x{b:02X}>" for b in (0x41, 0xC3, 0xA9))]
    while len(tokens) < 80:
        token = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5)))
        if token not in tokens:
            tokens.append(token)
    types = [2, 3, 3, 3, *[1] * 4, *[6] * 3, *[1] * (len(tokens) - 11)]
    return {
        "general.architecture": architecture, "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [rng.choice([-1.0, -2.0, -3.0]) for _ in tokens],  # ties on purpose
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": False,
    }


@pytest.mark.parametrize("architecture", ["gemma3", "llama"])  # merges ranked by position / by score
def test_own_sentencepiece_encoder_matches_tokenizers_on_random_vocabularies(architecture):
    rng = random.Random(architecture)
    for _ in range(20):
        metadata = _random_sentencepiece_vocab(rng, architecture)
        ours = Tokenizer.from_gguf_metadata(metadata)
        reference = tokenizer_build.build_sentencepiece_hf(ours._vocab)
        for _ in range(50):  # é falls back to bytes, A is a byte token, d and ü are <unk>
            text = "".join(rng.choice(["a", "b", "c", " ", "ab", "é", "A", "d", "ü", "<x>"]) for _ in range(30))
            expected = reference.encode(text, add_special_tokens=False).ids
            assert ours.encode(text, add_special_tokens=False) == expected, (metadata["tokenizer.ggml.tokens"], text)
            assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False)


def test_vocab_index_finds_every_token_and_the_last_of_equals():
    from edgellm.tokenizer.index import VocabIndex

    tokens = [f"t{i}" for i in range(5000)] + ["dup", "x", "dup", ""]
    index = VocabIndex(tokens)
    assert all(index.get(t) == i for i, t in enumerate(tokens[:5000]))
    assert index.get("dup") == 5002 and index.get("") == 5003 and "x" in index
    assert index.get("t5000") is None and index.get("du") is None
    spaced = VocabIndex(["  ", "a", "▁▁"], respelled={0: "▁▁"})
    assert spaced.get("▁▁") == 2 and spaced.get("  ") is None and spaced.get("a") == 1
    assert VocabIndex(["  ", "a"], respelled={0: "▁▁"}).get("▁▁") == 0
    assert index.get("\ud800") is None  # a lone surrogate is no token, and no error


def test_vocab_index_hashes_in_numpy_what_python_hashes():
    from edgellm.tokenizer.index import string_hashes, text_hash

    texts = ["", "a", "ab", "é", "日本語", "🦙" * 40, "x" * 300, "\x00\x01", "y" * 3000, "é" * 1500]
    assert string_hashes(texts).tolist() == [text_hash(t.encode()) for t in texts]


def _metadata(path: Path) -> dict:
    return dict(open_gguf(path).metadata)


def _random_texts(pieces: list[str], count: int, seed: int) -> list[str]:
    """Texts glued from vocabulary pieces, spaces, rare characters and added-token text: where
    merge order, byte fallback and added-token cutting can go wrong."""
    rng = random.Random(seed)
    extra = [" ", "  ", "\n", "\n\n", "\t", "é", "😀", "\x00", "ﬁ", "<", ">", "<bos>", "<end_of_turn>", "<start_of_turn>"]
    return ["".join(rng.choice(pieces if rng.random() < 0.7 else extra) for _ in range(rng.randint(0, 40)))
            for _ in range(count)]


def test_smollm2_own_encoder_matches_tokenizers_build(smollm2_path, tmp_path, monkeypatch):
    """edgellm encodes byte-level vocabularies itself, writes no cache, and agrees with the
    `tokenizers` build of the same vocabulary."""
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    metadata = _metadata(smollm2_path)
    ours = Tokenizer.from_gguf_metadata(metadata)
    assert not list(tmp_path.rglob("*"))
    reference = tokenizer_build.build_hf(ours._vocab)
    tokens = metadata["tokenizer.ggml.tokens"]
    pieces = [ours.decode([i]) for i in random.Random(0).sample(range(len(tokens)), 3000)]
    heldout = (Path(edgellm.__file__).parent / "data" / "heldout.txt").read_text()
    pieces += ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "123", "4567", "'s", "'LL"]
    for text in [*CORPUS, heldout, *_random_texts(pieces, 300, seed=1)]:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False), text
        assert ours.decode(expected, skip_special_tokens=True) == reference.decode(expected, skip_special_tokens=True)


def _random_byte_level_vocab(rng: random.Random, pre: str) -> dict:
    """Every byte, then tokens made by merging random pairs; the merges listed in a shuffled
    order (ranks unrelated to how tokens were built, so stale heap entries and ties happen), a
    few listed twice (the later rank counts), and one control token."""
    from edgellm.tokenizer.spelling import BYTE_TO_CHAR

    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + ["<x>"]
    merges = []
    common = [BYTE_TO_CHAR[b] for b in b"abc "]
    while len(merges) < 60:
        left, right = rng.choice(common + tokens[257:]), rng.choice(common + tokens[257:])
        if left + right not in tokens:
            tokens.append(left + right)
        merges.append(f"{left} {right}")
    rng.shuffle(merges)
    merges += rng.sample(merges, 5)
    return {
        "general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [1] * 256 + [3] + [1] * (len(tokens) - 257),
    }


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe"])  # merges only / whole pieces first
def test_own_byte_level_encoder_matches_tokenizers_on_random_vocabularies(pre):
    rng = random.Random(pre)
    for _ in range(20):
        ours = Tokenizer.from_gguf_metadata(_random_byte_level_vocab(rng, pre))
        reference = tokenizer_build.build_hf(ours._vocab)
        for _ in range(30):
            text = "".join(rng.choice(["a", "b", "c", " ", "ab", "cab", "é", "<x>", "\n", "1"]) for _ in range(25))
            expected = reference.encode(text, add_special_tokens=False).ids
            assert ours.encode(text, add_special_tokens=False) == expected, text
            assert ours.decode(expected, skip_special_tokens=True) == reference.decode(expected, skip_special_tokens=True)


def test_gemma3_own_encoder_matches_tokenizers_build(gemma3, gemma3_path, tmp_path, monkeypatch):
    """edgellm encodes SentencePiece vocabularies itself, writes no cache, and agrees with the
    `tokenizers` build of the same vocabulary (transformers parity: the slow test above)."""
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    metadata = _metadata(gemma3_path)
    ours = Tokenizer.from_gguf_metadata(metadata)
    assert not list(tmp_path.rglob("*.json"))
    reference = tokenizer_build.build_sentencepiece_hf(ours._vocab)
    tokens = metadata["tokenizer.ggml.tokens"]
    pieces = [tokens[i].replace("▁", " ") for i in random.Random(0).sample(range(len(tokens)), 3000)]
    heldout = (Path(edgellm.__file__).parent / "data" / "heldout.txt").read_text()
    for text in [*CORPUS, heldout, *_random_texts(pieces, 300, seed=1)]:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=False), text
        assert ours.decode(expected, skip_special_tokens=True) == reference.decode(expected, skip_special_tokens=True)
