"""The tokenizer part of a GGUF's metadata, read and checked."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from enum import IntEnum
from typing import Any

import numpy as np

from edgellm.errors import TokenizerError
from edgellm.formats.strings import StringArray

# Bump whenever the way a tokenizer is built changes, so stale cached builds are ignored.
BUILD_VERSION = 2

class TokenType(IntEnum):
    """llama.cpp's tokenizer.ggml.token_type values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class Vocab:
    """The tokenizer part of a GGUF's metadata, checked."""

    model: str
    pre: str
    architecture: str
    tokens: Sequence[str]  # a list, or the GGUF reader's compact StringArray
    types: list[int]
    scores: np.ndarray | None
    merges: Sequence[str] | None
    add_space_prefix: bool
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool

    @cached_property
    def control_ids(self) -> frozenset[int]:
        """CONTROL tokens: BOS/EOS, turn markers, padding, unused slots."""
        return frozenset(i for i, kind in enumerate(self.types) if kind == TokenType.CONTROL)

    def cache_key(self) -> str:
        digest = hashlib.sha256()
        header = (BUILD_VERSION, self.model, self.pre, self.architecture, self.add_space_prefix, self.unk_id)
        digest.update(repr(header).encode())
        # NUL cannot occur inside a GGUF string used as a token, so joining is unambiguous.
        digest.update(_strings_key(self.tokens, "\0"))
        digest.update(np.asarray(self.types, dtype="<i4").tobytes())
        if self.scores is not None:
            digest.update(np.ascontiguousarray(self.scores, dtype="<f4").tobytes())
        if self.merges is not None:
            digest.update(_strings_key(self.merges, "\n"))
        return digest.hexdigest()[:32]


def _strings_key(strings: Sequence[str], separator: str) -> bytes:
    # A StringArray identifies itself without decoding its strings (the GGUF reader's form of
    # every long list); a plain list is joined.
    if isinstance(strings, StringArray):
        return strings.fingerprint()
    return separator.join(strings).encode("utf-8", "surrogatepass")


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


def _strings(value: Any) -> bool:
    """A list of str, or the GGUF reader's compact StringArray (checked UTF-8 when read)."""
    return isinstance(value, StringArray) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def read_vocab(metadata: Mapping[str, Any]) -> Vocab:
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise TokenizerError(f"unsupported tokenizer model {model!r} (supported: 'gpt2', 'llama')")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not _strings(tokens) or not tokens:
        raise TokenizerError("tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    types = _numeric_array(metadata, "tokenizer.ggml.token_type", n)
    # Plain ints: the per-token loops below are several times slower over numpy scalars.
    types = [int(TokenType.NORMAL)] * n if types is None else types.astype(np.int64).tolist()
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None and not _strings(merges):
        raise TokenizerError("tokenizer.ggml.merges is not a list of strings")
    if model == "gpt2" and merges is None:
        raise TokenizerError("a 'gpt2' tokenizer needs tokenizer.ggml.merges")
    is_llama = model == "llama"
    return Vocab(
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


