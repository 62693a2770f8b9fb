"""One module per model family, found by its name (a GGUF file's `general.architecture`).

A family module holds everything edgellm knows of the family that is not arithmetic: how Hugging
Face names its tensors and config fields, llama.cpp's converter conventions for it, the quirks its
metadata records (RoPE variants, windows, caps, NoPE layers) and what a tiny model of it holds, for
tests and synthetic benchmarks. The arithmetic lives in models/: `llama.py` runs the Llama-like
families, `gemma.py` Gemma's; each family names its `runner`. Adding a Llama-like family is one
new module here, with its test."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Mapping

from edgellm.errors import UnsupportedModel

Getter = Callable[..., Any]  # metadata key suffix (after "<arch>.") -> value, with an optional default


def _none(*_: Any, **__: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    arch: str  # the GGUF general.architecture (and this module's name)
    model_type: str  # a Hugging Face config.json's model_type
    hf_class: str  # the Hugging Face class named in config.json's `architectures`
    hf_config_class: str  # transformers' config class (tests build reference models with it)
    runner: str  # the models/ module that runs it: "llama" or "gemma"
    layer_names: Mapping[str, str]  # GGUF tensor part in a block -> the Hugging Face module path
    permuted_qk: bool = False  # llama.cpp's converter interleaves each head's q/k rows for its RoPE
    norms_plus_one: bool = False  # GGUF stores the norm weights as 1 + w
    qkv_bias: bool = False  # q, k and v have biases
    config_keys: Mapping[str, str] = field(default_factory=dict)  # GGUF key suffix <- config.json field
    writable: bool = True  # convert can write it back as a Hugging Face folder
    # config.json -> GGUF metadata for what only this family has (keys "<arch>.<suffix>")
    metadata_from_config: Callable[[Mapping[str, Any]], dict[str, Any]] = _none
    # GGUF metadata -> the extra fields of its runner's config: (get, context length loaded for)
    runtime: Callable[[Getter, int | None], dict[str, Any]] = _none
    # the fields config.json needs beyond the common ones, from GGUF metadata: (get, config so far)
    config_from_metadata: Callable[[Getter, dict[str, Any]], dict[str, Any]] = _none
    # a tiny model (tests): its extra GGUF metadata, extra GGUF tensors and transformers config
    # fields, each from (head_dim, **options: sliding_window, partial_rotary)
    tiny_metadata: Callable[..., dict[str, Any]] = _none
    tiny_tensors: Callable[..., dict[str, Any]] = _none
    tiny_hf_config: Callable[..., dict[str, Any]] = _none
    tiny_vocab: str = "llama-bpe"  # the llama.cpp vocabulary fixture a tiny converted model gets (tests)
    gguf_from_llama_cpp: bool = True  # llama.cpp's converter writes its checkpoints under this architecture

    def block_tensors(self, i: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                      ffn: int) -> list[tuple[str, tuple[int, ...]]]:
        """Block i's GGUF tensors and their (rows, columns) shapes, as llama.cpp's converter writes
        them (norms: one vector each)."""
        q, kv = heads * head_dim, kv_heads * head_dim
        up = ffn if "ffn_gate" in self.layer_names else 2 * ffn  # gate|up fused in one tensor
        shapes = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                  "attn_qkv": (q + 2 * kv, hidden), "attn_output": (hidden, q), "ffn_gate": (ffn, hidden),
                  "ffn_up": (up, hidden), "ffn_down": (hidden, ffn), "attn_q_norm": (head_dim,),
                  "attn_k_norm": (head_dim,)}
        out = [(f"blk.{i}.{part}.weight", shapes.get(part, (hidden,))) for part in self.layer_names]
        if self.qkv_bias:
            out += [(f"blk.{i}.attn_{x}.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv))]
        return out


@cache
def names() -> tuple[str, ...]:
    """Every family's architecture name: the modules of this package."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


@cache
def get(arch: str) -> Family:
    """The family of a GGUF architecture name; UnsupportedModel naming the supported ones."""
    if arch not in names():
        raise UnsupportedModel(f"architecture {arch!r} is not supported ({', '.join(names())})")
    return importlib.import_module(f"{__name__}.{arch}").FAMILY


def by_model_type(model_type: str | None) -> Family:
    """The family of a Hugging Face config.json's model_type."""
    for arch in names():
        if get(arch).model_type == model_type:
            return get(arch)
    types = ", ".join(get(arch).model_type for arch in names())
    raise UnsupportedModel(f"model_type {model_type!r} is not supported ({types})")
