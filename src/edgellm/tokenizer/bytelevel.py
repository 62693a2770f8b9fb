"""Byte-level BPE ("gpt2" GGUF vocabularies: SmolLM2, Llama 3, Qwen, GPT-2, ...), encoded by
edgellm itself.

The vocabulary and its merges stay in the GGUF reader's compact form; two hash indexes
(index.py) answer "which token is this text" and "what rank has the merge 'left right'" without
a Python dict over either, so building the tokenizer takes milliseconds and no cache.

The result is the one Hugging Face's `tokenizers` gives for the tokenizer transformers rebuilds
from the same file (tests compare both, and against llama.cpp's vocab fixtures):
1. Added tokens (CONTROL ones in the byte alphabet, USER_DEFINED ones) are cut out of the raw
   text first, leftmost match first and the longest at a position.
2. The rest is split by the regexes the file's `tokenizer.ggml.pre` names (pretokenize.py), each
   splitting the pieces the one before left, matches and gaps both kept.
3. Each piece's UTF-8 bytes become GPT-2's byte alphabet, one character per byte; vocabularies
   that ask for it (Llama 3) take a whole piece that is a token as it is.
4. Otherwise the piece starts as its characters and the adjacent pair with the best merge rank
   merges first (the leftmost of equals), until no pair is a merge.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import numpy as np

from edgellm.tokenizer.added import AddedTokens, Memo, merge_pieces
from edgellm.tokenizer.index import VocabIndex
from edgellm.tokenizer.pretokenize import compile_split, pre_tokenizer
from edgellm.errors import TokenizerError
from edgellm.tokenizer.spelling import (byte_level_spelling, bytes_to_alphabet, malformed_merges, outside_byte_alphabet,
                                        token_bytes)
from edgellm.tokenizer.vocab import TokenType, Vocab

# Pieces already encoded, as Hugging Face's BPE keeps them; cleared when it grows past this.
_WORD_CACHE = 50_000


class ByteLevelBPE:
    """Encoder/decoder for one byte-level BPE vocabulary."""

    def __init__(self, vocab: Vocab):
        split = pre_tokenizer(vocab.pre)
        self._vocab = vocab
        self._regexes = [compile_split(r) for r in split.regexes]
        self._whole_words = split.ignore_merges
        outside = outside_byte_alphabet(vocab.tokens)
        self._index = VocabIndex(vocab.tokens, {int(i): byte_level_spelling(vocab.tokens[i]) for i in outside})
        merges = vocab.merges or []
        if len(bad := malformed_merges(merges)):
            raise TokenizerError(f"malformed merge {merges[int(bad[0])]!r} (expected 'left right')")
        self._merges = VocabIndex(merges)  # "left right" -> its rank (the later of equals)
        kinds = np.asarray(vocab.types)
        # A CONTROL token outside the byte alphabet is a mislabelled ordinary token in these files.
        in_alphabet = np.ones(len(kinds), bool)
        in_alphabet[outside] = False
        control = np.flatnonzero((kinds == TokenType.CONTROL) & in_alphabet)
        user = np.flatnonzero(kinds == TokenType.USER_DEFINED)
        special = self._added_ids(control)
        # What skip_special_tokens leaves out: Hugging Face skips by text, so every id of those texts.
        self._special = frozenset(special.values()) | frozenset(control.tolist())
        self._added = AddedTokens({**special, **self._added_ids(user)})
        self._words: dict[str, list[int]] = {}

    def _added_ids(self, ids: np.ndarray) -> dict[str, int]:
        """Added token text -> the id its text has in the vocabulary (the last of equals)."""
        texts = (self._vocab.tokens[i] for i in ids.tolist())
        return {text: token_id for text in texts if text and (token_id := self._index.get(text)) is not None}

    def token_to_id(self, text: str) -> int | None:
        return self._index.get(text)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for plain, added_id in self._added.split(text):
            for piece in self._pieces(plain):
                ids += self._word(bytes_to_alphabet(piece.encode("utf-8", "surrogatepass")))
            if added_id is not None:
                ids.append(added_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The tokens' bytes read as UTF-8, each invalid sequence becoming U+FFFD."""
        kept = (i for i in ids if not (skip_special_tokens and i in self._special))
        return b"".join(token_bytes(self._vocab, i) for i in kept).decode("utf-8", "replace")

    def to_hf_json(self) -> str:
        """The same tokenizer as a Hugging Face tokenizer.json (for exported models)."""
        from edgellm.tokenizer.build import build_hf  # the tools extra's `tokenizers`

        return build_hf(self._vocab).to_str()

    # -- splitting ----------------------------------------------------------------------------

    def _pieces(self, text: str) -> Iterator[str]:
        pieces = [text] if text else []
        for pattern in self._regexes:
            pieces = [part for piece in pieces for part in _isolate(pattern, piece)]
        return iter(pieces)

    # -- BPE ----------------------------------------------------------------------------------

    def _word(self, word: str) -> list[int]:
        ids = self._words.get(word)
        if ids is None:
            if len(self._words) >= _WORD_CACHE:
                self._words.clear()
            ids = self._words[word] = self._merge_word(word)
        return ids

    def _merge_word(self, word: str) -> list[int]:
        if self._whole_words and (whole := self._index.get(word)) is not None:
            return [whole]
        lookup = Memo(self._index.get)
        # A byte with no token is dropped, as Hugging Face's BPE (without <unk>) and llama.cpp do.
        texts: list[str | None] = [c for c in word if lookup[c] is not None]
        ids = [lookup[c] for c in texts]
        return _merge(texts, ids, Memo(self._merges.get), lookup)


def _merge(texts: list[str | None], ids: list[int], ranks: Memo, lookup: Memo) -> list[int]:
    """Merges by rank, then position; a stale entry still merges when its pair is still a merge
    into the same token."""
    def candidate(left: str, right: str, at: int) -> tuple[int, int, str, int] | None:
        if (rank := ranks[f"{left} {right}"]) is None or (token_id := lookup[left + right]) is None:
            return None
        return rank, at, left + right, token_id

    def still_merges(left: str, right: str, merged: str) -> bool:
        return left + right == merged and ranks[f"{left} {right}"] is not None

    return merge_pieces(texts, ids, candidate, still_merges)


def _isolate(pattern: re.Pattern, text: str) -> Iterator[str]:
    """`text` cut at `pattern`'s matches, matches and the gaps between them both kept."""
    at = 0
    for match in pattern.finditer(text):
        start, end = match.span()
        if start > at:
            yield text[at:start]
        if end > start:
            yield text[start:end]
        at = max(at, end)
    if at < len(text):
        yield text[at:]
