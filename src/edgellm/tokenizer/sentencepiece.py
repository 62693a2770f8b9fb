"""SentencePiece-style BPE ("llama" GGUF vocabularies, e.g. Gemma's), encoded by edgellm itself.

The `tokenizers` library holds Gemma 3's tokenizer in ~90 MB live (~275 MB at load): a 262k
vocabulary and 515k merges derived from it, as Rust strings. Here the vocabulary stays in the
GGUF reader's compact form and the merges are never listed: SentencePiece BPE merges two
adjacent pieces exactly when their concatenation is a token, so one text -> id index
(index.py, ~4 MB) and each token's rank answer every question a merge table would.

The result is the one Hugging Face builds from the same file (tests compare both, and against
transformers):
1. Added tokens (CONTROL and USER_DEFINED ones) are cut out of the raw text first, leftmost
   match first and the longest at a position.
2. In the rest (after a space in front where the file asks for a prefix space: Llama 2, Phi-3),
   spaces become '▁'; every character is a piece, or its UTF-8 bytes as <0xXX>
   pieces when it is not a token (byte fallback).
3. Repeatedly merge the adjacent pair whose concatenation ranks best: lower merge rank of the
   result, then the longer left half (the order transformers lists derived merges in), then
   the leftmost pair.

Two differences, on purpose, in vocabularies no GGUF we know has: a character that is neither a
token nor spelled by byte tokens, with no <unk> to stand for it, raises TokenizerError (Hugging
Face drops it silently); and an id whose text a later token repeats decodes as its text
(Hugging Face's reverse vocabulary has only the later id, so it drops the earlier one).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgellm.errors import TokenizerError
from edgellm.tokenizer.added import AddedTokens, Memo, merge_pieces
from edgellm.tokenizer.index import VocabIndex
from edgellm.tokenizer.spelling import (SPIECE_SPACE, byte_token_value, check_sentencepiece, merge_ranks,
                                        space_run_tokens, spell_piece)
from edgellm.tokenizer.vocab import TokenType, Vocab


class SentencePieceBPE:
    """Encoder/decoder for one SentencePiece-BPE vocabulary."""

    def __init__(self, vocab: Vocab):
        check_sentencepiece(vocab)
        self._vocab = vocab
        self._index = VocabIndex(vocab.tokens, {i: spell_piece(vocab.tokens[i]) for i in space_run_tokens(vocab.tokens)})
        self._ranks = memoryview(merge_ranks(vocab))
        self._byte_ids = [self._index.get(f"<0x{b:02X}>") for b in range(256)]
        # As Hugging Face adds them: by text, so a token whose text the vocabulary spells
        # differently (Gemma's runs of real spaces) is not an added token.
        kinds = np.asarray(vocab.types)
        wanted = np.flatnonzero((kinds == TokenType.CONTROL) | (kinds == TokenType.USER_DEFINED)).tolist()
        added = (token for token in (vocab.tokens[i] for i in wanted) if token)
        self._added = AddedTokens({token: token_id for token in added
                                    if (token_id := self._index.get(token)) is not None})

    def token_to_id(self, text: str) -> int | None:
        return self._index.get(text)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        lookup = Memo(self._index.get)  # pieces repeat; an index lookup costs ~1 µs
        # Llama 2 / Phi-3 style vocabularies read a space before the text and after each added token
        prefix = " " if self._vocab.add_space_prefix else ""
        for plain, added_id in self._added.split(text):
            if plain:
                ids += self._merge(self._pieces((prefix + plain).replace(" ", SPIECE_SPACE), lookup), lookup)
            if added_id is not None:
                ids.append(added_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Pieces joined with '▁' read as a space; runs of <0xXX> pieces read as UTF-8 together,
        each byte of an invalid run becoming U+FFFD (Hugging Face's ByteFallback decoder)."""
        out: list[str] = []
        run = bytearray()
        for token_id in ids:
            if skip_special_tokens and token_id in self._vocab.control_ids:
                continue
            piece = self._vocab.tokens[token_id].replace(SPIECE_SPACE, " ")
            if (value := byte_token_value(piece)) is not None:
                run.append(value)
                continue
            if run:
                out.append(_utf8_or_replacement(run))
                run.clear()
            out.append(piece)
        if run:
            out.append(_utf8_or_replacement(run))
        text = "".join(out)
        return text[1:] if self._vocab.add_space_prefix and text.startswith(" ") else text  # the prefix space

    def to_hf_json(self) -> str:
        """The same tokenizer as a Hugging Face tokenizer.json (for exported models)."""
        from edgellm.tokenizer.build import build_sentencepiece_hf  # the tools extra's `tokenizers`

        return build_sentencepiece_hf(self._vocab).to_str()

    # -- BPE --------------------------------------------------------------------------------

    def _pieces(self, text: str, lookup: Memo) -> list[tuple[str, int]]:
        """(piece, id) per character, bytes where a character is not a token. Characters with
        neither become one <unk> per run, placed where Hugging Face's BPE places it: before the
        next character that is a token, after any byte pieces met in between."""
        pieces: list[tuple[str, int]] = []
        unk_pending = False
        for char in text:
            token_id = lookup[char]
            if token_id is not None:
                if unk_pending:
                    pieces.append(self._unk_piece())
                    unk_pending = False
                pieces.append((char, token_id))
                continue
            raw = char.encode("utf-8")
            byte_ids = [self._byte_ids[b] for b in raw]
            if None not in byte_ids:
                pieces += [(f"<0x{b:02X}>", i) for b, i in zip(raw, byte_ids)]
            else:
                unk_pending = True
        if unk_pending:
            pieces.append(self._unk_piece())
        return pieces

    def _unk_piece(self) -> tuple[str, int]:
        unk_id = self._vocab.unk_id
        if unk_id is None:
            raise TokenizerError("the text has characters outside the vocabulary, which has no <unk> token")
        return self._vocab.tokens[unk_id], unk_id

    def _merge(self, pieces: list[tuple[str, int]], lookup: Memo) -> list[int]:
        """Merges by the result's rank, then the longer left half, then position; a stale entry
        still merges when its pieces still make the same text (the same text is the same id)."""
        ranks = self._ranks

        def candidate(left: str, right: str, at: int) -> tuple[int, int, int, str, int] | None:
            token_id = lookup[left + right]
            return None if token_id is None else (ranks[token_id], -len(left), at, left + right, token_id)

        return merge_pieces([text for text, _ in pieces], [token_id for _, token_id in pieces], candidate,
                            lambda left, right, merged: left + right == merged)


def _utf8_or_replacement(raw: bytearray) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(raw)
