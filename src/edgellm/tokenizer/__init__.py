"""Text <-> token ids, rebuilt from a GGUF's metadata by edgellm's own encoders: byte-level BPE
(bytelevel.py) and SentencePiece BPE (sentencepiece.py). Hugging Face folders bring their
tokenizer.json, read by the `tokenizers` library of the tools extra (hf.py)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property, lru_cache, partial
from typing import Any, Protocol

from edgellm.errors import TokenizerError
from edgellm.tokenizer.bytelevel import ByteLevelBPE
from edgellm.tokenizer.sentencepiece import SentencePieceBPE
from edgellm.tokenizer.spelling import token_bytes
from edgellm.tokenizer.vocab import TokenType, Vocab, read_vocab

__all__ = ["Tokenizer", "TokenType"]

# Tokens that end an assistant turn in common chat formats; generation stops on any of them.
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


class TokenizerBackend(Protocol):
    """What encodes and decodes for a Tokenizer (BOS/EOS and id checks are the Tokenizer's)."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def token_to_id(self, text: str) -> int | None: ...
    def to_hf_json(self) -> str: ...


class Tokenizer:
    """Text <-> token ids for one GGUF model, matching the Hugging Face tokenizer for that file."""

    def __init__(self, vocab: Vocab, backend: TokenizerBackend):
        self._vocab = vocab
        self._backend = backend
        # computed per token when streamed (a table for 262k tokens would hold ~13 MB)
        self._token_bytes = lru_cache(maxsize=8192)(partial(token_bytes, vocab))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF's metadata describes, on edgellm's own encoders."""
        vocab = read_vocab(metadata)
        return cls(vocab, SentencePieceBPE(vocab) if vocab.model == "llama" else ByteLevelBPE(vocab))

    # -- ids --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        """The file's EOS token; see eos_ids for everything that ends generation."""
        return self._vocab.eos_id

    @property
    def add_bos(self) -> bool:
        """Whether encode(..., add_special_tokens=True) starts with BOS, as the file asks."""
        return self._vocab.add_bos and self._vocab.bos_id is not None

    @cached_property
    def eos_ids(self) -> frozenset[int]:
        """Every token that ends generation: the file's EOS and known end-of-turn tokens."""
        ids = {self._vocab.eos_id} if self._vocab.eos_id is not None else set()
        for text in _END_OF_TURN_TEXTS:
            token_id = self.token_to_id(text)
            if token_id is not None and token_id in self._vocab.control_ids:
                ids.add(token_id)
        return frozenset(ids)

    @property
    def special_ids(self) -> frozenset[int]:
        """CONTROL tokens: BOS/EOS, turn markers, padding, unused slots."""
        return self._vocab.control_ids

    def id_to_token(self, token_id: int) -> str:
        """The token as the GGUF spells it."""
        return self._vocab.tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        return self._backend.token_to_id(text)

    # -- text ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text inside it (e.g. '<|im_end|>') becomes that
        token. add_special_tokens adds BOS/EOS where the file says to."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._backend.encode(text)
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self._vocab.bos_id)
            if self._vocab.add_eos and self._vocab.eos_id is not None:
                ids.append(self._vocab.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        plain = [int(i) for i in ids]  # numpy/torch integers index as plain ints
        self._check_ids(plain)
        return self._backend.decode(plain, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes `token_id` stands for; may be part of a UTF-8 character, so a streaming
        detokenizer concatenates these and decodes only complete characters."""
        self._check_ids((token_id,))
        return self._token_bytes(token_id)

    def _check_ids(self, ids: Iterable[int]) -> None:
        n = self.vocab_size
        for token_id in ids:
            if not 0 <= token_id < n:
                raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{n - 1})")

    def __repr__(self) -> str:
        return f"Tokenizer(model={self._vocab.model!r}, vocab_size={self.vocab_size})"

