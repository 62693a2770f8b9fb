"""Tiny random models written as real GGUF files, with the matching transformers model.

The GGUF side follows llama.cpp's converter: Llama q/k rows are permuted for its rotary
layout, Gemma norm weights are stored as 1 + w. The transformers side gets the original
tensors, so a parity check covers those conventions too."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edgellm import families
from edgellm.io.hf_names import gguf_name, hf_name

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
    """HF-named float32 tensors for a tiny model of any family (families.names()): the tensors its
    family module says a block has, fused where its checkpoints fuse them."""
    family = families.get(arch)
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=0.08: torch.randn(*shape, generator=g) * s  # noqa: E731
    # a norm's weight: near 1, or near 0 where the checkpoint stores w for a (1 + w) norm (Gemma)
    norm = (lambda n: r(n, s=0.1)) if family.norms_plus_one else (lambda n: 1 + r(n, s=0.1))  # noqa: E731
    w = {"model.embed_tokens.weight": r(vocab, HIDDEN, s=0.5), "model.norm.weight": norm(HIDDEN)}
    for i in range(layers):
        for name, shape in family.block_tensors(i, HIDDEN, HEADS, KV_HEADS, head_dim, FFN):
            w[hf_name(arch, name)] = r(*shape) if len(shape) == 2 else r(*shape, s=0.1) if name.endswith("bias") \
                else norm(*shape)
    return w


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # TOKENS run past the original 16 positions


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
    """Write `weights` (HF names) as a GGUF file the way llama.cpp's converter would: the family's
    q/k rows permuted and norms stored as 1 + w where its converter does so, and what its family
    module adds for a tiny model (windows, caps, LongRoPE; `partial_rotary`: the share of each head
    RoPE turns)."""
    import gguf

    family = families.get(arch)
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
    options = {"sliding_window": sliding_window, "partial_rotary": partial_rotary}
    for key, value in family.tiny_metadata(head_dim, **options).items():
        writer.add_key_value(key, value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32)
    _tokenizer_metadata(writer, tokenizer)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for name, array in family.tiny_tensors(head_dim, **options).items():
        writer.add_tensor(name, array)
    for hf, tensor in weights.items():
        array = tensor.numpy()
        if family.permuted_qk and ("q_proj.weight" in hf or "k_proj.weight" in hf):
            array = _permute_for_gguf(array, HEADS if "q_proj" in hf else KV_HEADS)
        if family.norms_plus_one and hf.endswith("norm.weight"):
            array = array + 1
        is_matrix = array.ndim == 2 and "embed_tokens" not in hf
        _add(writer, gguf_name(arch, hf), array, qtype if is_matrix else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_model(arch: str, weights: dict[str, torch.Tensor], sliding_window: int = 8, head_dim: int = HEAD_DIM,
             rope: dict | None = None, layers: int = LAYERS, partial_rotary: float = 1.0):
    """The transformers model with the same weights (fp32, eager attention), configured as the
    family module says a tiny model is; `rope`: RoPE parameters other than the default (e.g.
    LLAMA3_ROPE); `partial_rotary`: Phi-3's partial_rotary_factor."""
    import transformers

    family = families.get(arch)
    vocab = weights["model.embed_tokens.weight"].shape[0]
    fields = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=head_dim,
                  rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=True)
    fields |= family.tiny_hf_config(head_dim, sliding_window=sliding_window, partial_rotary=partial_rotary)
    if rope is not None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0} | rope
    config = getattr(transformers, family.hf_config_class)(**fields)
    config._attn_implementation = "eager"
    model = getattr(transformers, family.hf_class)(config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model
