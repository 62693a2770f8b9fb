"""The limits the C layers are compiled with, read from their header (layer_types.h), so that
Python and C share one source: how many rows one layer call decodes together, the largest
LoRA rank the native layers apply, and so on. Needs no compiled library."""
from __future__ import annotations

import re
from importlib import resources


def header_defines(header: str = "layer_types.h") -> dict[str, int]:
    """Every `#define NAME <integer>` of one of the kernels' headers."""
    text = resources.files("edgellm.kernels").joinpath(header).read_text()
    return {name: int(value) for name, value in re.findall(r"^#define (\w+) (\d+)\b", text, re.M)}


_DEFINES = header_defines()
MAX_SEQS: int = _DEFINES["MAX_SEQS"]  # sequences (or a prompt's rows) one decode-sized layer call takes
MAX_LORA_RANK: int = _DEFINES["MAX_LORA_RANK"]
MAX_PARTS: int = _DEFINES["MAX_PARTS"]  # kernel parts one fused projection may have
