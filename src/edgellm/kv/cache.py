"""Per-layer KV caches behind one small protocol, so model code never asks which it has.

Keys are stored after RoPE. Positions are contiguous from 0 to offset-1; when a sliding
window with attention sinks evicts tokens, the survivors after the sinks are rotated back
by the number evicted (RoPE composes: R(p - n) = R(-n)·R(p)), so positions stay contiguous
and never outgrow the context the model was trained for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from edgellm.kv.codecs import Codec
from edgellm.kv.store import TokenStore

# What the queries of one update may see: None = every cached key (a decode step);
# CAUSAL = the T queries are the last T of the S positions and query i sees keys 0..S-T+i
# (a fresh prefill is the square case); SlidingCausal = CAUSAL within a window; or a (T, S)
# bool mask.
CAUSAL = "causal"


@dataclass(frozen=True)
class SlidingCausal:
    """CAUSAL, each query seeing only the `window` newest keys up to its own (keys in position
    order): a sliding-window layer's later prompt chunk, which kernels need not mask."""

    window: int


Visibility = None | str | SlidingCausal | torch.Tensor
Rotate = Callable[[torch.Tensor, int], torch.Tensor]  # (keys (B, H, T, D), delta) -> keys at position + delta


class KVCache(Protocol):
    offset: int  # tokens held == position of the next token

    def reserve(self, tokens: int) -> None: ...
    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Visibility]: ...
    def evict(self, start: int, n: int) -> None: ...
    def trim(self, n: int) -> int: ...
    def export(self, start: int, end: int) -> dict[str, torch.Tensor]: ...
    def import_(self, start: int, parts: dict[str, torch.Tensor]) -> None: ...
    @property
    def nbytes(self) -> int: ...

    # What native kernels read and write in place (kernels/decode.py):
    @property
    def stores(self) -> tuple[TokenStore, TokenStore]: ...  # K and V
    @property
    def capacity(self) -> int: ...  # token slots allocated
    @property
    def slot_positions(self) -> torch.Tensor | None: ...  # a ring's position per slot (-1: empty)
    def mark_written(self, n: int) -> None: ...  # n tokens were appended in place


def causal_mask(t: int, s: int, window: int | None = None) -> torch.Tensor:
    """CAUSAL (or SlidingCausal) as a (T, S) bool mask: query i (position S - T + i) sees keys
    0..S-T+i (only the last `window` of them)."""
    q_pos = torch.arange(s - t, s)[:, None]
    k_pos = torch.arange(s)[None, :]
    visible = k_pos <= q_pos
    return visible if window is None else visible & (q_pos - k_pos < window)


class DenseCache:
    """All of a sequence's keys and values for one layer, grown block by block."""

    def __init__(self, k_codec: Codec, v_codec: Codec, kv_heads: int, head_dim: int, *, block_size: int = 32,
                 rotate: Rotate | None = None, batch: int = 1):
        self.k = TokenStore(k_codec, batch, kv_heads, head_dim, block_size)
        self.v = TokenStore(v_codec, batch, kv_heads, head_dim, block_size)
        self.rotate = rotate
        self.offset = 0

    def reserve(self, tokens: int) -> None:
        self.k.ensure(tokens)
        self.v.ensure(tokens)

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Visibility]:
        t, end = k.shape[2], self.offset + k.shape[2]
        for store, x in ((self.k, k), (self.v, v)):
            store.ensure(end)
            store.write(self.offset, x)
        self.offset = end
        return self.k.read(0, end), self.v.read(0, end), None if t == 1 else CAUSAL

    def evict(self, start: int, n: int) -> None:
        """Drop tokens start..start+n-1; later ones move down and are rotated back n positions."""
        n = min(n, self.offset - start)
        tail = self.offset - start - n
        if tail:
            moved = self.k.read(start + n, start + n + tail)
            if self.rotate is not None:
                moved = self.rotate(moved, -n)
            self.k.write(start, moved)
            self.v.move(start + n, start, tail)
        self.offset -= n
        self.k.shrink_to(self.offset)
        self.v.shrink_to(self.offset)

    def trim(self, n: int) -> int:
        """Forget the newest n tokens (rejected speculation, a retried turn); returns how many."""
        n = min(n, self.offset)
        self.offset -= n
        self.k.shrink_to(self.offset)
        self.v.shrink_to(self.offset)
        return n

    def export(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Encoded K and V of positions start..end-1."""
        return _prefixed(self.k.read_parts(start, end), self.v.read_parts(start, end))

    def import_(self, start: int, parts: dict[str, torch.Tensor]) -> None:
        """Write exported positions back at `start` (the next position): prefix reuse."""
        k_parts, v_parts = _split(parts)
        end = start + next(iter(k_parts.values())).shape[2]
        for store, p in ((self.k, k_parts), (self.v, v_parts)):
            store.ensure(end)
            store.write_parts(start, p)
        self.offset = end

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    # -- for native kernels that read and append in place --------------------------------

    @property
    def stores(self) -> tuple[TokenStore, TokenStore]:
        return self.k, self.v

    @property
    def capacity(self) -> int:
        return self.k.capacity

    @property
    def slot_positions(self) -> torch.Tensor | None:
        return None  # slot i holds position i

    def mark_written(self, n: int) -> None:
        """n tokens were appended in place (within reserve()d capacity)."""
        self.offset += n



class RingCache:
    """A sliding-window layer's cache: `window` slots reused in a ring.

    Attention is order-free, so slots need no rotation: a query at position p sees the
    slots whose positions lie in (p - window, p]."""

    def __init__(self, k_codec: Codec, v_codec: Codec, kv_heads: int, head_dim: int, *, window: int,
                 rotate: Rotate | None = None, batch: int = 1):
        self.window = window
        self.k = TokenStore(k_codec, batch, kv_heads, head_dim, window, fixed_capacity=window)
        self.v = TokenStore(v_codec, batch, kv_heads, head_dim, window, fixed_capacity=window)
        self.positions = torch.full((window,), -1, dtype=torch.long)  # -1: empty slot
        self.rotate = rotate
        self.offset = 0

    def reserve(self, tokens: int) -> None:
        """Nothing to do: the ring's slots are allocated up front."""

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Visibility]:
        t = k.shape[2]
        q_pos = torch.arange(self.offset, self.offset + t)
        if t == 1:
            self._write(k, v, q_pos)
            keys, values, k_pos = self.k.read(0, self.window), self.v.read(0, self.window), self.positions
        else:
            keys, values, k_pos = self._chunk_keys(k, v, q_pos)
            self._write(k[:, :, -self.window:], v[:, :, -self.window:], q_pos[-self.window:])
        self.offset += t
        if k_pos is None:  # keys in position order, the chunk's own last
            return keys, values, CAUSAL if keys.shape[2] <= self.window else SlidingCausal(self.window)
        visible = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - k_pos[None, :] < self.window)
        return keys, values, (None if t == 1 and bool(visible.all()) else visible)

    def _chunk_keys(self, k: torch.Tensor, v: torch.Tensor,
                    q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a prompt chunk attends over: the ring's positions oldest first, then its own
        (positions None: in order); or, where eviction or trimming left gaps in the ring, every
        slot and then its own, with their positions for a mask."""
        keys, values = k.float(), v.float()
        if self.offset == 0:
            return keys, values, None
        old_k, old_v, held = self.k.read(0, self.window), self.v.read(0, self.window), self._slots_in_order()
        if held is not None:
            return torch.cat((old_k[:, :, held], keys), dim=2), torch.cat((old_v[:, :, held], values), dim=2), None
        return torch.cat((old_k, keys), dim=2), torch.cat((old_v, values), dim=2), torch.cat((self.positions, q_pos))

    def _write(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        slots = pos % self.window
        first, n = int(slots[0]), k.shape[2]
        split = min(n, self.window - first)  # the write may wrap around the ring's end
        for lo, hi, dst in ((0, split, first), (split, n, 0)):
            if hi > lo:
                self.k.write(dst, k[:, :, lo:hi])
                self.v.write(dst, v[:, :, lo:hi])
                self.positions[dst:dst + hi - lo] = pos[lo:hi]

    def evict(self, start: int, n: int) -> None:
        """Positions shift down by n (tokens older than the window are gone already)."""
        live = self.positions >= start + n
        dropped = (self.positions >= start) & ~live
        self.positions[dropped] = -1
        if self.rotate is not None and bool(live.any()):
            keys = self.k.read(0, self.window)
            self.k.write(0, torch.where(live[None, None, :, None], self.rotate(keys, -n), keys))
        self.positions[live] -= n
        self.offset -= n

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.positions[self.positions >= self.offset - n] = -1
        self.offset -= n
        return n

    def export(self, start: int, end: int) -> dict[str, torch.Tensor]:
        slots = self._slots(start, end)
        return _prefixed(*({n: p[:, :, slots].clone() for n, p in store.parts.items()} for store in (self.k, self.v)))

    def import_(self, start: int, parts: dict[str, torch.Tensor]) -> None:
        k_parts, v_parts = _split(parts)
        n = next(iter(k_parts.values())).shape[2]
        keep = min(n, self.window)  # older positions would be overwritten anyway
        slots = torch.arange(start + n - keep, start + n) % self.window
        for store, p in ((self.k, k_parts), (self.v, v_parts)):
            for name, value in p.items():
                store.parts[name][:, :, slots] = value[:, :, n - keep:]
        self.positions[slots] = torch.arange(start + n - keep, start + n)
        self.offset = start + n

    def _slots_in_order(self) -> torch.Tensor | None:
        """The slots of the last min(offset, window) positions, oldest first, if the ring holds
        exactly those (it does unless eviction or trimming left gaps)."""
        try:
            return self._slots(max(0, self.offset - self.window), self.offset)
        except ValueError:
            return None

    def _slots(self, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        slots = positions % self.window
        if not torch.equal(self.positions[slots], positions):
            raise ValueError(f"positions {start}..{end - 1} are no longer in the ring")
        return slots

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.positions.numel() * 8

    # -- for native kernels that read and append in place --------------------------------

    @property
    def stores(self) -> tuple[TokenStore, TokenStore]:
        return self.k, self.v

    @property
    def capacity(self) -> int:
        return self.window

    @property
    def slot_positions(self) -> torch.Tensor:
        """Each slot's position (-1: empty); a native writer updates it with the slot."""
        return self.positions

    def mark_written(self, n: int) -> None:
        self.offset += n




def _prefixed(k_parts: dict[str, torch.Tensor], v_parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"k.{n}": p for n, p in k_parts.items()} | {f"v.{n}": p for n, p in v_parts.items()}


def _split(parts: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return ({n[2:]: p for n, p in parts.items() if n.startswith("k.")},
            {n[2:]: p for n, p in parts.items() if n.startswith("v.")})
