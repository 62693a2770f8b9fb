"""Per-layer KV caches behind one small protocol, so model code never asks which it has.

Keys are stored after RoPE. Positions are contiguous from 0 to offset-1; when a sliding
window with attention sinks evicts tokens, the survivors after the sinks are rotated back
by the number evicted (RoPE composes: R(p - n) = R(-n)·R(p)), so positions stay contiguous
and never outgrow the context the model was trained for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np

from edgellm.extras import torch
from edgellm.kv.codecs import Codec
from edgellm.kv.store import KVPage, TokenStore, prefixed, split_prefixed

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


Visibility = "None | str | SlidingCausal | torch.Tensor"
Rotate = Callable[["torch.Tensor", int], "torch.Tensor"]  # (keys (B, H, T, D), delta) -> keys at position + delta


class KVCache(Protocol):
    offset: int  # tokens held == position of the next token

    def reserve(self, tokens: int) -> None: ...
    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Visibility]: ...
    def evict(self, start: int, n: int) -> None: ...
    def trim(self, n: int) -> int: ...
    def keep_overwritten(self, n: int) -> None: ...  # before writing n tokens that trim(n) may undo
    def export(self, start: int, end: int) -> dict[str, torch.Tensor]: ...
    def import_(self, start: int, parts: dict[str, torch.Tensor]) -> None: ...
    @property
    def nbytes(self) -> int: ...

    # Blocks shared through the prefix cache (kv/sequence.py):
    def block(self, b: int) -> object | None: ...  # block b's KV for the cache (a dense cache's page itself); None: gone
    def adopt(self, b: int, block: object) -> None: ...  # take a cached block as block b
    def unshare(self, b: int) -> None: ...  # before writing block b while others hold it

    # What native kernels read and write in place (models/native/decoder.py):
    pages: list[KVPage]  # slot t lives in pages[t // page_tokens]
    page_tokens: int
    version: int  # changes whenever `pages` does
    codecs: tuple[Codec, Codec]  # K's and V's
    @property
    def capacity(self) -> int: ...  # token slots allocated
    @property
    def slot_positions(self) -> np.ndarray | None: ...  # a ring's position per slot (-1: empty)
    def mark_written(self, n: int) -> None: ...  # n tokens were appended in place


def causal_mask(t: int, s: int, window: int | None = None) -> torch.Tensor:
    """CAUSAL (or SlidingCausal) as a (T, S) bool mask: query i (position S - T + i) sees keys
    0..S-T+i (only the last `window` of them)."""
    q_pos = torch.arange(s - t, s)[:, None]
    k_pos = torch.arange(s)[None, :]
    visible = k_pos <= q_pos
    return visible if window is None else visible & (q_pos - k_pos < window)


class DenseCache:
    """All of a sequence's keys and values for one layer, in pages of `block_size` tokens: the
    KV blocks of kv/sequence.py. Sequences with a common prefix hold the same pages (`block`,
    `adopt`); a shared page is never written here — SequenceKV `unshare`s it first."""

    def __init__(self, k_codec: Codec, v_codec: Codec, kv_heads: int, head_dim: int, *, block_size: int = 32,
                 rotate: Rotate | None = None):
        self.codecs = (k_codec, v_codec)
        self.kv_heads, self.head_dim, self.page_tokens = kv_heads, head_dim, block_size
        self.pages: list[KVPage] = []
        self.rotate = rotate
        self.offset = 0
        self.version = 0  # changes whenever `pages` does (native views of the pages are rebuilt)

    def reserve(self, tokens: int) -> None:
        while self.capacity < tokens:
            self.pages.append(KVPage.empty(*self.codecs, self.kv_heads, self.head_dim, self.page_tokens))
            self.version += 1

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Visibility]:
        t, end = k.shape[2], self.offset + k.shape[2]
        self.reserve(end)
        for which, x in enumerate((k, v)):
            self._write(which, self.offset, self.codecs[which].encode(x))
        self.offset = end
        return self._read(0, 0, end), self._read(1, 0, end), None if t == 1 else CAUSAL

    def evict(self, start: int, n: int) -> None:
        """Drop tokens start..start+n-1; later ones move down and are rotated back n positions."""
        n = min(n, self.offset - start)
        tail = self.offset - start - n
        if tail:
            moved = self._read(0, start + n, start + n + tail)
            if self.rotate is not None:
                moved = self.rotate(moved, -n)
            self._write(0, start, self.codecs[0].encode(moved))
            self._write(1, start, self._read_parts(1, start + n, start + n + tail))
        self._shrink(self.offset - n)

    def trim(self, n: int) -> int:
        """Forget the newest n tokens (rejected speculation, a retried turn); returns how many."""
        n = min(n, self.offset)
        self._shrink(self.offset - n)
        return n

    def keep_overwritten(self, n: int) -> None:
        """Nothing to keep: new tokens never overwrite older ones here."""

    def _shrink(self, tokens: int) -> None:
        """Hold `tokens` tokens; whole pages beyond them go."""
        self.offset = tokens
        keep = -(-tokens // self.page_tokens)
        if keep < len(self.pages):
            del self.pages[keep:]
            self.version += 1

    def export(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Encoded K and V of positions start..end-1 (a copy)."""
        return prefixed(self._read_parts(0, start, end), self._read_parts(1, start, end))

    def import_(self, start: int, parts: dict[str, np.ndarray]) -> None:
        """Write exported positions back at `start` (the next position)."""
        k_parts, v_parts = split_prefixed(parts)
        end = start + next(iter(k_parts.values())).shape[2]
        self.reserve(end)
        self._write(0, start, k_parts)
        self._write(1, start, v_parts)
        self.offset = end

    # -- pages shared between sequences (the prefix cache) --------------------------------

    def block(self, b: int) -> KVPage:
        """Block b's page itself, for the prefix cache to hand to later sequences."""
        return self.pages[b]

    def adopt(self, b: int, page: KVPage) -> None:
        """Hold a cached block's page as block b (the next one), shared."""
        assert b == len(self.pages) == self.offset // self.page_tokens, "blocks are adopted in order"
        self.pages.append(page)
        self.offset += self.page_tokens
        self.version += 1

    def unshare(self, b: int) -> None:
        """Give block b a page of its own (copy on write)."""
        self.pages[b] = self.pages[b].copy()
        self.version += 1

    @property
    def nbytes(self) -> int:
        return sum(page.nbytes for page in self.pages)

    # -- spans of token slots over the pages ----------------------------------------------

    def _spans(self, start: int, end: int) -> Iterator[tuple[KVPage, int, int, int]]:
        """(page, first slot in it, last + 1, offset of the first slot from `start`) covering start..end-1."""
        size, at = self.page_tokens, start
        while at < end:
            page, lo = divmod(at, size)
            hi = min(size, lo + end - at)
            yield self.pages[page], lo, hi, at - start
            at += hi - lo

    def _store(self, page: KVPage, which: int) -> TokenStore:
        return page.k if which == 0 else page.v

    def _write(self, which: int, start: int, parts: dict) -> None:
        """Encoded parts (arrays, or the codec's tensors) at slots start..."""
        n = next(iter(parts.values())).shape[2]
        for page, lo, hi, at in self._spans(start, start + n):
            store = self._store(page, which)
            if isinstance(next(iter(parts.values())), np.ndarray):
                store.write_parts(lo, {name: p[:, :, at:at + hi - lo] for name, p in parts.items()})
            else:
                for name, p in parts.items():
                    store.tensors()[name][:, :, lo:hi] = p[:, :, at:at + hi - lo]

    def _read_parts(self, which: int, start: int, end: int) -> dict[str, np.ndarray]:
        spans = list(self._spans(start, end))
        names = self.codecs[which].part_shapes(self.head_dim)
        return {name: np.concatenate([self._store(page, which).parts[name][:, :, lo:hi] for page, lo, hi, _ in spans],
                                     axis=2) for name in names}

    def _read(self, which: int, start: int, end: int) -> torch.Tensor:
        spans = list(self._spans(start, end))
        names = self.codecs[which].part_shapes(self.head_dim)
        parts = {name: torch.cat([self._store(page, which).tensors()[name][:, :, lo:hi] for page, lo, hi, _ in spans],
                                 dim=2) for name in names}
        return self.codecs[which].decode(parts)

    # -- for native kernels that read and append in place --------------------------------

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_tokens

    @property
    def slot_positions(self) -> np.ndarray | None:
        return None  # slot i holds position i

    def mark_written(self, n: int) -> None:
        """n tokens were appended in place (within reserve()d capacity)."""
        self.offset += n


class RingCache:
    """A sliding-window layer's cache: `window` slots reused in a ring.

    Attention is order-free, so slots need no rotation: a query at position p sees the
    slots whose positions lie in (p - window, p]."""

    def __init__(self, k_codec: Codec, v_codec: Codec, kv_heads: int, head_dim: int, *, window: int,
                 block_size: int = 32, rotate: Rotate | None = None):
        self.window, self.block_size = window, block_size
        # Zeroed: empty slots are read (then masked), and 0 · NaN garbage would be NaN.
        self.k = TokenStore(k_codec, kv_heads, head_dim, window, zeroed=True)
        self.v = TokenStore(v_codec, kv_heads, head_dim, window, zeroed=True)
        self.codecs = (k_codec, v_codec)
        self._page = KVPage(self.k, self.v)
        self.positions = np.full(window, -1, dtype=np.int64)  # -1: empty slot (the native layers write it too)
        self.rotate = rotate
        self.offset = 0
        self.used_slots = 0  # slots 0..used_slots-1 have ever been written; attention skips the rest
        self._kept = None  # what keep_overwritten() saved: (first position, slots, positions, K and V parts)

    def reserve(self, tokens: int) -> None:
        """Nothing to do: the ring's slots are allocated up front."""

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Visibility]:
        t = k.shape[2]
        q_pos = torch.arange(self.offset, self.offset + t)
        if t == 1:
            self._write(k, v, q_pos)
            keys, values, k_pos = self.k.read(0, self.window), self.v.read(0, self.window), torch.from_numpy(self.positions)
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
            held = torch.from_numpy(held)
            return torch.cat((old_k[:, :, held], keys), dim=2), torch.cat((old_v[:, :, held], values), dim=2), None
        return torch.cat((old_k, keys), dim=2), torch.cat((old_v, values), dim=2), \
            torch.cat((torch.from_numpy(self.positions), q_pos))

    def _write(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        self._used_upto(int(pos[-1]) + 1)
        slots = pos % self.window
        first, n = int(slots[0]), k.shape[2]
        split = min(n, self.window - first)  # the write may wrap around the ring's end
        for lo, hi, dst in ((0, split, first), (split, n, 0)):
            if hi > lo:
                self.k.write(dst, k[:, :, lo:hi])
                self.v.write(dst, v[:, :, lo:hi])
                self.positions[dst:dst + hi - lo] = pos[lo:hi].numpy()

    def evict(self, start: int, n: int) -> None:
        """Positions shift down by n (tokens older than the window are gone already)."""
        live = self.positions >= start + n
        dropped = (self.positions >= start) & ~live
        self.positions[dropped] = -1
        if self.rotate is not None and bool(live.any()):
            keys = self.k.read(0, self.window)
            self.k.write(0, torch.where(torch.from_numpy(live)[None, None, :, None], self.rotate(keys, -n), keys))
        self.positions[live] -= n
        self.offset -= n

    def keep_overwritten(self, n: int) -> None:
        """Copy the slots the next n tokens will overwrite, so that trim(n) can give the older
        tokens back (speculative decoding writes guesses that may be rejected)."""
        slots = np.arange(self.offset, self.offset + min(n, self.window)) % self.window
        self._kept = (self.offset, slots, self.positions[slots].copy(), self._read_slots(slots))

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.positions[self.positions >= self.offset - n] = -1
        self.offset -= n
        self._restore_kept()
        return n

    def _restore_kept(self) -> None:
        """Put back the kept slots no token at or after the offset needs."""
        kept, self._kept = self._kept, None
        if kept is None:
            return
        start, slots, positions, parts = kept
        back = np.arange(start, start + len(slots)) >= self.offset  # slots of trimmed tokens
        if not bool(back.any()):
            return
        self._write_slots(slots[back], {name: value[:, :, back] for name, value in parts.items()}, positions[back])

    def export(self, start: int, end: int) -> dict[str, np.ndarray]:
        return self._read_slots(self._slots(start, end))

    def import_(self, start: int, parts: dict[str, np.ndarray]) -> None:
        n = next(iter(parts.values())).shape[2]
        keep = min(n, self.window)  # older positions would be overwritten anyway
        slots = np.arange(start + n - keep, start + n) % self.window
        self._write_slots(slots, {name: value[:, :, n - keep:] for name, value in parts.items()},
                          np.arange(start + n - keep, start + n))
        self.offset = start + n
        self._used_upto(self.offset)

    def _read_slots(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the encoded K and V at `slots`, in the exported form ("k.<part>", "v.<part>")."""
        return prefixed(*({n: p[:, :, slots] for n, p in store.parts.items()} for store in (self.k, self.v)))

    def _write_slots(self, slots: np.ndarray, parts: dict[str, np.ndarray], positions: np.ndarray) -> None:
        """Exported-form K and V into `slots`, which then hold `positions`."""
        for store, store_parts in zip((self.k, self.v), split_prefixed(parts)):
            for name, value in store_parts.items():
                store.parts[name][:, :, slots] = value
        self.positions[slots] = positions

    def _slots_in_order(self) -> np.ndarray | None:
        """The slots of the last min(offset, window) positions, oldest first, if the ring holds
        exactly those (it does unless eviction or trimming left gaps)."""
        try:
            return self._slots(max(0, self.offset - self.window), self.offset)
        except ValueError:
            return None

    def _slots(self, start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        slots = positions % self.window
        if not np.array_equal(self.positions[slots], positions):
            raise ValueError(f"positions {start}..{end - 1} are no longer in the ring")
        return slots

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.positions.nbytes

    # -- the prefix cache: a ring's blocks are copies -------------------------------------

    def block(self, b: int) -> dict[str, np.ndarray] | None:
        """Block b's KV as far as a sequence resuming at its end needs it: its last `window`
        positions (all of it unless the window is shorter than a block); None where the ring no
        longer holds them all (a piece ran past the block's end by more than the window allows)."""
        end = (b + 1) * self.block_size
        try:
            return self.export(max(b * self.block_size, end - self.window), end)
        except ValueError:
            return None

    def adopt(self, b: int, block: dict[str, np.ndarray]) -> None:
        n = next(iter(block.values())).shape[2]  # the block's last n positions (see block())
        self.import_((b + 1) * self.block_size - n, block)

    def unshare(self, b: int) -> None:
        """Nothing to do: a ring shares no slots."""

    # -- for native kernels that read and append in place: one page of `window` slots -----

    @property
    def pages(self) -> list[KVPage]:
        return [self._page]

    @property
    def page_tokens(self) -> int:
        return self.window

    version = 0  # the one page never changes

    @property
    def capacity(self) -> int:
        return self.window

    @property
    def slot_positions(self) -> np.ndarray:
        """Each slot's position (-1: empty); a native writer updates it with the slot."""
        return self.positions

    def mark_written(self, n: int) -> None:
        self.offset += n
        self._used_upto(self.offset)

    def _used_upto(self, end: int) -> None:
        """Positions up to `end` were written (slot p % window each; never shrinks)."""
        self.used_slots = max(self.used_slots, min(end, self.window))
