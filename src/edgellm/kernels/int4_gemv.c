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

#if EDGELLM_AVX512
/* y = the product of chunks [c0, c1) of block nb (int4_layout.h: 0, 4 the whole block, 0, 2 its low
   nibbles' 32 rows, 2, 4 the high ones') with m <= I4_TILE activation rows. The sums and the outputs
   stay in registers from the first group to the last (stored through memory per group, they cost a
   batch of 4 rows 12-20 % of its time). */
ALWAYS_INLINE void block64(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw, int64_t group,
                           int64_t ka, int64_t nb, int m, const Act *act, float *y, int64_t ldy, int c0, int c1) {
    const uint8_t *w = packed + nb * I4_ROWS * kw / 2;  /* this block: kw * 32 bytes */
    __m512 out[I4_TILE][4];
    for (int i = 0; i < m; i++)
        for (int c = c0; c < c1; c++) out[i][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < kw / group; g++) {
        int64_t ga = (g * group) % ka, gi = ga / group;  /* activation index of this group's first k */
        const uint16_t *sz = scale_zero + (g * n + nb * I4_ROWS) * 2;
        if (nb + 1 < n / I4_ROWS)  /* the next block's scales: see the generic block64 */
            for (int64_t p = 0; p < I4_ROWS * 4; p += 64) __builtin_prefetch((const uint8_t *)(sz + I4_ROWS * 2) + p);
        __m512i dots[I4_TILE][4];
        i4_dots_zmm(w + g * group * 32, group, m, act, ga, dots, c0, c1);
        for (int c = c0; c < c1; c++) {
            vf scale, zero;
            i4_chunk_scales(sz, c, &scale, &zero);
            vf offset = vf_fnma(vf_set1(8.f), scale, zero);
            for (int i = 0; i < m; i++) {
                vf acc = vf_fma(vf_from_vi(dots[i][c]), vf_mul(scale, vf_set1(act[i].dx[gi])), out[i][c]);
                out[i][c] = vf_fma(offset, vf_set1(act[i].sum[gi]), acc);
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int c = c0; c < c1; c++) i4_chunk_store(y + i * ldy + nb * I4_ROWS, c, out[i][c]);
}
#else
/* y rows [nb*64, nb*64 + 64) += the block's product with m <= I4_TILE activation rows. */
ALWAYS_INLINE void block64(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw, int64_t group,
                    int64_t ka, int64_t nb, int m, const Act *act, float *y, int64_t ldy) {
    const uint8_t *w = packed + nb * I4_ROWS * kw / 2;  /* this block: kw * 32 bytes */
    int32_t dots[I4_TILE][I4_ROWS];
    for (int64_t g = 0; g < kw / group; g++) {
        int64_t ga = (g * group) % ka;  /* activation index of this group's first k */
        for (int64_t p = 0; p < group * 32; p += 64) __builtin_prefetch(w + g * group * 32 + I4_PREFETCH_BYTES + p);
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
#endif

/* block64 for `rows` activation rows, each row count (and chunk range) a constant, so the
   accumulators stay in registers (a variable one kept them in memory: a batch of 4 loaded and stored
   all 16 for every pair of k's) */
static void block_rows(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw, int64_t group,
                       int64_t ka, int64_t nb, int rows, const Act *act, float *y, int64_t ldy, int c0, int c1) {
#if EDGELLM_AVX512
#define I4_CALL(r, a, b) block64(packed, scale_zero, n, kw, group, ka, nb, r, act, y, ldy, a, b)
#define I4_PARTS(r) if (c1 - c0 == 4) I4_CALL(r, 0, 4); else if (c0 == 0) I4_CALL(r, 0, 2); else I4_CALL(r, 2, 4); break;
#else
#define I4_PARTS(r) block64(packed, scale_zero, n, kw, group, ka, nb, r, act, y, ldy); break;
    (void)c0, (void)c1;
#endif
    switch (rows) {  /* rows <= I4_TILE: no instance for more (NEON's 2 would overrun its accumulators) */
    case 1: I4_PARTS(1)
    case 2: I4_PARTS(2)
#if I4_TILE >= 4
    case 3: I4_PARTS(3)
    case 4: I4_PARTS(4)
#endif
    default: I4_PARTS(rows)
    }
#undef I4_PARTS
#undef I4_CALL
}

/* Scratch bytes edgellm_int4_gemv needs for m activation rows of ka. */
int64_t edgellm_int4_gemv_work(int m, int64_t ka, int64_t group) { return m * act_bytes(ka, group); }

typedef struct {
    const Act *act;
    int m;
    int64_t ka;
    const uint8_t *packed;
    const uint16_t *scale_zero;
    int64_t n, kw, group;
    float *y;
    int64_t ldy;
} Int4Gemv;

/* Each thread a contiguous share of half-blocks where AVX-512 can split them (a 576-row projection's
   9 blocks went 5 : 4 over 2 threads), whole blocks inside a share: their nibbles unpack once. */
static void int4_share(void *p, int t, int threads) {
    const Int4Gemv *a = p;
    int64_t parts = a->n / I4_ROWS * I4_SPLIT;
    for (int64_t q = parts * t / threads, end = parts * (t + 1) / threads; q < end;) {
        int whole = q % I4_SPLIT == 0 && q + I4_SPLIT <= end;
        int c0 = whole ? 0 : 2 * (int)(q % 2), c1 = whole ? 4 : c0 + 2;
        for (int i0 = 0; i0 < a->m; i0 += I4_TILE)
            block_rows(a->packed, a->scale_zero, a->n, a->kw, a->group, a->ka, q / I4_SPLIT,
                       a->m - i0 < I4_TILE ? a->m - i0 : I4_TILE, a->act + i0, a->y + i0 * a->ldy, a->ldy, c0, c1);
        q += whole ? I4_SPLIT : 1;
    }
}

/* y[i][0..n) (row i at y + i * ldy) = x[m][ka] @ W^T, W (n, kw) in the I4R64 layout; kw = planes * ka.
   m <= 8, n % 64 == 0, group % 4 == 0, ka % group == 0. */
void edgellm_int4_gemv(const float *x, int m, int64_t ka, const uint8_t *packed, const uint16_t *scale_zero,
                       int64_t n, int64_t kw, int64_t group, float *y, int64_t ldy, void *work, int threads) {
    Act act[MAX_M];
    for (int i = 0; i < m; i++) act[i] = quantize_act(x + i * ka, ka, group, (uint8_t *)work + i * act_bytes(ka, group));
#if !EDGELLM_AVX512  /* where block64 adds to y; AVX-512's stores it */
    for (int i = 0; i < m; i++) memset(y + i * ldy, 0, (size_t)n * sizeof(float));
#endif
    Int4Gemv a = {act, m, ka, packed, scale_zero, n, kw, group, y, ldy};
    pool_run(threads, int4_share, &a);
}
