"""A model source's tokenizer: what the source (io/) names, built here, so that the readers of
files never import the tokenizers."""
from __future__ import annotations

from typing import Any

from edgellm.tokenizer import Tokenizer


def load_tokenizer(source: Any) -> Tokenizer:
    """The tokenizer a model source (io/) carries: what its `tokenizer_files()` names (a GGUF
    vocabulary, or a Hugging Face tokenizer.json and its config), else its own GGUF metadata's."""
    files = getattr(source, "tokenizer_files", None)
    spec = files() if files is not None else {"gguf_metadata": source.metadata}
    if "gguf_metadata" in spec:
        return Tokenizer.from_gguf_metadata(spec["gguf_metadata"])
    from edgellm.tokenizer.hf import from_hf  # the tools extra's `tokenizers`

    return from_hf(spec["tokenizer_json"], spec["config"], spec["architecture"])
