"""Tokenizers rebuilt from GGUF metadata, on top of the `tokenizers` library.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the vocabulary, token
types, and either BPE merges (byte-level "gpt2" vocabularies) or per-token scores
(SentencePiece "llama" vocabularies). We rebuild the same tokenizer transformers builds from
the same file, so token ids agree with the Hugging Face reference:

* gpt2: byte-level BPE with the GPT-2 split regex, the file's merges as given.
* llama: SentencePiece-style BPE with byte fallback and no prefix space (Gemma's kind; files
  that ask for a prefix space are refused for now). The file has no merges, so they are
  derived from the vocabulary (every split of a token into two vocabulary pieces), ranked by
  token position (Gemma) or score -- slow enough (~1 s + build) that the result is cached on disk.

CONTROL tokens become special added tokens and USER_DEFINED ones plain added tokens, so their
text in the input maps to the single token, as llama.cpp does.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from edgellm.errors import TokenizerError
from edgellm.registry import cache_dir

# Bump whenever the way a tokenizer is built changes, so stale cached builds are ignored.
_BUILD_VERSION = 1

_SPIECE_SPACE = "\u2581"

# Byte-level pre-tokenizer names whose split is GPT-2's regex, or one it agrees with on these
# vocabularies: llama.cpp's "smollm" splits digits one by one, but SmolLM2's merges contain no
# digit pairs and no space+digit pairs, so GPT-2's grouping tokenizes digits identically.
_GPT2_SPLIT_PRES = frozenset({"default", "gpt2", "smollm"})

# Tokens that end an assistant turn in common chat formats; generation stops on any of them.
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>")

# Architectures whose SentencePiece scores do not follow the merge order; their token order does.
_POSITION_RANKED_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


class TokenType(IntEnum):
    """llama.cpp's tokenizer.ggml.token_type values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class _Vocab:
    """The tokenizer part of a GGUF's metadata, checked."""

    model: str
    pre: str
    architecture: str
    tokens: list[str]
    types: list[int]
    scores: np.ndarray | None
    merges: list[str] | None
    add_space_prefix: bool
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool

    def cache_key(self) -> str:
        digest = hashlib.sha256()
        header = (_BUILD_VERSION, self.model, self.pre, self.architecture, self.add_space_prefix, self.unk_id)
        digest.update(repr(header).encode())
        # NUL cannot occur inside a GGUF string used as a token, so joining is unambiguous.
        digest.update("\0".join(self.tokens).encode("utf-8", "surrogatepass"))
        digest.update(np.asarray(self.types, dtype="<i4").tobytes())
        if self.scores is not None:
            digest.update(np.ascontiguousarray(self.scores, dtype="<f4").tobytes())
        if self.merges is not None:
            digest.update("\n".join(self.merges).encode())
        return digest.hexdigest()[:32]


# -- reading the metadata ---------------------------------------------------------------------


def _optional_id(metadata: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < n_tokens:
        raise TokenizerError(f"{key} = {value!r} is not a token id (vocabulary has {n_tokens} tokens)")
    return int(value)


def _numeric_array(metadata: Mapping[str, Any], key: str, n_tokens: int) -> np.ndarray | None:
    value = metadata.get(key)
    if value is None:
        return None
    array = np.asarray(value)
    if array.shape != (n_tokens,) or not np.issubdtype(array.dtype, np.number):
        raise TokenizerError(f"{key} must be {n_tokens} numbers, got shape {array.shape} {array.dtype}")
    return array


def _read_vocab(metadata: Mapping[str, Any]) -> _Vocab:
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise TokenizerError(f"unsupported tokenizer model {model!r} (supported: 'gpt2', 'llama')")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError("tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    types = _numeric_array(metadata, "tokenizer.ggml.token_type", n)
    # Plain ints: the per-token loops below are several times slower over numpy scalars.
    types = [int(TokenType.NORMAL)] * n if types is None else types.astype(np.int64).tolist()
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None and not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise TokenizerError("tokenizer.ggml.merges is not a list of strings")
    if model == "gpt2" and merges is None:
        raise TokenizerError("a 'gpt2' tokenizer needs tokenizer.ggml.merges")
    is_llama = model == "llama"
    return _Vocab(
        model=model,
        pre=str(metadata.get("tokenizer.ggml.pre", "default")),
        architecture=str(metadata.get("general.architecture", "")),
        tokens=tokens,
        types=types,
        scores=_numeric_array(metadata, "tokenizer.ggml.scores", n),
        merges=merges,
        # llama.cpp's defaults when a flag is absent: SentencePiece prefixes a space and adds BOS.
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", is_llama)),
        bos_id=_optional_id(metadata, "tokenizer.ggml.bos_token_id", n),
        eos_id=_optional_id(metadata, "tokenizer.ggml.eos_token_id", n),
        unk_id=_optional_id(metadata, "tokenizer.ggml.unknown_token_id", n),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", is_llama)),
        add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    )


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


def _build_byte_level(vocab: _Vocab) -> _Backend:
    if vocab.pre not in _GPT2_SPLIT_PRES:
        raise TokenizerError(
            f"unsupported byte-level pre-tokenizer {vocab.pre!r} (supported: {sorted(_GPT2_SPLIT_PRES)})")
    spelled = {_byte_level_spelling(t): i for i, t in enumerate(vocab.tokens)}
    merges = [_split_merge(m) for m in vocab.merges or ()]
    backend = _Backend(BPE(vocab=spelled, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
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


def _sentencepiece_spelling(token: str) -> str:
    # Gemma files store whitespace-run tokens with real spaces; the normalizer produces '▁'.
    if token and not token.strip(" "):
        return _SPIECE_SPACE * len(token)
    return token


def _merge_order(vocab: _Vocab, spelled: Mapping[str, int]) -> list[str]:
    """Tokens from most to least preferred merge result."""
    by_position = sorted(spelled, key=spelled.__getitem__)
    if vocab.architecture in _POSITION_RANKED_ARCHS or vocab.scores is None:
        return by_position
    scores = vocab.scores
    return sorted(by_position, key=lambda t: -float(scores[spelled[t]]))  # stable: ties keep position


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


def _build_sentencepiece(vocab: _Vocab) -> _Backend:
    if vocab.pre != "default":
        raise TokenizerError(f"unsupported SentencePiece pre-tokenizer {vocab.pre!r}")
    if vocab.add_space_prefix:
        # Llama-2-style vocabularies also need a prefix space on encode and its removal on
        # decode; unverified against a reference model, so refused rather than guessed.
        raise TokenizerError("SentencePiece vocabularies with add_space_prefix are not supported yet")
    spelled = {_sentencepiece_spelling(t): i for i, t in enumerate(vocab.tokens)}
    merges = _derive_merges(_merge_order(vocab, spelled), spelled)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    backend = _Backend(BPE(vocab=spelled, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # No pre-tokenizer: SentencePiece sees the whole text, spaces included, as one sequence.
    backend.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_added_tokens(backend, vocab, spelled, special_ok=lambda _t: True)
    return backend


# -- shared building --------------------------------------------------------------------------


def _add_added_tokens(
    backend: _Backend, vocab: _Vocab, spelled: Mapping[str, int], special_ok: Callable[[str], bool]
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


def _build(vocab: _Vocab) -> _Backend:
    if vocab.model == "gpt2":
        return _build_byte_level(vocab)
    return _build_sentencepiece(vocab)


def _cache_path(vocab: _Vocab) -> Path:
    return cache_dir() / "tokenizers" / f"{vocab.cache_key()}.json"


def _load_or_build(vocab: _Vocab) -> _Backend:
    path = _cache_path(vocab)
    if path.is_file():
        try:
            return _Backend.from_file(str(path))
        except Exception:  # a corrupt cache entry is rebuilt, never fatal
            pass
    backend = _build(vocab)
    _save_atomically(backend, path)
    return backend


def _save_atomically(backend: _Backend, path: Path) -> None:
    # Write-then-rename so a concurrent reader never sees half a file; a read-only cache only
    # costs speed, so failures are ignored.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        os.close(fd)
        try:
            backend.save(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception:  # OSError, or tokenizers' own error type from save()
        pass


# -- token bytes ------------------------------------------------------------------------------


def _byte_token_value(token: str) -> int | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def _token_bytes_table(vocab: _Vocab) -> list[bytes]:
    table: list[bytes] = []
    byte_level = vocab.model == "gpt2"
    for token, kind in zip(vocab.tokens, vocab.types):
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
            table.append(token.encode("utf-8"))
        elif byte_level:
            spelled = _byte_level_spelling(token)
            table.append(bytes(_CHAR_TO_BYTE[c] for c in spelled))
        elif kind == TokenType.BYTE and (value := _byte_token_value(token)) is not None:
            table.append(bytes((value,)))
        else:
            table.append(token.replace(_SPIECE_SPACE, " ").encode("utf-8"))
    return table


# -- the public class -------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one GGUF model, matching the Hugging Face tokenizer for that file."""

    def __init__(self, vocab: _Vocab, backend: _Backend):
        self._vocab = vocab
        self._backend = backend
        self._special_ids = frozenset(i for i, kind in enumerate(vocab.types) if kind == TokenType.CONTROL)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build (or load from the on-disk cache) the tokenizer a GGUF's metadata describes."""
        vocab = _read_vocab(metadata)
        return cls(vocab, _load_or_build(vocab))

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
            if token_id is not None and token_id in self._special_ids:
                ids.add(token_id)
        return frozenset(ids)

    @property
    def special_ids(self) -> frozenset[int]:
        """CONTROL tokens: BOS/EOS, turn markers, padding, unused slots."""
        return self._special_ids

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
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self._vocab.bos_id)
            if self._vocab.add_eos and self._vocab.eos_id is not None:
                ids.append(self._vocab.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        plain = [int(i) for i in ids]  # numpy/torch integers are not accepted by tokenizers
        self._check_ids(plain)
        return self._backend.decode(plain, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes `token_id` stands for; may be part of a UTF-8 character, so a streaming
        detokenizer concatenates these and decodes only complete characters."""
        self._check_ids((token_id,))
        return self._bytes_table[token_id]

    @cached_property
    def _bytes_table(self) -> list[bytes]:
        # Built on first use: streaming needs it, plain encode/decode does not.
        return _token_bytes_table(self._vocab)

    def _check_ids(self, ids: Iterable[int]) -> None:
        n = self.vocab_size
        for token_id in ids:
            if not 0 <= token_id < n:
                raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{n - 1})")

    def __repr__(self) -> str:
        return f"Tokenizer(model={self._vocab.model!r}, vocab_size={self.vocab_size})"
