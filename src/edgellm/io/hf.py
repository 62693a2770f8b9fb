"""Hugging Face model folders: config.json + *.safetensors (sharded or not) + tokenizer files.

An HFFolder offers what a GGUFFile offers (GGUF-style metadata, tensor infos under GGUF
names, raw bytes as zero-copy views), so everything above io/ runs it unchanged. Two
layout differences are bridged here: Llama q/k rows stay in HF's rotate-half order (the
metadata says so), and Gemma's norm weights, stored as w in HF but (1 + w) in GGUF, are
shifted on the way in."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgellm import families
from edgellm.extras import torch

from edgellm.errors import ModelFormatError, UnsupportedModel
from edgellm.io.gguf import TensorInfo
from edgellm.io.hf_names import gguf_name, metadata_from_config
from edgellm.io.safetensors import SafetensorsFile, torch_dtype

# Metadata flag: Llama q/k rows are in HF's order, not llama.cpp's interleaved one.
HF_QK_LAYOUT = "edgellm.hf_qk_layout"


def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


class HFFolder:
    """A memory-mapped Hugging Face checkpoint folder, seen through GGUF names."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = _read_json(self.path / "config.json")
        self.metadata: dict[str, Any] = metadata_from_config(self.config)
        self.metadata[HF_QK_LAYOUT] = True
        self.metadata.setdefault("general.name", self.path.name)
        self.arch = self.metadata["general.architecture"]
        self._files: list[SafetensorsFile] = []
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        self._shifted: dict[str, torch.Tensor] = {}
        try:
            self._map_shards()
        except BaseException:
            self.close()
            raise
        self.tensors = {name: self._info(name) for name in self._where}
        self.metadata |= _tokenizer_metadata(self.path)

    def _map_shards(self) -> None:
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise ModelFormatError(self.path, "no *.safetensors weights in the folder")
        for shard in shards:
            f = SafetensorsFile(shard)
            self._files.append(f)
            for hf in f.entries:
                name = gguf_name(self.arch, hf)
                if name is not None:
                    self._where[name] = (f, hf)
        if "token_embd.weight" not in self._where:
            raise ModelFormatError(self.path, "no embedding tensor (model.embed_tokens.weight)")

    def _info(self, name: str) -> TensorInfo:
        f, hf = self._where[name]
        info = f.entries[hf].as_float_info(name)
        if info is None:
            raise UnsupportedModel(f"{f.path}: tensor {hf!r} has dtype {f.entries[hf].dtype}; float weights expected")
        return info

    def raw(self, name: str) -> torch.Tensor:
        if families.get(self.arch).norms_plus_one and name.endswith("norm.weight"):
            return self._shifted_norm(name)
        f, hf = self._where[name]
        return f.raw(hf)

    def _shifted_norm(self, name: str) -> torch.Tensor:
        if name not in self._shifted:
            f, hf = self._where[name]
            w = f.tensor(hf).float() + 1.0
            self._shifted[name] = w.to(torch_dtype(f.entries[hf].dtype)).view(torch.uint8).reshape(-1)
        return self._shifted[name]

    def tokenizer_files(self) -> dict[str, Any]:
        """What tokenizer.load_tokenizer builds this folder's tokenizer from."""
        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise ModelFormatError(self.path, "no tokenizer.json in the folder")
        return {"tokenizer_json": path.read_text(encoding="utf-8"), "config": _tokenizer_config(self.path),
                "architecture": self.arch}

    def drop_pages(self, names: list[str] | None = None) -> None:
        if names is None:
            for f in self._files:
                f.drop_pages()
            return
        for name in names:
            f, hf = self._where[name]
            f.drop_pages([hf])

    @property
    def file_size(self) -> int:
        return sum(f.file_size for f in self._files)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> HFFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(path, "no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelFormatError(path, "expected a JSON object")
    return value


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    config = _read_json(path) if path.is_file() else {}
    generation = folder / "generation_config.json"
    if "eos_token" not in config and generation.is_file():
        config["eos_token_id"] = _read_json(generation).get("eos_token_id")
    return config


def _tokenizer_metadata(folder: Path) -> dict[str, Any]:
    """The chat template, from tokenizer_config.json or a chat_template.jinja beside it."""
    template = _tokenizer_config(folder).get("chat_template")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return {"tokenizer.chat_template": template} if isinstance(template, str) else {}
