"""LoRA adapters over one resident base model: reading them (adapter.py)."""
from edgellm.lora.adapter import Adapter, AdapterMismatch, LoRAPair, load_adapter

__all__ = ["Adapter", "AdapterMismatch", "LoRAPair", "load_adapter"]
