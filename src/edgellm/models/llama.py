"""The Llama-like families (Llama 2/3, SmolLM2/3, Qwen2, Qwen3, Phi-3; families/ describes each):
pre-norm blocks of grouped-query attention with rotary positions and a SwiGLU MLP.

    h = x + W_o · Attn(RoPE(W_q·n), RoPE(W_k·n), W_v·n),   n = RMSNorm(x)
    y = h + W_down · (silu(W_gate·m) ⊙ W_up·m),            m = RMSNorm(h)

Qwen2 adds a bias to q, k, v; Qwen3 normalizes each head of q and k (RMSNorm over head_dim)
before RoPE (both variations come from the weights present); SmolLM3 leaves RoPE out of every
fourth layer (NoPE: `rope_layers`, from families/smollm3.py); Phi-3 stores q|k|v and gate|up fused, scales RoPE with
LongRoPE factors, may slide a window over every layer and may rotate only part of each head
(Phi-4-mini: `rope_dims`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from edgellm.extras import torch
from edgellm.models.native.decoder import FusedDecoder, fused_step
from edgellm import families
from edgellm.io.hf_names import unpermute_rows
from edgellm.kv.config import LayerSpec
from edgellm.lora.apply import LayerAdapters, RowAdapters, add_lora
from edgellm.models.layers import (GatedMLP, RMSNorm, Rotary, as_tensors, attention, head_norms, llama3_rope_factors,
                                   norm_rope, partial_rotary_rows, weights_of)
from edgellm.models.weights import Weights
from edgellm.module import Module


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    hf_qk_layout: bool = False  # q/k rows already in rotate-half order (HF checkpoints)
    # Llama 3.1 RoPE scaling (factor, low_freq_factor, high_freq_factor, original context), where a
    # file states it instead of storing rope_freqs (Hugging Face folders)
    llama3_rope: tuple[float, float, float, int] | None = None
    rope_layers: tuple[bool, ...] | None = None  # which layers rotate q and k (None: all)
    # Phi-3 LongRoPE: the original context, the attention factor and which factors ("short" within
    # the original context, "long" beyond it; tensors in a GGUF, `longrope_factors` where a Hugging
    # Face config lists them)
    longrope: tuple[int, float, str] | None = None
    longrope_factors: tuple[float, ...] | None = None
    sliding_window: int | None = None  # every layer sees only this many positions (Phi-3 mini)
    rope_dims: int | None = None  # RoPE rotates only the first rope_dims of each head (Phi-4-mini: 3/4)

    def is_sliding(self, i: int) -> bool:
        return self.sliding_window is not None

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_size: int, context_length: int | None = None) -> LlamaConfig:
        """Config from metadata; `context_length` (what the model is loaded for) picks Phi-3's
        LongRoPE factors."""
        arch = meta["general.architecture"]
        get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        fields = dict(
            architecture=arch,
            hidden_size=hidden,
            n_layers=int(get("block_count")),
            n_heads=heads,
            n_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=vocab_size,
            context_length=int(get("context_length", 4096)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            hf_qk_layout=bool(meta.get("edgellm.hf_qk_layout", False)),
            llama3_rope=_llama3_rope(get),
        )
        rope_dims = int(get("rope.dimension_count", fields["head_dim"]))
        fields["rope_dims"] = rope_dims if rope_dims != fields["head_dim"] else None
        return cls(**(fields | families.get(arch).runtime(get, context_length)))


def _llama3_rope(get) -> tuple[float, float, float, int] | None:
    if get("rope.scaling.type") != "llama3":
        return None
    return (float(get("rope.scaling.factor")), float(get("rope.scaling.low_freq_factor", 1.0)),
            float(get("rope.scaling.high_freq_factor", 4.0)), int(get("rope.scaling.original_context_length")))


def _qk_rows(cfg: LlamaConfig, names: list[str], permuted: bool) -> dict[str, np.ndarray]:
    """The row orders q and k are read in: llama.cpp's interleaved pairs back to rotate-half, and
    a partial rotation's dims moved so that its pairs sit D/2 apart like a full one's (the same
    order for q and k leaves every q·k as it was)."""
    q_rows = k_rows = None
    if permuted:
        q_rows, k_rows = unpermute_rows(cfg.n_heads, cfg.head_dim), unpermute_rows(cfg.n_kv_heads, cfg.head_dim)
    if cfg.rope_dims is not None:
        q_rows = partial_rotary_rows(cfg.n_heads, cfg.head_dim, cfg.rope_dims, q_rows)
        k_rows = partial_rotary_rows(cfg.n_kv_heads, cfg.head_dim, cfg.rope_dims, k_rows)
    if q_rows is None:
        return {}
    if len(names) == 1:  # q|k|v fused in the file: v keeps its rows
        q, k = len(q_rows), len(k_rows)
        v = np.arange(q + k, q + 2 * k, dtype=np.int64)
        return {names[0]: np.concatenate([q_rows, q + k_rows, v])}
    return {names[0]: q_rows, names[1]: k_rows}


class Attention(Module):
    def __init__(self, cfg: LlamaConfig, w: Weights, prefix: str, permuted: bool):
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        names = [f"{prefix}.attn_q.weight", f"{prefix}.attn_k.weight", f"{prefix}.attn_v.weight"]
        if w.has(f"{prefix}.attn_qkv.weight"):  # Phi-3: fused in the file
            names = [f"{prefix}.attn_qkv.weight"]
        rows = _qk_rows(cfg, names, permuted)
        self.qkv_proj = w.linear(*names, rows=rows)  # fused q, k, v
        self.qkv_bias = w.bias(*(n.replace(".weight", ".bias") for n in names))  # Qwen2 has one
        self.o_proj = w.linear(f"{prefix}.attn_output.weight")
        self.native = w.mode == "fast"  # exact mode stays pure PyTorch: the reference
        self.q_norm, self.k_norm = head_norms(w, prefix, cfg.rms_eps)  # Qwen3
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache,
                lora: LayerAdapters | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = add_lora(lora, ("q", "k", "v"), x, self.qkv_proj(x)).float()
        if self.qkv_bias is not None:
            qkv = qkv + torch.from_numpy(self.qkv_bias)
        qkv = qkv.view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        if self.q_norm is None:
            qk = norm_rope(qkv[:, :, :self.n_heads + self.n_kv_heads], rope, native=self.native)  # q and k in one go
            q, k = qk[:, :, :self.n_heads], qk[:, :, self.n_heads:]
        else:
            q = norm_rope(qkv[:, :, :self.n_heads], rope, self.q_norm, native=self.native)
            k = norm_rope(qkv[:, :, self.n_heads:self.n_heads + self.n_kv_heads], rope, self.k_norm, native=self.native)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, Hq or Hkv, T, D)
        v = qkv[:, :, self.n_heads + self.n_kv_heads:].transpose(1, 2)
        k, v, visibility = cache.update_and_fetch(k, v)
        out = attention(q, k, v, visibility, scale=self.scale, native=self.native).transpose(1, 2).reshape(b, t, -1)
        return add_lora(lora, ("o",), out, self.o_proj(out))


class Block(Module):
    def __init__(self, cfg: LlamaConfig, w: Weights, i: int, permuted: bool):
        p = f"blk.{i}"
        native = w.mode == "fast"
        self.attn_norm = RMSNorm(w.vector(f"{p}.attn_norm.weight"), cfg.rms_eps, native)
        self.attn = Attention(cfg, w, p, permuted)
        self.mlp_norm = RMSNorm(w.vector(f"{p}.ffn_norm.weight"), cfg.rms_eps, native)
        self.mlp = GatedMLP(w, p, "silu")

    def forward(self, x: torch.Tensor, rope, cache, lora: LayerAdapters | None = None) -> torch.Tensor:
        h = x + self.attn(self.attn_norm.for_linear(x), rope, cache, lora)
        return h + self.mlp(self.mlp_norm.for_linear(h), lora)

    def native_vectors(self) -> list[np.ndarray | None]:
        """What llama_layer.c's struct points to, in its order."""
        return [self.attn_norm.weight, self.mlp_norm.weight, self.attn.qkv_bias,
                *weights_of([self.attn.q_norm, self.attn.k_norm])]


class Llama(Module):
    native_layer = "edgellm_llama_layer"  # kernels/llama_layer.c: a block's decode step in one call
    native_activation = "silu"
    embed_scale = 1.0

    def __init__(self, cfg: LlamaConfig, w: Weights):
        self.config = cfg
        # llama.cpp interleaves Llama q/k rows; Qwen2 GGUFs and HF checkpoints keep HF's order
        permuted = families.get(cfg.architecture).permuted_qk and not cfg.hf_qk_layout
        self.lm_head = w.linear("output.weight" if w.has("output.weight") else "token_embd.weight")
        self.embed = w.embedding("token_embd.weight", tied_head=None if w.has("output.weight") else self.lm_head)
        self.blocks = list(Block(cfg, w, i, permuted) for i in range(cfg.n_layers))
        self.norm = RMSNorm(w.vector("output_norm.weight"), cfg.rms_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, self._rope_factors(cfg, w),
                             cfg.longrope[1] if cfg.longrope else 1.0, rotated_dims=cfg.rope_dims)
        self.mode = w.mode  # precision: "fast" or "exact" (the fp32 reference)
        self.decoder = FusedDecoder.build(self, w.mode)  # None: the PyTorch layers decode

    @staticmethod
    def _rope_factors(cfg: LlamaConfig, w: Weights) -> np.ndarray | None:
        """Per-frequency RoPE divisors: a GGUF's rope_freqs, or Llama 3.1's scaling computed."""
        if w.has("rope_freqs.weight"):
            return w.vector("rope_freqs.weight")
        if cfg.longrope is not None:
            name = f"rope_factors_{cfg.longrope[2]}.weight"
            return w.vector(name) if w.has(name) else np.array(cfg.longrope_factors, dtype=np.float32)
        if cfg.llama3_rope is not None:
            return llama3_rope_factors(cfg.head_dim, cfg.rope_base, *cfg.llama3_rope)
        return None

    def rope_per_layer(self, positions) -> list[tuple[np.ndarray, np.ndarray]]:
        """(cos, sin) per layer, numpy; a NoPE layer's is the identity rotation (cos 1, sin 0)."""
        rope = self.rotary.tables(positions)
        if self.config.rope_layers is None:
            return [rope] * len(self.blocks)
        identity = (np.ones_like(rope[0]), np.zeros_like(rope[1]))
        return [rope if rotates else identity for rotates in self.config.rope_layers]

    def cache_specs(self) -> list[LayerSpec]:
        c = self.config
        rotates = c.rope_layers or (True,) * c.n_layers
        return [LayerSpec(c.n_kv_heads, c.head_dim, c.sliding_window, self.rotary.rotate if r else None)
                for r in rotates]

    def forward(self, tokens: torch.Tensor, caches: list, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T or 1, V) in fp32; caches advance by T (each sequence's
        adapter, if it has one, applies to its rows)."""
        logits = fused_step(self.decoder, tokens, caches, last_only)  # a decode step or short piece in C, where it applies
        if logits is not None:
            return logits
        tokens = torch.as_tensor(tokens)
        ropes = as_tensors(self.rope_per_layer(caches.positions(tokens.shape[1])))
        x, lora = self.embed(tokens), RowAdapters.of(caches)
        for i, (block, cache, rope) in enumerate(zip(self.blocks, caches, ropes)):
            x = block(x, rope, cache, None if lora is None else lora.layer(i))
        return self.head(x[:, -1:] if last_only else x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of final hidden states."""
        return self.lm_head(self.norm(x)).float()

    def head_parts(self) -> tuple[RMSNorm, Module]:
        """head(x) is lm_head(norm(x)), nothing more (the native decoder may run it itself)."""
        return self.norm, self.lm_head
