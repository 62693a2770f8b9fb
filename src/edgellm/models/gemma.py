"""Gemma 2 and Gemma 3 (text): Llama-like blocks with four norms per block, GELU-gated MLP,
embeddings scaled by √d, and attention that alternates sliding-window layers with global ones.

    h = x + PostNorm_attn(Attn(RoPE(QNorm(W_q·n)), RoPE(KNorm(W_k·n)), W_v·n)),  n = PreNorm_attn(x)
    y = h + PostNorm_mlp(W_down · (gelu_tanh(W_gate·m) ⊙ W_up·m)),              m = PreNorm_mlp(h)

Gemma 3: q/k norms, five sliding layers (local RoPE base) per global one (global base).
Gemma 2: no q/k norms, sliding and global layers alternating, one RoPE base, and soft-capped
attention scores and final logits: s -> cap · tanh(s / cap).

GGUF files store every Gemma norm weight as (1 + w), so the plain RMSNorm applies."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from edgellm import families
from edgellm.extras import torch
from edgellm.models.native.decoder import FusedDecoder, fused_step
from edgellm.kv.config import LayerSpec
from edgellm.lora.apply import LayerAdapters, RowAdapters, add_lora
from edgellm.models.layers import GatedMLP, RMSNorm, Rotary, attention, head_norms, norm_rope, weights_of
from edgellm.models.weights import Weights
from edgellm.module import Module



@dataclass(frozen=True)
class GemmaConfig:
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
    rope_local_base: float
    sliding_window: int
    query_pre_attn_scalar: float
    architecture: str = "gemma3"
    sliding_pattern: int = 6  # every n-th layer attends globally (families/gemma3.py, gemma2.py)
    attn_softcap: float | None = None  # Gemma 2: attention scores soft-capped at this
    final_softcap: float | None = None  # Gemma 2: logits soft-capped at this

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_size: int, context_length: int | None = None) -> GemmaConfig:
        """(`context_length`, the context a model is loaded for, changes nothing here.)"""
        arch = meta["general.architecture"]
        get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
        heads, head_dim = int(get("attention.head_count")), int(get("attention.key_length", 256))
        family = families.get(arch).runtime(get, context_length)  # its layout and default RoPE bases
        base = float(get("rope.freq_base", family["default_rope_base"]))
        local = family["default_local_rope_base"] or base  # Gemma 3's sliding layers have their own
        return cls(
            architecture=arch,
            hidden_size=int(get("embedding_length")),
            n_layers=int(get("block_count")),
            n_heads=heads,
            n_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=vocab_size,
            context_length=int(get("context_length", 32768)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=base,
            rope_local_base=float(get("rope.local.freq_base", local)),
            sliding_pattern=family["sliding_pattern"],
            sliding_window=int(get("attention.sliding_window", 4096)),
            query_pre_attn_scalar=float(get("attention.query_pre_attn_scalar", head_dim)),
            attn_softcap=float(get("attn_logit_softcapping")) if get("attn_logit_softcapping") else None,
            final_softcap=float(get("final_logit_softcapping")) if get("final_logit_softcapping") else None,
        )

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_pattern != 0


class Attention(Module):
    def __init__(self, cfg: GemmaConfig, w: Weights, prefix: str, sliding: bool):
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv_proj = w.linear(f"{prefix}.attn_q.weight", f"{prefix}.attn_k.weight", f"{prefix}.attn_v.weight")
        self.o_proj = w.linear(f"{prefix}.attn_output.weight")
        self.native = w.mode == "fast"  # exact mode stays pure PyTorch: the reference
        self.q_norm, self.k_norm = head_norms(w, prefix, cfg.rms_eps)  # Gemma 3
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.softcap = cfg.attn_softcap
        self.window = cfg.sliding_window if sliding else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache,
                lora: LayerAdapters | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = add_lora(lora, ("q", "k", "v"), x, self.qkv_proj(x)).float().view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q = norm_rope(qkv[:, :, :self.n_heads], rope, self.q_norm, native=self.native).transpose(1, 2)  # (B, Hq, T, D)
        k = norm_rope(qkv[:, :, self.n_heads:-self.n_kv_heads], rope, self.k_norm, native=self.native).transpose(1, 2)
        v = qkv[:, :, -self.n_kv_heads:].transpose(1, 2)  # (B, Hkv, T, D)
        k, v, visibility = cache.update_and_fetch(k, v)
        out = attention(q, k, v, visibility, scale=self.scale, native=self.native, softcap=self.softcap)
        out = out.transpose(1, 2).reshape(b, t, -1)
        return add_lora(lora, ("o",), out, self.o_proj(out))


class Block(Module):
    def __init__(self, cfg: GemmaConfig, w: Weights, i: int):
        p, eps, native = f"blk.{i}", cfg.rms_eps, w.mode == "fast"
        self.sliding = cfg.is_sliding(i)
        self.attn_norm = RMSNorm(w.vector(f"{p}.attn_norm.weight"), eps, native)
        self.attn = Attention(cfg, w, p, self.sliding)
        self.post_attn_norm = RMSNorm(w.vector(f"{p}.post_attention_norm.weight"), eps, native)
        self.mlp_norm = RMSNorm(w.vector(f"{p}.ffn_norm.weight"), eps, native)
        self.mlp = GatedMLP(w, p, "gelu_tanh")
        self.post_mlp_norm = RMSNorm(w.vector(f"{p}.post_ffw_norm.weight"), eps, native)

    def forward(self, x: torch.Tensor, rope, cache, lora: LayerAdapters | None = None) -> torch.Tensor:
        h = self.post_attn_norm.add_to(x, self.attn(self.attn_norm.for_linear(x), rope, cache, lora))
        return self.post_mlp_norm.add_to(h, self.mlp(self.mlp_norm.for_linear(h), lora))

    def native_vectors(self) -> list[np.ndarray | None]:
        """What gemma_layer.c's struct points to, in its order (no q/k norms: Gemma 2)."""
        norms = [self.attn_norm, self.post_attn_norm, self.mlp_norm, self.post_mlp_norm, self.attn.q_norm,
                 self.attn.k_norm]
        return weights_of(norms)


class Gemma(Module):
    native_layer = "edgellm_gemma_layer"  # kernels/gemma_layer.c: a block's decode step in one call
    native_activation = "gelu_tanh"

    def __init__(self, cfg: GemmaConfig, w: Weights):
        self.config = cfg
        self.lm_head = w.linear("output.weight" if w.has("output.weight") else "token_embd.weight")
        self.embed = w.embedding("token_embd.weight", tied_head=None if w.has("output.weight") else self.lm_head)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.blocks = list(Block(cfg, w, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(w.vector("output_norm.weight"), cfg.rms_eps)
        self.rotary_local = Rotary(cfg.head_dim, cfg.rope_local_base)
        self.rotary_global = Rotary(cfg.head_dim, cfg.rope_base)
        self.mode = w.mode  # precision: "fast" or "exact" (the fp32 reference)
        self.decoder = FusedDecoder.build(self, w.mode)  # None: the PyTorch layers decode

    def rope_per_layer(self, positions) -> list[tuple[np.ndarray, np.ndarray]]:
        """(cos, sin) per layer, numpy: the local table on sliding layers, the global one on the others."""
        local, glob = self.rotary_local.tables(positions), self.rotary_global.tables(positions)
        return [local if block.sliding else glob for block in self.blocks]

    def cache_specs(self) -> list[LayerSpec]:
        """Sliding layers keep a ring of the window; global layers keep everything."""
        c = self.config
        return [LayerSpec(c.n_kv_heads, c.head_dim, c.sliding_window, self.rotary_local.rotate) if b.sliding
                else LayerSpec(c.n_kv_heads, c.head_dim, None, self.rotary_global.rotate) for b in self.blocks]

    def forward(self, tokens: torch.Tensor, caches: list, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T or 1, V) in fp32; caches advance by T."""
        logits = fused_step(self.decoder, tokens, caches, last_only)  # a decode step or short piece in C, where it applies
        if logits is not None:
            return logits
        tokens, positions = torch.as_tensor(tokens), caches.positions(tokens.shape[1])
        rope_local, rope_global = self.rotary_local(positions), self.rotary_global(positions)
        x, lora = self.embed(tokens) * self.embed_scale, RowAdapters.of(caches)
        for i, (block, cache) in enumerate(zip(self.blocks, caches)):
            x = block(x, rope_local if block.sliding else rope_global, cache, None if lora is None else lora.layer(i))
        return self.head(x[:, -1:] if last_only else x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of final hidden states; Gemma 2 soft-caps them."""
        logits = self.lm_head(self.norm(x)).float()
        cap = self.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def head_parts(self) -> tuple[RMSNorm, Module] | None:
        """(norm, lm_head) where head(x) is lm_head(norm(x)); None under a soft cap."""
        return (self.norm, self.lm_head) if self.config.final_softcap is None else None
