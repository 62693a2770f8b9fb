/* RMSNorm for a prompt's rows, fused with what surrounds it, in one pass each:
     pre-norm:   n = x / rms(x) * w          in the compute dtype, the next linear's input
     post-norm:  out = x + y / rms(y) * w    Gemma 3's normed residual add, y the sublayer's output
   PyTorch spends ~5 ops on the norm plus a cast or an add, each a pass over the rows. */
#include "simd.h"

static inline float inv_rms(const void *x, int64_t at, int64_t d, float eps, int dtype) {
    vf ss = vf_zero();
    for (int64_t i = 0; i < d; i += VL) {
        vf v = vf_load_as(x, at + i, dtype);
        ss = vf_fma(v, v, ss);
    }
    return 1.f / sqrtf(vf_sum(ss) / (float)d + eps);
}

typedef struct {
    const float *x;
    const void *y;  /* add_rms_norm's normalized input, in `dtype` */
    int64_t d;
    const float *w;
    float eps;
    void *out;
    int dtype;
} Norm;

static void rms_norm_rows(void *p, int64_t r0, int64_t r1) {
    const Norm *a = p;
    int64_t d = a->d;
    for (int64_t r = r0; r < r1; r++) {
        vf scale = vf_set1(inv_rms(a->x, r * d, d, a->eps, DTYPE_F32));
        for (int64_t i = 0; i < d; i += VL)
            vf_store_as(a->out, r * d + i, vf_mul(vf_mul(vf_load(a->x + r * d + i), scale), vf_load(a->w + i)), a->dtype);
    }
}

/* out (rows, d) = RMSNorm(x) * w for x (rows, d) fp32, out in `dtype`; d % 16 == 0. */
void edgellm_rms_norm(const float *x, int64_t rows, int64_t d, const float *w, float eps, void *out, int dtype,
                      int threads) {
    Norm a = {x, NULL, d, w, eps, out, dtype};
    team_for(rows, threads, rms_norm_rows, &a);
}

static void add_rms_norm_rows(void *p, int64_t r0, int64_t r1) {
    const Norm *a = p;
    int64_t d = a->d;
    float *out = a->out;
    for (int64_t r = r0; r < r1; r++) {
        vf scale = vf_set1(inv_rms(a->y, r * d, d, a->eps, a->dtype));
        for (int64_t i = 0; i < d; i += VL) {
            vf v = vf_mul(vf_load_as(a->y, r * d + i, a->dtype), scale);
            vf_store(out + r * d + i, vf_fma(v, vf_load(a->w + i), vf_load(a->x + r * d + i)));
        }
    }
}

/* out (rows, d) fp32 = x + RMSNorm(y) * w for x fp32 and y in `dtype`, both (rows, d); d % 16 == 0. */
void edgellm_add_rms_norm(const float *x, const void *y, int64_t rows, int64_t d, const float *w, float eps,
                          float *out, int dtype, int threads) {
    Norm a = {x, y, d, w, eps, out, dtype};
    team_for(rows, threads, add_rms_norm_rows, &a);
}
