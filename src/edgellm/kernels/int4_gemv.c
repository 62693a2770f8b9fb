/* Decode-time matrix-vector product over edgellm's INT4 layout (int4_layout.h): the weights stay
   4-bit, read once per call.

   Activations are quantized per group to int16 (intdot.h), so the inner loop is integer
   multiply-adds (i4_dots, per ISA) and each group ends with one float fma per row:

     y[n] = sum_g  scale[g][n] * dx[g] * sum_{k in g} q[n][k] * qx[k]
                 + (zero[g][n] - 8 * scale[g][n]) * sum_{k in g} x[k]

   With planes = 2 the weight's K is twice the activation's (two 4-bit planes side by side,
   see quant/linear.py) and activation k maps to k mod K. */
#include "int4_layout.h"

#define MAX_M 8

/* y rows [nb*64, nb*64 + 64) += the block's product with m <= I4_TILE activation rows. */
ALWAYS_INLINE void block64(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw, int64_t group,
                    int64_t ka, int64_t nb, int m, const Act *act, float *y, int64_t ldy) {
    const uint8_t *w = packed + nb * I4_ROWS * kw / 2;  /* this block: kw * 32 bytes */
    int32_t dots[I4_TILE][I4_ROWS];
    for (int64_t g = 0; g < kw / group; g++) {
        int64_t ga = (g * group) % ka;  /* activation index of this group's first k */
#ifndef I4_PREFETCH_IN_DOTS
        for (int64_t p = 0; p < group * 32; p += 64) __builtin_prefetch(w + g * group * 32 + I4_PREFETCH_BYTES + p);
#endif
        const uint16_t *sz = scale_zero + (g * n + nb * I4_ROWS) * 2;
        /* the next block's scales of this group: a row of groups is n * 4 bytes apart, a stride
           the hardware prefetcher does not follow (a batch stalled here for ~1/5 of its time) */
        if (nb + 1 < n / I4_ROWS)
            for (int64_t p = 0; p < I4_ROWS * 4; p += 64) __builtin_prefetch((const uint8_t *)(sz + I4_ROWS * 2) + p);
        i4_dots(w + g * group * 32, group, m, act, ga, dots);
        for (int64_t r = 0; r < I4_ROWS; r += VL) {
            vf scale, zero;
            vf_load_bf16_pairs(sz + 2 * r, &scale, &zero);
            vf offset = vf_fnma(vf_set1(8.f), scale, zero);
            for (int i = 0; i < m; i++) {
                int64_t gi = ga / group;
                float *out = y + i * ldy + nb * I4_ROWS + r;
                vf acc = vf_fma(vf_from_vi(vi_load(dots[i] + r)), vf_mul(scale, vf_set1(act[i].dx[gi])), vf_load(out));
                vf_store(out, vf_fma(offset, vf_set1(act[i].sum[gi]), acc));
            }
        }
    }
}

/* Scratch bytes edgellm_int4_gemv needs for m activation rows of ka. */
int64_t edgellm_int4_gemv_work(int m, int64_t ka, int64_t group) { return m * act_bytes(ka, group); }

/* y[i][0..n) (row i at y + i * ldy) = x[m][ka] @ W^T, W (n, kw) in the I4R64 layout; kw = planes * ka.
   m <= 8, n % 64 == 0, group % 4 == 0, ka % group == 0. */
void edgellm_int4_gemv(const float *x, int m, int64_t ka, const uint8_t *packed, const uint16_t *scale_zero,
                       int64_t n, int64_t kw, int64_t group, float *y, int64_t ldy, void *work, int threads) {
    Act act[MAX_M];
    for (int i = 0; i < m; i++) act[i] = quantize_act(x + i * ka, ka, group, (uint8_t *)work + i * act_bytes(ka, group));
    for (int i = 0; i < m; i++) memset(y + i * ldy, 0, (size_t)n * sizeof(float));
    int64_t blocks = n / I4_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++)
        for (int i0 = 0; i0 < m; i0 += I4_TILE) {
            int rows = m - i0 < I4_TILE ? m - i0 : I4_TILE;
            /* each row count a constant, so the accumulators stay in registers (a variable one kept
               them in memory: a batch of 4 loaded and stored all 16 for every pair of k's) */
            switch (rows) {
            case 1: block64(packed, scale_zero, n, kw, group, ka, nb, 1, act + i0, y + i0 * ldy, ldy); break;
            case 2: block64(packed, scale_zero, n, kw, group, ka, nb, 2, act + i0, y + i0 * ldy, ldy); break;
            case 3: block64(packed, scale_zero, n, kw, group, ka, nb, 3, act + i0, y + i0 * ldy, ldy); break;
            case 4: block64(packed, scale_zero, n, kw, group, ka, nb, 4, act + i0, y + i0 * ldy, ldy); break;
            default: block64(packed, scale_zero, n, kw, group, ka, nb, rows, act + i0, y + i0 * ldy, ldy);
            }
        }
}
