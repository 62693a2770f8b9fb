"""LoRA adapters as people have them, read and checked against a base model.

Two formats: a PEFT folder (adapter_config.json + adapter_model.safetensors, what
`peft.save_pretrained` writes) and llama.cpp's GGUF LoRA (`general.type = adapter`, what
convert_lora_to_gguf.py writes). Either becomes an `Adapter`: per (layer, projection) the
low-rank pair A (r x in) and B (out x r, kept transposed: B^T (r x out)) in Hugging Face's row
order, and the scale s, so a projection computes y = W x + s B (A x). Anything that does not fit the base (a module the
base lacks, shapes of another model, a rank other than the config's) is an AdapterMismatch
naming it.

Pairs are numpy arrays (read without PyTorch; the native layers read the int8 ones in place); a
pair being trained holds tensors (lora/train.py), and the PyTorch layers view either as tensors.""" 
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgellm.errors import AdapterMismatch, ModelFormatError
from edgellm.kernels.limits import MAX_LORA_RANK

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # the order of the native LoraLayer's parts
MAX_RANK = MAX_LORA_RANK  # what the native layers apply
_PEFT_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
               "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_GGUF_NAMES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
               "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


@dataclass(frozen=True)
class LoRAPair:
    """A (rank, in) and B^T (rank, out) as float matrices; or, in fast mode, as int8 rows with an
    fp32 scale each (row r of A is a[r] * a_scale[r]) laid out as kernels/lora_ops.h reads them
    (flat: A in interleaved groups of 4 rows, B^T in tiles of 64 columns)."""
    a: np.ndarray
    b_t: np.ndarray
    a_scale: np.ndarray | None = None
    b_scale: np.ndarray | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[0] if self.a_scale is None else len(self.a_scale)

    @property
    def in_features(self) -> int:
        return math.prod(self.a.shape) // self.rank

    @property
    def out_features(self) -> int:
        return math.prod(self.b_t.shape) // self.rank

    @property
    def b(self):
        return self.dense()[1].T

    def dense(self) -> tuple:
        """A and B^T in fp32 (numpy; a pair being trained: its tensors)."""
        if self.a_scale is None:
            if not isinstance(self.a, np.ndarray):
                return self.a.float(), self.b_t.float()
            return self.a.astype(np.float32, copy=False), self.b_t.astype(np.float32, copy=False)
        a = _unpack_a(self.a, self.rank, self.in_features)
        b_t = _unpack_b_t(self.b_t, self.rank, self.out_features)
        return a.astype(np.float32) * self.a_scale[:, None], b_t.astype(np.float32) * self.b_scale[:, None]

    def stored_as(self, dtype: str) -> LoRAPair:
        """This pair in `dtype` ("float32" or "int8"); int8: symmetric rows, one fp32 scale each (the
        LoRA product's error stays ~0.4 % of its own size), in the native kernel's layout."""
        a, b_t = self.dense()
        if dtype != "int8" or a.shape[1] % _CHUNK:  # the native layout needs whole chunks: fp32 then
            return LoRAPair(np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(b_t, dtype=np.float32))
        (qa, sa), (qb, sb) = _int8_rows(a), _int8_rows(b_t)
        return LoRAPair(pack_a(qa), pack_b_t(qb), sa, sb)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.a, self.b_t, self.a_scale, self.b_scale) if t is not None)


def _int8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = np.maximum(np.abs(x).max(axis=1), np.float32(1e-30)) / np.float32(127)
    q = np.clip(np.round(x / scale[:, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q), np.ascontiguousarray(scale, dtype=np.float32)


# lora_ops.h's layout: the rows a job reads together lie in one contiguous run (short rows read
# side by side stalled on memory latency)
_RANKS, _CHUNK, _COLUMNS = 4, 16, 64  # LORA_RANKS, LORA_CHUNK, LORA_COLUMNS


def pack_a(a: np.ndarray) -> np.ndarray:
    """A (rank, in) as groups of 4 rows, each (in / 16, 4, 16); the rows after the last whole group plain."""
    rank, n = a.shape
    whole = rank // _RANKS * _RANKS
    groups = a[:whole].reshape(-1, _RANKS, n // _CHUNK, _CHUNK).transpose(0, 2, 1, 3)
    return np.concatenate([groups.reshape(-1), a[whole:].reshape(-1)])


def _unpack_a(flat: np.ndarray, rank: int, n: int) -> np.ndarray:
    whole = rank // _RANKS * _RANKS
    groups = flat[:whole * n].reshape(-1, n // _CHUNK, _RANKS, _CHUNK).transpose(0, 2, 1, 3).reshape(whole, n)
    return np.concatenate([groups, flat[whole * n:].reshape(-1, n)])


def pack_b_t(b_t: np.ndarray) -> np.ndarray:
    """B^T (rank, out) as tiles of 64 columns (the last may be narrower), each (rank, columns)."""
    return np.concatenate([b_t[:, c:c + _COLUMNS].reshape(-1) for c in range(0, b_t.shape[1], _COLUMNS)])


def _unpack_b_t(flat: np.ndarray, rank: int, out: int) -> np.ndarray:
    whole = out // _COLUMNS * _COLUMNS  # the full tiles in one view, then the narrower last one
    tiles = flat[:rank * whole].reshape(-1, rank, _COLUMNS).transpose(1, 0, 2).reshape(rank, whole)
    return np.concatenate([tiles, flat[rank * whole:].reshape(rank, out - whole)], axis=1)


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
        return sum(p.nbytes for p in self.pairs.values())

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
                 dtype: str = "float32") -> Adapter:
    """The adapter at `path` (a PEFT folder or a GGUF LoRA file), checked against the base
    model's `config`, its pairs in `dtype` ("int8" for the native kernels), its scale times `scale`."""
    path = Path(path)
    if path.is_dir():
        rank, alpha_scale, pairs = _read_peft(path)
    elif path.is_file():
        rank, alpha_scale, pairs = _read_gguf(path, config)
    else:
        raise ModelFormatError(path, "no LoRA adapter here (a PEFT folder or a GGUF LoRA file)")
    _check(path, pairs, rank, config)
    pairs = {key: p.stored_as(dtype) for key, p in pairs.items()}
    widths = {p: out for p, (out, _) in projection_shapes(config).items()}
    s = alpha_scale * scale
    return Adapter(name or path.stem, path, rank, s, pairs, widths, _digest(pairs, s))


def resident_bytes(path: str | Path, mode: str = "fast") -> int:
    """What the adapter at `path` takes once resident — fast mode: int8 pairs, a byte an element
    and an fp32 scale per rank row; exact mode: fp32 — from its file's header alone: for the
    planner, before anything loads."""
    path = Path(path)
    if path.is_dir():
        from edgellm.io.safetensors import SafetensorsFile

        with SafetensorsFile(path / "adapter_model.safetensors") as f:
            shapes = [e.shape for e in f.entries.values()]
    elif path.is_file():
        from edgellm.io.gguf import GGUFFile

        with GGUFFile(path) as gguf:
            shapes = [info.shape for info in gguf.tensors.values()]
    else:
        raise ModelFormatError(path, "no LoRA adapter here (a PEFT folder or a GGUF LoRA file)")
    if mode == "exact":
        return sum(4 * math.prod(shape) for shape in shapes)
    return sum(math.prod(shape) + 4 * min(shape) for shape in shapes)  # the rank is the small side


def _digest(pairs: dict[tuple[int, str], LoRAPair], scale: float) -> str:
    h = hashlib.sha256(repr(scale).encode())
    for key in sorted(pairs):
        h.update(repr(key).encode())
        for t in (pairs[key].a, pairs[key].b_t, pairs[key].a_scale, pairs[key].b_scale):
            if t is not None:
                h.update(np.ascontiguousarray(t).view(np.uint8))
    return h.hexdigest()[:16]


def _read_peft(folder: Path) -> tuple[int, float, dict]:
    from edgellm.io.safetensors import SafetensorsFile

    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelFormatError(folder, f"adapter_config.json is missing or incomplete: {error}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelFormatError(folder, f"not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    if config.get("use_dora"):
        raise ModelFormatError(folder, "DoRA adapters are not supported (use_dora)")
    with SafetensorsFile(folder / "adapter_model.safetensors") as f:
        tensors = {key: _floats(f, key) for key in f.entries}
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None or match.group(2) not in _PEFT_NAMES:
            raise AdapterMismatch(f"{folder}: tensor {key!r} targets no projection edgellm applies adapters to "
                                  f"({', '.join(_PEFT_NAMES)})")
        layer, module, half = int(match.group(1)), _PEFT_NAMES[match.group(2)], match.group(3)
        halves.setdefault((layer, module), {})[half] = tensor
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale, _pairs(folder, halves, "A", "B")


def _read_gguf(path: Path, config: Any) -> tuple[int, float, dict]:
    from edgellm.io.gguf import GGUFFile
    from edgellm import families
    from edgellm.io.hf_names import unpermute_rows
    from edgellm.quant.ggml import float_vector

    with GGUFFile(path) as gguf:
        meta = gguf.metadata
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
            raise ModelFormatError(path, "not a GGUF LoRA adapter (general.type / adapter.type)")
        halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for key, info in gguf.tensors.items():
            match = _GGUF_KEY.match(key)
            if match is None or match.group(2) not in _GGUF_NAMES:
                raise AdapterMismatch(f"{path}: tensor {key!r} targets no projection edgellm applies adapters to")
            tensor = float_vector(gguf.raw(key), info.ggml_type, info.shape)  # a copy, fp32
            halves.setdefault((int(match.group(1)), _GGUF_NAMES[match.group(2)]), {})[match.group(3)] = tensor
        alpha = float(meta.get("adapter.lora.alpha", 0.0))
        architecture = meta.get("general.architecture")
    pairs = _pairs(path, halves, "a", "b")
    if architecture in families.names() and families.get(architecture).permuted_qk:  # llama.cpp's converter interleaves these q/k rows, as in the base
        for (layer, module), pair in list(pairs.items()):
            if module in ("q", "k"):
                heads = config.n_heads if module == "q" else config.n_kv_heads
                pairs[layer, module] = LoRAPair(pair.a, pair.b_t[:, unpermute_rows(heads, config.head_dim)])
    rank = next(iter(pairs.values())).a.shape[0] if pairs else 0
    return rank, (alpha / rank if alpha and rank else 1.0), pairs


def _floats(f, name: str) -> np.ndarray:
    """A safetensors file's float tensor as a new fp32 array."""
    from edgellm.quant.ggml import float_vector

    info = f.entries[name].as_float_info(name)
    if info is None:
        raise ModelFormatError(f.path, f"tensor {name!r} is {f.entries[name].dtype}, not a float LoRA matrix")
    return float_vector(f.view(info.offset, info.nbytes), info.ggml_type, info.shape)


def _pairs(where: Path, halves: dict, a: str, b: str) -> dict[tuple[int, str], LoRAPair]:
    pairs = {}
    for key, parts in halves.items():
        if set(parts) != {a, b}:
            raise AdapterMismatch(f"{where}: layer {key[0]} {key[1]} has only lora_{next(iter(parts))}")
        if any(t.ndim != 2 for t in parts.values()):
            raise AdapterMismatch(f"{where}: layer {key[0]} {key[1]}: LoRA tensors must be matrices")
        pairs[key] = LoRAPair(parts[a], np.ascontiguousarray(parts[b].T))
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
