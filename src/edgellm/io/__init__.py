"""Model files -> (metadata, named tensors), memory-mapped: GGUF, Hugging Face folders, and
edgellm's own quantized files. `open_model` picks the reader from what is on disk."""
from __future__ import annotations

from pathlib import Path


def open_model(path: str | Path):
    """A GGUFFile, HFFolder or QuantizedFile for `path` (all offer the same reading interface)."""
    from edgellm.io.gguf import MAGIC, open_gguf
    from edgellm.io.hf import HFFolder, is_hf_folder
    from edgellm.io.quantized import QuantizedFile, is_quantized_file

    path = Path(path)
    if is_hf_folder(path):
        return HFFolder(path)
    if is_quantized_file(path):
        return QuantizedFile(path)
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != MAGIC and path.suffix in (".safetensors", ".edgellm"):
                from edgellm.errors import ModelFormatError

                raise ModelFormatError(path, "not an edgellm quantized file (no edgellm format metadata)")
    return open_gguf(path)

