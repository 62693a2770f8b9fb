"""LoRA adapters as people have them, read and checked against a base model.

Two formats: a PEFT folder (adapter_config.json + adapter_model.safetensors, what
`peft.save_pretrained` writes) and llama.cpp's GGUF LoRA (`general.type = adapter`, what
convert_lora_to_gguf.py writes). Either becomes an `Adapter`: per (layer, projection) the
low-rank pair A (r x in) and B (out x r, kept transposed: B^T (r x out)) in Hugging Face's row
order, and the scale s, so a projection computes y = W x + s B (A x). Anything that does not fit the base (a module the
base lacks, shapes of another model, a rank other than the config's) is an AdapterMismatch
naming it."""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgellm.errors import AdapterMismatch, ModelFormatError

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # the order of the native LoraLayer's parts
MAX_RANK = 256  # kernels/layer_types.h MAX_LORA_RANK
_PEFT_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
               "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_GGUF_NAMES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
               "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


@dataclass(frozen=True)
class LoRAPair:
    a: torch.Tensor  # A (rank, in)
    b_t: torch.Tensor  # B^T (rank, out): the native kernel runs along the output

    @property
    def b(self) -> torch.Tensor:
        return self.b_t.T


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: a resident adapter is one object
class Adapter:
    name: str
    path: Path
    rank: int
    scale: float  # s in y = W x + s B (A x): alpha / rank (alpha / sqrt(rank) with rsLoRA) times the user's scale
    pairs: dict[tuple[int, str], LoRAPair]  # (layer, projection) -> its pair
    widths: dict[str, int]  # output width of each projection of the base (fused parts sit side by side)
    digest: str  # of the weights and scale: prefix-cache keys carry it, so a prefix never crosses adapters

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in self.pairs.values())

    @property
    def projections(self) -> tuple[str, ...]:
        return tuple(p for p in PROJECTIONS if any(key[1] == p for key in self.pairs))


def projection_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection a LoRA may target, from a Llama- or Gemma-family config."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
            "gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}


def load_adapter(path: str | Path, config: Any, name: str | None = None, scale: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> Adapter:
    """The adapter at `path` (a PEFT folder or a GGUF LoRA file), checked against the base
    model's `config`, its pairs in `dtype` (bf16 for the native kernels), its scale times `scale`."""
    path = Path(path)
    if path.is_dir():
        rank, alpha_scale, pairs = _read_peft(path)
    elif path.is_file():
        rank, alpha_scale, pairs = _read_gguf(path, config)
    else:
        raise ModelFormatError(path, "no LoRA adapter here (a PEFT folder or a GGUF LoRA file)")
    _check(path, pairs, rank, config)
    pairs = {key: LoRAPair(p.a.to(dtype).contiguous(), p.b_t.to(dtype).contiguous()) for key, p in pairs.items()}
    widths = {p: out for p, (out, _) in projection_shapes(config).items()}
    s = alpha_scale * scale
    return Adapter(name or path.stem, path, rank, s, pairs, widths, _digest(pairs, s))


def resident_bytes(path: str | Path, element_bytes: int = 2) -> int:
    """What the adapter at `path` takes once resident (bf16 pairs in fast mode: 2 bytes an
    element), from its file's header alone: for the planner, before anything loads."""
    path = Path(path)
    if path.is_dir():
        from safetensors import safe_open

        try:
            with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
                return element_bytes * sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        except Exception as error:  # safetensors' own errors for missing or corrupt files
            raise ModelFormatError(path, f"cannot read adapter_model.safetensors: {error}") from None
    if not path.is_file():
        raise ModelFormatError(path, "no LoRA adapter here (a PEFT folder or a GGUF LoRA file)")
    from edgellm.formats.gguf import GGUFFile

    with GGUFFile(path) as gguf:
        return element_bytes * sum(info.n_elements for info in gguf.tensors.values())


def _digest(pairs: dict[tuple[int, str], LoRAPair], scale: float) -> str:
    h = hashlib.sha256(repr(scale).encode())
    for key in sorted(pairs):
        h.update(repr(key).encode())
        for t in (pairs[key].a, pairs[key].b_t):
            h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()[:16]


def _read_peft(folder: Path) -> tuple[int, float, dict]:
    from safetensors.torch import load_file

    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelFormatError(folder, f"adapter_config.json is missing or incomplete: {error}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelFormatError(folder, f"not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    if config.get("use_dora"):
        raise ModelFormatError(folder, "DoRA adapters are not supported (use_dora)")
    try:
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except Exception as error:  # safetensors raises its own errors for truncated or corrupt files
        raise ModelFormatError(folder / "adapter_model.safetensors", f"cannot read: {error}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None or match.group(2) not in _PEFT_NAMES:
            raise AdapterMismatch(f"{folder}: tensor {key!r} targets no projection edgellm applies adapters to "
                                  f"({', '.join(_PEFT_NAMES)})")
        layer, module, half = int(match.group(1)), _PEFT_NAMES[match.group(2)], match.group(3)
        halves.setdefault((layer, module), {})[half] = tensor.float()
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale, _pairs(folder, halves, "A", "B")


def _read_gguf(path: Path, config: Any) -> tuple[int, float, dict]:
    from edgellm.formats.gguf import GGUFFile
    from edgellm.models.llama import unpermute_rows
    from edgellm.quant.ggml import dequantize

    with GGUFFile(path) as gguf:
        meta = gguf.metadata
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise ModelFormatError(path, "not a GGUF LoRA adapter (general.type / adapter.type)")
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, info in gguf.tensors.items():
            match = _GGUF_KEY.match(key)
            if match is None or match.group(2) not in _GGUF_NAMES:
                raise AdapterMismatch(f"{path}: tensor {key!r} targets no projection edgellm applies adapters to")
            tensor = dequantize(gguf.raw(key), info.ggml_type, info.shape).float().clone()
            halves.setdefault((int(match.group(1)), _GGUF_NAMES[match.group(2)]), {})[match.group(3)] = tensor
        alpha = float(meta.get("adapter.lora.alpha", 0.0))
        architecture = meta.get("general.architecture")
    pairs = _pairs(path, halves, "a", "b")
    if architecture in ("llama",):  # llama.cpp's converter interleaves Llama q/k rows, as in the base
        for (layer, module), pair in list(pairs.items()):
            if module in ("q", "k"):
                heads = config.n_heads if module == "q" else config.n_kv_heads
                pairs[layer, module] = LoRAPair(pair.a, pair.b_t[:, unpermute_rows(heads, config.head_dim)])
    rank = next(iter(pairs.values())).a.shape[0] if pairs else 0
    return rank, (alpha / rank if alpha and rank else 1.0), pairs


def _pairs(where: Path, halves: dict, a: str, b: str) -> dict[tuple[int, str], LoRAPair]:
    pairs = {}
    for key, parts in halves.items():
        if set(parts) != {a, b}:
            raise AdapterMismatch(f"{where}: layer {key[0]} {key[1]} has only lora_{next(iter(parts))}")
        pairs[key] = LoRAPair(parts[a], parts[b].T)
    if not pairs:
        raise AdapterMismatch(f"{where}: the adapter holds no LoRA tensors")
    return pairs


def _check(path: Path, pairs: dict, rank: int, config: Any) -> None:
    shapes = projection_shapes(config)
    for (layer, module), pair in sorted(pairs.items()):
        where = f"{path}: layer {layer} {module}"
        if layer >= config.n_layers:
            raise AdapterMismatch(f"{where}: the base model has {config.n_layers} layers")
        out_dim, in_dim = shapes[module]
        if pair.a.shape[0] != rank or pair.b.shape[1] != rank:
            raise AdapterMismatch(f"{where}: rank {pair.a.shape[0]} / {pair.b.shape[1]} but the adapter says {rank}")
        if rank > MAX_RANK:
            raise AdapterMismatch(f"{where}: rank {rank} is above the {MAX_RANK} edgellm runs")
        if pair.a.shape[1] != in_dim or pair.b.shape[0] != out_dim:
            raise AdapterMismatch(f"{where}: A {tuple(pair.a.shape)} and B {tuple(pair.b.shape)} do not fit the "
                                  f"base's {out_dim} x {in_dim} projection (another base model?)")
