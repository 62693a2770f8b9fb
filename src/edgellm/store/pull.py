"""`edgellm pull SOURCE`: a model into the store from an http(s) URL of a GGUF file, an
`hf://owner/repo/file.gguf[@revision]` path (through HF_ENDPOINT), an edgellm manifest URL
(`.json`: url, sha256, size, name, tag), a local file, or a built-in name."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote, urljoin, urlsplit

from edgellm.errors import InvalidRequest, ModelFormatError, ModelNotFound
from edgellm.registry import REGISTRY
from edgellm.store.describe import describe_gguf
from edgellm.store.fetch import Limits, UnsafeSource, check_url, download, fetch_small
from edgellm.store.refs import DEFAULT_TAG, Ref, check_digest, name_from_file, parse_ref
from edgellm.store.store import Manifest, Store, sha256_file

MANIFEST_LIMIT = 1 << 20  # bytes: a manifest is a few hundred
DEFAULT_MAX_BYTES = 256 << 30
HF_DEFAULT_ENDPOINT = "https://huggingface.co"

Progress = Callable[[str, int, "int | None"], None]  # (stage, done, total)


@dataclass(frozen=True)
class Source:
    kind: str  # "url", "file" or "builtin"
    location: str  # the URL, the file's path, or the built-in name
    name: str  # the store name it gets unless told another
    tag: str | None = None
    sha256: str | None = None
    size: int | None = None


def parse_source(text: str, timeout_s: float = 30.0) -> Source:
    if text in REGISTRY:
        return Source("builtin", text, text)
    scheme = urlsplit(text).scheme
    if scheme == "hf":
        return _hf_source(text)
    if scheme in ("http", "https"):
        if urlsplit(text).path.endswith(".json"):
            return _manifest_source(text, timeout_s)
        return Source("url", check_url(text), name_from_file(urlsplit(text).path))
    if scheme and len(scheme) > 1:  # file://, ftp://, ... (a one-letter scheme is a Windows drive)
        raise UnsafeSource(f"refusing {text[:200]!r}: pull takes http(s):// and hf:// URLs, paths and built-in names")
    path = Path(text).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"{text!r} is no file, URL or built-in name ({', '.join(REGISTRY)})")
    return Source("file", str(path.resolve()), name_from_file(path.name))


def _hf_source(text: str) -> Source:
    """hf://owner/repo/path/in/repo.gguf[@revision] -> the endpoint's resolve URL."""
    body, _, revision = text.removeprefix("hf://").partition("@")
    parts = body.split("/")
    if len(parts) < 3 or any(p in ("", ".", "..") for p in parts):
        raise InvalidRequest(f"{text!r}: expected hf://owner/repo/file.gguf[@revision]")
    endpoint = os.environ.get("HF_ENDPOINT", HF_DEFAULT_ENDPOINT).rstrip("/")
    url = f"{endpoint}/{quote(parts[0])}/{quote(parts[1])}/resolve/{quote(revision or 'main', safe='')}/" \
          + "/".join(quote(p) for p in parts[2:])
    return Source("url", check_url(url), name_from_file(parts[-1]))


def _manifest_source(url: str, timeout_s: float) -> Source:
    try:
        data = json.loads(fetch_small(url, MANIFEST_LIMIT, timeout_s))
    except ValueError:
        raise UnsafeSource(f"{url}: not a JSON manifest") from None
    if not isinstance(data, dict) or not isinstance(data.get("url"), str):
        raise UnsafeSource(f"{url}: a manifest needs at least \"url\" and \"sha256\"")
    digest = check_digest(data.get("sha256"))
    size = data.get("size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise UnsafeSource(f"{url}: the manifest's size {size!r} is not a byte count")
    file_url = check_url(urljoin(url, data["url"]))
    name = data.get("name")
    ref = parse_ref(f"{name}:{data.get('tag') or DEFAULT_TAG}") if name is not None else None
    return Source("url", file_url, ref.name if ref else name_from_file(urlsplit(file_url).path),
                  ref.tag if ref else None, digest, size)


def pull(text: str, name: str | None = None, sha256: str | None = None, store: Store | None = None,
         progress: Progress = lambda stage, done, total: None, max_bytes: int = DEFAULT_MAX_BYTES,
         timeout_s: float = 30.0) -> Manifest:
    """Fetch `text` into the store under `name` (default: from the source) -> its manifest. A
    failed or refused pull changes nothing the store already held."""
    store = store or Store()
    source = parse_source(text, timeout_s)
    if source.kind == "builtin":
        return register_builtin(source.location, store, name)
    ref = parse_ref(name) if name else Ref(source.name, source.tag or DEFAULT_TAG)
    expected = _expected_digest(source.sha256, sha256)
    key = expected or hashlib.sha256(source.location.encode()).hexdigest()[:32]
    with store.locked(key) as partial:
        if expected is not None and source.size is not None and store.has_blob(expected, source.size):
            digest, size = expected, source.size
        else:
            if source.kind == "url":
                download(source.location, partial, Limits(max_bytes, timeout_s), source.size,
                         lambda done, total: progress("pulling", done, total))
            else:
                _copy(Path(source.location), partial, progress)
            total = partial.stat().st_size
            digest, size = store.add_blob(partial, expected, check=_check_gguf,
                                          progress=lambda done: progress("verifying", done, total))
    return _record(store, ref, digest, size, source.location)


def _expected_digest(from_source: str | None, given: str | None) -> str | None:
    given = check_digest(given) if given is not None else None
    if from_source and given and from_source != given:
        raise InvalidRequest(f"--sha256 {given} disagrees with the manifest's {from_source}")
    return given or from_source


def _check_gguf(path: Path) -> None:
    try:
        describe_gguf(path)
    except ModelFormatError as e:
        raise ModelFormatError(e.path, f"{e.problem}; nothing was stored") from None


def _copy(src: Path, dst: Path, progress: Progress) -> None:
    total, done = src.stat().st_size, 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(1 << 22):
            fout.write(block)
            done += len(block)
            progress("copying", done, total)


def _record(store: Store, ref: Ref, digest: str, size: int, source: str, path: str | None = None) -> Manifest:
    file = Path(path) if path else store.blob_path(digest)
    replaced = store.get(ref)
    manifest = Manifest(ref.name, ref.tag, digest, size, source, path=path, **describe_gguf(file))
    if replaced is not None:
        manifest.created, manifest.last_used = replaced.created, replaced.last_used
    store.put(manifest)
    if replaced is not None and replaced.sha256 != digest:
        store.collect_garbage()
    return manifest


def register_builtin(builtin: str, store: Store | None = None, name: str | None = None) -> Manifest:
    """List a built-in model under its name (or `name`) by reference to its wheel's file: hashed
    once, again only when that file changes."""
    store = store or Store()
    path = REGISTRY[builtin].locate()
    ref = parse_ref(name) if name else Ref(builtin)
    known = store.get(ref)
    if known is not None and known.path is None and name is None:
        return known  # a model the user pulled under the built-in's name stays theirs
    stat = path.stat()
    if known is not None and known.path == str(path) and known.size == stat.st_size and known.created >= stat.st_mtime:
        return known
    return _record(store, ref, sha256_file(path), stat.st_size, f"builtin:{builtin}", path=str(path))


def register_builtins(store: Store | None = None) -> list[Manifest]:
    """Every installed built-in model, listed (those whose wheel is missing are left out)."""
    found = []
    for builtin in REGISTRY:
        try:
            found.append(register_builtin(builtin, store))
        except ModelNotFound:
            continue
    return found
