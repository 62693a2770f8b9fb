/* The int8 prompt GEMM (int8_pack.c, int8_quantize.c, int8_gemm.c): prompt GEMMs in 8-bit integers for CPUs without native bf16: both `avx2` variants (Haswell to Comet
   Lake, AMD Zen 1-3; with AVX-VNNI Intel client cores since Alder Lake), `avx512` without bf16
   (Cascade Lake, Ice Lake, Tiger Lake, Rocket Lake) and `neon` without bf16 (Cortex-A55/A76/A78,
   Raspberry Pi 5, Apple M1), where an fp32 FMA makes 8 products (NEON: 4) and `vpmaddubsw` 32
   (unsigned byte by signed byte, summed in pairs to int16), `vpdpbusd` 32 summed straight into int32
   lanes (AVX-VNNI; AVX512-VNNI makes 64 on a zmm), NEON's `sdot` 16. What differs per ISA is in
   int8_isa.h; every build computes the same integers and float operations per lane, so the same
   floats.

   The weights stay exactly what the model holds: 4-bit I4R64 codes (q in 0..15), Q5_0 values held
   as Q8_0 / Q8R16 blocks (q + 16 in 0..31) or a GGUF file's Q6_K blocks (q in 0..63), each group of
   32 k's of a row an affine map (Q6_K: each half of 16 its own)
     w = scale * q + zero          (I4R64: zero = its zero - 8 scale; Q5_0: scale = d, zero = -16 d;
                                    Q6_K: scale = d * its int8 scale, zero = -32 scale)
   Only the activations are rounded, per token and group of 32, to int8 (llama.cpp's Q8 blocks):
     qx = round(x / sx),  sx = max |x| / 127
   except each token's OUTLIERS largest |x|: a channel that carries an outlier would round the other
   31 of its group to a few levels (SmolLM2's norm outputs have channels 50-100x the rest: prompt KL
   against transformers 2.8e-3 with none kept, ~7e-4 with 8), so they are zeroed here and multiplied
   in fp32 in the tile's epilogue, by the weight's columns for them (int8_gemm.c strip_columns).
     y[t][n] = sum_g scale[n][g] sx[t][g] sum_{k in g} q[n][k] qx[t][k] + zero[n][g] xsum[t][g]
               + sum_{j < OUTLIERS} x[t][c_tj] w[n][c_tj]
   with xsum[t][g] = sx[t][g] * sum_{k in g} qx[t][k] (int8_quantize.c says why). Every term is a token's
   own, summed in a fixed order: a token's row is the same whatever tokens share its call (a prompt
   computed whole or after a cached prefix gets the same KV). Pair sums of q * qx are at most
   2 * 31 * 127 = 7874, so int16 holds 4 of them (31,496), 8 for 4-bit codes (30,480), 2 for 6-bit
   (2 * 16,002): the products are summed in int16 for half a group (a whole one for 4 bits, a quarter
   for 6), widened to int32, and the group's sum scaled once (5-bit codes 6-8 % faster than scaling
   each half), Q6_K's each half's.

   The weight is packed per call into strips of 16 rows: per group, 8 steps of 4 k's, each 16 words of
   4 codes (row r's q[k .. k + 3]) that one vpmaddubsw multiplies against a broadcast word of 4
   activations; then the strip's 16 scales and 16 zeros of the group (Q6_K: of its first half, then of
   its second). A tile is 16 rows x 4 tokens (8 on AVX-512, 2 on NEON: int8_gemm.c). */
#ifndef EDGELLM_INT8_LAYOUT_H
#define EDGELLM_INT8_LAYOUT_H
#include <stdlib.h>

#include "int8_isa.h"

/* The forms in which the GEMM takes a weight as the model holds it (layer_types.h WeightPart.int8_form),
   numbered by their codes' width but Q5_K (ggml's number; 5-bit codes) */
enum { I8_FORM_I4R64 = 4, I8_FORM_Q5_0_R16 = 5, I8_FORM_Q6_K = 6, I8_FORM_Q8_0_R16 = 8, I8_FORM_Q5_K = 13 };

/* A form's code width, which decides how many products int16 holds between widenings. */
static inline int form_bits(int form) { return form == I8_FORM_Q5_K ? 5 : form; }

#define I8_STRIP 16
#define I8_GROUP 32
#define X_MAX 127
#define I8_MAX_OUTLIERS 16  /* per token, at most */
#define STEP_BYTES (4 * I8_STRIP)           /* 4 k's of a strip's 16 rows */
#define GROUP_BYTES (8 * STEP_BYTES)        /* a group's codes of a strip */
#define GROUP_FLOATS (2 * I8_STRIP)         /* a group's (or a Q6_K half group's) scales and zeros of a strip */
#define GROUP_STRIDE (GROUP_BYTES + 2 * 4 * GROUP_FLOATS)  /* a group of a strip in the panel: codes, then floats */
#define STATS 4                             /* floats per token and group: sx, xsum, and xsum of each half */

/* A token's quantized row: k int8, then per group its STATS; 32-byte aligned. */
static inline int64_t row_bytes(int64_t k) { return (k + 4 * STATS * (k / I8_GROUP) + 31) / 32 * 32; }

#endif
