"""`edgellm quantize SRC OUT --recipe R [--calibrate FILE]`: a float model (HF folder or GGUF)
in, an edgellm quantized file out, its quality measured against the source right after.

The pipeline: read every tensor as fp32 (GGUF layout) -> optional AWQ scaling from
calibration text -> each 2-D weight quantized by the recipe's scheme for it (vectors stay
fp32, unmatched weights bf16) -> written atomically with the tokenizer, recipe and source
hash -> evaluated (tools/evaluate.py) on held-out text."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from edgellm.tokenizer.chat.template import ChatTemplate
from edgellm.tools.convert import float_tensor
from edgellm.errors import InvalidRequest
from edgellm.io import open_model
from edgellm.io.hf_names import hf_name
from edgellm.io.quantized import QuantizedModel, save_quantized
from edgellm.quant.recipes import Recipe, fit_group
from edgellm.quant.schemes import FLOAT_SCHEMES, Scheme, quantize
from edgellm.store import resolve
from edgellm.tokenizer.load import load_tokenizer

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass
class QuantizeResult:
    path: Path
    recipe: str
    file_bytes: int
    schemes: dict[str, int]  # scheme name -> weight count
    regrouped: list[str] = field(default_factory=list)  # weights whose K forced a smaller group
    awq_error_ratio: float | None = None  # mean calibration error after / before AWQ

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "recipe": self.recipe, "file_bytes": self.file_bytes,
                "schemes": self.schemes, "regrouped": self.regrouped, "awq_error_ratio": self.awq_error_ratio}


def quantize_model(src: str | Path, out: str | Path, recipe: str, calibrate: str | None = None,
                   progress: Progress | None = None) -> QuantizeResult:
    """Quantize `src` into `out` by `recipe` ('int8', 'mixed', or rules; see quant/recipes.py).
    `calibrate`: text for AWQ scaling of the 4-bit weights."""
    try:
        rules = Recipe.parse(recipe)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if calibrate is not None and not Path(calibrate).is_file():
        raise InvalidRequest(f"calibration text {calibrate} does not exist")
    path = resolve(src)
    with open_model(path) as source:
        meta = source.metadata
        arch, tied = meta["general.architecture"], "output.weight" not in source.tensors
        n_layers = int(meta[f"{arch}.block_count"])
        names = list(source.tensors)
        floats = {}
        for i, name in enumerate(names):
            floats[name] = float_tensor(source, name)
            _report(progress, "read", i + 1, len(names))
        tokenizer = load_tokenizer(source)
        template = ChatTemplate.from_metadata(meta, tokenizer)
        model_meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")}
        # A GGUF's SentencePiece vocabulary travels as it is: the file then loads edgellm's
        # compact encoder rather than tokenizer.json in the tokenizers library.
        gguf_vocab = ({k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}
                      if meta.get("tokenizer.ggml.model") == "llama" else None)

    regrouped: list[str] = []

    def scheme_of(name: str) -> Scheme | None:
        w = floats[name]
        chosen = rules.scheme_for(name, hf_name(arch, name), n_layers, tied) if w.dim() == 2 else None
        if chosen is None or chosen.kind == "float":
            return chosen
        fitted = fit_group(chosen, w.shape[1])
        if fitted != chosen and name not in regrouped:
            regrouped.append(name)
        return fitted

    awq_ratio = None
    if calibrate is not None:
        awq_ratio = _calibrate(path, floats, calibrate, scheme_of, progress)
    quantized, kept = {}, {}
    for i, name in enumerate(names):
        scheme = scheme_of(name)
        if scheme is None or scheme.kind == "float":
            dtype = getattr(torch, FLOAT_SCHEMES[scheme.dtype]) if scheme else (torch.float32 if floats[name].dim() == 1 else torch.bfloat16)
            kept[name] = floats[name].to(dtype)
        else:
            quantized[name] = quantize(floats[name], scheme)
        _report(progress, "quantize", i + 1, len(names))
    from edgellm.tokenizer.hf import to_hf

    tokenizer_json, tokenizer_config = to_hf(tokenizer, template.source)
    model = QuantizedModel(model_meta, kept, quantized, tokenizer_json, tokenizer_config, rules.text, _sha256(path),
                           gguf_vocab)
    size = save_quantized(model, out)
    counts: dict[str, int] = {}
    for name in names:
        label = quantized[name].scheme.name if name in quantized else str(kept[name].dtype).removeprefix("torch.")
        counts[label] = counts.get(label, 0) + 1
    return QuantizeResult(Path(out), rules.text, size, counts, regrouped, awq_ratio)


def _calibrate(path: Path, floats: dict[str, torch.Tensor], text_file: str, scheme_of, progress) -> float:
    from edgellm.api.loader import load
    from edgellm.quant.awq import MAX_ROWS, apply_awq, capture_inputs

    text = Path(text_file).read_text(encoding="utf-8")
    model = load(path, mode="exact")
    try:
        ids = model.tokenizer.encode(text)[:MAX_ROWS]
        captured = capture_inputs(model.net, lambda: model.logits(ids))
    finally:
        model.close()
    ratios = apply_awq(floats, captured, scheme_of, lambda d, t: _report(progress, "awq", d, t))
    return sum(ratios) / len(ratios) if ratios else 1.0


def _sha256(path: Path) -> str:
    """Of the file, or of a folder's files in name order."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for f in files:
        with open(f, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _report(progress: Progress | None, stage: str, done: int, total: int) -> None:
    if progress is not None:
        progress(stage, done, total)
