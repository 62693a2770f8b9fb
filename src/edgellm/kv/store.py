"""Token-indexed storage for one of K or V in one layer (`TokenStore`: encoded parts of a fixed
number of token slots), and `KVPage`, the K and V of one block of tokens: dense caches grow page
by page, so memory follows the tokens actually held, and sequences with a common prefix hold the
same pages.

Parts are numpy arrays (bf16 as uint16 bits): the native layers read and append them in place, and
copies, exports and imports stay in numpy. The PyTorch layers write and read them through tensor
views of the same memory (`tensors`), encoding and decoding with the codec."""
from __future__ import annotations

import numpy as np

from edgellm.extras import torch
from edgellm.kv.codecs import Codec, storage_dtype


# What a KVPage costs beyond its arrays' bytes: the page, its two TokenStores and their parts dicts, and a
# header per array (tracemalloc on CPython 3.11: f16 ~1,060 bytes, int8 ~1,340, int4 ~1,660). A block of
# SmolLM2's f16 KV holds 30 pages of 24 KB: 4 % more than its arrays, which the KV gauges count too
# (tests/kv/test_store.py measures it).
PAGE_OBJECT_BYTES, ARRAY_OBJECT_BYTES = 760, 150


def page_object_bytes(k_codec: Codec, v_codec: Codec) -> int:
    """Bytes a page of these codecs holds in Python objects beside its arrays."""
    arrays = len(k_codec.part_shapes(64)) + len(v_codec.part_shapes(64))  # the count does not depend on D
    return PAGE_OBJECT_BYTES + ARRAY_OBJECT_BYTES * arrays


class TokenStore:
    """Encoded (1, H, capacity, ...) buffers of a fixed number of token slots."""

    # a prefix cache holds thousands of stores: without a __dict__ each costs ~100 bytes less
    __slots__ = ("codec", "heads", "head_dim", "parts", "_tensors")

    def __init__(self, codec: Codec, heads: int, head_dim: int, capacity: int, *, zeroed: bool = False):
        self.codec, self.heads, self.head_dim = codec, heads, head_dim
        make = np.zeros if zeroed else np.empty
        self.parts: dict[str, np.ndarray] = {
            name: make((1, heads, capacity, size), dtype=storage_dtype(dtype))
            for name, (size, dtype) in codec.part_shapes(head_dim).items()}
        self._tensors: dict | None = None

    @property
    def capacity(self) -> int:
        return next(iter(self.parts.values())).shape[2]

    def copy(self) -> TokenStore:
        twin = TokenStore(self.codec, self.heads, self.head_dim, 0)
        twin.parts = {name: part.copy() for name, part in self.parts.items()}
        return twin

    def tensors(self) -> dict:
        """The parts as tensors of their dtypes, viewing the same memory (for the PyTorch layers)."""
        if self._tensors is None:
            shapes = self.codec.part_shapes(self.head_dim)
            self._tensors = {name: torch.from_numpy(part).view(getattr(torch, shapes[name][1]))
                             for name, part in self.parts.items()}
        return self._tensors

    def write(self, start: int, x: torch.Tensor) -> None:
        """Store x (B, H, T, D) at token slots start..start+T-1."""
        tensors = self.tensors()
        for name, value in self.codec.encode(x).items():
            tensors[name][:, :, start:start + x.shape[2]] = value

    def read(self, start: int, end: int) -> torch.Tensor:
        """Decoded slots start..end-1 as (B, H, end-start, D) fp32."""
        return self.codec.decode({n: p[:, :, start:end] for n, p in self.tensors().items()})

    def read_parts(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Encoded slots start..end-1, copied (e.g. to keep a block for prefix reuse)."""
        return {n: p[:, :, start:end].copy() for n, p in self.parts.items()}

    def write_parts(self, start: int, parts: dict[str, np.ndarray]) -> None:
        for name, value in parts.items():
            self.parts[name][:, :, start:start + value.shape[2]] = value

    def buffers(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The encoded buffers a native kernel reads and writes: values (float, or integer
        codes), and the per-group scale and minimum of the integer codecs (None for floats)."""
        values = self.parts["x"] if "x" in self.parts else self.parts["q"]
        return values, self.parts.get("scale"), self.parts.get("min")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())


class KVPage:
    """K and V of one block of `tokens` token slots in one layer. A page held by several
    sequences (a shared prefix) is never written: kv/sequence.py copies it first."""

    __slots__ = ("k", "v", "__weakref__")  # models/native/caches.py keeps a weak table by page

    def __init__(self, k: TokenStore, v: TokenStore):
        self.k, self.v = k, v

    @classmethod
    def empty(cls, k_codec: Codec, v_codec: Codec, heads: int, head_dim: int, tokens: int) -> KVPage:
        return cls(TokenStore(k_codec, heads, head_dim, tokens), TokenStore(v_codec, heads, head_dim, tokens))

    def copy(self) -> KVPage:
        return KVPage(self.k.copy(), self.v.copy())

    def export(self) -> dict[str, np.ndarray]:
        """The page's encoded K and V as "k.<part>", "v.<part>" arrays (the disk tier's form)."""
        return prefixed(self.k.parts, self.v.parts)

    @classmethod
    def from_export(cls, k_codec: Codec, v_codec: Codec, heads: int, head_dim: int,
                    parts: dict[str, np.ndarray]) -> KVPage:
        tokens = next(iter(parts.values())).shape[2]
        page = cls.empty(k_codec, v_codec, heads, head_dim, tokens)
        k_parts, v_parts = split_prefixed(parts)
        page.k.write_parts(0, k_parts)
        page.v.write_parts(0, v_parts)
        return page

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def prefixed(k_parts: dict, v_parts: dict) -> dict:
    """K's and V's parts in one dict, as "k.<part>", "v.<part>" (the exported / disk form)."""
    return {f"k.{n}": p for n, p in k_parts.items()} | {f"v.{n}": p for n, p in v_parts.items()}


def split_prefixed(parts: dict) -> tuple[dict, dict]:
    """The inverse of prefixed: (K's parts, V's parts)."""
    return ({n[2:]: p for n, p in parts.items() if n.startswith("k.")},
            {n[2:]: p for n, p in parts.items() if n.startswith("v.")})
