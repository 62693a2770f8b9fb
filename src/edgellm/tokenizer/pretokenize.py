"""How byte-level BPE vocabularies split text before merging, by the GGUF's `tokenizer.ggml.pre`.

Each entry is the ordered list of regexes the model's own tokenizer applies (each one splits the
pieces the previous ones left, matches and gaps both kept: `Split(..., "isolated")`), then the
GPT-2 byte mapping. The regexes are those of the models' tokenizer.json files as llama.cpp
records them (src/llama-vocab.cpp); `ignore_merges` marks vocabularies whose whole pieces are
looked up before any merge (Llama 3's tokenizer.json says so).

edgellm runs them on Python's `re`, with the Unicode classes spelled out as the reference
tokenizer sees them (unicode_classes.py), so a split never depends on the Python's Unicode
version."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from edgellm.errors import TokenizerError
from edgellm.tokenizer import unicode_classes

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False


_FAMILIES = {
    "gpt2": PreTokenizer((_GPT2,)),
    "digits": PreTokenizer((r"\p{N}", _GPT2)),  # StarCoder, SmolLM, Command R: every digit its own piece
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "qwen2": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,)),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
}

# tokenizer.ggml.pre -> family: the names llama.cpp gives these splits (each checked against its
# vocab fixture where llama.cpp ships one: tests/test_vocab_fixtures.py). "default" (and a missing
# name) keeps GPT-2's split, as files without a pre name were tokenized.
_NAMES = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2",
    "starcoder": "digits", "refact": "digits", "command-r": "digits", "smollm": "digits",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
    "qwen35": "qwen35",
    "falcon": "falcon",
    "deepseek-coder": "deepseek-coder",
}

SUPPORTED = tuple(sorted(_NAMES))


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The split a vocabulary's `tokenizer.ggml.pre` names; TokenizerError for one not known here."""
    family = _NAMES.get(name or "default")
    if family is None:
        raise TokenizerError(f"unsupported byte-level pre-tokenizer {name!r} (supported: {', '.join(SUPPORTED)})")
    return _FAMILIES[family]


# -- the regexes on Python's re -----------------------------------------------------------------

_ESCAPES = {"p{L}": "LETTER", "p{N}": "NUMBER", "p{M}": "MARK", "p{P}": "PUNCTUATION", "s": "SPACE"}
_ESCAPE = re.compile(r"\\(p\{[LNMP]\}|s|S)|\\.|\[\^?|\]|[^\\\[\]]+")


@lru_cache(maxsize=None)
def compile_split(pattern: str) -> re.Pattern:
    """`pattern` (Oniguruma syntax, as tokenizer.json has it) for Python's re: \\p{L}, \\p{N},
    \\p{M}, \\p{P}, \\s and \\S become the reference's ranges, inside a [...] class or as one."""
    out, in_class = [], False
    for token in _ESCAPE.finditer(pattern):
        text, escape = token.group(0), token.group(1)
        if escape == "S":
            if in_class:
                raise TokenizerError(f"\\S inside a character class is not supported: {pattern!r}")
            out.append(f"[^{_class_ranges('SPACE')}]")
        elif escape:
            ranges = _class_ranges(_ESCAPES[escape])
            out.append(ranges if in_class else f"[{ranges}]")
        else:
            in_class = text.startswith("[") or (in_class and text != "]")
            out.append(text)
    return re.compile("".join(out))


@lru_cache(maxsize=None)
def _class_ranges(name: str) -> str:
    """A class's ranges as re writes them inside brackets: \\uXXXX-\\uYYYY ..."""
    def char(hex_point: str) -> str:
        return f"\\U{int(hex_point, 16):08X}"

    parts = getattr(unicode_classes, name).split()
    return "".join("-".join(char(p) for p in part.split("-")) for part in parts)
