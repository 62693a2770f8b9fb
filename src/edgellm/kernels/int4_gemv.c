/* Decode-time matrix-vector product over torch's packed INT4 CPU layout (int4_pack.h), with
   AVX-512 VNNI: the weights stay in the bytes torch packed, no second copy.

   Activations are quantized per group to int16 (activations.h), so the inner loop is integer
   multiply-adds (vpdpwssd: two int16 products per int32 lane) and each group ends with one
   float fma per row:

     y[n] = sum_g  scale[g][n] * dx[g] * sum_{k in g} q[n][k] * qx[k]
                 + (zero[g][n] - 8 * scale[g][n]) * sum_{k in g} x[k]

   With planes = 2 the weight's K is twice the activation's (two 4-bit planes side by side,
   see quant/linear.py) and activation k maps to k mod K. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "activations.h"
#include "int4_pack.h"

#define MAX_M 4

/* Rows [nb*64, nb*64 + 64) of y for m rows of activations. */
static void block64(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw,
                    int64_t group, int64_t ka, int64_t nb, int m, const int32_t *qx, const float *dx,
                    const float *sums, float *y) {
    const uint8_t *w = packed + nb * 64 * kw / 2;  /* this block: kw * 32 bytes */
    __m512 acc[MAX_M][4];
    for (int i = 0; i < m; i++)
        for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < kw / group; g++) {
        __m512i iacc[MAX_M][4];
        for (int i = 0; i < m; i++)
            for (int r = 0; r < 4; r++) iacc[i][r] = _mm512_setzero_si512();
        int64_t ga = (g * group) % ka;  /* activation index of this group's first k */
        for (int64_t kk = 0; kk < group; kk += 2) {
            int64_t k = g * group + kk;
            __m256i a = _mm256_loadu_si256((const __m256i *)(w + k * 32));
            __m256i b = _mm256_loadu_si256((const __m256i *)(w + (k + 1) * 32));
            __m256i a_lo = _mm256_and_si256(a, low4), a_hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
            __m256i b_lo = _mm256_and_si256(b, low4), b_hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
            /* lane j of chunk r: row r*16 + j, low half q[.][k], high half q[.][k+1] */
            __m512i wq[4];
            wq[0] = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(a_lo)),
                                    _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(b_lo)), 16));
            wq[1] = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(a_lo, 1)),
                                    _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(b_lo, 1)), 16));
            wq[2] = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(a_hi)),
                                    _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(b_hi)), 16));
            wq[3] = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(a_hi, 1)),
                                    _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(b_hi, 1)), 16));
            for (int i = 0; i < m; i++) {
                __m512i xp = _mm512_set1_epi32(qx[i * (ka / 2) + (ga + kk) / 2]);
                for (int r = 0; r < 4; r++) iacc[i][r] = _mm512_dpwssd_epi32(iacc[i][r], wq[r], xp);
            }
        }
        /* (scale, zero) bf16 pairs of rows nb*64 .. +64 in group g: 4 x 16 lanes of 32 bits */
        const uint16_t *sz = scale_zero + (g * n + nb * 64) * 2;
        for (int r = 0; r < 4; r++) {
            __m512 scale, offset;
            int4_scale_offset(sz + r * 32, &scale, &offset);
            for (int i = 0; i < m; i++) {
                int64_t gi = i * (ka / group) + ga / group;
                __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(dx[gi]));
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i][r]), s, acc[i][r]);
                acc[i][r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[gi]), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(y + i * n + nb * 64 + r * 16, acc[i][r]);
}

/* y[m][n] = x[m][ka] @ W^T, W (n, kw) packed; kw = planes * ka. m <= MAX_M, n % 64 == 0,
   group % 2 == 0, ka % group == 0. `work` holds m * (ka / 2) int32 + 2 * m * ka / group floats. */
void edgellm_int4_gemv(const float *x, int m, int64_t ka, const uint8_t *packed, const uint16_t *scale_zero,
                       int64_t n, int64_t kw, int64_t group, float *y, void *work, int threads) {
    int32_t *qx = (int32_t *)work;
    float *dx = (float *)(qx + m * (ka / 2));
    float *sums = dx + m * (ka / group);
    for (int i = 0; i < m; i++)
        quantize_activations(x + i * ka, ka, group, qx + i * (ka / 2), dx + i * (ka / group),
                             sums + i * (ka / group));
    int64_t blocks = n / 64;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++)
        block64(packed, scale_zero, n, kw, group, ka, nb, m, qx, dx, sums, y);
}
