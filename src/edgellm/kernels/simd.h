/* One vocabulary of float vectors for every ISA variant, so each kernel is written once.

   The variant is fixed by the compiler flags build.py passes (kernels/isa.py names them):
     avx512  -march=x86-64-v4 + VNNI (+ BF16)   vf = 16 floats
     avx2    -march=x86-64-v3 (+ AVX-VNNI)      vf = 8 floats
     neon    armv8.2-a + dotprod + fp16         vf = 4 floats
     scalar  no ISA flags: plain C              vf = 1 float (the reference every other is tested against)
   Kernels loop over VL lanes at a time and require sizes that are multiples of 16 (or 32), so
   the same loop is right for every VL. vi is VL int32 lanes, the accumulators of the integer
   dot products (intdot.h). */
#ifndef EDGELLM_SIMD_H
#define EDGELLM_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EDGELLM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EDGELLM_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define EDGELLM_NEON 1
#include <arm_neon.h>
#else
#define EDGELLM_SCALAR 1
#endif

/* For the bodies each variant of a loop is specialized from (a constant block type, say): GCC
   and clang otherwise keep large ones out of line and the constant never reaches them. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#include "pool.h"

/* ---- scalar conversions every variant may use (IEEE half and bfloat16, round to nearest even) ---- */

static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* The portable conversions; each variant's half_to_float / float_to_half use the CPU's own. */
static inline float f16_to_f32_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (mant << 13));
    if (exp == 0) return (sign ? -1.f : 1.f) * (float)mant * 5.9604644775390625e-08f; /* 2^-24 */
    return bits_to_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

static inline uint16_t f32_to_f16_soft(float f) {
    uint32_t u = f32_to_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return (uint16_t)(sign | 0x7C00 | (a > 0x7F800000u ? 0x200 : 0)); /* inf, NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);                              /* rounds past 65504 */
    if (a < 0x38800000u) {  /* subnormal half: round |f| / 2^-24 to an integer, ties to even */
        float scaled = bits_to_f32(a) * 16777216.f;
        return (uint16_t)(sign | (uint32_t)nearbyintf(scaled));
    }
    uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

#if (defined(__F16C__) || defined(__AVX512F__)) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#elif defined(__aarch64__)
static inline float f16_to_f32(uint16_t h) { __fp16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t f32_to_f16(float f) { __fp16 v = (__fp16)f; uint16_t h; memcpy(&h, &v, 2); return h; }
#else
static inline float f16_to_f32(uint16_t h) { return f16_to_f32_soft(h); }
static inline uint16_t f32_to_f16(float f) { return f32_to_f16_soft(f); }
#endif

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

#if EDGELLM_AVX512 || EDGELLM_AVX2
/* 8-float vectors on both x86 variants: AVX2's vf, and the halves the avx512 build's int8 GEMM
   rounds and scans in (int8_isa.h) */
static inline __m256 f8_abs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
static inline float f8_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float f8_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if EDGELLM_AVX512
/* ================================================================ AVX-512: 16 lanes */
#define VL 16
typedef __m512 vf;
typedef __m512i vi;
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a*b + c */
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a*b */
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }
/* out[j] = the sum of v_j's lanes, four vectors at once */
static inline void vf_sum4(vf a, vf b, vf c, vf d, float *out) {
    /* per 128-bit lane: (a0 + a2, b0 + b2, a1 + a3, b1 + b3), the same of c, d; then (a, b, c, d):
       13 instructions and as many µops, where halving each vector to 256 bits and hadd-ing took 13
       instructions but ~19 µops (vhaddps is 3; decode attention's scores 6 % faster) */
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}
static inline vf vf_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_pow2i(vf n) { /* 2^n for integral n in [-126, 127] */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* lanes below `floor` become exactly 0 */
static inline vf vf_zero_below(vf x, vf v, float floor) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(floor), _CMP_GT_OQ), v);
}
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void vf_store_bf16(uint16_t *p, vf f) {
    __m512i bits = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void vf_store_f16(uint16_t *p, vf f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vf_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* Elements i .. i + VL of values stored two to a byte, element 2j in the low nibble of byte j (the
   INT4 KV codec); i is a multiple of VL. */
static inline vf vf_load_u4_pairs(const uint8_t *base, int64_t i) {
    const uint8_t *p = base + i / 2;
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i lo = _mm_and_si128(b, _mm_set1_epi16(15)), hi = _mm_srli_epi16(b, 4);
    __m256i v = _mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi));
    return _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(v));
}
/* VL consecutive bytes' low (high = 0) or high (high = 1) nibbles */
static inline vf vf_load_nibbles(const uint8_t *p, int high) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    b = high ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15));
    return _mm512_cvtepi32_ps(b);
}
/* VL (lo, hi) bf16 pairs, one per 32-bit lane of v, as two vectors */
static inline void vf_split_bf16_pairs(__m512i v, vf *lo, vf *hi) {
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)));
}
/* VL (lo, hi) bf16 pairs as two vectors */
static inline void vf_load_bf16_pairs(const uint16_t *p, vf *lo, vf *hi) {
    vf_split_bf16_pairs(_mm512_loadu_si512((const void *)p), lo, hi);
}
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
/* VL values rounded to the nearest integer (ties to even) and stored as int16; |v| < 32768 */
static inline void vf_store_i16(int16_t *p, vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
}
static inline vf vf_abs(vf v) { return _mm512_abs_ps(v); }
static inline vf vf_from_vi(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline void vi_store(int32_t *p, vi v) { _mm512_storeu_si512((void *)p, v); }

#elif EDGELLM_AVX2
/* ================================================================ AVX2 + FMA + F16C: 8 lanes */
#define VL 8
typedef __m256 vf;
typedef __m256i vi;
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline float vf_sum(vf v) { return f8_sum(v); }
static inline float vf_hmax(vf v) { return f8_hmax(v); }
static inline vf vf_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void vf_sum4(vf a, vf b, vf c, vf d, float *out) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
static inline vf vf_pow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vf_zero_below(vf x, vf v, float floor) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(floor), _CMP_GT_OQ), v);
}
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void vf_store_bf16(uint16_t *p, vf f) {
    __m256i bits = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
    __m256i h = _mm256_srli_epi32(rounded, 16);  /* 8 x 16 bits in the low halves of 32-bit lanes */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
static inline vf vf_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void vf_store_f16(uint16_t *p, vf f) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vf_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vf_load_u4_pairs(const uint8_t *base, int64_t i) {
    const uint8_t *p = base + i / 2;
    uint32_t w;
    memcpy(&w, p, 4);
    __m128i b = _mm_cvtepu8_epi16(_mm_cvtsi32_si128((int)w));
    __m128i lo = _mm_and_si128(b, _mm_set1_epi16(15)), hi = _mm_srli_epi16(b, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_unpacklo_epi16(lo, hi)));
}
static inline vf vf_load_nibbles(const uint8_t *p, int high) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    b = high ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(b);
}
static inline void vf_load_bf16_pairs(const uint16_t *p, vf *lo, vf *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000)));
}
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline void vf_store_i16(int16_t *p, vf v) {
    __m256i i = _mm256_cvtps_epi32(v);
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
}
static inline vf vf_abs(vf v) { return f8_abs(v); }
static inline vf vf_from_vi(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi vi_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_store(int32_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }

#elif EDGELLM_NEON
/* ================================================================ ARMv8.2 NEON (dotprod, fp16): 4 lanes */
#define VL 4
typedef float32x4_t vf;
typedef int32x4_t vi;
static inline vf vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, vf v) { vst1q_f32(p, v); }
static inline vf vf_set1(float x) { return vdupq_n_f32(x); }
static inline vf vf_zero(void) { return vdupq_n_f32(0.f); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vf_max(vf a, vf b) { return vmaxq_f32(a, b); }
static inline vf vf_min(vf a, vf b) { return vminq_f32(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vf_fnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); }
static inline float vf_sum(vf v) { return vaddvq_f32(v); }
static inline float vf_hmax(vf v) { return vmaxvq_f32(v); }
static inline vf vf_round(vf x) { return vrndnq_f32(x); }
static inline void vf_sum4(vf a, vf b, vf c, vf d, float *out) {
    vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)));
}
static inline vf vf_pow2i(vf n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23));
}
static inline vf vf_zero_below(vf x, vf v, float floor) {
    return vreinterpretq_f32_u32(vandq_u32(vcgtq_f32(x, vdupq_n_f32(floor)), vreinterpretq_u32_f32(v)));
}
static inline vf vf_load_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
static inline void vf_store_bf16(uint16_t *p, vf f) {
    uint32x4_t bits = vreinterpretq_u32_f32(f);
    uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    uint32x4_t rounded = vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7FFF)));
    uint32x4_t is_num = vceqq_f32(f, f);
    rounded = vbslq_u32(is_num, rounded, vorrq_u32(bits, vdupq_n_u32(0x00400000)));
    vst1_u16(p, vshrn_n_u32(rounded, 16));
}
static inline vf vf_load_f16(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline void vf_store_f16(uint16_t *p, vf f) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(f))); }
static inline vf vf_load_i8(const int8_t *p) {
    int32_t w;
    memcpy(&w, p, 4);
    int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}
static inline vf vf_load_u4_pairs(const uint8_t *base, int64_t i) {
    const uint8_t *p = base + i / 2;
    uint16_t w;
    memcpy(&w, p, 2);
    uint8x8_t b = vreinterpret_u8_u16(vdup_n_u16(w));     /* b0 b1 b0 b1 ... */
    uint8x8_t lo = vand_u8(b, vdup_n_u8(15)), hi = vshr_n_u8(b, 4);
    uint8x8_t v = vzip1_u8(lo, hi);                        /* b0lo b0hi b1lo b1hi ... */
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(v))));
}
static inline vf vf_load_nibbles(const uint8_t *p, int high) {
    uint32_t w;
    memcpy(&w, p, 4);
    uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(w));
    b = high ? vshr_n_u8(b, 4) : vand_u8(b, vdup_n_u8(15));
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
}
static inline void vf_load_bf16_pairs(const uint16_t *p, vf *lo, vf *hi) {
    uint32x4_t v = vld1q_u32((const uint32_t *)p);
    *lo = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    *hi = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF0000u)));
}
static inline vi vi_zero(void) { return vdupq_n_s32(0); }
static inline void vf_store_i16(int16_t *p, vf v) { vst1_s16(p, vmovn_s32(vcvtnq_s32_f32(v))); }
static inline vf vf_abs(vf v) { return vabsq_f32(v); }
static inline vf vf_from_vi(vi v) { return vcvtq_f32_s32(v); }
static inline vi vi_load(const int32_t *p) { return vld1q_s32(p); }
static inline void vi_store(int32_t *p, vi v) { vst1q_s32(p, v); }

#else
/* ================================================================ scalar reference: 1 lane */
#define VL 1
typedef float vf;
typedef int32_t vi;
static inline vf vf_load(const float *p) { return *p; }
static inline void vf_store(float *p, vf v) { *p = v; }
static inline vf vf_set1(float x) { return x; }
static inline vf vf_zero(void) { return 0.f; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_div(vf a, vf b) { return a / b; }
static inline vf vf_max(vf a, vf b) { return a > b ? a : b; }
static inline vf vf_min(vf a, vf b) { return a < b ? a : b; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vf_fnma(vf a, vf b, vf c) { return c - a * b; }
static inline float vf_sum(vf v) { return v; }
static inline float vf_hmax(vf v) { return v; }
static inline vf vf_round(vf x) { return nearbyintf(x); }
static inline void vf_sum4(vf a, vf b, vf c, vf d, float *out) { out[0] = a, out[1] = b, out[2] = c, out[3] = d; }
static inline vf vf_pow2i(vf n) { return bits_to_f32((uint32_t)((int32_t)n + 127) << 23); }
static inline vf vf_zero_below(vf x, vf v, float floor) { return x > floor ? v : 0.f; }
static inline vf vf_load_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline void vf_store_bf16(uint16_t *p, vf f) { *p = f32_to_bf16(f); }
static inline vf vf_load_f16(const uint16_t *p) { return f16_to_f32(*p); }
static inline void vf_store_f16(uint16_t *p, vf f) { *p = f32_to_f16(f); }
static inline vf vf_load_i8(const int8_t *p) { return (float)*p; }
static inline vf vf_load_u4_pairs(const uint8_t *base, int64_t i) { return (float)((base[i / 2] >> (4 * (i & 1))) & 15); }
static inline vf vf_load_nibbles(const uint8_t *p, int high) { return (float)(high ? p[0] >> 4 : p[0] & 15); }
static inline void vf_load_bf16_pairs(const uint16_t *p, vf *lo, vf *hi) {
    *lo = bf16_to_f32(p[0]);
    *hi = bf16_to_f32(p[1]);
}
static inline vi vi_zero(void) { return 0; }
static inline void vf_store_i16(int16_t *p, vf v) { *p = (int16_t)lrintf(v); }
static inline vf vf_abs(vf v) { return fabsf(v); }
static inline vf vf_from_vi(vi v) { return (float)v; }
static inline vi vi_load(const int32_t *p) { return *p; }
static inline void vi_store(int32_t *p, vi v) { *p = v; }
#endif

/* ---- built from the primitives above: the same code on every variant ---- */

/* e^x: 2^(x log2 e) = 2^n * 2^f with a degree-6 polynomial on f in [-0.5, 0.5], relative error
   ~2e-7; x clamped to [-87, 88] so results stay normal and finite. */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.f)), vf_set1(88.f));
    vf t = vf_mul(x, vf_set1(1.44269504f));
    vf n = vf_round(t);
    vf f = vf_sub(t, n);
    vf p = vf_set1(1.540353e-4f);
    p = vf_fma(p, f, vf_set1(1.333355e-3f));
    p = vf_fma(p, f, vf_set1(9.618129e-3f));
    p = vf_fma(p, f, vf_set1(5.550411e-2f));
    p = vf_fma(p, f, vf_set1(2.402265e-1f));
    p = vf_fma(p, f, vf_set1(6.931472e-1f));
    p = vf_fma(p, f, vf_set1(1.f));
    return vf_mul(p, vf_pow2i(n));
}

/* 1 / (1 + e^-x) */
static inline vf vf_sigmoid(vf x) {
    vf e = vf_exp(vf_sub(vf_zero(), x));
    return vf_div(vf_set1(1.f), vf_add(vf_set1(1.f), e));
}

/* Rows of n floats from/to the three storage types of activations and caches. */
enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

static inline vf vf_load_as(const void *p, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16) return vf_load_bf16((const uint16_t *)p + i);
    if (dtype == DTYPE_F16) return vf_load_f16((const uint16_t *)p + i);
    return vf_load((const float *)p + i);
}

static inline void vf_store_as(void *p, int64_t i, vf v, int dtype) {
    if (dtype == DTYPE_BF16) vf_store_bf16((uint16_t *)p + i, v);
    else if (dtype == DTYPE_F16) vf_store_f16((uint16_t *)p + i, v);
    else vf_store((float *)p + i, v);
}
#endif
