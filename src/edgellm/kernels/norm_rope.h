/* RMSNorm of one row, and one head's optional RMSNorm and rotate-half RoPE in place: shared by the
   prompt kernel (rope.c) and the decode layers (layer_ops.h). n % VL == 0, d % (2 VL) == 0. */
#ifndef EDGELLM_NORM_ROPE_H
#define EDGELLM_NORM_ROPE_H
#include "simd.h"

/* out = x / sqrt(mean(x^2) + eps) * w (out may be x) */
static inline void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    vf ss = vf_zero();
    for (int64_t i = 0; i < n; i += VL) {
        vf v = vf_load(x + i);
        ss = vf_fma(v, v, ss);
    }
    vf r = vf_set1(1.f / sqrtf(vf_sum(ss) / (float)n + eps));
    for (int64_t i = 0; i < n; i += VL) vf_store(out + i, vf_mul(vf_mul(vf_load(x + i), r), vf_load(w + i)));
}

static inline void norm_rope_head(float *x, int64_t d, const float *w, float eps, const float *cos, const float *sin) {
    if (w) rms_norm(x, w, d, eps, x);
    int64_t h = d / 2;
    for (int64_t i = 0; i < h; i += VL) {
        vf a = vf_load(x + i), b = vf_load(x + h + i);
        vf_store(x + i, vf_fnma(b, vf_load(sin + i), vf_mul(a, vf_load(cos + i))));
        vf_store(x + h + i, vf_fma(a, vf_load(sin + h + i), vf_mul(b, vf_load(cos + h + i))));
    }
}
#endif
