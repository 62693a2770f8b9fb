"""Hugging Face `tokenizers` backends rebuilt from GGUF metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the vocabulary, token
types, and either BPE merges (byte-level "gpt2" vocabularies) or per-token scores
(SentencePiece "llama" vocabularies). We rebuild the same tokenizer transformers builds from
the same file, so token ids agree with the Hugging Face reference:

* gpt2: byte-level BPE split as the file's `tokenizer.ggml.pre` names (pretokenize.py), the
  file's merges as given. edgellm encodes these with its own encoder (bytelevel.py).
* llama: SentencePiece-style BPE with byte fallback and no prefix space (Gemma's kind; files
  that ask for a prefix space are refused for now). The file has no merges, so they are
  derived from the vocabulary (every split of a token into two vocabulary pieces), ranked by
  token position (Gemma) or score. edgellm encodes these with its own compact encoder
  (sentencepiece.py).

Both builds serve model export (tokenizer.json) and are the tests' second opinion; they need the
`tokenizers` library of the tools extra.

CONTROL tokens become special added tokens and USER_DEFINED ones plain added tokens, so their
text in the input maps to the single token, as llama.cpp does.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from edgellm.extras import ToolsNeeded

try:  # the tools extra's
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE
except ModuleNotFoundError as e:
    raise ToolsNeeded(e.name or "tokenizers") from None

from edgellm.errors import TokenizerError
from edgellm.tokenizer.pretokenize import PreTokenizer, pre_tokenizer
from edgellm.tokenizer.spelling import (SPIECE_SPACE, byte_level_spelling, check_sentencepiece, in_byte_alphabet,
                                        merge_ranks, spell_piece)
from edgellm.tokenizer.vocab import TokenType, Vocab


def build_hf(vocab: Vocab) -> Backend:
    """The `tokenizers` build of `vocab`."""
    if vocab.model == "gpt2":
        return _build_byte_level(vocab)
    return build_sentencepiece_hf(vocab)


# -- byte-level ("gpt2") vocabularies ---------------------------------------------------------


def _build_byte_level(vocab: Vocab) -> Backend:
    split = pre_tokenizer(vocab.pre)
    spelled = {byte_level_spelling(t): i for i, t in enumerate(vocab.tokens)}
    merges = [_split_merge(m) for m in vocab.merges or ()]
    backend = Backend(BPE(vocab=spelled, merges=merges, fuse_unk=False, ignore_merges=split.ignore_merges))
    backend.pre_tokenizer = _hf_pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()
    # A CONTROL token outside the byte alphabet is a mislabelled ordinary token in these files.
    _add_added_tokens(backend, vocab, spelled, special_ok=in_byte_alphabet)
    return backend


def _hf_pre_tokenizer(split: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split.regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise TokenizerError(f"malformed merge {merge!r} (expected 'left right')")
    return left, right


# -- SentencePiece ("llama") vocabularies -----------------------------------------------------


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
