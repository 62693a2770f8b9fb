/* Integer dot products of quantized weights with quantized activations: the inner loops of every
   decode GEMV, one implementation per ISA variant (simd.h picks it), all computing the same
   integers.

   Activations are quantized per group to int16 (|q| <= ACT_MAX, error ~1/65000 of the group's
   largest value, well under bf16's 1/256); weights arrive as int8 (every GGUF format up to 8 bits
   fits). So each product is exact in int32, and the variants differ only in the order of the
   float sums that follow:
     AVX-512  vpdpwssd on 32 int16 pairs                      (16 lanes)
     AVX2     vpmaddwd + add, or AVX-VNNI's vpdpwssd          (8 lanes)
     NEON     sdot twice: q = 256 hi + lo with hi, lo int8    (4 lanes)
     scalar   plain loops                                     (1 lane) */
#ifndef EDGELLM_INTDOT_H
#define EDGELLM_INTDOT_H
#include "simd.h"
#include "k_scales.h"

/* 127 * 256 + 127: the largest |q| whose NEON split into two signed bytes is exact */
#define ACT_MAX 32639

/* One activation row, quantized: q[k] = round(x[k] / dx[g]) for k in group g; sum[g] = sum of x. */
typedef struct {
    const int16_t *q;
    const int8_t *hi, *lo;  /* NEON: q = 256 * hi + lo, both in [-128, 127] */
    const float *dx, *sum;
} Act;

/* Bytes of scratch quantize_act needs for k activations. */
static inline int64_t act_bytes(int64_t k, int64_t group) { return 4 * k + 8 * (k / group) + 64; }

/* q = 256 hi + lo with hi, lo in [-128, 127], for the byte-wise dot products (NEON sdot, AVX2
   vpmaddubsw, AVX-512's Q6_K rows): |q| <= ACT_MAX makes the split exact. */
static inline void split_bytes(const int16_t *q, int64_t k, int8_t *hi, int8_t *lo) {
    int64_t i = 0;
#if EDGELLM_AVX2 || EDGELLM_AVX512
    for (; i + 16 <= k; i += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(q + i));
        __m256i h = _mm256_srai_epi16(_mm256_add_epi16(v, _mm256_set1_epi16(128)), 8);
        __m256i l = _mm256_sub_epi16(v, _mm256_slli_epi16(h, 8));
        _mm_storeu_si128((__m128i *)(hi + i), _mm_packs_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
        _mm_storeu_si128((__m128i *)(lo + i), _mm_packs_epi16(_mm256_castsi256_si128(l), _mm256_extracti128_si256(l, 1)));
    }
#endif
    for (; i < k; i++) {
        int h = (q[i] + 128) >> 8;
        hi[i] = (int8_t)h;
        lo[i] = (int8_t)(q[i] - 256 * h);
    }
}

static inline Act quantize_act(const float *x, int64_t k, int64_t group, uint8_t *mem) {
    int16_t *q = (int16_t *)mem;
    int8_t *hi = (int8_t *)(q + k), *lo = hi + k;
    float *dx = (float *)(mem + 4 * k), *sum = dx + k / group;
    for (int64_t g = 0; g < k / group; g++) {
        const float *xs = x + g * group;
        vf amax = vf_zero(), s = vf_zero();
        for (int64_t i = 0; i < group; i += VL) {
            vf v = vf_load(xs + i);
            amax = vf_max(amax, vf_abs(v));
            s = vf_add(s, v);
        }
        float a = vf_hmax(amax), d = a > 0.f ? a / (float)ACT_MAX : 1.f;
        vf inv = vf_set1(1.f / d), limit = vf_set1((float)ACT_MAX);
        for (int64_t i = 0; i < group; i += VL)  /* |x / d| <= ACT_MAX up to rounding: clamp, then round */
            vf_store_i16(q + g * group + i, vf_max(vf_min(vf_mul(vf_load(xs + i), inv), limit), vf_sub(vf_zero(), limit)));
        dx[g] = d;
        sum[g] = vf_sum(s);
    }
#if EDGELLM_NEON || (EDGELLM_AVX2 && !defined(__AVXVNNI__))
    split_bytes(q, k, hi, lo);
#endif
    Act a = {q, hi, lo, dx, sum};
    return a;
}

/* ---------------------------------------------------------------- 32 int8 weights: w32 */
#if EDGELLM_AVX512 || EDGELLM_AVX2
typedef __m256i w32;

static inline w32 w32_load(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void w32_store(int8_t *p, w32 w) { _mm256_storeu_si256((__m256i *)p, w); }

/* 16 bytes -> 32 values: low nibbles (elements 0-15), then high nibbles (16-31) */
static inline w32 w32_nibbles(const uint8_t *p) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* byte j = 0x10 where bit j of `bits` is set */
static inline w32 w32_bit4(uint32_t bits) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

static inline w32 w32_add(w32 a, w32 b) { return _mm256_add_epi8(a, b); }
static inline w32 w32_or(w32 a, w32 b) { return _mm256_or_si256(a, b); }
static inline w32 w32_sub_const(w32 a, int8_t c) { return _mm256_sub_epi8(a, _mm256_set1_epi8(c)); }

/* 32 bytes' low (high = 0) or high nibbles */
static inline w32 w32_nibble_plane(const uint8_t *p, int high) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

/* bits `shift`, `shift` + 1 (width 2) or bit `shift` (width 1) of 32 bytes, moved to bit 4 */
static inline w32 w32_bits_at4(const uint8_t *p, int shift, int width) {
    __m256i v = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)p), _mm_cvtsi32_si128(shift));
    return _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi8((char)((1 << width) - 1))), 4);
}
#elif EDGELLM_NEON
typedef struct { int8x16_t lo, hi; } w32;

static inline w32 w32_load(const int8_t *p) { w32 w = {vld1q_s8(p), vld1q_s8(p + 16)}; return w; }
static inline void w32_store(int8_t *p, w32 w) { vst1q_s8(p, w.lo); vst1q_s8(p + 16, w.hi); }

static inline w32 w32_nibbles(const uint8_t *p) {
    uint8x16_t raw = vld1q_u8(p);
    w32 w = {vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F))), vreinterpretq_s8_u8(vshrq_n_u8(raw, 4))};
    return w;
}

static inline w32 w32_bit4(uint32_t bits) {
    static const uint8_t bit_of[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    uint8x16_t mask = vld1q_u8(bit_of);
    uint8x16_t b01 = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    uint8x16_t b23 = vcombine_u8(vdup_n_u8((uint8_t)(bits >> 16)), vdup_n_u8((uint8_t)(bits >> 24)));
    w32 w = {vreinterpretq_s8_u8(vandq_u8(vtstq_u8(b01, mask), vdupq_n_u8(0x10))),
             vreinterpretq_s8_u8(vandq_u8(vtstq_u8(b23, mask), vdupq_n_u8(0x10)))};
    return w;
}

static inline w32 w32_add(w32 a, w32 b) { w32 w = {vaddq_s8(a.lo, b.lo), vaddq_s8(a.hi, b.hi)}; return w; }
static inline w32 w32_or(w32 a, w32 b) { w32 w = {vorrq_s8(a.lo, b.lo), vorrq_s8(a.hi, b.hi)}; return w; }
static inline w32 w32_sub_const(w32 a, int8_t c) {
    w32 w = {vsubq_s8(a.lo, vdupq_n_s8(c)), vsubq_s8(a.hi, vdupq_n_s8(c))};
    return w;
}

static inline w32 w32_nibble_plane(const uint8_t *p, int high) {
    uint8x16_t a = vld1q_u8(p), b = vld1q_u8(p + 16);
    uint8x16_t m = vdupq_n_u8(0x0F);
    w32 w = {vreinterpretq_s8_u8(high ? vshrq_n_u8(a, 4) : vandq_u8(a, m)),
             vreinterpretq_s8_u8(high ? vshrq_n_u8(b, 4) : vandq_u8(b, m))};
    return w;
}

static inline w32 w32_bits_at4(const uint8_t *p, int shift, int width) {
    int8x16_t count = vdupq_n_s8((int8_t)-shift);  /* a negative shift count shifts right */
    uint8x16_t mask = vdupq_n_u8((uint8_t)((1 << width) - 1));
    uint8x16_t a = vandq_u8(vshlq_u8(vld1q_u8(p), count), mask), b = vandq_u8(vshlq_u8(vld1q_u8(p + 16), count), mask);
    w32 w = {vreinterpretq_s8_u8(vshlq_n_u8(a, 4)), vreinterpretq_s8_u8(vshlq_n_u8(b, 4))};
    return w;
}
#else
typedef struct { int8_t v[32]; } w32;

static inline w32 w32_load(const int8_t *p) { w32 w; memcpy(w.v, p, 32); return w; }
static inline void w32_store(int8_t *p, w32 w) { memcpy(p, w.v, 32); }

static inline w32 w32_nibbles(const uint8_t *p) {
    w32 w;
    for (int j = 0; j < 16; j++) {
        w.v[j] = (int8_t)(p[j] & 15);
        w.v[j + 16] = (int8_t)(p[j] >> 4);
    }
    return w;
}

static inline w32 w32_bit4(uint32_t bits) {
    w32 w;
    for (int j = 0; j < 32; j++) w.v[j] = (int8_t)(((bits >> j) & 1) << 4);
    return w;
}

static inline w32 w32_add(w32 a, w32 b) { for (int j = 0; j < 32; j++) a.v[j] = (int8_t)(a.v[j] + b.v[j]); return a; }
static inline w32 w32_or(w32 a, w32 b) { for (int j = 0; j < 32; j++) a.v[j] |= b.v[j]; return a; }
static inline w32 w32_sub_const(w32 a, int8_t c) { for (int j = 0; j < 32; j++) a.v[j] = (int8_t)(a.v[j] - c); return a; }

static inline w32 w32_nibble_plane(const uint8_t *p, int high) {
    w32 w;
    for (int j = 0; j < 32; j++) w.v[j] = (int8_t)(high ? p[j] >> 4 : p[j] & 15);
    return w;
}

static inline w32 w32_bits_at4(const uint8_t *p, int shift, int width) {
    w32 w;
    for (int j = 0; j < 32; j++) w.v[j] = (int8_t)(((p[j] >> shift) & ((1 << width) - 1)) << 4);
    return w;
}
#endif

/* ---------------------------------------------------------------- w . x for 32 weights */
/* acc + (w0 x0 + w1 x1) per 32-bit lane, by vpdpwssd in place. Inline assembly because GCC 12 (-O3)
   gives the intrinsics' result a register of its own and copies every accumulator back on every
   turn of a loop (32 moves among 35 instructions per pair of k's in the INT4 loop for 4 rows), where the
   instruction itself accumulates in place. */
#if EDGELLM_AVX512
static inline __m512i dpwssd512(__m512i acc, __m512i w16, __m512i x16) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w16), "v"(x16));
    return acc;
}
#endif

#if EDGELLM_AVX2
/* (x0, x1) . (w0, w1) per 32-bit lane, added to acc */
static inline __m256i madd_acc(__m256i acc, __m256i w16, __m256i x16) {
#ifdef __AVXVNNI__
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w16), "x"(x16));  /* in place: see dpwssd512 */
    return acc;
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w16, x16));
#endif
}
#endif

/* 32 weights in the form the dot product reads: int16 on x86 (widened once, then reused for every
   activation row of a batch), the int8 themselves on NEON and scalar. */
#if EDGELLM_AVX512
typedef __m512i wide32;
static inline wide32 widen(w32 w) { return _mm512_cvtepi8_epi16(w); }
#elif EDGELLM_AVX2
typedef struct { __m256i lo, hi; } wide32;
static inline wide32 widen(w32 w) {
    wide32 v = {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1))};
    return v;
}
#else
typedef w32 wide32;
static inline wide32 widen(w32 w) { return w; }
#endif

/* 32 int8 weights at p, in the dot product's form: AVX2 widens each half straight from memory
   (a 32-byte load, an extract and two widenings took twice the instructions: Q8_0 blocks are
   instruction-bound on 2 cores of a shared host in its slow phases) */
static inline wide32 widen_at(const int8_t *p) {
#if EDGELLM_AVX2
    wide32 v = {_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
    return v;
#else
    return widen(w32_load(p));
#endif
}

/* The 32 weights of a Q5_0 block (fp16 d, 32 fifth bits qh, 16 bytes of nibbles) as q - 16, in the
   dot product's form: AVX-512 subtracts 16 under the inverted bit mask, AVX2 builds the int16
   halves directly (one widening instead of two, no byte shuffle). */
static inline wide32 q5_0_wide(const uint8_t *b) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
#if EDGELLM_AVX512
    __m256i q = w32_nibbles(b + 6);
    return _mm512_cvtepi8_epi16(_mm256_mask_sub_epi8(q, (__mmask32)~qh, q, _mm256_set1_epi8(16)));
#elif EDGELLM_AVX2
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 6)));  /* byte j: weights j, 16 + j */
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          (short)0x8000);
    const __m256i sixteen = _mm256_set1_epi16(16);
    __m256i set0 = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)qh), bit), bit);
    __m256i set1 = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)(qh >> 16)), bit), bit);
    wide32 w = {_mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(15)), _mm256_andnot_si256(set0, sixteen)),
                _mm256_sub_epi16(_mm256_srli_epi16(v, 4), _mm256_andnot_si256(set1, sixteen))};
    return w;
#else
    return widen(w32_sub_const(w32_or(w32_nibbles(b + 6), w32_bit4(qh)), 16));
#endif
}

#if EDGELLM_AVX512
/* acc + s * (the 16 lanes' sums of w[2j] * q[k + 2j] + w[2j + 1] * q[k + 2j + 1]): fma_dot_wide with
   its scales already a vector */
static inline __m512 fma_dot_scaled(__m512 acc, wide32 w, const Act *a, int64_t k, __m512 s) {
    __m512i d = dpwssd512(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)(a->q + k)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc);
}
#endif

/* acc + s0 * (partial sums of w[j] * q[k + j], j < 16) + s1 * (the same for 16 <= j < 32): one scale
   per block (s0 == s1), or Q6_K's two sub-blocks of 16. */
static inline vf fma_dot_wide(vf acc, wide32 w, const Act *a, int64_t k, float s0, float s1) {
#if EDGELLM_AVX512
    return fma_dot_scaled(acc, w, a, k, s0 == s1 ? _mm512_set1_ps(s0)  /* lane j: weights 2j, 2j + 1 */
                                                 : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1)));
#elif EDGELLM_AVX2
    __m256i d0 = madd_acc(_mm256_setzero_si256(), w.lo, _mm256_loadu_si256((const __m256i *)(a->q + k)));
    if (s0 == s1) {
        __m256i d = madd_acc(d0, w.hi, _mm256_loadu_si256((const __m256i *)(a->q + k + 16)));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(s0), acc);
    }
    __m256i d1 = madd_acc(_mm256_setzero_si256(), w.hi, _mm256_loadu_si256((const __m256i *)(a->q + k + 16)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(s0), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(s1), acc);
#elif EDGELLM_NEON
    int32x4_t h0 = vdotq_s32(vdupq_n_s32(0), w.lo, vld1q_s8(a->hi + k));
    int32x4_t l0 = vdotq_s32(vdupq_n_s32(0), w.lo, vld1q_s8(a->lo + k));
    int32x4_t h1 = vdotq_s32(vdupq_n_s32(0), w.hi, vld1q_s8(a->hi + k + 16));
    int32x4_t l1 = vdotq_s32(vdupq_n_s32(0), w.hi, vld1q_s8(a->lo + k + 16));
    if (s0 == s1)
        return vfmaq_n_f32(acc, vcvtq_f32_s32(vaddq_s32(vshlq_n_s32(vaddq_s32(h0, h1), 8), vaddq_s32(l0, l1))), s0);
    acc = vfmaq_n_f32(acc, vcvtq_f32_s32(vaddq_s32(vshlq_n_s32(h0, 8), l0)), s0);
    return vfmaq_n_f32(acc, vcvtq_f32_s32(vaddq_s32(vshlq_n_s32(h1, 8), l1)), s1);
#else
    int32_t d0 = 0, d1 = 0;
    for (int j = 0; j < 16; j++) {
        d0 += (int32_t)w.v[j] * a->q[k + j];
        d1 += (int32_t)w.v[j + 16] * a->q[k + j + 16];
    }
    return acc + s0 * (float)d0 + s1 * (float)d1;
#endif
}


#endif
