"""The prefix cache's disk tier: save the KV blocks of a prompt, load them into a later
process's prefix cache. One safetensors file; the model identity (salt), KV precisions and
layer shapes are recorded and checked, so a file never feeds the wrong model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np


from edgellm.atomic import atomic_path
from edgellm.errors import KVStateMismatch, ModelFormatError
from edgellm.io.safetensors import SafetensorsFile, write_safetensors
from edgellm.kv.manager import KVManager

FORMAT = "edgellm-kv-prefix/1"


def _identity(manager: KVManager) -> dict[str, str]:
    c = manager.config
    layers = [[s.kv_heads, s.head_dim, s.window] for s in manager.specs]
    return {"format": FORMAT, "model": manager.salt, "k_precision": c.k_precision, "v_precision": c.v_precision,
            "block_size": str(c.block_size), "layers": json.dumps(layers)}


def save_prefix(manager: KVManager, tokens: Sequence[int], path: str | Path, note: str | None = None) -> int:
    """Write the cached blocks covering `tokens` (run them through the model first); returns
    how many tokens were saved. Written to a temp file and renamed: never half a file. `note`:
    text kept beside them (a session's conversation), read back by saved_note."""
    if manager.prefix is None:
        raise KVStateMismatch("the prefix cache is disabled (prefix_cache_bytes = 0)")
    hashes = manager.hashes(tokens)
    payloads = manager.prefix.lookup(hashes)
    try:
        arrays = {f"{b}.{layer}.{name}": a for b, payload in enumerate(payloads)
                  for layer, parts in enumerate(manager.exported(payload)) for name, a in parts.items()}
        meta = _identity(manager) | {"tokens": json.dumps(list(tokens[:len(payloads) * manager.config.block_size])),
                                     "blocks": str(len(payloads))} | ({} if note is None else {"note": note})
        with atomic_path(path) as tmp:
            write_safetensors(tmp, arrays, metadata=meta)
    finally:
        manager.prefix.release(hashes[:len(payloads)])
    return len(payloads) * manager.config.block_size


def load_prefix(manager: KVManager, path: str | Path) -> list[int]:
    """Put a saved prefix into this model's prefix cache; returns its tokens. A file from
    another model, precision or layout raises KVStateMismatch; a damaged one too."""
    if manager.prefix is None:
        raise KVStateMismatch("the prefix cache is disabled (prefix_cache_bytes = 0)")
    try:
        with SafetensorsFile(path) as f:
            arrays, meta = {name: f.array(name).copy() for name in f.entries}, f.metadata
    except (OSError, ModelFormatError, KeyError, ValueError) as e:
        raise KVStateMismatch(f"{path}: not a readable KV file ({e})") from None
    expected = _identity(manager)
    wrong = [k for k, v in expected.items() if meta.get(k) != v]
    if wrong:
        raise KVStateMismatch(f"{path}: saved for another setup ({', '.join(f'{k}={meta.get(k)!r}' for k in wrong)}; "
                              f"this model has {', '.join(f'{k}={expected[k]!r}' for k in wrong)})")
    tokens = json.loads(meta["tokens"])
    for b, h in enumerate(manager.hashes(tokens)):
        manager.remember(h, [_parts(arrays, b, layer) for layer in range(len(manager.specs))])
    return tokens


def saved_note(path: str | Path) -> str | None:
    """The note a KV file was saved with (save_prefix)."""
    try:
        with SafetensorsFile(path) as f:
            return f.metadata.get("note")
    except (OSError, ModelFormatError, KeyError, ValueError) as e:
        raise KVStateMismatch(f"{path}: not a readable KV file ({e})") from None


def _parts(arrays: dict[str, np.ndarray], block: int, layer: int) -> dict[str, np.ndarray]:
    prefix = f"{block}.{layer}."
    parts = {name[len(prefix):]: a for name, a in arrays.items() if name.startswith(prefix)}
    if not parts:
        raise KVStateMismatch(f"block {block} layer {layer} is missing from the KV file")
    return parts
