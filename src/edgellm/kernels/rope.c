/* Per-head RMSNorm (optional) and rotate-half RoPE over a prompt's q or k heads, in place, in one
   pass: PyTorch spends ~6 ops on RoPE alone (chunk, neg, cat, two muls, add) and 4 on each norm.

     x <- x / sqrt(mean(x^2) + eps) * w                      (when w is given: Gemma 3's QNorm/KNorm)
     x[i] <- x[i] cos[i] - x[i + D/2] sin[i],  x[i + D/2] <- x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2] */
#include "norm_rope.h"

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
