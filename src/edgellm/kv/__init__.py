"""KV caches. Every cache speaks the same small protocol so model code never asks which it has."""
from edgellm.kv.cache import DenseCache, KVCache, make_caches

__all__ = ["DenseCache", "KVCache", "make_caches"]
