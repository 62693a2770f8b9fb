/* The int8 prompt GEMM's tiles (int8_layout.h says what they compute): a strip of 16 packed rows
   (int8_pack.c) times the quantized activations (int8_quantize.c) of up to I8_TILE tokens a tile, their
   int32 sums scaled per group, the zeros times the activations' rounded sums, and each token's outliers
   times the strip's weight columns for them. */
#include "int8_layout.h"

#if EDGELLM_AVX512
#define I8_TILE 8  /* tokens a tile: 8 on zmm (32 registers; 5-8 % faster than 4), 4 on ymm */
#elif EDGELLM_NEON
#define I8_TILE 2  /* 4 q-registers a token's sums and as many its floats, of 32 (not timed: no ARM CPU at hand) */
#else
#define I8_TILE 4
#endif

#ifdef I8_NATIVE
/* The fp32 part of a tile: token i's r outliers (values) times their weight columns, 16 rows of the strip
   each, rows at[i * r + j] of cols (strip_columns). */
typedef struct {
    const float *cols;          /* (u, 16): the strip's rows of every channel some token of the call left out */
    const int32_t *at;          /* (t, r) */
    const float *values;        /* (t, r) */
    int r;
} Outliers;

/* cols (u, 16) = the strip's 16 rows of columns `channels` (u of them), w = scale * q + zero: computed once
   a strip for all its tiles (a quarter to a half of K, measured: many tokens have outliers of their own). */
static void strip_columns(const uint8_t *strip, const int32_t *channels, int64_t u, int halves, float *cols) {
    for (int64_t j = 0; j < u; j++) {
        int c = channels[j];
        const uint8_t *group = strip + (c / I8_GROUP) * GROUP_STRIDE;
        const uint8_t *step = group + ((c % I8_GROUP) / 4) * STEP_BYTES;
        const float *scale = (const float *)(group + GROUP_BYTES) + (halves && c % I8_GROUP >= 16 ? GROUP_FLOATS : 0);
        i8_column(step, c % 4, scale, scale + I8_STRIP, cols + j * I8_STRIP);  /* row r's code: byte c % 4 of word r */
    }
}

/* a strip's 16 rows as vectors of SL lanes (int8_isa.h) */
#define H (I8_STRIP / SL)

/* acc[i] += the int32 sums of steps [p_begin, p_end) of group g for the tt tokens, times scale * sx */
ALWAYS_INLINE void group_dots(const uint8_t *w, const float *scale, const uint8_t *act, int64_t rb, int64_t k,
                              int64_t g, int tt, int steps, int p_begin, int p_end, sf acc[][H]) {
    si dot[I8_TILE][H];
    for (int p0 = p_begin; p0 < p_end; p0 += steps) {
        si sums[I8_TILE][H];
        for (int i = 0; i < tt; i++)
            for (int h = 0; h < H; h++) sums[i][h] = si_zero();
        for (int p = p0; p < p0 + steps; p++) {
            si wv[H];
            for (int h = 0; h < H; h++) wv[h] = si_load(w + p * STEP_BYTES + 4 * SL * h);
            for (int i = 0; i < tt; i++) {
                int32_t word;  /* activations 4p .. 4p + 3 of group g */
                memcpy(&word, act + i * rb + g * I8_GROUP + 4 * p, 4);
                si x4 = si_set1(word);
                for (int h = 0; h < H; h++) sums[i][h] = si_dot(sums[i][h], wv[h], x4);
            }
        }
        for (int i = 0; i < tt; i++)
            for (int h = 0; h < H; h++) {
                si wide = si_widen(sums[i][h]);
                dot[i][h] = p0 > p_begin ? si_add(dot[i][h], wide) : wide;
            }
    }
    for (int i = 0; i < tt; i++) {
        sf sx = sf_set1(((const float *)(act + i * rb + k))[STATS * g]);
        for (int h = 0; h < H; h++)
            acc[i][h] = sf_fma(sf_from_si(dot[i][h]), sf_mul(sf_load(scale + SL * h), sx), acc[i][h]);
    }
}

/* acc[i] += zero * xsum for the tt tokens: a group's (halves = 0) or each half's (Q6_K) */
ALWAYS_INLINE void add_zeros(sf acc[][H], const float *floats, const uint8_t *act, int64_t rb, int64_t k,
                             int64_t g, int tt, int halves) {
    for (int i = 0; i < tt; i++) {
        const float *stats = (const float *)(act + i * rb + k) + STATS * g;
        for (int half = 0; half <= halves; half++) {
            const float *zero = floats + half * GROUP_FLOATS + I8_STRIP;
            sf xsum = sf_set1(stats[halves ? 2 + half : 1]);
            for (int h = 0; h < H; h++) acc[i][h] = sf_fma(sf_load(zero + SL * h), xsum, acc[i][h]);
        }
    }
}

/* out[t][0..16) for tt <= I8_TILE tokens (rows of rb bytes from act) of one strip; the products of
   `steps` 4-k steps are summed (in int16 without VNNI) before they are widened (8 for 4-bit codes,
   4 for 5-bit, 2 for 6-bit); with `halves` (Q6_K) each half group's sum is scaled on its own. */
ALWAYS_INLINE void tile(const uint8_t *codes, const uint8_t *act, int64_t rb, int64_t k, const Outliers *o,
                        float *out, int64_t ldo, int tt, int steps, int halves) {
    sf acc[I8_TILE][H];
    for (int i = 0; i < tt; i++)
        for (int h = 0; h < H; h++) acc[i][h] = sf_zero();
    for (int64_t g = 0; g < k / I8_GROUP; g++) {
        const uint8_t *w = codes + g * GROUP_STRIDE;
        const float *floats = (const float *)(w + GROUP_BYTES);
        add_zeros(acc, floats, act, rb, k, g, tt, halves);
        for (int half = 0; half <= halves; half++)
            group_dots(w, floats + half * GROUP_FLOATS, act, rb, k, g, tt, steps, halves ? 4 * half : 0,
                       halves ? 4 * half + 4 : 8, acc);
    }
    for (int i = 0; i < tt; i++) {
        for (int j = 0; j < o->r; j++) {
            sf v = sf_set1(o->values[i * o->r + j]);
            const float *col = o->cols + o->at[i * o->r + j] * I8_STRIP;
            for (int h = 0; h < H; h++) acc[i][h] = sf_fma(v, sf_load(col + SL * h), acc[i][h]);
        }
        for (int h = 0; h < H; h++) sf_store(out + i * ldo + SL * h, acc[i][h]);
    }
}

/* one instance per token count (up to I8_TILE) and code width, so that the accumulators stay in registers */
#define I8_CASE(n, steps, halves) case n: tile(codes, act, rb, k, o, out, ldo, n, steps, halves); break;
#if I8_TILE == 8
#define I8_CASES(s, h) I8_CASE(8, s, h) I8_CASE(7, s, h) I8_CASE(6, s, h) I8_CASE(5, s, h) I8_CASE(4, s, h) \
                       I8_CASE(3, s, h) I8_CASE(2, s, h)
#elif I8_TILE == 4
#define I8_CASES(s, h) I8_CASE(4, s, h) I8_CASE(3, s, h) I8_CASE(2, s, h)
#else
#define I8_CASES(s, h) I8_CASE(2, s, h)
#endif
static void tile_any(const uint8_t *codes, const uint8_t *act, int64_t rb, int64_t k, const Outliers *o, float *out,
                     int64_t ldo, int tt, int bits) {
#define I8_TILES(steps, halves)                                                   \
    switch (tt) {                                                                 \
    I8_CASES(steps, halves)                                                       \
    default: tile(codes, act, rb, k, o, out, ldo, 1, steps, halves); break;      \
    }
#ifdef I8_VNNI
    if (bits == 6) {  /* int32 sums: a whole half between widenings */
        I8_TILES(4, 1)
    } else {  /* a whole group */
        I8_TILES(8, 0)
    }
#else
    if (bits <= 4) {
        I8_TILES(8, 0)
    } else if (bits == 5) {
        I8_TILES(4, 0)
    } else {
        I8_TILES(2, 1)
    }
#endif
#undef I8_TILES
}
#endif

/* Whether this build's int8 GEMM takes a weight in `form` (int8_layout.h): every form wherever it is native,
   but a real Q8_0's byte codes only where their products are summed straight into int32 (I8_BYTE_CODES). */
int edgellm_int8_gemm_takes(int form) {
#ifdef I8_NATIVE
    int bytes = 0;
#ifdef I8_BYTE_CODES
    bytes = 1;
#endif
    return form == I8_FORM_I4R64 || form == I8_FORM_Q5_0_R16 || form == I8_FORM_Q6_K || form == I8_FORM_Q5_K
           || (form == I8_FORM_Q8_0_R16 && bytes);
#else
    (void)form;
    return 0;
#endif
}

/* Whether this build has the 8-bit prompt GEMM. */
int edgellm_int8_gemm_native(void) {
#ifdef I8_NATIVE
    return 1;
#else
    return 0;
#endif
}

#ifdef I8_NATIVE
void edgellm_int8_pack_strip(const uint8_t *src, const uint16_t *scale_zero, int64_t n, int64_t k, int64_t s,
                             int form, uint8_t *out);

typedef struct {
    const uint8_t *rows;
    int64_t t, k;
    const void *panel;          /* packed strips, or NULL: each strip packed from weight as it comes */
    const uint8_t *weight;
    const uint16_t *scale_zero;
    int64_t n;
    int bits, form;             /* the codes' width; the weight's form (int8_layout.h) where it is packed here */
    float *out;
    int64_t ldo;
    const int32_t *channels;
    int64_t u;
    const int32_t *at;
    const float *values;
    int r;
} Gemm;

/* A thread's share of the strips, each for every token, with its own buffer of outlier columns. */
static void gemm_strips(void *p, int thread, int threads) {
    const Gemm *a = p;
    int64_t s0, s1, rb = row_bytes(a->k), strip_bytes = (a->k / I8_GROUP) * GROUP_STRIDE;
    pool_share(a->n / I8_STRIP, thread, threads, &s0, &s1);
    if (s0 >= s1) return;
    float *cols = (float *)aligned_alloc(32, (size_t)(a->u > 0 ? a->u : 1) * I8_STRIP * 4);
    uint8_t *own = a->panel ? NULL : (uint8_t *)aligned_alloc(64, (size_t)strip_bytes);
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *strip = own ? own : (const uint8_t *)a->panel + s * strip_bytes;
        if (own) edgellm_int8_pack_strip(a->weight, a->scale_zero, a->n, a->k, s, a->form, own);
        strip_columns(strip, a->channels, a->u, a->bits == 6, cols);
        for (int64_t t0 = 0; t0 < a->t; t0 += I8_TILE) {
            Outliers o = {cols, a->at + t0 * a->r, a->values + t0 * a->r, a->r};
            tile_any(strip, a->rows + t0 * rb, rb, a->k, &o, a->out + t0 * a->ldo + s * I8_STRIP, a->ldo,
                     (int)(a->t - t0 < I8_TILE ? a->t - t0 : I8_TILE), a->bits);
        }
    }
    free(own);
    free(cols);
}
#endif

/* out (t, n), row stride ldo, = the quantized activations times the packed (n, k) weight, transposed, plus
   each token's r outliers (values (t, r)) times their weight columns: channels[at[i][j]] of the u
   `channels`. bits: the codes' width (4: I4R64, 5: Q5_0, 6: Q6_K). A strip at a time per thread, all tokens. */
void edgellm_int8_gemm(const void *act, int64_t t, int64_t k, const void *panel, int64_t n, int bits, float *out,
                       int64_t ldo, const int32_t *channels, int64_t u, const int32_t *at, const float *values, int r,
                       int threads) {
#ifdef I8_NATIVE
    const uint8_t *rows = (const uint8_t *)act;
    Gemm a = {rows, t, k, panel, NULL, NULL, n, bits, 0, out, ldo, channels, u, at, values, r};
    team_run(threads, gemm_strips, &a);
#else
    (void)act, (void)t, (void)k, (void)panel, (void)n, (void)bits, (void)out, (void)ldo, (void)channels, (void)u,
        (void)at, (void)values, (void)r, (void)threads;
#endif
}

/* The same product on the weight as the model holds it (in one of int8_layout.h's forms, n % 16 == 0): each
   thread packs its strips one at a time into a buffer of its own and multiplies them while they are in its
   cache. No panel of the whole weight: nothing to keep, and the weight is read once. On
   edgellm's pool: the native layers' GEMM (layer_ops.h), between kernels that run there too (pool.h). */
void edgellm_int8_gemm_weight(const void *act, int64_t t, int64_t k, const uint8_t *weight, const uint16_t *scale_zero,
                              int64_t n, int form, float *out, int64_t ldo, const int32_t *channels, int64_t u,
                              const int32_t *at, const float *values, int r, int threads) {
#ifdef I8_NATIVE
    Gemm a = {(const uint8_t *)act, t, k, NULL, weight, scale_zero, n, form_bits(form), form, out, ldo, channels, u,
              at, values, r};
    pool_run(threads, gemm_strips, &a);
#else
    (void)act, (void)t, (void)k, (void)weight, (void)scale_zero, (void)n, (void)form, (void)out, (void)ldo,
        (void)channels, (void)u, (void)at, (void)values, (void)r, (void)threads;
#endif
}
