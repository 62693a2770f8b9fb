/* Row kernels for GGUF's K-quant super-blocks of 256 (Q5_K, Q6_K; block_gemv.c has their layouts),
   for decode on x86: the codes stay unsigned bytes and meet the activations' two signed bytes
   (q = 256 hi + lo, split_bytes) in byte dot products, exact in int32, one scale per 16 (Q6_K) or 32
   (Q5_K) weights applied in float. The codes' bias (Q6_K's 32, Q5_K's mins) comes off per super-block
   through sums of the activations. The generic path of block_gemv.c widens 32 codes at a time to
   int16 instead, and reads these blocks at half the memory's speed on 2 cores (6-7 GB/s a core at
   AVX2 width on Zen 4, against 14-15 here). */
#ifndef EDGELLM_K_ROWS_H
#define EDGELLM_K_ROWS_H
#include "intdot.h"

#ifndef MAX_M
#define MAX_M 8  /* activation rows per call */
#endif
#define Q5_K_BYTES 176
#define Q6_K_BYTES 210

static inline uint16_t half_bits(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

static inline float half_at(const uint8_t *p) { return f16_to_f32(half_bits(p)); }

#if EDGELLM_AVX512 || EDGELLM_AVX2
/* What the Q6_K rows need of an activation row beyond its Act: each 16 weights' offset term
   32 * dx * sum(q), the codes' bias times the activations it meets. */
static inline int64_t q6_offset_bytes(int64_t k) { return k / 4 + 64; }

static const float *q6_offsets(const Act *a, int64_t k, float *offset) {
    for (int64_t s = 0; s < k / 16; s++) {
        int32_t sum = 0;
        for (int j = 0; j < 16; j++) sum += a->q[16 * s + j];
        offset[s] = 32.f * a->dx[s / 2] * (float)sum;
    }
    return offset;
}

/* A Q5_K super-block's 8 sub-block scales d * sc and mins dmin * m (k_scale_min's unpacking, 4 bytes at
   a time: a loop of scalars per sub-block cost as much as the block's products). */
static inline void k_scales_mins(const uint8_t *blk, __m256 *scales, __m256 *mins) {
    uint32_t w[3];
    memcpy(w, blk + 4, 12);
    uint64_t sc = (w[0] & 0x3f3f3f3fu) | (uint64_t)((w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4)) << 32;
    uint64_t mn = (w[1] & 0x3f3f3f3fu) | (uint64_t)(((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4)) << 32;
    *scales = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))),
                            _mm256_set1_ps(half_at(blk)));
    *mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))),
                          _mm256_set1_ps(half_at(blk + 2)));
}
#endif

#if EDGELLM_AVX512
/* The int32 lanes (4 products each) of 64 unsigned codes . an activation row's 64 values from `at`, each
   value as its two signed bytes (q = 256 hi + lo, split_bytes): exact. */
static inline __m512i codes_dot(__m512i codes, const Act *a, int64_t at) {
    __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512((const void *)(a->hi + at)));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(hi, 8), codes, _mm512_loadu_si512((const void *)(a->lo + at)));
}

/* out[i] = a Q6_K row . activation row i on AVX-512, 64 weights a vector: the 6-bit codes unpacked as
   unsigned bytes (a 512-bit load of low nibbles, the high bit pairs shifted into place per 256-bit half)
   meet the activations' two signed bytes (q = 256 hi + lo) in two vpdpbusd, and the codes' bias of 32
   comes off once per super-block through each 16's sum of activations. The generic path widens 32
   codes at a time to int16 and read Q6_K at 13-15 GB/s on 2 Zen 4 cores from cache, under the DRAM's
   ~20 (Qwen2.5-1.5B Q4_K_M keeps its head and half its down projections in Q6_K). */
ALWAYS_INLINE void q6_k_row_dots(const uint8_t *row, int64_t k, int m, const Act *act, const float *const *offsets,
                                float *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);    /* bits 0-1 | 2-3 */
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  /* 4-5 | 6-7 */
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lane = _mm512_srli_epi32(lanes, 2), group = _mm512_srli_epi32(lanes, 1);  /* 4 lanes a 16, 2 16s a dx */
    vf acc[MAX_M][2];  /* the two vectors of each half: two fma chains per row */
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = vf_zero();
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * Q6_K_BYTES;
        __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))),
                                      _mm512_set1_ps(half_at(blk + 208)));  /* d * scale of each 16 */
        __m512 sdx[MAX_M];  /* each 16's d * scale * dx */
        for (int i = 0; i < m; i++) {
            acc[i][0] = _mm512_fnmadd_ps(scales, _mm512_loadu_ps(offsets[i] + b * 16), acc[i][0]);
            sdx[i] = _mm512_mul_ps(scales, _mm512_permutexvar_ps(group, _mm512_castps256_ps512(_mm256_loadu_ps(act[i].dx + b * 8))));
        }
        for (int h = 0; h < 2; h++) {
            __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
            __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
            __m512i q[2] = {  /* weights 0-63, then 64-127 of the half, 0..63 */
                _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_sllv_epi16(qh, up), high2)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(_mm512_srlv_epi16(qh, down), high2))};
            for (int j = 0; j < 2; j++) {
                int64_t at = b * 256 + 128 * h + 64 * j;  /* first weight of the vector */
                __m512i pick = _mm512_add_epi32(lane, _mm512_set1_epi32(8 * h + 4 * j));
                for (int i = 0; i < m; i++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes_dot(q[j], &act[i], at)),
                                                _mm512_permutexvar_ps(pick, sdx[i]), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < m; i++) out[i] = vf_sum(vf_add(acc[i][0], acc[i][1]));
}

/* out[i] = a Q5_K row . activation row i on AVX-512, 64 weights a vector as the Q6_K rows go: a chunk's
   32 bytes of nibbles are two sub-blocks (low nibbles, then high), their fifth bits from qh, each 8
   int32 lanes of vpdpbusd with the activations' two bytes; a super-block's 8 sub-block scales times
   their groups' dx are permuted onto the lanes, and the mins come off through the activations' sums
   of 32. The generic path widens 32 codes at a time: Q5_K_M's q, k, gate and up took half of a
   Qwen2.5-1.5B decode there. */
ALWAYS_INLINE void q5_k_row_dots(const uint8_t *row, int64_t k, int m, const Act *act, float *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const __m512i lane = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
    vf acc[MAX_M][2];
    __m256 mins[MAX_M];
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = vf_zero(), mins[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * Q5_K_BYTES;
        __m256 scales, offsets;
        k_scales_mins(blk, &scales, &offsets);
        __m512 sdx[MAX_M];
        for (int i = 0; i < m; i++) {
            sdx[i] = _mm512_castps256_ps512(_mm256_mul_ps(scales, _mm256_loadu_ps(act[i].dx + b * 8)));
            mins[i] = _mm256_fmadd_ps(offsets, _mm256_loadu_ps(act[i].sum + b * 8), mins[i]);
        }
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int j = 0; j < 4; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * j));
            __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low4),
                                         _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), 4), bit4));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                         _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), 4), bit4));
            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            __m512i pick = _mm512_add_epi32(lane, _mm512_set1_epi32(2 * j));
            int64_t at = b * 256 + 64 * j;
            for (int i = 0; i < m; i++)
                acc[i][j & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes_dot(q, &act[i], at)),
                                                _mm512_permutexvar_ps(pick, sdx[i]), acc[i][j & 1]);
        }
    }
    for (int i = 0; i < m; i++) out[i] = vf_sum(vf_add(acc[i][0], acc[i][1])) - f8_sum(mins[i]);
}
#elif EDGELLM_AVX2
/* The int32 lanes (4 products each) of 32 unsigned codes . an activation row's 32 values from `at`:
   AVX-VNNI's vpdpbusd, else vpmaddubsw (|63 * 128 * 2| fits its int16) and vpmaddwd, exact either way. */
static inline __m256i codes_dot32(__m256i codes, const Act *a, int64_t at) {
    __m256i hi = _mm256_loadu_si256((const __m256i *)(a->hi + at)), lo = _mm256_loadu_si256((const __m256i *)(a->lo + at));
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), codes, hi), 8), codes, lo);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(codes, hi), _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(codes, lo), _mm256_set1_epi16(1)));
#endif
}

/* out[i] = a Q6_K row . activation row i at AVX2 width, 32 weights a vector: the four 32-code chunks of
   a half from 64 bytes of nibbles and 32 of bit pairs; a chunk's lanes 0-3 are its first 16 weights,
   4-7 its second, so the two scales of its 16s sit on the lanes by one permute. */
ALWAYS_INLINE void q6_k_row_dots(const uint8_t *row, int64_t k, int m, const Act *act, const float *const *offsets,
                                float *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[MAX_M][2];
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * Q6_K_BYTES;
        __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        __m256 d = _mm256_set1_ps(half_at(blk + 208));
        __m256 scales[2] = {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d),  /* d * scale of 16s 0-7 */
                            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d)};
        for (int i = 0; i < m; i++) {
            acc[i][0] = _mm256_fnmadd_ps(scales[0], _mm256_loadu_ps(offsets[i] + b * 16), acc[i][0]);
            acc[i][1] = _mm256_fnmadd_ps(scales[1], _mm256_loadu_ps(offsets[i] + b * 16 + 8), acc[i][1]);
        }
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m256i codes[4] = {  /* weights 0-31, 32-63, 64-95, 96-127 of the half */
                _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2)),
                _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, high2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2))};
            for (int c = 0; c < 4; c++) {
                int64_t chunk = b * 8 + 4 * h + c;  /* the activations' group of 32 */
                __m256 sc2 = _mm256_permutevar8x32_ps(scales[h], _mm256_add_epi32(pair, _mm256_set1_epi32(2 * c)));
                for (int i = 0; i < m; i++)
                    acc[i][c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes_dot32(codes[c], &act[i], chunk * 32)),
                                                    _mm256_mul_ps(sc2, _mm256_set1_ps(act[i].dx[chunk])), acc[i][c & 1]);
            }
        }
    }
    for (int i = 0; i < m; i++) out[i] = f8_sum(_mm256_add_ps(acc[i][0], acc[i][1]));
}

/* out[i] = a Q5_K row . activation row i at AVX2 width: 32 bytes of nibbles are two sub-blocks (low
   nibbles, then high), their fifth bits from qh; one scale d * sc * dx per 32 weights, the mins
   through the activations' sums of 32. */
ALWAYS_INLINE void q5_k_row_dots(const uint8_t *row, int64_t k, int m, const Act *act, float *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    __m256 acc[MAX_M][2], mins[MAX_M];
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = mins[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = row + b * Q5_K_BYTES;
        __m256 scales, offsets;
        k_scales_mins(blk, &scales, &offsets);
        float sdx[MAX_M][8];  /* each sub-block's d * sc * dx, broadcast from memory below */
        for (int i = 0; i < m; i++) {
            _mm256_storeu_ps(sdx[i], _mm256_mul_ps(scales, _mm256_loadu_ps(act[i].dx + b * 8)));
            mins[i] = _mm256_fmadd_ps(offsets, _mm256_loadu_ps(act[i].sum + b * 8), mins[i]);
        }
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int j = 0; j < 4; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * j));
            __m256i codes[2] = {  /* sub-blocks 2j and 2j + 1 */
                _mm256_or_si256(_mm256_and_si256(raw, low4),
                                _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), 4), bit4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), 4), bit4))};
            for (int s = 0; s < 2; s++) {
                int64_t sub = b * 8 + 2 * j + s;
                for (int i = 0; i < m; i++)
                    acc[i][s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes_dot32(codes[s], &act[i], sub * 32)),
                                                _mm256_broadcast_ss(&sdx[i][2 * j + s]), acc[i][s]);
            }
        }
    }
    for (int i = 0; i < m; i++) out[i] = f8_sum(_mm256_add_ps(acc[i][0], acc[i][1])) - f8_sum(mins[i]);
}
#endif
#endif
