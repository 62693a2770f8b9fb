"""How a GGUF vocabulary's tokens are spelled, and the bytes each one stands for.

Byte-level ("gpt2") vocabularies spell every byte as one printable character (GPT-2's byte
alphabet), so a token is a string of those characters. SentencePiece ("llama") vocabularies
spell a space as '▁' and a byte the vocabulary has no piece for as a <0xXX> token. Both
encoders (bytelevel.py, sentencepiece.py) and the Hugging Face builds (build.py) read these."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgellm.errors import TokenizerError
from edgellm.io.strings import as_string_array
from edgellm.tokenizer.vocab import TokenType, Vocab

SPIECE_SPACE = "\u2581"

# Architectures whose SentencePiece scores do not follow the merge order; their token order does.
_POSITION_RANKED_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


# -- byte-level ("gpt2") vocabularies ---------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 stands for itself, every
    other byte is shifted to U+0100 and up, so no token needs whitespace or control characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
# str.translate table from a Latin-1 reading of raw bytes to the byte alphabet
LATIN1_TO_ALPHABET = {b: c for b, c in BYTE_TO_CHAR.items() if chr(b) != c}


def in_byte_alphabet(token: str) -> bool:
    return all(c in CHAR_TO_BYTE for c in token)


def byte_level_spelling(token: str) -> str:
    """A few converted files store a token as plain text; the model still means its UTF-8 bytes."""
    if in_byte_alphabet(token):
        return token
    return bytes_to_alphabet(token.encode("utf-8"))


def bytes_to_alphabet(raw: bytes) -> str:
    return raw.decode("latin-1").translate(LATIN1_TO_ALPHABET)


def outside_byte_alphabet(tokens: Sequence[str]) -> np.ndarray:
    """Ids of the tokens with a character outside the byte alphabet, found from their UTF-8 bytes
    in numpy: the alphabet is '!'..'~' (one byte), U+00A1..U+00AC and U+00AE..U+0143 (two bytes,
    lead 0xC2..0xC5)."""
    blob, starts, ends = as_string_array(tokens).spans()
    raw = np.frombuffer(blob, np.uint8)
    bad = (raw < 0x21) | (raw == 0x7F) | (raw >= 0xC6)
    if len(raw) > 1:
        lead, follow = raw[:-1], raw[1:]
        bad[1:] |= ((lead == 0xC2) & ((follow < 0xA1) | (follow == 0xAD))) | ((lead == 0xC5) & (follow > 0x83))
    return np.flatnonzero(_flagged_bytes(bad, starts, ends) > 0)


def malformed_merges(merges: Sequence[str]) -> np.ndarray:
    """Ids of the merges not written "left right": without a space, or with one at either end."""
    blob, starts, ends = as_string_array(merges).spans()
    raw = np.frombuffer(blob, np.uint8)
    spaces = _flagged_bytes(raw == 0x20, starts, ends)
    empty = ends <= starts
    at_ends = ~empty & ((raw[np.minimum(starts, len(raw) - 1)] == 0x20) | (raw[np.maximum(ends - 1, 0)] == 0x20)) \
        if len(raw) else empty
    return np.flatnonzero(empty | (spaces == 0) | at_ends)


# -- SentencePiece ("llama") vocabularies -----------------------------------------------------


def spell_piece(token: str) -> str:
    """A SentencePiece token as the tokenizer sees it: Gemma files store whitespace-run tokens
    with real spaces, where the text the tokenizer reads has '▁'."""
    if token and not token.strip(" "):
        return SPIECE_SPACE * len(token)
    return token


def space_run_tokens(tokens: Sequence[str]) -> np.ndarray:
    """Ids of the tokens spell_piece respells: non-empty runs of spaces, found in numpy."""
    blob, starts, ends = as_string_array(tokens).spans()
    spaces = _flagged_bytes(np.frombuffer(blob, np.uint8) == 0x20, starts, ends)
    return np.flatnonzero((ends > starts) & (spaces == ends - starts))


def merge_ranks(vocab: Vocab) -> np.ndarray:
    """Each token's merge priority as a merge result, lower first: its position (Gemma), or its
    place in descending score order (ties keep position)."""
    n = len(vocab.tokens)
    if vocab.architecture in _POSITION_RANKED_ARCHS or vocab.scores is None:
        return np.arange(n, dtype=np.int32)
    ranks = np.empty(n, np.int32)
    ranks[np.argsort(-np.asarray(vocab.scores, np.float64), kind="stable")] = np.arange(n, dtype=np.int32)
    return ranks


def check_sentencepiece(vocab: Vocab) -> None:
    """Refuse SentencePiece vocabularies edgellm does not reproduce."""
    if vocab.pre != "default":
        raise TokenizerError(f"unsupported SentencePiece pre-tokenizer {vocab.pre!r}")


# -- token bytes ------------------------------------------------------------------------------


def byte_token_value(token: str) -> int | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def token_bytes(vocab: Vocab, token_id: int) -> bytes:
    """The raw bytes one token stands for (what Hugging Face's decoders make of it)."""
    token, kind = vocab.tokens[token_id], int(vocab.types[token_id])
    if vocab.model == "gpt2":  # byte-level BPE: the alphabet's bytes; text outside it as itself
        return bytes(CHAR_TO_BYTE[c] for c in token) if in_byte_alphabet(token) else token.encode("utf-8")
    if kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
        return token.encode("utf-8")
    if kind == TokenType.BYTE and (value := byte_token_value(token)) is not None:
        return bytes((value,))
    return token.replace(SPIECE_SPACE, " ").encode("utf-8")


def _flagged_bytes(flags: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per string (byte span): how many of its bytes are flagged (flags are few, so their
    positions are what is held, not a running count over every byte)."""
    at = np.flatnonzero(flags)
    return np.searchsorted(at, ends) - np.searchsorted(at, starts)
