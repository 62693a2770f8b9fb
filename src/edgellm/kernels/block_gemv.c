/* Matrix-vector products straight on a GGUF file's own blocks (no converted copy), for decode,
   and their dequantization to bf16 for the GEMM of a prompt.

   Q8_0: 34-byte blocks of 32: fp16 d, 32 int8 q;                       w = d * q
   Q5_0: 22-byte blocks of 32: fp16 d, 32 high bits qh, 16 bytes of nibbles
         (element j < 16: low nibble of byte j, element j + 16: its high nibble; bit j of qh
         is element j's fifth bit);                                     w = d * (q - 16)
   Q6_K: 210-byte super-blocks of 256: 128 bytes of low nibbles ql, 64 bytes of high bit pairs qh,
         16 int8 scales (one per 16 weights), fp16 d;                  w = d * scale * (q - 32)
         (per half of 128: ql[0:32], ql[32:64] and qh[0:32] give weights 0-31 (low nibbles,
         qh bits 0-1), 32-63 (bits 2-3), 64-95 (high nibbles, bits 4-5), 96-127 (bits 6-7))
   Each 32 weights become 32 int16; with int16 activations (activations.h) one vpdpwssd
   gives 16 partial sums, and the block ends with one float fma by d * dx. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "activations.h"
#include "vec_math.h"

#define MAX_M 4
enum { BLOCK_Q8_0 = 8, BLOCK_Q5_0 = 6, BLOCK_Q6_K = 14 }; /* ggml type numbers */
#define Q6_K_BYTES 210

static inline int block_bytes(int type) { return type == BLOCK_Q8_0 ? 34 : 22; }

static inline float block_scale(const uint8_t *b) {
    uint16_t half;
    memcpy(&half, b, 2);
    return _cvtsh_ss(half);
}

/* The 32 integer weights of one Q8_0 / Q5_0 block, as int8. */
static inline __m256i block_int8(const uint8_t *b, int type) {
    if (type == BLOCK_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    __m128i raw = _mm_loadu_si128((const __m128i *)(b + 6));
    __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    q = _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(16));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
}

static inline __m512i block_weights(const uint8_t *b, int type) { return _mm512_cvtepi8_epi16(block_int8(b, type)); }

/* One weight row . one activation row. Blocks go four at a time into four accumulators, so
   the per-block fma chains overlap instead of waiting on each other's latency. */
static inline __m512 block_term(const uint8_t *block, int type, const int32_t *qx_block, float dx, __m512 acc) {
    __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), block_weights(block, type),
                                      _mm512_loadu_si512((const void *)qx_block));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(block_scale(block) * dx), acc);
}

static inline float row_dot(const uint8_t *row, int type, int64_t nblocks, const int32_t *qx, const float *dx) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t bb = block_bytes(type), b = 0;
    for (; b + 3 < nblocks; b += 4) {
        a0 = block_term(row + b * bb, type, qx + b * 16, dx[b], a0);
        a1 = block_term(row + (b + 1) * bb, type, qx + (b + 1) * 16, dx[b + 1], a1);
        a2 = block_term(row + (b + 2) * bb, type, qx + (b + 2) * 16, dx[b + 2], a2);
        a3 = block_term(row + (b + 3) * bb, type, qx + (b + 3) * 16, dx[b + 3], a3);
    }
    for (; b < nblocks; b++) a0 = block_term(row + b * bb, type, qx + b * 16, dx[b], a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* The four 32-weight chunks of one Q6_K half (ql: 64 bytes, qh: 32), as int8 q - 32. */
static inline void q6_k_half(const uint8_t *ql, const uint8_t *qh, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    __m256i a = _mm256_loadu_si256((const __m256i *)ql), b = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    __m256i a_hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4), b_hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    q[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
    q[2] = _mm256_or_si256(a_hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
    q[3] = _mm256_or_si256(b_hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
    for (int c = 0; c < 4; c++) q[c] = _mm256_sub_epi8(q[c], bias);
}

/* d * scale of one super-block's 16 sub-blocks, and the lane pattern picking chunk c's two:
   lanes 0-7 of a vpdpwssd result cover weights 0-15 of the chunk, lanes 8-15 weights 16-31. */
static inline __m512 q6_k_scales(const uint8_t *block) {
    __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192))));
    return _mm512_mul_ps(sc, _mm512_set1_ps(block_scale(block + 208)));
}

static inline __m512 chunk_scales(__m512 scales, int chunk) {
    __m512i idx = _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                   _mm512_set1_epi32(2 * chunk));
    return _mm512_permutexvar_ps(idx, scales);
}

static inline float row_dot_q6_k(const uint8_t *row, int64_t nblocks, const int32_t *qx, const float *dx) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t sb = 0; sb < nblocks / 8; sb++) {
        const uint8_t *block = row + sb * Q6_K_BYTES;
        __m512 scales = q6_k_scales(block);
        for (int half = 0; half < 2; half++) {
            __m256i q[4];
            q6_k_half(block + half * 64, block + 128 + half * 32, q);
            for (int c = 0; c < 4; c++) {
                int64_t g = sb * 8 + half * 4 + c;  /* 32-weight group */
                __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(q[c]),
                                                  _mm512_loadu_si512((const void *)(qx + g * 16)));
                __m512 f = _mm512_mul_ps(chunk_scales(scales, half * 4 + c), _mm512_set1_ps(dx[g]));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), f, acc[c]);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

static void gemv_rows(const float *x, int m, int64_t k, const uint8_t *blocks, int type, int64_t n, float *y,
                      void *work, int threads) {
    int32_t *qx = (int32_t *)work;
    float *dx = (float *)(qx + m * (k / 2));
    float *sums = dx + m * (k / 32);
    for (int i = 0; i < m; i++)
        quantize_activations(x + i * k, k, 32, qx + i * (k / 2), dx + i * (k / 32), sums + i * (k / 32));
    int64_t nblocks = k / 32, row_bytes = type == BLOCK_Q6_K ? k / 256 * Q6_K_BYTES : nblocks * block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = blocks + r * row_bytes;
        for (int i = 0; i < m; i++)
            y[i * n + r] = type == BLOCK_Q6_K ? row_dot_q6_k(row, nblocks, qx + i * (k / 2), dx + i * nblocks)
                                              : row_dot(row, type, nblocks, qx + i * (k / 2), dx + i * nblocks);
    }
}

/* y[m][n] = x[m][k] @ W^T for W given as n rows of GGUF blocks of `type` (Q8_0, Q5_0, Q6_K), m <= 4.
   `work` holds m * (k / 2) int32 + 2 * m * k / 32 floats. */
void edgellm_block_gemv(const float *x, int m, int64_t k, const uint8_t *blocks, int type, int64_t n, float *y,
                        void *work, int threads) {
    /* constant types, so each loop is compiled for its format */
    if (type == BLOCK_Q8_0) gemv_rows(x, m, k, blocks, BLOCK_Q8_0, n, y, work, threads);
    else if (type == BLOCK_Q5_0) gemv_rows(x, m, k, blocks, BLOCK_Q5_0, n, y, work, threads);
    else gemv_rows(x, m, k, blocks, BLOCK_Q6_K, n, y, work, threads);
}

static inline void store_bf16_chunk(__m256i q, __m512 f0, __m512 f1, uint16_t *dst) {
    __m512i w = _mm512_cvtepi8_epi16(q);
    __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));
    __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));
    _mm256_storeu_si256((__m256i *)dst, ps_to_bf16(_mm512_mul_ps(w0, f0)));
    _mm256_storeu_si256((__m256i *)(dst + 16), ps_to_bf16(_mm512_mul_ps(w1, f1)));
}

static void q6_k_rows_to_bf16(const uint8_t *blocks, int64_t n, int64_t k, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *block = blocks + (r * (k / 256) + sb) * Q6_K_BYTES;
            __m512 scales = q6_k_scales(block);
            for (int half = 0; half < 2; half++) {
                __m256i q[4];
                q6_k_half(block + half * 64, block + 128 + half * 32, q);
                for (int c = 0; c < 4; c++) {
                    int chunk = half * 4 + c;
                    __m512 f0 = _mm512_permutexvar_ps(_mm512_set1_epi32(2 * chunk), scales);
                    __m512 f1 = _mm512_permutexvar_ps(_mm512_set1_epi32(2 * chunk + 1), scales);
                    store_bf16_chunk(q[c], f0, f1, out + r * k + sb * 256 + chunk * 32);
                }
            }
        }
}

static void rows_to_bf16(const uint8_t *blocks, int type, int64_t n, int64_t k, uint16_t *out, int threads) {
    int64_t nblocks = k / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *block = blocks + (r * nblocks + b) * block_bytes(type);
            __m512 d = _mm512_set1_ps(block_scale(block));
            store_bf16_chunk(block_int8(block, type), d, d, out + r * k + b * 32);
        }
}

/* out (n, k) bf16 = the dequantized weight, for a prompt's bf16 GEMM. */
void edgellm_blocks_to_bf16(const uint8_t *blocks, int type, int64_t n, int64_t k, uint16_t *out, int threads) {
    if (type == BLOCK_Q8_0) rows_to_bf16(blocks, BLOCK_Q8_0, n, k, out, threads);
    else if (type == BLOCK_Q5_0) rows_to_bf16(blocks, BLOCK_Q5_0, n, k, out, threads);
    else q6_k_rows_to_bf16(blocks, n, k, out, threads);
}
