"""What a manifest says of a model file, read from its GGUF header: family, quantization,
tokenizer, chat template, context length. Reading it is also the check that the file is a GGUF
edgellm can parse at all, before it gets a name."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from edgellm.io.gguf import open_gguf

# llama.cpp's general.file_type numbers (llama_ftype), for the names people download by
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def describe_gguf(path: Path) -> dict:
    """Manifest fields of a GGUF file; ModelFormatError when it is not one."""
    with open_gguf(path) as f:
        md = f.metadata
        arch = str(md.get("general.architecture", ""))
        file_type = md.get("general.file_type")
        quantization = FILE_TYPES.get(file_type) if isinstance(file_type, int) else None
        if quantization is None:  # the type holding the most bytes
            by_bytes = Counter()
            for info in f.tensors.values():
                by_bytes[info.type_name] += info.nbytes
            quantization = by_bytes.most_common(1)[0][0] if by_bytes else ""
        context = md.get(f"{arch}.context_length", 0)
        return dict(family=arch, quantization=quantization, tokenizer=str(md.get("tokenizer.ggml.model", "")),
                    chat_template="tokenizer.chat_template" in md,
                    context_length=int(context) if isinstance(context, int) else 0)
