/* Torch's packed INT4 CPU layout (AVX-512 build of `_convert_weight_to_int4pack_for_cpu`), read by
   int4_gemv.c (decode) and dequant.c (prompts): rows in blocks of 64; per k, 32 bytes whose byte i
   holds row i (low nibble) and row 32 + i (high nibble); per group of k's, `scale_zero` holds one
   bf16 (scale, zero) pair per row, and w = (q - 8) * scale + zero. */
#ifndef EDGELLM_INT4_PACK_H
#define EDGELLM_INT4_PACK_H
#include <immintrin.h>
#include <stdint.h>

/* scale and zero - 8 * scale of 16 consecutive rows, from their (scale, zero) bf16 pairs. */
static inline void int4_scale_offset(const uint16_t *pairs, __m512 *scale, __m512 *offset) {
    __m512i v = _mm512_loadu_si512((const void *)pairs);
    *scale = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)));
    *offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), *scale, zero);
}
#endif
