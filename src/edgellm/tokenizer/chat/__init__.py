"""Chat on top of the tokenizer: the model's chat template (`template.py`), message and tool
validation (`messages.py`) and tool-call formats (`tool_calls.py`)."""
