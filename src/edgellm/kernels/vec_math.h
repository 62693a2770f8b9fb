/* Vectorized transcendental functions for the prompt kernels (AVX-512, fp32). */
#ifndef EDGELLM_VEC_MATH_H
#define EDGELLM_VEC_MATH_H
#include <immintrin.h>

/* e^x: 2^(x log2 e) = 2^n * 2^f with a degree-6 polynomial on f in [-0.5, 0.5], relative error
   ~2e-7. x is clamped to [-87, 88] (results stay normal and finite). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.540353e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333355e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550411e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* 1 / (1 + e^-x) */
static inline __m512 sigmoid_ps(__m512 x) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

/* bf16 <-> fp32; rounding to nearest even by hand, so AVX-512 BF16 is not required. */
static inline __m512 bf16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m256i ps_to_bf16(__m512 f) {
    __m512i bits = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    /* NaN stays NaN (rounding could carry it into infinity): truncate it and set the quiet bit */
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#endif
