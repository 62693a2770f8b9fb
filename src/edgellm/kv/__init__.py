"""KV caches. Every cache speaks the same small protocol so model code never asks which it has."""
from edgellm.kv.blocks import BlockPool, PrefixIndex, chain_hashes
from edgellm.kv.cache import CAUSAL, DenseCache, KVCache, RingCache
from edgellm.kv.config import KVConfig, LayerSpec, kv_bytes_per_token
from edgellm.kv.manager import KVManager, fresh_sequence
from edgellm.kv.sequence import BatchKV, SequenceKV

__all__ = ["CAUSAL", "BatchKV", "BlockPool", "DenseCache", "KVCache", "KVConfig", "KVManager", "LayerSpec", "PrefixIndex",
           "RingCache", "SequenceKV", "chain_hashes", "fresh_sequence", "kv_bytes_per_token"]
