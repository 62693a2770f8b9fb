"""Native kernels where PyTorch has none fast enough, compiled from C at first use (build.py).

Decode (gemv.py): `int4_gemv` multiplies a few activation rows by a weight in torch's packed INT4
layout (the bytes `_weight_int4pack_mm_for_cpu` reads: no second copy) with AVX-512 VNNI integer
dot products; `block_gemv` by GGUF Q8_0 / Q5_0 / Q6_K weights straight from the model file
(quant/blocks.py). llama_layer.c and gemma3_layer.c run a whole decoder layer for one token on
these (decode.py).

Prompts (prompt.py): `int4_unpack_bf16` and `blocks_to_bf16` unpack weights into one reused bf16
scratch for the bf16 GEMM (~3x the INT4 kernel here); `attention` runs a chunk's attention 2-4x
faster than PyTorch's flash kernel; `gated_act` is the gated MLP's act(gate)·up in one pass;
`norm_rope` a per-head norm and RoPE in place; `rms_norm_bf16` / `add_rms_norm` a sublayer's
norm with its cast or residual add. EDGELLM_KERNELS=0 turns all of it off."""
from edgellm.kernels.build import available, library, profiled
from edgellm.kernels.gemv import MAX_ROWS, block_gemv, int4_gemv, supports
from edgellm.kernels.prompt import (SCRATCH_ROWS, add_rms_norm, add_rms_norm_supports, attention, attention_bf16_values,
                                    attention_supports, blocks_to_bf16, gated_act, gated_act_supports, int4_unpack_bf16,
                                    norm_rope, norm_rope_supports, rms_norm_bf16, rms_norm_supports, scratch_bf16)

__all__ = ["MAX_ROWS", "SCRATCH_ROWS", "add_rms_norm", "add_rms_norm_supports", "attention", "attention_bf16_values", "attention_supports", "available", "block_gemv",
           "blocks_to_bf16", "gated_act", "gated_act_supports", "int4_gemv", "int4_unpack_bf16", "library",
           "norm_rope", "norm_rope_supports", "profiled", "rms_norm_bf16", "rms_norm_supports", "scratch_bf16", "supports"]
