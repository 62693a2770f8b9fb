"""`edgellm convert MODEL --to hf OUT`: any model edgellm reads, written as a standard
Hugging Face folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) that transformers loads as is.

Quantized weights are dequantized; llama.cpp's interleaved Llama q/k rows go back to HF's
rotate-half order and Gemma's (1 + w) norms back to w, the inverse of what io/hf.py does."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from edgellm import families
from edgellm.tokenizer.chat.template import ChatTemplate
from edgellm.errors import InvalidRequest, UnsupportedModel
from edgellm.io import open_model
from edgellm.io.hf_names import config_from_metadata, hf_name, unpermute_rows
from edgellm.quant.ggml import dequantize
from edgellm.quant.schemes import FLOAT_SCHEMES
from edgellm.store import resolve
from edgellm.tokenizer.load import load_tokenizer

Progress = Callable[[str, int, int], None]  # (tensor name, index, total)


def float_tensor(source, name: str) -> torch.Tensor:
    """A source's tensor as fp32, in edgellm's (GGUF) layout, whatever its storage."""
    find = getattr(source, "quantized", None)
    weight = find(name) if find is not None else None
    if weight is not None:
        return weight.dequantize()
    info = source.tensors[name]
    return dequantize(source.raw(name), info.ggml_type, info.shape)


def to_hf_layout(source, name: str, w: torch.Tensor) -> torch.Tensor:
    """GGUF layout -> HF layout for one tensor."""
    meta = source.metadata
    arch = meta["general.architecture"]
    family = families.get(arch)
    if family.permuted_qk and not meta.get("edgellm.hf_qk_layout") and name.split(".")[-2] in ("attn_q", "attn_k"):
        heads = meta[f"{arch}.attention.head_count" + ("_kv" if "attn_k" in name else "")]
        head_dim = w.shape[0] // heads
        w = w[unpermute_rows(heads, head_dim)]
    if family.norms_plus_one and name.endswith("norm.weight"):
        w = w - 1.0
    return w


def convert_to_hf(model: str | Path, out_dir: str | Path, dtype: str = "bf16",
                  progress: Progress | None = None, adapter=None) -> Path:
    """Write `model` as an HF folder at out_dir (which must not exist or be empty); with a LoRA
    `adapter` (lora.Adapter, fp32) merged in: W + s B A for each projection it adapts."""
    if dtype not in FLOAT_SCHEMES:
        raise InvalidRequest(f"dtype must be one of {', '.join(FLOAT_SCHEMES)}, got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidRequest(f"{out} exists and is not an empty directory")
    with open_model(resolve(model)) as source:
        tensors = _hf_tensors(source, getattr(torch, FLOAT_SCHEMES[dtype]), progress, _merged(adapter))
        files = _hf_side_files(source, tensors, dtype)
    _write_folder(out, tensors, files)
    return out


def _merged(adapter) -> dict[str, torch.Tensor]:
    """HF tensor name -> s B A for each (layer, projection) the adapter changes."""
    from edgellm.lora.peft_io import HF_MODULES

    if adapter is None:
        return {}
    deltas = {}
    for (layer, part), pair in adapter.pairs.items():
        a, b_t = (torch.as_tensor(t) for t in pair.dense())
        deltas[f"model.layers.{layer}.{HF_MODULES[part]}.weight"] = adapter.scale * (b_t.T @ a)
    return deltas


def _hf_tensors(source, dtype: torch.dtype, progress: Progress | None,
                deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    arch = source.metadata["general.architecture"]
    if "rope_freqs.weight" in source.tensors:
        raise UnsupportedModel("models with RoPE frequency factors (Llama 3.1 scaling) cannot be written as HF yet")
    tensors, names = {}, list(source.tensors)
    for i, name in enumerate(names):
        hf = hf_name(arch, name)
        if hf is None:
            raise UnsupportedModel(f"tensor {name!r} has no Hugging Face counterpart")
        w = to_hf_layout(source, name, float_tensor(source, name))
        tensors[hf] = (w + deltas.pop(hf) if hf in deltas else w).to(dtype).contiguous()
        if progress is not None:
            progress(name, i + 1, len(names))
    if deltas:
        raise UnsupportedModel(f"the adapter changes tensors this model has not: {', '.join(sorted(deltas))}")
    return tensors


def _hf_side_files(source, tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, dict | str]:
    from edgellm.tokenizer.hf import to_hf

    tokenizer = load_tokenizer(source)
    template = ChatTemplate.from_metadata(source.metadata, tokenizer)
    tied = "lm_head.weight" not in tensors
    vocab_rows = tensors["model.embed_tokens.weight"].shape[0]
    config = config_from_metadata(source.metadata, vocab_rows, tied, {"f32": "float32", "f16": "float16",
                                  "bf16": "bfloat16"}[dtype], tokenizer.bos_id, tokenizer.eos_id)
    tokenizer_json, tokenizer_config = to_hf(tokenizer, template.source)
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": sorted(tokenizer.eos_ids) or None}
    return {"config.json": config, "generation_config.json": generation,
            "tokenizer.json": tokenizer_json, "tokenizer_config.json": tokenizer_config}


def _write_folder(out: Path, tensors: dict[str, torch.Tensor], files: dict[str, dict | str]) -> None:
    """Write into a sibling temp folder and rename it into place: no half-written model."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for filename, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2)
            (tmp / filename).write_text(text, encoding="utf-8")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
