"""How a model's KV is configured and what it costs: precisions, block size, window, budgets,
and the byte arithmetic the manager and the planner share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from edgellm.errors import InvalidRequest
from edgellm.kv.cache import Rotate
from edgellm.kv.codecs import bytes_per_head_token, codec


@dataclass(frozen=True)
class KVConfig:
    # f32 | bf16 | f16 | int8 | int4; keys are the sensitive half. f16 (llama.cpp's default too)
    # halves f32's memory and bytes read per decoded token, with a 10-bit mantissa.
    k_precision: str = "f16"
    v_precision: str = "f16"
    block_size: int = 32  # tokens per block: the unit of growth, accounting and prefix reuse
    max_tokens: int | None = None  # held per sequence; beyond it, sinks + sliding window (None: the context)
    sinks: int = 4  # first tokens always kept ("attention sinks")
    budget_bytes: int | None = None  # all KV together (sequences + prefix cache); None: unbounded
    # Finished blocks kept for later requests with the same prefix. None: automatic
    # (auto_prefix_cache_bytes); 0 disables prefix reuse.
    prefix_cache_bytes: int | None = None

    @classmethod
    def for_mode(cls, mode: str) -> KVConfig:
        """The default for a precision mode: "exact" (the fp32 reference) keeps fp32 KV."""
        return cls(k_precision="f32", v_precision="f32") if mode == "exact" else cls()

    def __post_init__(self) -> None:
        for precision in (self.k_precision, self.v_precision):
            codec(precision)  # raises InvalidRequest for unknown names
        if self.block_size < 1 or self.sinks < 0:
            raise InvalidRequest("block_size must be >= 1 and sinks >= 0")
        if self.max_tokens is not None and self.max_tokens < self.sinks + 2 * self.block_size:
            raise InvalidRequest(f"max_tokens must be at least sinks + 2 blocks ({self.sinks + 2 * self.block_size})")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise InvalidRequest("prefix_cache_bytes must be >= 0 (0 turns prefix reuse off)")


def split_precision(text: str) -> tuple[str, str]:
    """"int8" -> (int8, int8); "int8:int4" -> K int8, V int4 (how the CLI and API name them)."""
    k, _, v = text.partition(":")
    return k, v or k


AUTO_PREFIX_CAP = 256 * 2**20


def auto_prefix_cache_bytes(config: KVConfig) -> int:
    """The prefix cache's share when nobody set one: a quarter of a KV budget, or else a
    sixteenth of the memory free now, at most 256 MiB (~11,000 tokens of SmolLM2's f16 KV).
    Cached blocks are evicted, oldest first, whenever a request needs their room."""
    if config.budget_bytes is not None:
        return config.budget_bytes // 4
    import psutil

    return min(AUTO_PREFIX_CAP, psutil.virtual_memory().available // 16)


@dataclass(frozen=True)
class LayerSpec:
    """What a model tells the cache about one layer."""

    kv_heads: int
    head_dim: int
    window: int | None  # a sliding-window layer keeps only this many positions
    rotate: Rotate | None  # moves stored keys along positions (for the sink window)


def kv_bytes_per_token(specs: Sequence[LayerSpec], config: KVConfig) -> int:
    """K + V bytes one more token costs in the growing (non-window) layers."""
    return sum(s.kv_heads * (bytes_per_head_token(config.k_precision, s.head_dim) +
                             bytes_per_head_token(config.v_precision, s.head_dim))
               for s in specs if s.window is None)


def fixed_kv_bytes(specs: Sequence[LayerSpec], config: KVConfig) -> int:
    """Bytes of the ring layers, which do not grow with the sequence."""
    return sum(s.window * s.kv_heads * (bytes_per_head_token(config.k_precision, s.head_dim) +
                                        bytes_per_head_token(config.v_precision, s.head_dim))
               for s in specs if s.window is not None)
