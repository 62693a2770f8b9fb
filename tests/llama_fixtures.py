"""llama.cpp's own fixtures, without a model download: the llama-cpp-python 0.3.36 source
distribution (MIT) carries vocab-only GGUFs of real tokenizers with test strings and the ids
they must give (`models/ggml-vocab-*.gguf` + `.inp` / `.out`) and ~70 real chat templates
(`models/templates/*.jinja`), and llama.cpp's own converter (`convert_hf_to_gguf.py` with its
`conversion/` package and `gguf-py`). Fetched with pip once, unpacked into edgellm's cache;
nothing of it is copied into the repository."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

from edgellm.atomic import atomic_path
from edgellm.registry import cache_dir

SDIST = "llama-cpp-python==0.3.36"
_VENDOR = "vendor/llama.cpp/"
_MODELS = _VENDOR + "models/"
_ROOT = ("fixtures", "llama-cpp-python-0.3.36")


def models_dir() -> Path:
    """The unpacked `models/` folder (vocab GGUFs, their test vectors, templates/)."""
    root = cache_dir().joinpath(*_ROOT)
    if not (root / "complete").exists():
        _unpack(_sdist(), root / "models", _MODELS, _is_model_fixture, root / "complete")
    return root / "models"


@lru_cache(maxsize=None)
def transformers_tokenizer(name: str):
    """transformers' rebuild of the tokenizer in `ggml-vocab-{name}.gguf` (~20 s for a 150k-token
    vocabulary): built once a session for every module that compares with it or saves it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(models_dir()), gguf_file=f"ggml-vocab-{name}.gguf")


def converter_script() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`, beside the `conversion/` and `gguf-py/` it imports."""
    root = cache_dir().joinpath(*_ROOT, "converter")
    if not (root / "complete").exists():
        _unpack(_sdist(), root, _VENDOR, _is_converter_file, root / "complete")
    return root / "convert_hf_to_gguf.py"


def lora_converter_script() -> Path:
    """llama.cpp's `convert_lora_to_gguf.py` (PEFT folder -> GGUF LoRA), beside the HF converter."""
    script = converter_script().parent / "convert_lora_to_gguf.py"
    marker = script.parent / "complete-lora"
    if not marker.exists():
        _unpack(_sdist(), script.parent, _VENDOR, lambda inner: inner == _VENDOR + "convert_lora_to_gguf.py", marker)
    return script


def _is_model_fixture(inner: str) -> bool:
    return inner.startswith(_MODELS) and ("ggml-vocab-" in inner or inner.startswith(_MODELS + "templates/"))


def _is_converter_file(inner: str) -> bool:
    return inner == _VENDOR + "convert_hf_to_gguf.py" or inner.startswith(
        (_VENDOR + "conversion/", _VENDOR + "gguf-py/gguf/"))


def _sdist() -> Path:
    local = os.environ.get("EDGELLM_LLAMA_SDIST")  # a copy already on disk (offline machines)
    if local:
        return Path(local)
    out = Path(tempfile.mkdtemp(prefix="edgellm-sdist-"))
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                          SDIST, "-d", str(out)], capture_output=True, text=True, timeout=600)
    found = list(out.glob("*.tar.gz"))
    if run.returncode != 0 or not found:
        why = f"cannot fetch {SDIST} with pip: {run.stderr.strip().splitlines()[-1:] or run.returncode}"
        if os.environ.get("CI"):  # CI has the package index: a missing fixture is a failure there
            pytest.fail(why)
        pytest.skip(why)
    return found[0]


def _unpack(sdist: Path, into: Path, prefix: str, wanted, marker: Path) -> None:
    """Members of the sdist whose path (below its top folder) passes `wanted`, written under
    `into` without `prefix`; `marker` last, so an interrupted unpack starts again."""
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            _, _, inner = member.name.partition("/")
            if member.isfile() and wanted(inner):
                target = into / inner[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(target) as tmp:
                    tmp.write_bytes(tar.extractfile(member).read())
    marker.touch()


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs of one vocab fixture, as llama.cpp's test-tokenizer-0 reads them."""
    base = models_dir() / f"ggml-vocab-{name}.gguf"
    texts = base.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = base.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]
