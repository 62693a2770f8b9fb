"""What names a model in the store: `NAME[:TAG]` references and SHA-256 digests, checked before
any of them becomes part of a path (a name or digest a server sends is never trusted as one)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from edgellm.errors import InvalidRequest

DEFAULT_TAG = "latest"
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,79}")
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


class UnsafeReference(InvalidRequest):
    """A name, tag or digest that could not be one (a path, `..`, a wrong length)."""


@dataclass(frozen=True, order=True)
class Ref:
    name: str
    tag: str = DEFAULT_TAG

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}"


def parse_ref(text: str) -> Ref:
    """`name` or `name:tag` -> Ref; names are lower-case letters, digits and `._-`, starting
    with a letter or digit, so no reference is ever a path."""
    name, _, tag = str(text).strip().partition(":")
    tag = tag or DEFAULT_TAG
    if not _NAME.fullmatch(name) or ".." in name:
        raise UnsafeReference(f"{text!r} is not a model name: use lower-case letters, digits and '._-' "
                              "(up to 80), starting with a letter or digit, and an optional ':tag'")
    if not _TAG.fullmatch(tag) or ".." in tag:
        raise UnsafeReference(f"{tag!r} is not a tag: letters, digits and '._-' (up to 64)")
    return Ref(name, tag)


def looks_like_ref(text: str) -> bool:
    try:
        parse_ref(text)
    except InvalidRequest:
        return False
    return True


def check_digest(value: object) -> str:
    """A SHA-256 as 64 hex digits (a `sha256:` prefix allowed) -> lower-case hex, or UnsafeReference."""
    text = value.strip().lower().removeprefix("sha256:") if isinstance(value, str) else ""
    if not _DIGEST.fullmatch(text):
        raise UnsafeReference(f"{str(value)[:80]!r} is not a SHA-256 digest (64 hex digits)")
    return text


def name_from_file(file_name: str) -> str:
    """A store name made from a downloaded file's name (`Qwen2.5-0.5B-Instruct-Q4_K_M.gguf` ->
    `qwen2.5-0.5b-instruct-q4_k_m`): only the characters a name may hold survive."""
    stem = file_name.rsplit("/", 1)[-1].removesuffix(".gguf").lower()
    cleaned = re.sub(r"[^a-z0-9._-]+", "-", stem).strip("-._")
    cleaned = re.sub(r"\.{2,}", ".", cleaned)[:80].strip("-._")
    return cleaned or "model"
