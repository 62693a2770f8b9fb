/* What the int8 prompt GEMM (int8_gemm.c) needs of each ISA, so that its packing, quantizing and
   tiles are written once. Defines I8_NATIVE where a build has the GEMM (x86 with AVX2 or AVX-512,
   ARM with NEON dotprod; the scalar build multiplies prompts in fp32), I8_VNNI where one instruction
   sums 4 byte products into an int32 lane (AVX-VNNI, AVX512-VNNI, NEON's sdot), and:

     b16                   16 bytes: load / store / set1 / and / or / add, shr_and (each byte's bits
                           shifted right, then masked), shl4, and the zips of bytes and of 16-bit words
     i8_amax32(x)          the largest |x| of 32 floats
     i8_codes32(x, inv, qx, sums)   round(x * inv) of 32 floats to int8 (nearest even; |x * inv| <= 127),
                           and each half's sum of them (exact integers)
     i8_at_least(x, floor) a mask of the 32 floats with |x| >= floor, bit j for x[j]
     i8_column(step, byte, scale, zero, out)   the 16 rows' code `byte` of a step's words, as
                           w = code * scale + zero (one fused multiply-add, as every build does)
     sf, si                a strip's 16 rows as H = 16 / SL vectors of SL floats / int32 lanes, and the
                           tile's operations on them (si_dot: the products of a word of 4 codes per row
                           with a broadcast word of 4 activations, summed into int32 lanes, or without
                           VNNI in pairs into int16 lanes that si_widen turns into int32 ones)

   Every build computes the same integers and the same float operations per lane (each fused
   multiply-add explicit), so the same floats: test_int8_prompt.py checks x86 builds bit for bit
   against plain AVX2 and the NEON build under qemu. */
#ifndef EDGELLM_INT8_ISA_H
#define EDGELLM_INT8_ISA_H
#include "simd.h"

#if EDGELLM_AVX2 || EDGELLM_AVX512
#define I8_NATIVE 1
#if defined(__AVXVNNI__) || EDGELLM_AVX512
#define I8_VNNI 1
/* vpdpbusd sums unsigned byte by signed byte products straight into int32: codes up to 255 (a real
   Q8_0's q + 128) cannot overflow (vpmaddubsw's int16 pairs would, and NEON's sdot reads signed codes) */
#define I8_BYTE_CODES 1
#endif

typedef __m128i b16;
static inline b16 b16_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline void b16_store(uint8_t *p, b16 v) { _mm_storeu_si128((__m128i *)p, v); }
static inline b16 b16_set1(uint8_t x) { return _mm_set1_epi8((char)x); }
static inline b16 b16_and(b16 a, b16 b) { return _mm_and_si128(a, b); }
static inline b16 b16_or(b16 a, b16 b) { return _mm_or_si128(a, b); }
static inline b16 b16_add(b16 a, b16 b) { return _mm_add_epi8(a, b); }
static inline b16 b16_shr_and(b16 v, int n, b16 mask) { return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(n)), mask); }
static inline b16 b16_shl4(b16 v) { return _mm_slli_epi16(v, 4); }  /* callers' bytes are < 16: nothing crosses */
static inline b16 b16_zip8_lo(b16 a, b16 b) { return _mm_unpacklo_epi8(a, b); }
static inline b16 b16_zip8_hi(b16 a, b16 b) { return _mm_unpackhi_epi8(a, b); }
static inline b16 b16_zip16_lo(b16 a, b16 b) { return _mm_unpacklo_epi16(a, b); }
static inline b16 b16_zip16_hi(b16 a, b16 b) { return _mm_unpackhi_epi16(a, b); }

static inline float i8_amax32(const float *x) {
    __m256 m = f8_abs(_mm256_loadu_ps(x));
    for (int i = 1; i < 4; i++) m = _mm256_max_ps(m, f8_abs(_mm256_loadu_ps(x + 8 * i)));
    return f8_hmax(m);
}

static inline void i8_codes32(const float *x, float inv, int8_t *qx, float sums[2]) {
    __m256 v[4], vinv = _mm256_set1_ps(inv);
    for (int i = 0; i < 4; i++)  /* the codes as floats: converting them is exact */
        v[i] = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    sums[0] = f8_sum(_mm256_add_ps(v[0], v[1]));
    sums[1] = f8_sum(_mm256_add_ps(v[2], v[3]));
    __m256i ia = _mm256_cvtps_epi32(v[0]), ib = _mm256_cvtps_epi32(v[1]);
    __m256i ic = _mm256_cvtps_epi32(v[2]), id = _mm256_cvtps_epi32(v[3]);
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(ia, ib), _mm256_packs_epi32(ic, id));
    /* per 128-bit lane the packs interleave: words k0-3, k8-11, k16-19, k24-27 | k4-7, ... */
    _mm256_storeu_si256((__m256i *)qx, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline uint32_t i8_at_least(const float *x, float floor) {
    __m256 f = _mm256_set1_ps(floor);
    uint32_t mask = 0;
    for (int i = 0; i < 4; i++)
        mask |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(f8_abs(_mm256_loadu_ps(x + 8 * i)), f, _CMP_GE_OQ)) << (8 * i);
    return mask;
}

static inline void i8_column(const uint8_t *step, int byte, const float *scale, const float *zero, float *out) {
    __m128i shift = _mm_cvtsi32_si128(8 * byte);  /* row r's code: byte `byte` of word r */
    for (int h = 0; h < 2; h++) {
        __m256i words = _mm256_loadu_si256((const __m256i *)(step + 32 * h));
        __m256i q = _mm256_and_si256(_mm256_srl_epi32(words, shift), _mm256_set1_epi32(0xFF));
        _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(scale + 8 * h),
                                                      _mm256_loadu_ps(zero + 8 * h)));
    }
}

#if EDGELLM_AVX512  /* one zmm: half the instructions of two ymm per product, sum and scale */
#define SL 16
typedef __m512 sf;
typedef __m512i si;
static inline si si_load(const void *p) { return _mm512_loadu_si512(p); }
static inline si si_set1(int32_t x) { return _mm512_set1_epi32(x); }
static inline si si_zero(void) { return _mm512_setzero_si512(); }
static inline si si_add(si a, si b) { return _mm512_add_epi32(a, b); }
/* In place by inline assembly: GCC 12 otherwise copies every accumulator of a tile back each turn. */
static inline si si_dot(si acc, si w, si x4) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x4));
    return acc;
}
static inline si si_widen(si sums) { return sums; }
static inline sf sf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void sf_store(float *p, sf v) { _mm512_storeu_ps(p, v); }
static inline sf sf_set1(float x) { return _mm512_set1_ps(x); }
static inline sf sf_zero(void) { return _mm512_setzero_ps(); }
static inline sf sf_mul(sf a, sf b) { return _mm512_mul_ps(a, b); }
static inline sf sf_fma(sf a, sf b, sf c) { return _mm512_fmadd_ps(a, b, c); }
static inline sf sf_from_si(si v) { return _mm512_cvtepi32_ps(v); }
#else
#define SL 8
typedef __m256 sf;
typedef __m256i si;
static inline si si_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline si si_set1(int32_t x) { return _mm256_set1_epi32(x); }
static inline si si_zero(void) { return _mm256_setzero_si256(); }
static inline si si_add(si a, si b) { return _mm256_add_epi32(a, b); }
/* unsigned codes times signed activations: with AVX-VNNI per int32 lane the sums of 4 (vpdpbusd: one
   instruction, no int16 stage, 6.6 against 8.9 ms for a 4096 x 640 x 512 GEMM), else per int16 lane
   the pair sums (vpmaddubsw). In place by inline assembly, as on AVX-512. */
static inline si si_dot(si acc, si w, si x4) {
#ifdef __AVXVNNI__
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x4));
#else
    __m256i pairs = _mm256_maddubs_epi16(w, x4);
    __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(pairs));
#endif
    return acc;
}
static inline si si_widen(si sums) {
#ifdef I8_VNNI
    return sums;
#else
    return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
#endif
}
static inline sf sf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void sf_store(float *p, sf v) { _mm256_storeu_ps(p, v); }
static inline sf sf_set1(float x) { return _mm256_set1_ps(x); }
static inline sf sf_zero(void) { return _mm256_setzero_ps(); }
static inline sf sf_mul(sf a, sf b) { return _mm256_mul_ps(a, b); }
static inline sf sf_fma(sf a, sf b, sf c) { return _mm256_fmadd_ps(a, b, c); }
static inline sf sf_from_si(si v) { return _mm256_cvtepi32_ps(v); }
#endif

#elif EDGELLM_NEON
#define I8_NATIVE 1
#define I8_VNNI 1  /* sdot: the codes (0..63) are non-negative as signed bytes too */

typedef uint8x16_t b16;
static inline b16 b16_load(const uint8_t *p) { return vld1q_u8(p); }
static inline void b16_store(uint8_t *p, b16 v) { vst1q_u8(p, v); }
static inline b16 b16_set1(uint8_t x) { return vdupq_n_u8(x); }
static inline b16 b16_and(b16 a, b16 b) { return vandq_u8(a, b); }
static inline b16 b16_or(b16 a, b16 b) { return vorrq_u8(a, b); }
static inline b16 b16_add(b16 a, b16 b) { return vaddq_u8(a, b); }
static inline b16 b16_shr_and(b16 v, int n, b16 mask) { return vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)-n)), mask); }
static inline b16 b16_shl4(b16 v) { return vshlq_n_u8(v, 4); }
static inline b16 b16_zip8_lo(b16 a, b16 b) { return vzip1q_u8(a, b); }
static inline b16 b16_zip8_hi(b16 a, b16 b) { return vzip2q_u8(a, b); }
static inline b16 b16_zip16_lo(b16 a, b16 b) {
    return vreinterpretq_u8_u16(vzip1q_u16(vreinterpretq_u16_u8(a), vreinterpretq_u16_u8(b)));
}
static inline b16 b16_zip16_hi(b16 a, b16 b) {
    return vreinterpretq_u8_u16(vzip2q_u16(vreinterpretq_u16_u8(a), vreinterpretq_u16_u8(b)));
}

static inline float i8_amax32(const float *x) {
    float32x4_t m = vabsq_f32(vld1q_f32(x));
    for (int i = 1; i < 8; i++) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + 4 * i)));
    return vmaxvq_f32(m);
}

static inline void i8_codes32(const float *x, float inv, int8_t *qx, float sums[2]) {
    float32x4_t v[8], vinv = vdupq_n_f32(inv);
    for (int i = 0; i < 8; i++) v[i] = vrndnq_f32(vmulq_f32(vld1q_f32(x + 4 * i), vinv));  /* nearest, ties to even */
    sums[0] = vaddvq_f32(vaddq_f32(vaddq_f32(v[0], v[1]), vaddq_f32(v[2], v[3])));
    sums[1] = vaddvq_f32(vaddq_f32(vaddq_f32(v[4], v[5]), vaddq_f32(v[6], v[7])));
    for (int i = 0; i < 8; i += 2) {  /* integral floats within +-127: each conversion and narrowing exact */
        int16x8_t words = vcombine_s16(vmovn_s32(vcvtq_s32_f32(v[i])), vmovn_s32(vcvtq_s32_f32(v[i + 1])));
        vst1_s8(qx + 4 * i, vmovn_s16(words));
    }
}

static inline uint32_t i8_at_least(const float *x, float floor) {
    const uint32_t bits[4] = {1, 2, 4, 8};
    uint32x4_t lane_bit = vld1q_u32(bits);
    float32x4_t f = vdupq_n_f32(floor);
    uint32_t mask = 0;
    for (int i = 0; i < 8; i++)
        mask |= vaddvq_u32(vandq_u32(vcgeq_f32(vabsq_f32(vld1q_f32(x + 4 * i)), f), lane_bit)) << (4 * i);
    return mask;
}

static inline void i8_column(const uint8_t *step, int byte, const float *scale, const float *zero, float *out) {
    int32x4_t shift = vdupq_n_s32(-8 * byte);
    for (int h = 0; h < 4; h++) {
        uint32x4_t q = vandq_u32(vshlq_u32(vld1q_u32((const uint32_t *)(step + 16 * h)), shift), vdupq_n_u32(0xFF));
        vst1q_f32(out + 4 * h, vfmaq_f32(vld1q_f32(zero + 4 * h), vcvtq_f32_u32(q), vld1q_f32(scale + 4 * h)));
    }
}

#define SL 4
typedef float32x4_t sf;
typedef int32x4_t si;
static inline si si_load(const void *p) { return vreinterpretq_s32_u8(vld1q_u8((const uint8_t *)p)); }
static inline si si_set1(int32_t x) { return vdupq_n_s32(x); }
static inline si si_zero(void) { return vdupq_n_s32(0); }
static inline si si_add(si a, si b) { return vaddq_s32(a, b); }
static inline si si_dot(si acc, si w, si x4) { return vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(x4)); }
static inline si si_widen(si sums) { return sums; }
static inline sf sf_load(const float *p) { return vld1q_f32(p); }
static inline void sf_store(float *p, sf v) { vst1q_f32(p, v); }
static inline sf sf_set1(float x) { return vdupq_n_f32(x); }
static inline sf sf_zero(void) { return vdupq_n_f32(0.f); }
static inline sf sf_mul(sf a, sf b) { return vmulq_f32(a, b); }
static inline sf sf_fma(sf a, sf b, sf c) { return vfmaq_f32(c, a, b); }
static inline sf sf_from_si(si v) { return vcvtq_f32_s32(v); }
#endif

#endif
