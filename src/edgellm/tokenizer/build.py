"""Hugging Face `tokenizers` backends rebuilt from GGUF metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the vocabulary, token
types, and either BPE merges (byte-level "gpt2" vocabularies) or per-token scores
(SentencePiece "llama" vocabularies). We rebuild the same tokenizer transformers builds from
the same file, so token ids agree with the Hugging Face reference:

* gpt2: byte-level BPE split as the file's `tokenizer.ggml.pre` names (pretokenize.py), the
  file's merges as given. This is the backend edgellm encodes with; the build is cached on disk.
* llama: SentencePiece-style BPE with byte fallback and no prefix space (Gemma's kind; files
  that ask for a prefix space are refused for now). The file has no merges, so they are
  derived from the vocabulary (every split of a token into two vocabulary pieces), ranked by
  token position (Gemma) or score. edgellm encodes these with its own compact encoder
  (sentencepiece.py); this build serves model export and is the tests' second opinion.

CONTROL tokens become special added tokens and USER_DEFINED ones plain added tokens, so their
text in the input maps to the single token, as llama.cpp does.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, decoders, normalizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from edgellm.atomic import atomic_path
from edgellm.errors import TokenizerError
from edgellm.registry import cache_dir
from edgellm.tokenizer.pretokenize import pre_tokenizer
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


_BYTE_TO_CHAR = _byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _in_byte_alphabet(token: str) -> bool:
    return all(c in _CHAR_TO_BYTE for c in token)


def _byte_level_spelling(token: str) -> str:
    # A few converted files store a token as plain text; the model still means its UTF-8 bytes.
    if _in_byte_alphabet(token):
        return token
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _build_byte_level(vocab: Vocab) -> Backend:
    split = pre_tokenizer(vocab.pre)
    spelled = {_byte_level_spelling(t): i for i, t in enumerate(vocab.tokens)}
    merges = [_split_merge(m) for m in vocab.merges or ()]
    backend = Backend(BPE(vocab=spelled, merges=merges, fuse_unk=False, ignore_merges=split.ignore_merges))
    backend.pre_tokenizer = split.build()
    backend.decoder = decoders.ByteLevel()
    # A CONTROL token outside the byte alphabet is a mislabelled ordinary token in these files.
    _add_added_tokens(backend, vocab, spelled, special_ok=_in_byte_alphabet)
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise TokenizerError(f"malformed merge {merge!r} (expected 'left right')")
    return left, right


# -- SentencePiece ("llama") vocabularies -----------------------------------------------------


def spell_piece(token: str) -> str:
    """A SentencePiece token as the tokenizer sees it: Gemma files store whitespace-run tokens
    with real spaces, where the text the tokenizer reads has '▁'."""
    if token and not token.strip(" "):
        return SPIECE_SPACE * len(token)
    return token


def merge_ranks(vocab: Vocab) -> np.ndarray:
    """Each token's merge priority as a merge result, lower first: its position (Gemma), or its
    place in descending score order (ties keep position)."""
    n = len(vocab.tokens)
    if vocab.architecture in _POSITION_RANKED_ARCHS or vocab.scores is None:
        return np.arange(n, dtype=np.int32)
    ranks = np.empty(n, np.int32)
    ranks[np.argsort(-np.asarray(vocab.scores, np.float64), kind="stable")] = np.arange(n, dtype=np.int32)
    return ranks


def _merge_order(vocab: Vocab, spelled: Mapping[str, int]) -> list[str]:
    """Tokens from most to least preferred merge result."""
    ranks = merge_ranks(vocab)
    return sorted(spelled, key=lambda t: ranks[spelled[t]])


def _derive_merges(ordered: Iterable[str], spelled: Mapping[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges a token when both halves are pieces; list every such split, best
    token first and, within a token, longest left half first (transformers' order, for parity)."""
    merges: list[tuple[str, str]] = []
    for token in ordered:
        for cut in range(len(token) - 1, 0, -1):
            left = token[:cut]
            if left in spelled:
                right = token[cut:]
                if right in spelled:
                    merges.append((left, right))
    return merges


def check_sentencepiece(vocab: Vocab) -> None:
    """Refuse SentencePiece vocabularies neither builder reproduces."""
    if vocab.pre != "default":
        raise TokenizerError(f"unsupported SentencePiece pre-tokenizer {vocab.pre!r}")


def build_sentencepiece_hf(vocab: Vocab) -> Backend:
    """The `tokenizers` build of a SentencePiece vocabulary (not cached: edgellm encodes these
    itself, and export needs it once)."""
    check_sentencepiece(vocab)
    spelled = {spell_piece(t): i for i, t in enumerate(vocab.tokens)}
    merges = _derive_merges(_merge_order(vocab, spelled), spelled)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    backend = Backend(BPE(vocab=spelled, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # No pre-tokenizer: SentencePiece sees the whole text, spaces included, as one sequence
    # (after a '▁' in front, where the file asks for a prefix space, removed again on decode).
    replace = normalizers.Replace(" ", SPIECE_SPACE)
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), replace])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = replace
    backend.decoder = decoders.Sequence(steps)
    _add_added_tokens(backend, vocab, spelled, special_ok=lambda _t: True)
    return backend


# -- shared building --------------------------------------------------------------------------


def _add_added_tokens(
    backend: Backend, vocab: Vocab, spelled: Mapping[str, int], special_ok: Callable[[str], bool]
) -> None:
    # normalized=False: the raw input text is matched, before spaces become '▁' or bytes remap.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(vocab.tokens, vocab.types)
        if kind == TokenType.CONTROL and special_ok(t)
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(vocab.tokens, vocab.types)
        if kind == TokenType.USER_DEFINED and t in spelled
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _build(vocab: Vocab) -> Backend:
    if vocab.model == "gpt2":
        return _build_byte_level(vocab)
    return build_sentencepiece_hf(vocab)


def _cache_path(vocab: Vocab) -> Path:
    key = vocab.cache_key()
    if vocab.model == "gpt2":  # the split is edgellm's table, not the file's: it keys the build too
        key += hashlib.sha256(repr(pre_tokenizer(vocab.pre)).encode()).hexdigest()[:8]
    return cache_dir() / "tokenizers" / f"{key}.json"


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


def load_or_build(vocab: Vocab) -> HFBackend:
    """The `tokenizers` build of `vocab`, from edgellm's cache when it was built before."""
    path = _cache_path(vocab)
    if path.is_file():
        try:
            return HFBackend(Backend.from_file(str(path)))
        except Exception:  # a corrupt cache entry is rebuilt, never fatal
            pass
    backend = _build(vocab)
    _save_atomically(backend, path)
    return HFBackend(backend)


def _save_atomically(backend: Backend, path: Path) -> None:
    # Write-then-rename so a concurrent reader never sees half a file; a read-only cache only
    # costs speed, so failures are ignored.
    try:
        with atomic_path(path) as tmp:
            backend.save(str(tmp))
    except Exception:  # OSError, or tokenizers' own error type from save()
        pass


# -- token bytes ------------------------------------------------------------------------------


def byte_token_value(token: str) -> int | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def token_bytes(vocab: Vocab, token_id: int) -> bytes:
    """The raw bytes one token stands for."""
    token, kind = vocab.tokens[token_id], vocab.types[token_id]
    if kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
        return token.encode("utf-8")
    if vocab.model == "gpt2":  # byte-level BPE
        return bytes(_CHAR_TO_BYTE[c] for c in _byte_level_spelling(token))
    if kind == TokenType.BYTE and (value := byte_token_value(token)) is not None:
        return bytes((value,))
    return token.replace(SPIECE_SPACE, " ").encode("utf-8")
