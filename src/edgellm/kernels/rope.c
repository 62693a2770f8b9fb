/* Per-head RMSNorm (optional) and rotate-half RoPE over a prompt's q or k heads, in place, in one
   pass: PyTorch spends ~6 ops on RoPE alone (chunk, neg, cat, two muls, add) and 4 on each norm.

     x <- x / sqrt(mean(x^2) + eps) * w                      (when w is given: Gemma 3's QNorm/KNorm)
     x[i] <- x[i] cos[i] - x[i + D/2] sin[i],  x[i + D/2] <- x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2] */
#include "norm_rope.h"

typedef struct {
    float *x;
    int64_t heads, d, t_stride;
    const float *w, *cos, *sin;
    float eps;
} NormRope;

static void norm_rope_heads(void *p, int64_t th0, int64_t th1) {
    const NormRope *a = p;
    for (int64_t th = th0; th < th1; th++) {
        int64_t t = th / a->heads, j = th % a->heads;
        norm_rope_head(a->x + t * a->t_stride + j * a->d, a->d, a->w, a->eps, a->cos + t * a->d, a->sin + t * a->d);
    }
}

/* x: T tokens of H heads of D floats, token t's head j at x + t * t_stride + j * D; cos, sin: (T, D).
   w: (D) or NULL. D % 32 == 0. */
void edgellm_norm_rope(float *x, int64_t t_count, int64_t heads, int64_t d, int64_t t_stride, const float *w,
                       float eps, const float *cos, const float *sin, int threads) {
    NormRope a = {x, heads, d, t_stride, w, cos, sin, eps};
    team_for(t_count * heads, threads, norm_rope_heads, &a);
}
