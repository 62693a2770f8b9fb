/* edgellm's INT4 weight layout "I4R64" (docs/kernels.md), written by quant/int4_pack.py on every
   machine alike, read by int4_gemv.c (decode) and dequant.c (prompts):

   rows in blocks of 64; per k, 32 bytes whose byte i holds row i (low nibble) and row 32 + i
   (high nibble), so one k of a block is 64 consecutive rows. Per group of k's, `scale_zero` holds
   one bf16 (scale, zero) pair per row, group-major: (K / group, N, 2). w = (q - 8) * scale + zero.

   i4_dots() below, per ISA, turns one group of one block into exact int32 dot products with the
   int16 activations of intdot.h. */
#ifndef EDGELLM_INT4_LAYOUT_H
#define EDGELLM_INT4_LAYOUT_H
#include "intdot.h"

#define I4_ROWS 64  /* rows per block */

/* Bytes ahead to prefetch (a thread's blocks are contiguous): one core alone keeps too few lines in
   flight to stream at the memory's speed (SmolLM2 decode +10-20 %; 2 KB measured best of 0-12 KB).
   AVX-512 prefetches a line per pair of k's inside i4_dots_zmm (5 % faster than a group's lines in
   one burst, A/B at 1-8 rows); the other variants a group's lines before its i4_dots. */
#define I4_PREFETCH_BYTES 2048

#if EDGELLM_AVX512
#define I4_TILE 4   /* activation rows per i4_dots_zmm call: its accumulators stay in registers */
#define I4_SPLIT 2  /* parts a block's work may split into between threads: its two halves of 32 rows */
#elif EDGELLM_AVX2
#define I4_TILE 8   /* a batch goes 8 rows of the block at a time instead (i4_dots_batch) */
#define I4_SPLIT 1
#else
#define I4_TILE 2
#define I4_SPLIT 1
#endif

#if EDGELLM_AVX2
/* i4_dots for a batch (m <= 8): one chunk of 8 rows at a time, so the batch's accumulators fit the
   16 registers and the nibbles are unpacked once for all of its rows. */
ALWAYS_INLINE void i4_dots_rows(const uint8_t *w, int64_t group, int m, const Act *act, int64_t ka0,
                                int32_t dots[][I4_ROWS]) {
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int chunk = 0; chunk < 8; chunk++) {
        int high = chunk >> 2, byte0 = (chunk & 3) * 8;  /* rows 32 * high + byte0 .. + 8 */
        __m256i acc[I4_TILE];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_si256();
        for (int64_t kk = 0; kk < group; kk += 2) {
            __m256i ua = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + kk * 32 + byte0)));
            __m256i ub = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + (kk + 1) * 32 + byte0)));
            __m256i wq = high ? _mm256_or_si256(_mm256_srli_epi32(ua, 4), _mm256_slli_epi32(_mm256_srli_epi32(ub, 4), 16))
                              : _mm256_or_si256(_mm256_and_si256(ua, low4), _mm256_slli_epi32(_mm256_and_si256(ub, low4), 16));
            for (int i = 0; i < m; i++) {
                int32_t pair;
                memcpy(&pair, act[i].q + ka0 + kk, 4);
                acc[i] = madd_acc(acc[i], wq, _mm256_set1_epi32(pair));
            }
        }
        for (int i = 0; i < m; i++) _mm256_storeu_si256((__m256i *)(dots[i] + 32 * high + byte0), acc[i]);
    }
}

/* i4_dots for a batch of m <= 4: 8 bytes of k and k + 1 interleaved and widened to words make
   both 8 rows of low nibbles (a mask) and the 8 of high ones (a shift), 4 instructions for 16 rows
   where i4_dots_rows spends 6 on 8; 2m accumulators fit the 16 registers up to m = 4. */
ALWAYS_INLINE void i4_dots_rows_both(const uint8_t *w, int64_t group, int m, const Act *act, int64_t ka0,
                                     int32_t dots[][I4_ROWS]) {
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    for (int byte0 = 0; byte0 < 32; byte0 += 8) {  /* rows byte0 .. + 8 (low nibbles) and 32 + byte0 .. + 8 */
        __m256i lo[4], hi[4];
        for (int i = 0; i < m; i++) lo[i] = hi[i] = _mm256_setzero_si256();
        for (int64_t kk = 0; kk < group; kk += 2) {
            __m128i a = _mm_loadl_epi64((const __m128i *)(w + kk * 32 + byte0));
            __m128i b = _mm_loadl_epi64((const __m128i *)(w + (kk + 1) * 32 + byte0));
            __m256i ab = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));  /* lane r: (byte r of k, of k + 1) */
            __m256i wl = _mm256_and_si256(ab, low4), wh = _mm256_srli_epi16(ab, 4);
            for (int i = 0; i < m; i++) {
                int32_t pair;
                memcpy(&pair, act[i].q + ka0 + kk, 4);
                __m256i x = _mm256_set1_epi32(pair);
                lo[i] = madd_acc(lo[i], wl, x);
                hi[i] = madd_acc(hi[i], wh, x);
            }
        }
        for (int i = 0; i < m; i++) {
            _mm256_storeu_si256((__m256i *)(dots[i] + byte0), lo[i]);
            _mm256_storeu_si256((__m256i *)(dots[i] + 32 + byte0), hi[i]);
        }
    }
}

#ifndef __AVXVNNI__
/* One activation row without VNNI: the nibbles of k and k + 1 interleaved byte by byte and
   multiplied by the activation's two bytes (q = 256 hi + lo) with vpmaddubsw, 16 rows x 2 k per
   instruction. Products stay in int16 for 8 pairs of k (8 x 2 x 15 x 128 < 32768), then widen. */
static inline void i4_dots_bytes(const uint8_t *w, int64_t group, const Act *act, int64_t ka0, int32_t *dots) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    /* pairs p: 0 rows 0-7 | 16-23, 1 rows 8-15 | 24-31, 2 and 3 the same + 32 */
    static const int first_row[8] = {0, 16, 8, 24, 32, 48, 40, 56};
    for (int r = 0; r < I4_ROWS; r += 8) _mm256_storeu_si256((__m256i *)(dots + r), _mm256_setzero_si256());
    for (int64_t k8 = 0; k8 < group; k8 += 16) {
        __m256i hi16[4], lo16[4];  /* int16 per row: P0 lo nibbles, P1 lo, P0 hi, P1 hi */
        for (int p = 0; p < 4; p++) hi16[p] = lo16[p] = _mm256_setzero_si256();
        for (int64_t kk = k8; kk < k8 + 16 && kk < group; kk += 2) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(w + kk * 32));
            __m256i b = _mm256_loadu_si256((const __m256i *)(w + (kk + 1) * 32));
            __m256i a_lo = _mm256_and_si256(a, low4), a_hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
            __m256i b_lo = _mm256_and_si256(b, low4), b_hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
            __m256i pairs[4] = {_mm256_unpacklo_epi8(a_lo, b_lo), _mm256_unpackhi_epi8(a_lo, b_lo),
                                _mm256_unpacklo_epi8(a_hi, b_hi), _mm256_unpackhi_epi8(a_hi, b_hi)};
            int16_t xh, xl;
            memcpy(&xh, act->hi + ka0 + kk, 2);
            memcpy(&xl, act->lo + ka0 + kk, 2);
            __m256i vh = _mm256_set1_epi16(xh), vl = _mm256_set1_epi16(xl);
            for (int p = 0; p < 4; p++) {
                hi16[p] = _mm256_add_epi16(hi16[p], _mm256_maddubs_epi16(pairs[p], vh));
                lo16[p] = _mm256_add_epi16(lo16[p], _mm256_maddubs_epi16(pairs[p], vl));
            }
        }
        for (int p = 0; p < 4; p++)
            for (int half = 0; half < 2; half++) {
                __m128i h = half ? _mm256_extracti128_si256(hi16[p], 1) : _mm256_castsi256_si128(hi16[p]);
                __m128i l = half ? _mm256_extracti128_si256(lo16[p], 1) : _mm256_castsi256_si128(lo16[p]);
                __m256i v = _mm256_add_epi32(_mm256_slli_epi32(_mm256_cvtepi16_epi32(h), 8), _mm256_cvtepi16_epi32(l));
                __m256i *out = (__m256i *)(dots + first_row[2 * p + half]);
                _mm256_storeu_si256(out, _mm256_add_epi32(_mm256_loadu_si256(out), v));
            }
    }
}
#endif

/* each batch size its own instance: a constant m keeps the accumulators in registers */
static void i4_dots_batch(const uint8_t *w, int64_t group, int m, const Act *act, int64_t ka0, int32_t dots[][I4_ROWS]) {
    switch (m) {
    case 2: i4_dots_rows_both(w, group, 2, act, ka0, dots); break;
    case 3: i4_dots_rows_both(w, group, 3, act, ka0, dots); break;
    case 4: i4_dots_rows_both(w, group, 4, act, ka0, dots); break;
    case 5: i4_dots_rows(w, group, 5, act, ka0, dots); break;
    case 6: i4_dots_rows(w, group, 6, act, ka0, dots); break;
    case 7: i4_dots_rows(w, group, 7, act, ka0, dots); break;
    default: i4_dots_rows(w, group, 8, act, ka0, dots);
    }
}
#endif

#if EDGELLM_AVX512
/* AVX-512 keeps a block's sums in registers as 4 "chunks" of 16 rows (int4_gemv.c's block64).
   i4_pairs_zmm turns the 64 bytes of k and k + 1 into the chunks' int16 pairs (k, k + 1): with VBMI
   one vpermb per two chunks interleaves the bytes of k and k + 1 and widens them to words, so chunk c
   holds rows 16c .. 16c + 16 in order (the low nibbles make chunks 0 and 1, the high nibbles of the
   same words chunks 2 and 3). Without VBMI (Cascade Lake) vpunpck{l,h}bw + vpmovzxbw work per 128-bit
   lane, two instructions more: chunk c then holds rows f .. f + 8 and f + 16 .. f + 24 with
   f = 32 (c >> 1) + 8 (c & 1). The scales and outputs follow the same order (the helpers below). */
#ifdef __AVX512VBMI__
#define I4_PAIR(c, j) 16 * (c) + (j), 0, 32 + 16 * (c) + (j), 0  /* a word of byte j of k, one of k + 1 */
#define I4_PAIRS4(c, j) I4_PAIR(c, j), I4_PAIR(c, j + 1), I4_PAIR(c, j + 2), I4_PAIR(c, j + 3)
static const uint8_t I4_TO_CHUNK[2][64] __attribute__((aligned(64))) = {
    {I4_PAIRS4(0, 0), I4_PAIRS4(0, 4), I4_PAIRS4(0, 8), I4_PAIRS4(0, 12)},
    {I4_PAIRS4(1, 0), I4_PAIRS4(1, 4), I4_PAIRS4(1, 8), I4_PAIRS4(1, 12)},
};
#endif

ALWAYS_INLINE void i4_pairs_zmm(const uint8_t *w, __m512i wq[4], int c0, int c1) {
    const __m512i low4 = _mm512_set1_epi16(0x0F);
#ifdef __AVX512VBMI__
    const __mmask64 even_bytes = 0x5555555555555555ull;  /* odd bytes zeroed: each word is one byte */
    __m512i both = _mm512_loadu_si512((const void *)w);
    __m512i lo = _mm512_maskz_permutexvar_epi8(even_bytes, _mm512_load_si512((const void *)I4_TO_CHUNK[0]), both);
    __m512i hi = _mm512_maskz_permutexvar_epi8(even_bytes, _mm512_load_si512((const void *)I4_TO_CHUNK[1]), both);
#else
    __m256i a = _mm256_loadu_si256((const __m256i *)w), b = _mm256_loadu_si256((const __m256i *)(w + 32));
    __m512i lo = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(a, b));
    __m512i hi = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(a, b));
#endif
    /* a word holds a zero-extended byte: its high nibble needs only the shift */
    if (c0 == 0) wq[0] = _mm512_and_si512(lo, low4), wq[1] = _mm512_and_si512(hi, low4);
    if (c1 == 4) wq[2] = _mm512_srli_epi16(lo, 4), wq[3] = _mm512_srli_epi16(hi, 4);
}

/* chunk c's 16 (scale, zero) pairs from the block's 64 at sz, as two vectors */
static inline void i4_chunk_scales(const uint16_t *sz, int c, vf *scale, vf *zero) {
#ifdef __AVX512VBMI__
    vf_load_bf16_pairs(sz + 32 * c, scale, zero);
#else
    int f = 32 * (c >> 1) + 8 * (c & 1);
    __m256i first = _mm256_loadu_si256((const __m256i *)(sz + 2 * f));
    vf_split_bf16_pairs(_mm512_inserti64x4(_mm512_castsi256_si512(first),
                                           _mm256_loadu_si256((const __m256i *)(sz + 2 * (f + 16))), 1), scale, zero);
#endif
}

/* chunk c's 16 outputs into the block's 64 at y */
static inline void i4_chunk_store(float *y, int c, __m512 v) {
#ifdef __AVX512VBMI__
    _mm512_storeu_ps(y + 16 * c, v);
#else
    int f = 32 * (c >> 1) + 8 * (c & 1);
    _mm256_storeu_ps(y + f, _mm512_castps512_ps256(v));
    _mm256_storeu_ps(y + f + 16, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#endif
}

/* acc[i][c] = chunk c's sums over kk < group of q[row][k0 + kk] * act[i].q[ka0 + kk], for the chunks
   c0 <= c < c1 (0, 4: the whole block; 0, 2 or 2, 4: a half), m <= I4_TILE */
ALWAYS_INLINE void i4_dots_zmm(const uint8_t *w, int64_t group, int m, const Act *act, int64_t ka0,
                               __m512i acc[][4], int c0, int c1) {
    for (int i = 0; i < m; i++)
        for (int c = c0; c < c1; c++) acc[i][c] = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < group; kk += 2) {
        __builtin_prefetch(w + kk * 32 + I4_PREFETCH_BYTES);  /* a line per pair of k's: as fast as they are read */
        __m512i wq[4];
        i4_pairs_zmm(w + kk * 32, wq, c0, c1);
        for (int i = 0; i < m; i++) {
            int32_t pair;
            memcpy(&pair, act[i].q + ka0 + kk, 4);
            __m512i xp = _mm512_set1_epi32(pair);
            for (int c = c0; c < c1; c++) acc[i][c] = dpwssd512(acc[i][c], wq[c], xp);
        }
    }
}
#else

/* dots[i][r] = sum over kk < group of q[r][k0 + kk] * act[i].q[ka0 + kk], for the block whose
   k-row k0 starts at w (32 bytes per k), m <= I4_TILE; group is a multiple of 4. */
ALWAYS_INLINE void i4_dots(const uint8_t *w, int64_t group, int m, const Act *act, int64_t ka0,
                           int32_t dots[][I4_ROWS]) {
#if EDGELLM_AVX2
    if (m > 1) {
        i4_dots_batch(w, group, m, act, ka0, dots);
        return;
    }
#ifndef __AVXVNNI__
    i4_dots_bytes(w, group, act, ka0, dots[0]);
#else
    /* one row with AVX-VNNI: bytes [16h, 16h + 16) hold rows 16h.. (low nibbles) and 32 + 16h..
       (high): 4 x 8 rows */
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) {
        __m256i acc[4];
        for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_si256();
        for (int64_t kk = 0; kk < group; kk += 2) {
            const uint8_t *a = w + kk * 32 + 16 * h, *b = a + 32;
            __m256i wq[4];
            for (int c = 0; c < 2; c++) {
                __m256i ua = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(a + 8 * c)));
                __m256i ub = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * c)));
                wq[c] = _mm256_or_si256(_mm256_and_si256(ua, low4), _mm256_slli_epi32(_mm256_and_si256(ub, low4), 16));
                wq[c + 2] = _mm256_or_si256(_mm256_srli_epi32(ua, 4), _mm256_slli_epi32(_mm256_srli_epi32(ub, 4), 16));
            }
            int32_t pair;
            memcpy(&pair, act->q + ka0 + kk, 4);
            __m256i xp = _mm256_set1_epi32(pair);
            for (int r = 0; r < 4; r++) acc[r] = madd_acc(acc[r], wq[r], xp);
        }
        /* wq[0..1]: rows 16h + 0..15; wq[2..3]: rows 32 + 16h + 0..15 */
        _mm256_storeu_si256((__m256i *)(dots[0] + 16 * h), acc[0]);
        _mm256_storeu_si256((__m256i *)(dots[0] + 16 * h + 8), acc[1]);
        _mm256_storeu_si256((__m256i *)(dots[0] + 32 + 16 * h), acc[2]);
        _mm256_storeu_si256((__m256i *)(dots[0] + 32 + 16 * h + 8), acc[3]);
    }
#endif
#elif EDGELLM_NEON
    /* 16 rows at a time (bytes [16h, 16h + 16), low or high nibbles); 4 k's at a time, transposed so
       each 32-bit lane holds one row's 4 consecutive k's for sdot. */
    for (int set = 0; set < 4; set++) {
        int h = set & 1, high = set >> 1;
        int32x4_t acc_h[I4_TILE][4], acc_l[I4_TILE][4];
        for (int i = 0; i < m; i++)
            for (int r = 0; r < 4; r++) acc_h[i][r] = acc_l[i][r] = vdupq_n_s32(0);
        for (int64_t kk = 0; kk < group; kk += 4) {
            uint8x16_t q[4];
            for (int j = 0; j < 4; j++) {
                uint8x16_t v = vld1q_u8(w + (kk + j) * 32 + 16 * h);
                q[j] = high ? vshrq_n_u8(v, 4) : vandq_u8(v, vdupq_n_u8(0x0F));
            }
            uint8x16_t z01a = vzip1q_u8(q[0], q[1]), z01b = vzip2q_u8(q[0], q[1]);
            uint8x16_t z23a = vzip1q_u8(q[2], q[3]), z23b = vzip2q_u8(q[2], q[3]);
            int8x16_t wq[4] = {
                vreinterpretq_s8_u16(vzip1q_u16(vreinterpretq_u16_u8(z01a), vreinterpretq_u16_u8(z23a))),
                vreinterpretq_s8_u16(vzip2q_u16(vreinterpretq_u16_u8(z01a), vreinterpretq_u16_u8(z23a))),
                vreinterpretq_s8_u16(vzip1q_u16(vreinterpretq_u16_u8(z01b), vreinterpretq_u16_u8(z23b))),
                vreinterpretq_s8_u16(vzip2q_u16(vreinterpretq_u16_u8(z01b), vreinterpretq_u16_u8(z23b))),
            };
            for (int i = 0; i < m; i++) {
                int32_t xh, xl;
                memcpy(&xh, act[i].hi + ka0 + kk, 4);
                memcpy(&xl, act[i].lo + ka0 + kk, 4);
                int8x16_t vh = vreinterpretq_s8_s32(vdupq_n_s32(xh)), vl = vreinterpretq_s8_s32(vdupq_n_s32(xl));
                for (int r = 0; r < 4; r++) {
                    acc_h[i][r] = vdotq_s32(acc_h[i][r], wq[r], vh);
                    acc_l[i][r] = vdotq_s32(acc_l[i][r], wq[r], vl);
                }
            }
        }
        for (int i = 0; i < m; i++)
            for (int r = 0; r < 4; r++)
                vst1q_s32(dots[i] + 32 * high + 16 * h + 4 * r, vaddq_s32(vshlq_n_s32(acc_h[i][r], 8), acc_l[i][r]));
    }
#else
    for (int i = 0; i < m; i++) {
        for (int r = 0; r < I4_ROWS; r++) dots[i][r] = 0;
        for (int64_t kk = 0; kk < group; kk++) {
            const uint8_t *row = w + kk * 32;
            int32_t x = act[i].q[ka0 + kk];
            for (int r = 0; r < 32; r++) {
                dots[i][r] += (row[r] & 15) * x;
                dots[i][r + 32] += (row[r] >> 4) * x;
            }
        }
    }
#endif
}
#endif  /* EDGELLM_AVX512 */
#endif
