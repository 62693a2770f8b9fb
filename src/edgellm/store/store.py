"""The local model store: content-addressed blobs (`blobs/sha256-<hex>`, read-only) and one small
JSON manifest per `name:tag` (`manifests/<name>/<tag>.json`). A blob enters under its digest only
after its size and digest were checked, a manifest only after its blob; both by write-then-rename,
so the store never shows half a file under a real name. Built-in models are listed by reference to
the file their wheel installed."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from edgellm.atomic import atomic_path
from edgellm.errors import EdgeLLMError, ModelNotFound, StoreError
from edgellm.registry import cache_dir
from edgellm.store.refs import Ref, check_digest, parse_ref

SCHEMA = 1
HASH_CHUNK = 1 << 22


class DigestMismatch(StoreError):
    """Bytes whose SHA-256 is not the one expected: nothing was stored."""


def store_root() -> Path:
    """EDGELLM_HOME, else `models/` in edgellm's cache directory."""
    home = os.environ.get("EDGELLM_HOME")
    return Path(home).expanduser() if home else cache_dir() / "models"


def sha256_file(path: Path, progress: Callable[[int], None] = lambda done: None) -> str:
    digest, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            digest.update(block)
            done += len(block)
            progress(done)
    return digest.hexdigest()


@dataclass
class Manifest:
    name: str
    tag: str
    sha256: str
    size: int
    source: str
    family: str = ""
    quantization: str = ""
    tokenizer: str = ""
    chat_template: bool = False
    context_length: int = 0
    created: float = field(default_factory=time.time)
    last_used: float | None = None
    path: str | None = None  # a built-in model's file, outside the store; else the blob
    schema: int = SCHEMA

    @property
    def ref(self) -> Ref:
        return Ref(self.name, self.tag)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: Path) -> "Manifest":
        try:
            fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            manifest = cls(**fields)
            check_digest(manifest.sha256)
            parse_ref(f"{manifest.name}:{manifest.tag}")
        except (TypeError, KeyError, EdgeLLMError) as e:
            raise StoreError(f"{where}: not a store manifest ({e})") from None
        return manifest


class Store:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else store_root()
        self.blobs, self.manifests, self.partial = self.root / "blobs", self.root / "manifests", self.root / "partial"

    # -- blobs -----------------------------------------------------------------------------

    def blob_path(self, sha256: str) -> Path:
        return self.blobs / f"sha256-{check_digest(sha256)}"

    def has_blob(self, sha256: str, size: int) -> bool:
        path = self.blob_path(sha256)
        return path.is_file() and path.stat().st_size == size

    def add_blob(self, candidate: Path, expected: str | None = None, check: Callable[[Path], object] = lambda p: None,
                 progress: Callable[[int], None] = lambda done: None) -> tuple[str, int]:
        """Move a fully written `candidate` into the store under its SHA-256 -> (digest, size), once
        it is `expected` (when given) and passes `check`; else DigestMismatch or check's error, and
        the candidate goes."""
        try:
            size = candidate.stat().st_size
            actual = sha256_file(candidate, progress)
            if expected is not None and actual != check_digest(expected):
                raise DigestMismatch(f"the bytes' sha256 is {actual}, expected {expected}; nothing was stored")
            check(candidate)
        except BaseException:
            candidate.unlink(missing_ok=True)
            raise
        self.blobs.mkdir(parents=True, exist_ok=True)
        if self.has_blob(actual, size):
            candidate.unlink()
        else:
            os.chmod(candidate, 0o444)
            os.replace(candidate, self.blob_path(actual))
        return actual, size

    @contextmanager
    def locked(self, key: str) -> Iterator[Path]:
        """An exclusive lock (across processes) on one download, and its partial file's path."""
        self.partial.mkdir(parents=True, exist_ok=True)
        with open(self.partial / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self.partial / f"{key}.part"
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- manifests -------------------------------------------------------------------------

    def _manifest_path(self, ref: Ref) -> Path:
        return self.manifests / ref.name / f"{ref.tag}.json"

    def get(self, ref: Ref) -> Manifest | None:
        path = self._manifest_path(ref)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise StoreError(f"{path}: unreadable manifest ({e})") from None
        manifest = Manifest.from_dict(data, path)
        if manifest.ref != ref:
            raise StoreError(f"{path}: the manifest names {manifest.ref}, not {ref}")
        return manifest

    def put(self, manifest: Manifest) -> None:
        if manifest.path is None and not self.has_blob(manifest.sha256, manifest.size):
            raise StoreError(f"{manifest.ref}: its blob sha256-{manifest.sha256} is not in the store")
        with atomic_path(self._manifest_path(manifest.ref)) as tmp:
            tmp.write_text(json.dumps(manifest.as_dict(), indent=1))

    def all(self) -> list[Manifest]:
        found = []
        for path in sorted(self.manifests.glob("*/*.json")):
            try:
                found.append(self.get(Ref(path.parent.name, path.stem)))
            except StoreError:
                continue  # `verify` reports it
        return found

    def file_of(self, manifest: Manifest) -> Path:
        return Path(manifest.path) if manifest.path else self.blob_path(manifest.sha256)

    def touch(self, manifest: Manifest) -> None:
        manifest.last_used = time.time()
        try:
            self.put(manifest)
        except (OSError, StoreError):
            pass  # a read-only store still serves its models

    def remove(self, ref: Ref) -> list[Path]:
        """Forget `ref`; returns the blobs that went with it (those no other tag uses)."""
        manifest = self.get(ref)
        if manifest is None:
            raise ModelNotFound(f"no model {ref} in the store ({self.root})")
        self._manifest_path(ref).unlink()
        try:
            self._manifest_path(ref).parent.rmdir()
        except OSError:
            pass  # other tags remain
        return self.collect_garbage()

    def collect_garbage(self) -> list[Path]:
        used = {f"sha256-{m.sha256}" for m in self.all() if m.path is None}
        doomed = [p for p in self.blobs.glob("sha256-*") if p.name not in used]
        for path in doomed:
            path.unlink(missing_ok=True)
        return doomed

    def verify(self, progress: Callable[[str], None] = lambda line: None) -> list[tuple[Ref, str]]:
        """Re-hash every model's file: (ref, problem) for each that is not what its manifest says."""
        problems = []
        for manifest in self.all():
            path = self.file_of(manifest)
            progress(f"verifying {manifest.ref} ({path.name}) ...")
            if not path.is_file():
                problems.append((manifest.ref, f"{path} is missing"))
            elif path.stat().st_size != manifest.size:
                problems.append((manifest.ref, f"{path} has {path.stat().st_size} bytes, not {manifest.size}"))
            elif (actual := sha256_file(path)) != manifest.sha256:
                problems.append((manifest.ref, f"{path} has sha256 {actual}, not {manifest.sha256}"))
        return problems
