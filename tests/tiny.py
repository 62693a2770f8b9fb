"""Tiny random models written as real GGUF files, with the matching transformers model.

The GGUF side follows llama.cpp's converter: Llama q/k rows are permuted for its rotary
layout, Gemma norm weights are stored as 1 + w. The transformers side gets the original
tensors, so a parity check covers those conventions too."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 128, 96, 2


def _permute_for_gguf(w: np.ndarray, n_heads: int) -> np.ndarray:
    # HF rotate-half rows -> llama.cpp interleaved rows (what convert_hf_to_gguf does)
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(writer, name: str, array: np.ndarray, qtype) -> None:
    import gguf

    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype in (None, gguf.GGMLQuantizationType.F32) or array.ndim == 1:
        writer.add_tensor(name, array)
    elif qtype == gguf.GGMLQuantizationType.IQ4_NL:  # gguf-py reads it but cannot write it
        writer.add_tensor(name, quantize_iq4_nl(array), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of w (rows, cols): per 32 values an fp16 scale and the nearest of the 16
    levels, Q4_0's nibble order (value j low nibble of byte j, value j + 16 its high nibble)."""
    from edgellm.quant.ggml import IQ4_NL_LEVELS

    levels = np.array(IQ4_NL_LEVELS, dtype=np.float32)
    blocks = w.reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1, keepdims=True) / 127).astype(np.float16)
    q = np.abs(blocks[:, :, None] / np.maximum(d.astype(np.float32), 1e-12)[:, :, None] - levels).argmin(-1)
    packed = (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)
    return np.concatenate([d.view(np.uint8), packed], axis=1).reshape(w.shape[0], -1)


def _tokenizer_metadata(writer, kind: str) -> None:
    if kind == "llama":  # a SentencePiece vocabulary, Gemma-style: no prefix space, byte fallback
        _sentencepiece_metadata(writer)
        return
    tokens = [f"<t{i}>" for i in range(VOCAB)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    writer.add_bos_token_id(1)


def sentencepiece_tokens() -> list[str]:
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁a", "▁b", "ab", "ba", "▁ab", "abc", "\n"]
    pieces += [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "aeiou" if a + b not in pieces]
    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<0xC3>", "<0xA9>"]
    return (special + pieces)[:VOCAB]


def _sentencepiece_metadata(writer) -> None:
    tokens = sentencepiece_tokens()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 2, 3, 3, 6, 6] + [1] * (len(tokens) - 8))
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(False)


def random_weights(arch: str, seed: int = 0, head_dim: int = HEAD_DIM, layers: int = LAYERS,
                   vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors for a tiny model of `arch` (llama, qwen2, qwen3, smollm3, phi3, gemma2, gemma3)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=0.08: torch.randn(*shape, generator=g) * s  # noqa: E731
    w = {"model.embed_tokens.weight": r(vocab, HIDDEN, s=0.5), "model.norm.weight": 1 + r(HIDDEN, s=0.1)}
    for i in range(layers):
        p = f"model.layers.{i}"
        w |= {f"{p}.self_attn.q_proj.weight": r(HEADS * head_dim, HIDDEN),
              f"{p}.self_attn.k_proj.weight": r(KV_HEADS * head_dim, HIDDEN),
              f"{p}.self_attn.v_proj.weight": r(KV_HEADS * head_dim, HIDDEN),
              f"{p}.self_attn.o_proj.weight": r(HIDDEN, HEADS * head_dim),
              f"{p}.mlp.gate_proj.weight": r(FFN, HIDDEN), f"{p}.mlp.up_proj.weight": r(FFN, HIDDEN),
              f"{p}.mlp.down_proj.weight": r(HIDDEN, FFN),
              f"{p}.input_layernorm.weight": 1 + r(HIDDEN, s=0.1),
              f"{p}.post_attention_layernorm.weight": 1 + r(HIDDEN, s=0.1)}
        if arch == "qwen2":
            w |= {f"{p}.self_attn.{x}_proj.bias": r(n * head_dim, s=0.1)
                  for x, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
        if arch == "qwen3":  # per-head q/k RMSNorm before RoPE
            w |= {f"{p}.self_attn.q_norm.weight": 1 + r(head_dim, s=0.1),
                  f"{p}.self_attn.k_norm.weight": 1 + r(head_dim, s=0.1)}
        if arch in ("gemma2", "gemma3"):
            w |= {f"{p}.pre_feedforward_layernorm.weight": r(HIDDEN, s=0.1),
                  f"{p}.post_feedforward_layernorm.weight": r(HIDDEN, s=0.1)}
        if arch == "gemma3":
            w |= {f"{p}.self_attn.q_norm.weight": r(head_dim, s=0.1),
                  f"{p}.self_attn.k_norm.weight": r(head_dim, s=0.1)}
        if arch in ("gemma2", "gemma3"):
            # Gemma's HF norms are (1 + w) with w near 0
            w[f"{p}.input_layernorm.weight"] -= 1
            w[f"{p}.post_attention_layernorm.weight"] -= 1
    if arch in ("gemma2", "gemma3"):
        w["model.norm.weight"] -= 1
    if arch == "phi3":  # q|k|v and gate|up fused, as Phi-3 checkpoints store them
        for i in range(layers):
            p = f"model.layers.{i}"
            w[f"{p}.self_attn.qkv_proj.weight"] = torch.cat([w.pop(f"{p}.self_attn.{x}_proj.weight") for x in "qkv"])
            w[f"{p}.mlp.gate_up_proj.weight"] = torch.cat([w.pop(f"{p}.mlp.{x}_proj.weight") for x in ("gate", "up")])
    return w


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
}


def _gguf_name(arch: str, hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, i, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    norms = {"input_layernorm": "attn_norm",
             "post_attention_layernorm": "post_attention_norm" if arch.startswith("gemma") else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    return f"blk.{i}.{norms.get(module) or _GGUF_NAMES[module]}.{kind}"


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # TOKENS run past the original 16 positions


# Phi-3 LongRoPE: a context 4x the original one (so an attention factor applies); the short
# factors are what runs at TOKENS' length
# Gemma 2's attention and final soft caps: small, so that they bite on these random weights
GEMMA2_SOFTCAPS = (2.0, 3.0)
PHI3_CONTEXT, PHI3_ORIGINAL = 256, 64
PHI3_ATTN_FACTOR = float(np.sqrt(1 + np.log(PHI3_CONTEXT / PHI3_ORIGINAL) / np.log(PHI3_ORIGINAL)))


def phi3_rope(head_dim: int, partial_rotary: float = 1.0) -> dict:
    pairs = int(head_dim * partial_rotary) // 2
    return {"rope_type": "longrope", "original_max_position_embeddings": PHI3_ORIGINAL,
            "short_factor": [1.0 + 0.3 * i for i in range(pairs)], "long_factor": [4.0] * pairs}


def llama3_rope_freqs(head_dim: int, base: float, spec: dict) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1 scaling, per frequency."""
    factor, low, high = spec["factor"], spec["low_freq_factor"], spec["high_freq_factor"]
    old = spec["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: Path, arch: str, weights: dict[str, torch.Tensor], qtype=None,
               sliding_window: int = 8, tokenizer: str = "gpt2", head_dim: int = HEAD_DIM,
               rope_freqs: np.ndarray | None = None, layers: int = LAYERS, partial_rotary: float = 1.0) -> Path:
    """Write `weights` (HF names) as a GGUF file the way llama.cpp's converter would
    (`partial_rotary`: Phi-3's share of each head that RoPE turns)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(GEMMA2_SOFTCAPS[0])
        writer.add_final_logit_softcapping(GEMMA2_SOFTCAPS[1])
    _tokenizer_metadata(writer, tokenizer)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    if arch == "phi3":  # sliding window and LongRoPE, as llama.cpp's converter writes them
        writer.add_sliding_window(sliding_window)
        writer.add_rope_scaling_orig_ctx_len(PHI3_ORIGINAL)
        writer.add_rope_scaling_attn_factors(PHI3_ATTN_FACTOR)
        writer.add_rope_dimension_count(int(head_dim * partial_rotary))
        for kind in ("short", "long"):
            factors = phi3_rope(head_dim, partial_rotary)[f"{kind}_factor"]
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(factors, dtype=np.float32))
    for hf_name, tensor in weights.items():
        array = tensor.numpy()
        if arch in ("llama", "smollm3") and ("q_proj.weight" in hf_name or "k_proj.weight" in hf_name):
            array = _permute_for_gguf(array, HEADS if "q_proj" in hf_name else KV_HEADS)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            array = array + 1
        is_matrix = array.ndim == 2 and "embed_tokens" not in hf_name
        _add(writer, _gguf_name(arch, hf_name), array, qtype if is_matrix else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_model(arch: str, weights: dict[str, torch.Tensor], sliding_window: int = 8, head_dim: int = HEAD_DIM,
             rope: dict | None = None, layers: int = LAYERS, partial_rotary: float = 1.0):
    """The transformers model with the same weights (fp32, eager attention); `rope`: RoPE
    parameters other than the default (e.g. LLAMA3_ROPE); `partial_rotary`: Phi-3's
    partial_rotary_factor."""
    import transformers

    vocab = weights["model.embed_tokens.weight"].shape[0]
    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=head_dim,
                  rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=True)
    if arch == "gemma3":
        config = transformers.Gemma3TextConfig(**common, sliding_window=sliding_window, query_pre_attn_scalar=head_dim,
                                               rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh")
        model_cls = transformers.Gemma3ForCausalLM
    elif arch == "gemma2":
        config = transformers.Gemma2Config(**common, sliding_window=sliding_window, query_pre_attn_scalar=head_dim,
                                           rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh",
                                           attn_logit_softcapping=GEMMA2_SOFTCAPS[0],
                                           final_logit_softcapping=GEMMA2_SOFTCAPS[1])
        model_cls = transformers.Gemma2ForCausalLM
    elif arch == "qwen2":
        config, model_cls = transformers.Qwen2Config(**common, rope_theta=10000.0), transformers.Qwen2ForCausalLM
    elif arch == "smollm3":  # every fourth layer without RoPE
        config = transformers.SmolLM3Config(**common, rope_theta=10000.0, pad_token_id=None, bos_token_id=1, eos_token_id=0)
        model_cls = transformers.SmolLM3ForCausalLM
    elif arch == "phi3":
        config = transformers.Phi3Config(**(common | {"max_position_embeddings": PHI3_CONTEXT}), sliding_window=sliding_window,
                                         original_max_position_embeddings=PHI3_ORIGINAL,
                                         rope_parameters={"rope_theta": 10000.0, **phi3_rope(head_dim, partial_rotary),
                                                          "partial_rotary_factor": partial_rotary},
                                         partial_rotary_factor=partial_rotary, pad_token_id=None,
                                         bos_token_id=1, eos_token_id=0)
        model_cls = transformers.Phi3ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, rope_theta=10000.0, attention_bias=False)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0} | (rope or {})
        config = transformers.LlamaConfig(**common, rope_parameters=rope_parameters)
        model_cls = transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model
