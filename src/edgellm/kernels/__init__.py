"""Native kernels where PyTorch has none fast enough: one C source tree (simd.h's vocabulary,
intdot.h's integer dot products) compiled at first use for the CPU's ISA variant — AVX-512,
AVX2, NEON or the portable scalar reference (isa.py, build.py).

Decode (gemv.py): `int4_gemv` multiplies a few activation rows by a weight in edgellm's INT4 layout
(quant/int4_pack.py); `block_gemv` by GGUF Q8_0 / Q5_0 / Q5_K / Q6_K weights straight from the model
file (quant/blocks.py). llama_layer.c and gemma_layer.c run a whole decoder layer for one token of
up to 8 sequences on these (models/native/decoder.py).

Prompts (prompt.py): `int4_unpack` and `blocks_to_float` unpack weights into one reused scratch for
PyTorch's GEMM in the compute dtype (bf16 only where the CPU multiplies bf16 natively, else fp32),
or with AVX-VNNI and no bf16 an integer GEMM (prompt_gemm.py `prompt_matmul`); on AVX2 without native
bf16 an int8 GEMM on the 4-bit / Q5_0 codes themselves (int8_prompt.py `Int8Prompt`);
`attention` runs a chunk's attention; `gated_act` is the gated MLP's act(gate)·up in one pass;
`norm_rope` a per-head norm and RoPE in place; `rms_norm` / `add_rms_norm` a sublayer's norm with its
cast or residual add. EDGELLM_KERNELS=0 turns all of it off; EDGELLM_ISA picks a variant."""
from edgellm.kernels.build import available, compute_dtype, describe, library, library_for, profiled
from edgellm.kernels.gemv import (MAX_ROWS, Q8R16, Q8R16_ROWS, block_gemv, i4r64_from_blocks, int4_gemv, q5_0_as_q8_0,
                                  q8_0_as_q8r16, q8r16_rows, supports)
from edgellm.kernels.isa import Variant, runnable, selected
from edgellm.kernels.int8_prompt import Int8Prompt, int8_gemm_native, int8_takes_i4r64
from edgellm.kernels.prompt_gemm import int16_gemm, int16_gemm_native, int16_gemm_supports, prompt_matmul
from edgellm.kernels.prompt import (SCRATCH_ROWS, add_rms_norm, add_rms_norm_supports, attention, attention_bf16_values,
                                    attention_supports, blocks_to_float, gated_act, gated_act_supports, int4_unpack,
                                    norm_rope, norm_rope_supports, rms_norm, rms_norm_supports, scratch)

__all__ = ["MAX_ROWS", "Q8R16", "Q8R16_ROWS", "SCRATCH_ROWS", "Variant", "add_rms_norm", "add_rms_norm_supports", "attention",
           "attention_bf16_values", "attention_supports", "available", "block_gemv", "blocks_to_float",
           "compute_dtype", "describe", "gated_act", "i4r64_from_blocks", "gated_act_supports", "Int8Prompt", "int16_gemm", "int16_gemm_native", "int16_gemm_supports", "int4_gemv", "int8_gemm_native", "int8_takes_i4r64", "int4_unpack", "library", "library_for",
           "norm_rope", "norm_rope_supports", "profiled", "prompt_matmul", "q5_0_as_q8_0", "q8_0_as_q8r16", "q8r16_rows", "rms_norm", "rms_norm_supports", "runnable", "scratch",
           "selected", "supports"]
