from __future__ import annotations

from pathlib import Path

import pytest

from edgellm.store import Store
from tests.store.server import FileServer
from tests.tiny import random_weights, write_gguf


@pytest.fixture
def server():
    s = FileServer()
    yield s
    s.close()


@pytest.fixture
def store(tmp_path, monkeypatch) -> Store:
    """An empty store of the test's own (EDGELLM_HOME), which every command then uses."""
    root = tmp_path / "home"
    monkeypatch.setenv("EDGELLM_HOME", str(root))
    return Store(root)


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory) -> list[Path]:
    """Two small, different, valid GGUF models (a few hundred KB each)."""
    folder = tmp_path_factory.mktemp("ggufs")
    return [write_gguf(folder / f"tiny-{seed}.gguf", "llama", random_weights("llama", seed=seed), tokenizer="llama") for seed in (1, 2)]
