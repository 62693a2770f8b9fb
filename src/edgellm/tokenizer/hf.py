"""Tokenizers in Hugging Face's files: tokenizer.json + tokenizer_config.json, both ways.

Reading: the backend is tokenizer.json as is; the Vocab (token strings, kinds, BOS/EOS) that
the rest of edgellm reads is derived from it and tokenizer_config.json. Writing: our backend
saved as tokenizer.json, with a post-processor that adds BOS where the model wants one, so
transformers encodes exactly as edgellm does. Both use the `tokenizers` library (the tools extra)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from edgellm.extras import ToolsNeeded

try:  # the tools extra's
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, processors
except ModuleNotFoundError as e:
    raise ToolsNeeded(e.name or "tokenizers") from None

from edgellm.errors import TokenizerError
from edgellm.tokenizer import Tokenizer
from edgellm.tokenizer.spelling import byte_token_value
from edgellm.tokenizer.vocab import TokenType, Vocab


class HFBackend:
    """A `tokenizers` Tokenizer behind the interface edgellm's Tokenizer encodes with."""

    def __init__(self, backend: Backend):
        self._backend = backend

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self._backend.token_to_id(text)

    def to_hf_json(self) -> str:
        return self._backend.to_str()


def from_hf(tokenizer_json: str, config: Mapping[str, Any], architecture: str = "") -> Tokenizer:
    """A Tokenizer from tokenizer.json text and tokenizer_config.json's fields."""
    try:
        backend = Backend.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises its own exception type
        raise TokenizerError(f"tokenizer.json cannot be read ({e})") from None
    byte_level = isinstance(backend.decoder, decoders.ByteLevel)
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    added = {t.content: bool(t.special) for t in backend.get_added_tokens_decoder().values()}
    types = np.array([_kind(t, added, byte_level) for t in tokens], np.int32)
    bos, eos = _token_id(config, "bos_token", vocab), _token_id(config, "eos_token", vocab)
    probe = backend.encode("a", add_special_tokens=True).ids
    return Tokenizer(Vocab(
        model="gpt2" if byte_level else "llama", pre="default", architecture=architecture,
        tokens=tokens, types=types, scores=None, merges=None, add_space_prefix=False,
        bos_id=bos, eos_id=eos, unk_id=_token_id(config, "unk_token", vocab),
        add_bos=bos is not None and bool(probe) and probe[0] == bos,
        add_eos=eos is not None and bool(probe) and probe[-1] == eos and len(probe) > 1,
    ), HFBackend(_without_post_processor(backend)))


def _kind(token: str, added: Mapping[str, bool], byte_level: bool) -> int:
    if token in added:
        return TokenType.CONTROL if added[token] else TokenType.USER_DEFINED
    if not byte_level and byte_token_value(token) is not None:
        return TokenType.BYTE
    return TokenType.NORMAL


def _token_id(config: Mapping[str, Any], key: str, vocab: Mapping[str, int]) -> int | None:
    value = config.get(key)
    if isinstance(value, dict):  # older files: {"content": "<s>", ...}
        value = value.get("content")
    if value is None:
        return None
    if value not in vocab:
        raise TokenizerError(f"tokenizer_config.json's {key} {value!r} is not in the vocabulary")
    return vocab[value]


def _without_post_processor(backend: Backend) -> Backend:
    # edgellm's Tokenizer adds BOS/EOS itself (add_bos/add_eos above); the backend must not too.
    backend.post_processor = None
    return backend


def to_hf(tokenizer: Tokenizer, chat_template: str | None) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json fields) describing `tokenizer`."""
    vocab, backend = tokenizer._vocab, Backend.from_str(tokenizer._backend.to_hf_json())
    bos = vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else None
    eos = vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else None
    if tokenizer.add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)])
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "unk_token": vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None,
        "add_bos_token": tokenizer.add_bos, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    if chat_template:
        config["chat_template"] = chat_template
    return backend.to_str(), config
