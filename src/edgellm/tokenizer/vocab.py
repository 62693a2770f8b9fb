"""The tokenizer part of a GGUF's metadata, read and checked."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from enum import IntEnum
from typing import Any

import numpy as np

from edgellm.errors import TokenizerError
from edgellm.io.strings import StringArray

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
    types: np.ndarray  # int32, one TokenType per token
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
        return frozenset(np.flatnonzero(np.asarray(self.types) == TokenType.CONTROL).tolist())


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
    types = np.full(n, TokenType.NORMAL, np.int32) if types is None else types.astype(np.int32)
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


