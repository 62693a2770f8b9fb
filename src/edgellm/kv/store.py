"""Token-indexed storage for one of K or V in one layer (`TokenStore`: encoded parts of a fixed
number of token slots), and `KVPage`, the K and V of one block of tokens: dense caches grow page
by page, so memory follows the tokens actually held, and sequences with a common prefix hold the
same pages."""
from __future__ import annotations

import torch

from edgellm.kv.codecs import Codec


class TokenStore:
    """Encoded (1, H, capacity, ...) buffers of a fixed number of token slots."""

    def __init__(self, codec: Codec, heads: int, head_dim: int, capacity: int, *, zeroed: bool = False):
        self.codec, self.heads, self.head_dim = codec, heads, head_dim
        make = torch.zeros if zeroed else torch.empty
        self.parts: dict[str, torch.Tensor] = {
            name: make(1, heads, capacity, size, dtype=dtype) for name, (size, dtype) in codec.part_shapes(head_dim).items()}

    @property
    def capacity(self) -> int:
        return next(iter(self.parts.values())).shape[2]

    def copy(self) -> TokenStore:
        twin = TokenStore(self.codec, self.heads, self.head_dim, 0)
        twin.parts = {name: part.clone() for name, part in self.parts.items()}
        return twin

    def write(self, start: int, x: torch.Tensor) -> None:
        """Store x (B, H, T, D) at token slots start..start+T-1."""
        for name, value in self.codec.encode(x).items():
            self.parts[name][:, :, start:start + x.shape[2]] = value

    def read(self, start: int, end: int) -> torch.Tensor:
        """Decoded slots start..end-1 as (B, H, end-start, D) fp32."""
        return self.codec.decode({n: p[:, :, start:end] for n, p in self.parts.items()})

    def read_parts(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Encoded slots start..end-1, copied (e.g. to keep a block for prefix reuse)."""
        return {n: p[:, :, start:end].clone() for n, p in self.parts.items()}

    def write_parts(self, start: int, parts: dict[str, torch.Tensor]) -> None:
        for name, value in parts.items():
            self.parts[name][:, :, start:start + value.shape[2]] = value

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The encoded buffers a native kernel reads and writes: values (float, or integer
        codes), and the per-group scale and minimum of the integer codecs (None for floats)."""
        values = self.parts["x"] if "x" in self.parts else self.parts["q"]
        return values, self.parts.get("scale"), self.parts.get("min")

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())


class KVPage:
    """K and V of one block of `tokens` token slots in one layer. A page held by several
    sequences (a shared prefix) is never written: kv/sequence.py copies it first."""

    def __init__(self, k: TokenStore, v: TokenStore):
        self.k, self.v = k, v

    @classmethod
    def empty(cls, k_codec: Codec, v_codec: Codec, heads: int, head_dim: int, tokens: int) -> KVPage:
        return cls(TokenStore(k_codec, heads, head_dim, tokens), TokenStore(v_codec, heads, head_dim, tokens))

    def copy(self) -> KVPage:
        return KVPage(self.k.copy(), self.v.copy())

    def export(self) -> dict[str, torch.Tensor]:
        """The page's encoded K and V as "k.<part>", "v.<part>" tensors (the disk tier's form)."""
        return prefixed(self.k.parts, self.v.parts)

    @classmethod
    def from_export(cls, k_codec: Codec, v_codec: Codec, heads: int, head_dim: int,
                    parts: dict[str, torch.Tensor]) -> KVPage:
        tokens = next(iter(parts.values())).shape[2]
        page = cls.empty(k_codec, v_codec, heads, head_dim, tokens)
        k_parts, v_parts = split_prefixed(parts)
        page.k.write_parts(0, k_parts)
        page.v.write_parts(0, v_parts)
        return page

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def prefixed(k_parts: dict[str, torch.Tensor], v_parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """K's and V's parts in one dict, as "k.<part>", "v.<part>" (the exported / disk form)."""
    return {f"k.{n}": p for n, p in k_parts.items()} | {f"v.{n}": p for n, p in v_parts.items()}


def split_prefixed(parts: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The inverse of prefixed: (K's parts, V's parts)."""
    return ({n[2:]: p for n, p in parts.items() if n.startswith("k.")},
            {n[2:]: p for n, p in parts.items() if n.startswith("v.")})
