"""Layers shared by every architecture: RMSNorm, rotary embeddings, attention over a cache."""
from __future__ import annotations

from functools import cached_property

import numpy as np

from edgellm import kernels
from edgellm.extras import lazy, torch
from edgellm.kernels.buffers import as_array
from edgellm.kv.cache import SlidingCausal, causal_mask
from edgellm.lora.apply import LayerAdapters, add_lora
from edgellm.module import Module

F = lazy("torch.nn.functional")


class RMSNorm(Module):
    """y = x / sqrt(mean(x²) + eps) · w, in fp32 (the residual stream's dtype) whatever x's.

    With `native` (fast mode), prompt-sized inputs take kernels/norm.c: `for_linear` hands the
    next linear its input in the compute dtype directly, `add_to` is a normed residual add in one
    pass. `weight` is float32 numpy (what the C layers read); `tensor` the same memory for PyTorch."""

    def __init__(self, weight: np.ndarray, eps: float, native: bool = False):
        self.weight = np.ascontiguousarray(as_array(weight), dtype=np.float32)
        self.shape = tuple(self.weight.shape)
        self.eps, self.native = eps, native

    @cached_property
    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.shape, self.tensor, self.eps)

    def for_linear(self, x: torch.Tensor) -> torch.Tensor:
        """Norm(x) as a linear's input: the compute dtype for a prompt in fast mode (the linear casts
        to it anyway)."""
        if self.native and kernels.rms_norm_supports(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        return self(x)

    def add_to(self, residual: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """residual + Norm(y)."""
        if self.native and kernels.add_rms_norm_supports(residual, y):
            return kernels.add_rms_norm(residual, y, self.weight, self.eps)
        return residual + self(y)


def head_norms(w, prefix: str, eps: float) -> tuple[RMSNorm | None, RMSNorm | None]:
    """The per-head RMSNorms of q and k a block's file holds (Qwen3, Gemma 3), else (None, None)."""
    return tuple(RMSNorm(w.vector(f"{prefix}.attn_{x}_norm.weight"), eps) if w.has(f"{prefix}.attn_{x}_norm.weight")
                 else None for x in "qk")


def weights_of(norms) -> list[np.ndarray | None]:
    """Each norm's weight, None for an absent one (what a native layer struct points to)."""
    return [None if n is None else n.weight for n in norms]


class Rotary:
    """Rotary position embedding in the "rotate half" layout: dimension i pairs with i + d/2.
    A partial rotation (`rotated_dims` < d) turns the first rotated_dims/2 pairs of that layout;
    the weights' rows are reordered to match it (partial_rotary_rows).

    θ_i = base^(-2i/d), optionally divided by per-frequency factors (Llama 3.1 stores them
    in the file as `rope_freqs`, Phi-3's LongRoPE as `rope_factors_short`), and cos, sin scaled
    by `magnitude` (LongRoPE's attention factor). Computed in numpy (`tables`); calling it gives
    the same as tensors, for the PyTorch layers."""

    def __init__(self, head_dim: int, base: float, freq_factors: np.ndarray | None = None, magnitude: float = 1.0,
                 rotated_dims: int | None = None):
        rotated = rotated_dims or head_dim
        inv_freq = 1.0 / base ** (np.arange(0, rotated, 2, dtype=np.float64) / rotated)
        if freq_factors is not None:
            inv_freq = inv_freq / np.asarray(as_array(freq_factors), dtype=np.float64)
        # a partial rotation's other dims (placed after its pairs by partial_rotary_rows) turn by 0
        self.inv_freq = np.concatenate([inv_freq, np.zeros((head_dim - rotated) // 2)]).astype(np.float32)
        self.rotated_pairs = rotated // 2
        self.magnitude = magnitude

    def rotate(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Move already-rotated keys x (..., D) by `delta` positions: R(p + δ) = R(δ)·R(p)."""
        cos, sin = (torch.from_numpy(t) for t in self._angles(np.array([delta])))
        return apply_rotary(x, cos[0, 0], sin[0, 0])

    def __call__(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.from_numpy(t) for t in self.tables(positions))

    def tables(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of each position's angles, both halves repeated: (T, 1, D) for
        positions (T,), (B, T, 1, D) for a batch's own positions (B, T); float32."""
        cos, sin = self._angles(positions)
        if self.magnitude == 1.0:
            return cos, sin
        cos, sin = cos * np.float32(self.magnitude), sin * np.float32(self.magnitude)
        half, r = self.inv_freq.shape[0], self.rotated_pairs
        cos[..., r:half] = cos[..., half + r:] = 1.0  # dims left unrotated are not scaled either
        return cos, sin

    def _angles(self, positions) -> tuple[np.ndarray, np.ndarray]:
        # cos and sin in float64, rounded to float32: float32 ones differ from the rounded exact ones
        # (torch's were not even the same bits from one call to the next, and a prompt's logits moved
        # by up to 0.16 with them); the angles themselves stay the float32 products
        angles = (np.asarray(as_array(positions), dtype=np.float32)[..., None] * self.inv_freq).astype(np.float64)
        angles = np.concatenate((angles, angles), axis=-1)[..., None, :]  # (..., T, 1, D)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def partial_rotary_rows(n_heads: int, head_dim: int, rotated_dims: int, rows: np.ndarray | None = None) -> np.ndarray:
    """Row order of a q or k weight (n_heads · head_dim rows) that moves each head's partially
    rotated dims into the full rotate-half layout: a file pairs dim i with i + r/2 within its first
    r dims and leaves the rest; after this order, pair i sits at i and i + d/2 (i < r/2) and the
    unrotated dims fill the places between. `rows`: an order to apply this one on top of."""
    half, pairs = head_dim // 2, rotated_dims // 2
    kept = np.arange(rotated_dims, head_dim)
    head = np.concatenate([np.arange(pairs), kept[:half - pairs], np.arange(pairs, rotated_dims), kept[half - pairs:]])
    order = (np.arange(n_heads)[:, None] * head_dim + head).reshape(-1).astype(np.int64)
    return order if rows is None else rows[order]


def llama3_rope_factors(head_dim: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_context: int) -> np.ndarray:
    """Llama 3.1's RoPE scaling as per-frequency divisors (what llama.cpp stores as rope_freqs):
    wavelengths longer than original_context / low_freq_factor are stretched by `factor`, shorter
    than original_context / high_freq_factor kept, and those between blended smoothly."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1)
    return 1 / ((1 - smooth) / factor + smooth)  # smooth 0: factor (long waves); 1: unchanged (short)


def as_tensors(per_layer: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer RoPE tables as tensors, a table shared by layers converted once."""
    converted: dict[int, tuple] = {}
    for pair in per_layer:
        if id(pair) not in converted:
            converted[id(pair)] = tuple(torch.from_numpy(t) for t in pair)
    return [converted[id(pair)] for pair in per_layer]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin with rotate_half(x1, x2) = (-x2, x1).

    x: (B, T, H, D) fp32; cos, sin: (T, 1, D). Few ops: decode speed is op count."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def norm_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], norm: RMSNorm | None = None, *,
              native: bool = False) -> torch.Tensor:
    """RoPE(Norm(x)) per head for x (B, T, H, D) fp32 (Norm: an optional per-head RMSNorm).

    `native` (fast mode): one in-place pass of kernels/rope.c over x, which must be a fresh
    tensor (e.g. a view of a linear's output)."""
    cos, sin = rope
    if native and kernels.norm_rope_supports(x, cos, sin):
        return kernels.norm_rope(x, cos, sin, None if norm is None else norm.weight, 0.0 if norm is None else norm.eps)
    return apply_rotary(x if norm is None else norm(x), cos, sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visibility, *, scale: float,
              native: bool = False, softcap: float | None = None) -> torch.Tensor:
    """Attention of new queries q (B, Hq, T, D) over cached keys k, v (B, Hkv, S, D).

    `visibility` comes from the cache: None (all keys), CAUSAL (the queries are the last T of
    the S positions; fused kernels skip the masked part), SlidingCausal (the same within a
    window) or a (T, S) bool mask. For a batch of sequences (LayerBatch) k, v and visibility
    are lists, one per sequence. `native` (fast mode) sends prompt chunks to
    kernels/attention.c; decode steps are already native or tiny. `softcap` (Gemma 2) caps the
    scores at ±softcap smoothly."""
    if isinstance(k, list):
        return torch.cat([attention(q[i:i + 1], k[i], v[i], visibility[i], scale=scale, native=native, softcap=softcap)
                          for i in range(len(k))])
    if native and q.shape[2] > 1 and kernels.attention_supports(q, k):
        if visibility is None:  # every key visible: the kernel's None means causal
            visibility = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
        if isinstance(visibility, torch.Tensor):
            return kernels.attention(q, k, v, scale, visibility, softcap=softcap)
        window = visibility.window if isinstance(visibility, SlidingCausal) else 0
        return kernels.attention(q, k, v, scale, None, window=window, softcap=softcap)
    if softcap is not None:
        return softcapped_attention(q, k, v, _mask(visibility, q.shape[2], k.shape[2]), scale, softcap)
    if isinstance(visibility, str) and q.shape[2] == k.shape[2]:  # a fresh prefill: the flash kernel's own causal path
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    # a later chunk: torch's is_causal aligns top-left, ours bottom-right, so CAUSAL goes as a mask
    mask = _mask(visibility, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _mask(visibility, t: int, s: int) -> torch.Tensor | None:
    """A cache's visibility as a (T, S) bool mask (None: everything visible)."""
    if isinstance(visibility, str):
        return causal_mask(t, s)
    if isinstance(visibility, SlidingCausal):
        return causal_mask(t, s, visibility.window)
    return visibility


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         softcap: float) -> torch.Tensor:
    """softmax(cap · tanh(q kᵀ · scale / cap), masked) v, grouped-query heads sharing k, v."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap * torch.tanh((q @ k.transpose(-1, -2)) * (scale / softcap))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


ACTIVATIONS = {"silu": lambda x: F.silu(x), "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(Module):
    """down(act(gate(x)) ⊙ up(x)), gate and up fused into one matmul at load time (or in the file:
    Phi-3's ffn_up holds gate then up).

    `activation` names one of ACTIVATIONS; a prompt's gate|up in fast mode goes through
    kernels/act.c in one pass instead of three ops."""

    def __init__(self, w, prefix: str, activation: str):
        fused = not w.has(f"{prefix}.ffn_gate.weight")
        self.gate_up_proj = w.linear(*([] if fused else [f"{prefix}.ffn_gate.weight"]), f"{prefix}.ffn_up.weight")
        self.down_proj = w.linear(f"{prefix}.ffn_down.weight")
        self.activation = activation
        self._act = ACTIVATIONS[activation]
        self.native = w.mode == "fast"  # exact mode stays pure PyTorch: the reference

    def forward(self, x: torch.Tensor, lora: LayerAdapters | None = None) -> torch.Tensor:
        gate_up = add_lora(lora, ("gate", "up"), x, self.gate_up_proj(x))
        if self.native and kernels.gated_act_supports(gate_up):
            h = kernels.gated_act(gate_up, self.activation)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self._act(gate) * up
        return add_lora(lora, ("down",), h, self.down_proj(h))
