"""LoRA adapters over one resident base model: reading them (adapter.py), applying them per row
on the PyTorch layers (apply.py; the native layers: kernels/lora_ops.h), keeping several resident
(resident.py)."""
from edgellm.lora.adapter import Adapter, AdapterMismatch, LoRAPair, load_adapter
from edgellm.lora.resident import AdapterSet

__all__ = ["Adapter", "AdapterMismatch", "AdapterSet", "LoRAPair", "load_adapter"]
