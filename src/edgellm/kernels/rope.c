/* Per-head RMSNorm (optional) and rotate-half RoPE over a prompt's q or k heads, in place, in one
   pass: PyTorch spends ~6 ops on RoPE alone (chunk, neg, cat, two muls, add) and 4 on each norm.

     x <- x / sqrt(mean(x^2) + eps) * w                      (when w is given: Gemma 3's QNorm/KNorm)
     x[i] <- x[i] cos[i] - x[i + D/2] sin[i],  x[i + D/2] <- x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2] */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static void norm_rope_head(float *x, int64_t d, const float *w, float eps, const float *cos, const float *sin) {
    if (w) {
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)d + eps));
        for (int64_t i = 0; i < d; i += 16)
            _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), r), _mm512_loadu_ps(w + i)));
    }
    int64_t h = d / 2;
    for (int64_t i = 0; i < h; i += 16) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + h + i);
        _mm512_storeu_ps(x + i, _mm512_fnmadd_ps(b, _mm512_loadu_ps(sin + i), _mm512_mul_ps(a, _mm512_loadu_ps(cos + i))));
        _mm512_storeu_ps(x + h + i,
                         _mm512_fmadd_ps(a, _mm512_loadu_ps(sin + h + i), _mm512_mul_ps(b, _mm512_loadu_ps(cos + h + i))));
    }
}

/* x: T tokens of H heads of D floats, token t's head j at x + t * t_stride + j * D; cos, sin: (T, D).
   w: (D) or NULL. D % 32 == 0. */
void edgellm_norm_rope(float *x, int64_t t_count, int64_t heads, int64_t d, int64_t t_stride, const float *w,
                       float eps, const float *cos, const float *sin, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t th = 0; th < t_count * heads; th++) {
        int64_t t = th / heads, j = th % heads;
        norm_rope_head(x + t * t_stride + j * d, d, w, eps, cos + t * d, sin + t * d);
    }
}
