"""The tools extra's jobs on whole models: `quantize.py`, `convert.py` (GGUF <-> Hugging Face) and
`evaluate.py` (quality against a reference)."""
