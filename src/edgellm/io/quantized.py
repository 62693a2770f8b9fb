"""edgellm's quantized model file: one safetensors file, memory-mapped, in kernel-ready form.

Tensors: float ones under their GGUF names (norms, anything a recipe kept float); each
quantized weight as `<name>.q`, `<name>.scale` and, for asymmetric INT4, `<name>.zero`
(see quant/schemes.py); the tokenizer as `__tokenizer__` (tokenizer.json's bytes).
Metadata (all strings): format + version, the model's GGUF-style metadata, each quantized
weight's scheme, the recipe, the source's SHA-256, the tokenizer config, and a SHA-256 of
all tensor contents that is checked on open — a damaged file is refused, never run.

Version 2 adds, for a GGUF source with a SentencePiece vocabulary (Gemma), that vocabulary
as the GGUF has it: its scalar `tokenizer.ggml.*` keys in the metadata and its tokens, types
and scores as `__vocab__.*` tensors. Such a file then loads edgellm's compact SentencePiece
encoder (~10 MB) instead of tokenizer.json in the `tokenizers` library (~90 MB for Gemma)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from edgellm.extras import torch

from edgellm.atomic import atomic_path
from edgellm.errors import ModelFormatError, TokenizerError, UnsupportedModel
from edgellm.io.safetensors import PAD_PREFIX, SafetensorsFile, write_safetensors
from edgellm.io.strings import StringArray, pack_strings
from edgellm.quant.schemes import QuantizedWeight, Scheme

FORMAT = "edgellm.quantized"
VERSION = 2
READABLE_VERSIONS = ("1", "2")  # 1: no __vocab__ tensors
TOKENIZER = "__tokenizer__"
VOCAB = "__vocab__."  # .text, .offsets (the tokens), .types, .scores
_VOCAB_ARRAYS = {"tokenizer.ggml.token_type": ("types", "int32"), "tokenizer.ggml.scores": ("scores", "float32")}
_PARTS = ("q", "scale", "zero")


@dataclass(frozen=True)
class QuantInfo:
    """A quantized weight's entry in `tensors` (what describe() and the planner read)."""

    name: str
    shape: tuple[int, int]
    scheme: Scheme
    nbytes: int
    ggml_type: int = -1

    @property
    def type_name(self) -> str:
        return self.scheme.name

    @property
    def n_elements(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass
class QuantizedModel:
    """What the quantizer produces, before it is written."""

    metadata: dict[str, Any]  # GGUF-style model metadata
    floats: dict[str, torch.Tensor]  # GGUF name -> float tensor
    weights: dict[str, QuantizedWeight]  # GGUF name -> quantized weight
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    recipe: str
    source_sha256: str
    gguf_vocab: dict[str, Any] | None = None  # a GGUF's tokenizer.ggml.* keys (SentencePiece sources)


def is_quantized_file(path: str | Path) -> bool:
    """Whether `path` is a safetensors file whose metadata names our format."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= 100 * 2**20:
                return False
            header = json.loads(f.read(length))
    except (OSError, ValueError):
        return False
    return isinstance(header, dict) and (header.get("__metadata__") or {}).get("format") == FORMAT


def save_quantized(model: QuantizedModel, path: str | Path) -> int:
    """Write atomically (a failure never leaves a half file at `path`); returns its size."""
    tensors = dict(model.floats)
    for name, w in model.weights.items():
        tensors |= {f"{name}.{part}": t for part, t in zip(_PARTS, (w.q, w.scale, w.zero)) if t is not None}
    tensors[TOKENIZER] = torch.frombuffer(bytearray(model.tokenizer_json.encode("utf-8")), dtype=torch.uint8)
    vocab_tensors, vocab_scalars = _vocab_parts(model.gguf_vocab) if model.gguf_vocab else ({}, None)
    tensors = {k: v.contiguous() for k, v in (tensors | vocab_tensors).items()}
    metadata = {
        "format": FORMAT, "format_version": str(VERSION),
        "model": json.dumps(model.metadata), "recipe": model.recipe, "source_sha256": model.source_sha256,
        "weights": json.dumps({n: {"scheme": w.scheme.name, "shape": list(w.shape)} for n, w in model.weights.items()}),
        "tokenizer_config": json.dumps(model.tokenizer_config),
        **({"gguf_vocab": json.dumps(vocab_scalars)} if vocab_scalars is not None else {}),
        "content_sha256": _content_hash((k, v.view(torch.uint8).reshape(-1)) for k, v in sorted(tensors.items())),
    }
    path = Path(path)
    with atomic_path(path) as tmp:
        write_safetensors(str(tmp), tensors, metadata)
    return path.stat().st_size


def _vocab_parts(gguf_vocab: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A GGUF tokenizer's metadata as tensors (tokens, types, scores) and JSON-able scalars."""
    text, offsets = pack_strings(gguf_vocab["tokenizer.ggml.tokens"])
    tensors = {f"{VOCAB}text": torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8),
               f"{VOCAB}offsets": torch.from_numpy(offsets)}
    for key, (part, dtype) in _VOCAB_ARRAYS.items():
        if gguf_vocab.get(key) is not None:
            tensors[f"{VOCAB}{part}"] = torch.as_tensor(np.asarray(gguf_vocab[key])).to(getattr(torch, dtype))
    scalars = {k: v.item() if isinstance(v, np.generic) else v for k, v in gguf_vocab.items()
               if isinstance(v, (str, bool, int, float, np.generic))}
    return tensors, scalars


def _content_hash(items) -> str:
    digest = hashlib.sha256()
    for name, raw in items:
        digest.update(f"{name}:{raw.numel()}|".encode())
        if raw.numel():
            digest.update(memoryview(raw.numpy()))
    return digest.hexdigest()


class QuantizedFile:
    """A mapped, verified edgellm quantized file, offering what GGUFFile offers plus quantized()."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        self._file = SafetensorsFile(self.path)
        try:
            self._read_header()
            if verify:
                self.verify()
        except BaseException:
            self._file.close()
            raise

    def _fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def _read_header(self) -> None:
        meta = self._file.metadata
        if meta.get("format") != FORMAT:
            raise self._fail("not an edgellm quantized file")
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise UnsupportedModel(f"{self.path}: quantized format version {meta.get('format_version')!r} "
                                   f"is not one this edgellm reads ({', '.join(READABLE_VERSIONS)})")
        try:
            self.metadata = json.loads(meta["model"])
            weights = json.loads(meta["weights"])
            self.tokenizer_config = json.loads(meta["tokenizer_config"])
            self.recipe, self.source_sha256 = meta["recipe"], meta["source_sha256"]
            self._gguf_vocab = json.loads(meta["gguf_vocab"]) if "gguf_vocab" in meta else None
        except (KeyError, json.JSONDecodeError) as e:
            raise self._fail(f"damaged metadata ({e})") from None
        self._weights = {name: self._weight_info(name, spec) for name, spec in weights.items()}
        self.tensors: dict[str, Any] = dict(self._weights)
        for name, e in self._file.entries.items():
            if name != TOKENIZER and not name.startswith((PAD_PREFIX, VOCAB)) and name.rsplit(".", 1)[0] not in self._weights:
                info = e.as_float_info(name)
                if info is None:
                    raise self._fail(f"tensor {name!r} has dtype {e.dtype}, neither float nor a quantized part")
                self.tensors[name] = info

    def _weight_info(self, name: str, spec: Mapping[str, Any]) -> QuantInfo:
        try:
            scheme = Scheme.parse(spec["scheme"])
        except ValueError as e:
            raise UnsupportedModel(f"{self.path}: weight {name!r}: {e}") from None
        needed = ["q", "scale"] + ([] if scheme.kind == "int8" or scheme.symmetric else ["zero"])
        missing = [p for p in needed if f"{name}.{p}" not in self._file.entries]
        if missing:
            raise self._fail(f"weight {name!r} lacks {', '.join(missing)}")
        nbytes = sum(self._file.entries[f"{name}.{p}"].nbytes for p in needed)
        return QuantInfo(name, tuple(spec["shape"]), scheme, nbytes)

    def verify(self) -> None:
        """Recompute the content hash; raise ModelFormatError if anything changed."""
        entries = sorted(n for n in self._file.entries if not n.startswith(PAD_PREFIX))
        actual = _content_hash((name, self._file.raw(name)) for name in entries)
        if actual != self._file.metadata.get("content_sha256"):
            raise self._fail("content hash mismatch: the file is damaged or was modified")

    def quantized(self, name: str) -> QuantizedWeight | None:
        info = self._weights.get(name)
        if info is None:
            return None
        part = lambda p: self._file.tensor(f"{name}.{p}") if f"{name}.{p}" in self._file.entries else None  # noqa: E731
        weight = QuantizedWeight(info.scheme, part("q"), part("scale"), part("zero"))
        if weight.shape != info.shape:
            raise self._fail(f"weight {name!r} has shape {weight.shape}, header says {info.shape}")
        return weight

    def raw(self, name: str) -> torch.Tensor:
        return self._file.raw(name)

    def tokenizer_files(self) -> dict[str, Any]:
        """What tokenizer.load_tokenizer builds this file's tokenizer from: the source GGUF's
        vocabulary, or the Hugging Face tokenizer.json it carries."""
        if self._gguf_vocab is not None:
            return {"gguf_metadata": self._gguf_vocab_metadata()}
        return {"tokenizer_json": bytes(self._file.raw(TOKENIZER).numpy()).decode("utf-8"),
                "config": self.tokenizer_config, "architecture": self.metadata.get("general.architecture", "")}

    @property
    def gguf_vocab(self) -> dict[str, Any] | None:
        """The source GGUF's scalar tokenizer.ggml.* keys, when the file carries its vocabulary."""
        return self._gguf_vocab

    def _gguf_vocab_metadata(self) -> dict[str, Any]:
        """The source GGUF's tokenizer metadata, rebuilt from this file (read_vocab checks it)."""
        try:
            tokens = StringArray.from_packed(bytes(self._file.raw(f"{VOCAB}text").numpy()),
                                             self._file.tensor(f"{VOCAB}offsets").numpy())
        except (KeyError, ValueError) as e:
            raise TokenizerError(f"{self.path}: damaged vocabulary ({e})") from None
        arrays = {key: self._file.tensor(f"{VOCAB}{part}").numpy() for key, (part, _) in _VOCAB_ARRAYS.items()
                  if f"{VOCAB}{part}" in self._file.entries}
        return {"general.architecture": self.metadata.get("general.architecture", ""), **self._gguf_vocab,
                "tokenizer.ggml.tokens": tokens, **arrays}

    def drop_pages(self, names: list[str] | None = None) -> None:
        if names is None:
            return self._file.drop_pages()
        # Only float tensors: int8 weights are used in place, straight from the mapping.
        self._file.drop_pages([n for n in names if n in self._file.entries])

    @property
    def file_size(self) -> int:
        return self._file.file_size

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> QuantizedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
