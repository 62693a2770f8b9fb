"""Token-indexed storage for one of K or V in one layer: encoded parts that grow in whole
blocks of tokens as the sequence grows, so memory follows the tokens actually held."""
from __future__ import annotations

import torch

from edgellm.kv.codecs import Codec


class TokenStore:
    """Encoded (B, H, tokens, ...) buffers; capacity grows block by block (or is fixed)."""

    def __init__(self, codec: Codec, batch: int, heads: int, head_dim: int, block_size: int,
                 fixed_capacity: int | None = None):
        self.codec, self.block_size, self.fixed = codec, block_size, fixed_capacity
        self.shapes = codec.part_shapes(head_dim)
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.parts: dict[str, torch.Tensor] = {
            name: torch.empty(batch, heads, 0, size, dtype=dtype) for name, (size, dtype) in self.shapes.items()}
        if fixed_capacity is not None:
            # Zeroed: empty ring slots are read (then masked), and 0 · NaN garbage would be NaN.
            self._resize(fixed_capacity)
            for part in self.parts.values():
                part.zero_()

    @property
    def capacity(self) -> int:
        return next(iter(self.parts.values())).shape[2]

    def ensure(self, tokens: int) -> None:
        """Grow to hold `tokens`, rounded up to whole blocks."""
        if tokens > self.capacity:
            if self.fixed is not None:
                raise ValueError(f"store of fixed capacity {self.fixed} cannot hold {tokens} tokens")
            self._resize(-(-tokens // self.block_size) * self.block_size)

    def shrink_to(self, tokens: int) -> None:
        """Return whole blocks beyond `tokens` (after trimming or eviction)."""
        blocks = -(-tokens // self.block_size) * self.block_size
        if self.fixed is None and blocks < self.capacity:
            self._resize(blocks, keep=tokens)

    def _resize(self, capacity: int, keep: int | None = None) -> None:
        keep = min(self.capacity, capacity) if keep is None else keep
        for name, old in self.parts.items():
            new = old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, :keep] = old[:, :, :keep]
            self.parts[name] = new

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

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy n token slots from src to dst (overlap-safe)."""
        for part in self.parts.values():
            part[:, :, dst:dst + n] = part[:, :, src:src + n].clone()

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The encoded buffers a native kernel reads and writes: values (float, or integer
        codes), and the per-group scale and minimum of the integer codecs (None for floats)."""
        values = self.parts["x"] if "x" in self.parts else self.parts["q"]
        return values, self.parts.get("scale"), self.parts.get("min")

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())
