/* RMSNorm for a prompt's rows, fused with what surrounds it, in one pass each:
     pre-norm:   n = bf16(x / rms(x) * w)      the next linear's input, which takes bf16 anyway
     post-norm:  out = x + y / rms(y) * w       Gemma 3's normed residual add, y the sublayer's bf16 output
   PyTorch spends ~5 ops on the norm plus a cast or an add, each a pass over the rows. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

static inline __m512 inv_rms(float sum_sq, int64_t d, float eps) {
    return _mm512_set1_ps(1.f / sqrtf(sum_sq / (float)d + eps));
}

/* out (rows, d) bf16 = RMSNorm(x) * w for x (rows, d) fp32; d % 16 == 0. */
void edgellm_rms_norm_bf16(const float *x, int64_t rows, int64_t d, const float *w, float eps, uint16_t *out,
                           int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 scale = inv_rms(_mm512_reduce_add_ps(ss), d, eps);
        for (int64_t i = 0; i < d; i += 16) {
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), scale), _mm512_loadu_ps(w + i));
            _mm256_storeu_si256((__m256i *)(out + r * d + i), ps_to_bf16(v));
        }
    }
}

/* out (rows, d) fp32 = x + RMSNorm(y) * w for x fp32 and y bf16, both (rows, d); d % 16 == 0. */
void edgellm_add_rms_norm(const float *x, const uint16_t *y, int64_t rows, int64_t d, const float *w, float eps,
                          float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *yr = y + r * d;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 v = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(yr + i)));
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 scale = inv_rms(_mm512_reduce_add_ps(ss), d, eps);
        for (int64_t i = 0; i < d; i += 16) {
            __m512 v = _mm512_mul_ps(bf16_to_ps(_mm256_loadu_si256((const __m256i *)(yr + i))), scale);
            _mm512_storeu_ps(out + r * d + i, _mm512_fmadd_ps(v, _mm512_loadu_ps(w + i), _mm512_loadu_ps(x + r * d + i)));
        }
    }
}
