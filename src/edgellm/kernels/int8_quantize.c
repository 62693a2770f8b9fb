/* The int8 prompt GEMM's activations (int8_layout.h): each token's row rounded to int8 per group of 32,
   except its r largest |x| (its outliers), which are zeroed there and kept in fp32 for the tiles'
   epilogue; per group the scale and the sums of the rounded values the zeros meet. */
#include "int8_layout.h"

#ifdef I8_NATIVE
/* One group of a token's activations (its outliers zeroed), whose largest |x| is amax -> 32 int8 codes
   and the group's STATS. xsum is the sum of the rounded activations (sx * sum qx), not of x: then the
   zeros meet the same activations as the codes, and the rounding's error is (qx sx - x) w, not
   (qx sx - x)(w - zero), which is ~2x larger for codes 0..15 (SmolLM2's logits moved 3.5 instead of 1.1
   on a chat prompt). */
static inline void quantize_group(const float *x, float amax, int8_t *qx, float *st) {
    float sums[2], sx = amax > 0.f ? amax / X_MAX : 1.f;
    i8_codes32(x, amax > 0.f ? X_MAX / amax : 0.f, qx, sums);  /* each half's sum of codes: exact integers */
    st[0] = sx;
    st[1] = sx * (sums[0] + sums[1]);
    st[2] = sx * sums[0];  /* Q6_K's halves */
    st[3] = sx * sums[1];
}
#endif

/* Bytes of the quantized activations of t tokens. */
int64_t edgellm_int8_act_bytes(int64_t t, int64_t k) { return t * row_bytes(k); }

#ifdef I8_NATIVE
/* Insert (v, j) into the n <= r largest so far, best[] descending; returns the new n. */
static inline int keep_largest(float *best, int32_t *channels, int n, int r, float v, int32_t j) {
    if (n == r && v <= best[r - 1]) return n;
    int at = n < r ? n++ : r - 1;
    for (; at > 0 && best[at - 1] < v; at--) {
        best[at] = best[at - 1];
        channels[at] = channels[at - 1];
    }
    best[at] = v;
    channels[at] = j;
    return n;
}

/* The r largest |x[j]| of one token's row (0 < r <= k), in ascending channel order: its outliers, found
   from the groups' largest values `amax` (k / 32 of them). Every one of the r largest |x| lies in a
   group whose maximum is at least the r-th largest group maximum (else r larger values, one in each of
   r other groups, would outrank it), so only those groups (r of them, bar ties) are searched. */
static void largest(const float *x, int64_t k, int r, const float *amax, int32_t *channels) {
    float best[I8_MAX_OUTLIERS];
    int n = 0;
    for (int64_t g = 0; g < k / I8_GROUP; g++) n = keep_largest(best, channels, n, r, amax[g], 0);
    float floor = n == r ? best[r - 1] : 0.f;  /* fewer groups than r: every value */
    n = 0;
    for (int64_t g = 0; g < k / I8_GROUP; g++) {
        if (amax[g] < floor) continue;
        for (uint32_t mask = i8_at_least(x + g * I8_GROUP, floor); mask; mask &= mask - 1) {
            int64_t j = g * I8_GROUP + __builtin_ctz(mask);
            n = keep_largest(best, channels, n, r, fabsf(x[j]), (int32_t)j);
        }
    }
    for (int i = 1; i < r; i++)  /* ascending channels: a fixed order for their fp32 sum */
        for (int j = i; j > 0 && channels[j - 1] > channels[j]; j--) {
            int32_t c = channels[j];
            channels[j] = channels[j - 1];
            channels[j - 1] = c;
        }
}
#endif

#ifdef I8_NATIVE
typedef struct {
    const float *x;
    int64_t t, k;
    int r;
    uint8_t *rows;
    int64_t rb;
    int32_t *at;
    float *values;
} Quantize;

/* One token's row: its r outliers (channels ascending in at, their values) and the int8 codes of the rest;
   only the groups that hold an outlier are copied, to zero it. amax: k / 32 floats of scratch. */
static void quantize_token(const float *x, int64_t k, int r, int32_t *at, float *values, uint8_t *row, float *amax) {
    int8_t *qx = (int8_t *)row;
    float *stats = (float *)(row + k);
    for (int64_t g = 0; g < k / I8_GROUP; g++) amax[g] = i8_amax32(x + g * I8_GROUP);
    if (r > 0) largest(x, k, r, amax, at);
    for (int j = 0; j < r; j++) values[j] = x[at[j]];
    for (int64_t g = 0, o = 0; g < k / I8_GROUP; g++) {
        const float *group = x + g * I8_GROUP;
        float zeroed[I8_GROUP];
        if (o < r && at[o] / I8_GROUP == g) {
            memcpy(zeroed, group, sizeof zeroed);
            for (; o < r && at[o] / I8_GROUP == g; o++) zeroed[at[o] % I8_GROUP] = 0.f;
            quantize_group(zeroed, i8_amax32(zeroed), qx + g * I8_GROUP, stats + STATS * g);
        } else {
            quantize_group(group, amax[g], qx + g * I8_GROUP, stats + STATS * g);
        }
    }
}

/* A thread's share of the tokens. */
static void quantize_rows(void *p, int thread, int threads) {
    const Quantize *a = p;
    int64_t i0, i1, k = a->k;
    pool_share(a->t, thread, threads, &i0, &i1);
    if (i0 >= i1) return;
    float *amax = (float *)malloc((size_t)(k / I8_GROUP) * sizeof(float));
    for (int64_t i = i0; i < i1; i++)
        quantize_token(a->x + i * k, k, a->r, a->at + i * a->r, a->values + i * a->r, a->rows + i * a->rb, amax);
    free(amax);
}
#endif

/* Quantize x (t, k) fp32 into act. Each token's r (<= I8_MAX_OUTLIERS) largest channels are left out of
   it, their values in values (t, r); union (k) gets the u channels some token left out, ascending, and
   at (t, r) each token's outliers as indices into it. Returns u. */
static int64_t quantize(const float *x, int64_t t, int64_t k, int r, void *act, int32_t *at, float *values,
                        int32_t *channels, int threads, void (*run)(int, PoolBody, void *)) {
#ifdef I8_NATIVE
    uint8_t *rows = (uint8_t *)act;
    int64_t rb = row_bytes(k);
    Quantize a = {x, t, k, r, rows, rb, at, values};
    run(threads, quantize_rows, &a);
    for (int64_t c = 0; c < k; c++) channels[c] = -1;  /* then: position in the union, or -1 */
    for (int64_t i = 0; i < t * r; i++) channels[at[i]] = 0;
    int64_t u = 0;
    for (int64_t c = 0; c < k; c++)
        if (channels[c] == 0) channels[c] = (int32_t)u++;
    for (int64_t i = 0; i < t * r; i++) at[i] = channels[at[i]];
    for (int64_t c = 0, j = 0; c < k; c++)  /* in place: position j <= c */
        if (channels[c] >= 0) channels[j++] = (int32_t)c;
    return u;
#else
    (void)x, (void)t, (void)k, (void)r, (void)act, (void)at, (void)values, (void)channels, (void)threads, (void)run;
    return 0;
#endif
}

int64_t edgellm_int8_quantize(const float *x, int64_t t, int64_t k, int r, void *act, int32_t *at, float *values,
                              int32_t *channels, int threads) {
    return quantize(x, t, k, r, act, at, values, channels, threads, team_run);
}

/* The same on edgellm's pool: for the native layers (layer_ops.h), whose other kernels run there (pool.h). */
int64_t edgellm_int8_quantize_pooled(const float *x, int64_t t, int64_t k, int r, void *act, int32_t *at,
                                     float *values, int32_t *channels, int threads) {
    return quantize(x, t, k, r, act, at, values, channels, threads, pool_run);
}
