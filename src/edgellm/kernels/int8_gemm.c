/* Prompt GEMMs in 8-bit integers for CPUs without native bf16: both `avx2` variants (Haswell to Comet
   Lake, AMD Zen 1-3; with AVX-VNNI Intel client cores since Alder Lake), `avx512` without bf16
   (Cascade Lake, Ice Lake, Tiger Lake, Rocket Lake) and `neon` without bf16 (Cortex-A55/A76/A78,
   Raspberry Pi 5, Apple M1), where an fp32 FMA makes 8 products (NEON: 4) and `vpmaddubsw` 32
   (unsigned byte by signed byte, summed in pairs to int16), `vpdpbusd` 32 summed straight into int32
   lanes (AVX-VNNI; AVX512-VNNI makes 64 on a zmm), NEON's `sdot` 16. What differs per ISA is in
   int8_isa.h; every build computes the same integers and float operations per lane, so the same
   floats.

   The weights stay exactly what the model holds: 4-bit I4R64 codes (q in 0..15), Q5_0 values held
   as Q8_0 / Q8R16 blocks (q + 16 in 0..31) or a GGUF file's Q6_K blocks (q in 0..63), each group of
   32 k's of a row an affine map (Q6_K: each half of 16 its own)
     w = scale * q + zero          (I4R64: zero = its zero - 8 scale; Q5_0: scale = d, zero = -16 d;
                                    Q6_K: scale = d * its int8 scale, zero = -32 scale)
   Only the activations are rounded, per token and group of 32, to int8 (llama.cpp's Q8 blocks):
     qx = round(x / sx),  sx = max |x| / 127
   except each token's OUTLIERS largest |x|: a channel that carries an outlier would round the other
   31 of its group to a few levels (SmolLM2's norm outputs have channels 50-100x the rest: prompt KL
   against transformers 2.8e-3 with none kept, ~7e-4 with 8), so they are zeroed here and multiplied
   in fp32 in the tile's epilogue, by the weight's columns for them (strip_columns).
     y[t][n] = sum_g scale[n][g] sx[t][g] sum_{k in g} q[n][k] qx[t][k] + zero[n][g] xsum[t][g]
               + sum_{j < OUTLIERS} x[t][c_tj] w[n][c_tj]
   with xsum[t][g] = sx[t][g] * sum_{k in g} qx[t][k] (quantize_row says why). Every term is a token's
   own, summed in a fixed order: a token's row is the same whatever tokens share its call (a prompt
   computed whole or after a cached prefix gets the same KV). Pair sums of q * qx are at most
   2 * 31 * 127 = 7874, so int16 holds 4 of them (31,496), 8 for 4-bit codes (30,480), 2 for 6-bit
   (2 * 16,002): the products are summed in int16 for half a group (a whole one for 4 bits, a quarter
   for 6), widened to int32, and the group's sum scaled once (5-bit codes 6-8 % faster than scaling
   each half), Q6_K's each half's.

   The weight is packed per call into strips of 16 rows: per group, 8 steps of 4 k's, each 16 words of
   4 codes (row r's q[k .. k + 3]) that one vpmaddubsw multiplies against a broadcast word of 4
   activations; then the strip's 16 scales and 16 zeros of the group (Q6_K: of its first half, then of
   its second). A tile is 16 rows x 4 tokens (8 on AVX-512). */
#include <stdlib.h>

#include "int8_isa.h"

#define I8_STRIP 16
#define I8_GROUP 32
#if EDGELLM_AVX512
#define I8_TILE 8  /* tokens a tile: 8 on zmm (32 registers; 5-8 % faster than 4), 4 on ymm */
#elif EDGELLM_NEON
#define I8_TILE 2  /* 4 q-registers a token's sums and as many its floats, of 32 (not timed: no ARM CPU at hand) */
#else
#define I8_TILE 4
#endif
#define X_MAX 127
#define I8_MAX_OUTLIERS 16  /* per token, at most */
#define STEP_BYTES (4 * I8_STRIP)           /* 4 k's of a strip's 16 rows */
#define GROUP_BYTES (8 * STEP_BYTES)        /* a group's codes of a strip */
#define GROUP_FLOATS (2 * I8_STRIP)         /* a group's (or a Q6_K half group's) scales and zeros of a strip */
#define GROUP_STRIDE (GROUP_BYTES + 2 * 4 * GROUP_FLOATS)  /* a group of a strip in the panel: codes, then floats */
#define STATS 4                             /* floats per token and group: sx, xsum, and xsum of each half */

/* A token's quantized row: k int8, then per group its STATS; 32-byte aligned. */
static int64_t row_bytes(int64_t k) { return (k + 4 * STATS * (k / I8_GROUP) + 31) / 32 * 32; }

#ifdef I8_NATIVE
/* Codes of 16 rows x 4 k's (4 vectors, one k each, byte j = row j) -> 16 words, row j's 4 codes in word j. */
static inline void store_step(uint8_t *dst, b16 k0, b16 k1, b16 k2, b16 k3) {
    b16 a = b16_zip8_lo(k0, k1), b = b16_zip8_hi(k0, k1);  /* rows 0-7, 8-15: (k0, k1) */
    b16 c = b16_zip8_lo(k2, k3), d = b16_zip8_hi(k2, k3);
    b16_store(dst, b16_zip16_lo(a, c));
    b16_store(dst + 16, b16_zip16_hi(a, c));
    b16_store(dst + 32, b16_zip16_lo(b, d));
    b16_store(dst + 48, b16_zip16_hi(b, d));
}

/* Strip s of I4R64 rows row0 + 16 s .. (row0 a multiple of 64), group g: codes, then scales and zeros. */
static void pack_i4r64_group(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t k, int64_t row,
                             int64_t g, uint8_t *codes, float *sz) {
    const uint8_t *block = packed + (row / 64) * 64 * (k / 2);
    int byte0 = (int)(row % 32), high = (int)(row % 64) >= 32;
    const b16 low4 = b16_set1(0x0F);
    for (int p = 0; p < 8; p++) {
        b16 q[4];
        for (int j = 0; j < 4; j++)
            q[j] = b16_shr_and(b16_load(block + (g * I8_GROUP + 4 * p + j) * 32 + byte0), high ? 4 : 0, low4);
        store_step(codes + p * STEP_BYTES, q[0], q[1], q[2], q[3]);
    }
    for (int j = 0; j < I8_STRIP; j++) {
        const uint16_t *pair = scale_zero + (g * n + row + j) * 2;
        float scale = bf16_to_f32(pair[0]);
        sz[j] = scale;
        sz[I8_STRIP + j] = bf16_to_f32(pair[1]) - 8.f * scale;
    }
}

/* Group s (16 rows) of Q8R16 blocks holding Q5_0 values (-16..15), block g: codes q + 16, scales, zeros. */
static void pack_q8r16_group(const uint8_t *rows, int64_t k, int64_t s, int64_t g, uint8_t *codes, float *sz) {
    const uint8_t *block = rows + (s * (k / 32) + g) * 544;  /* q8r16.c: 16 fp16 d, then 16 k-pairs x 16 rows */
    const b16 bias = b16_set1(16);
    for (int p = 0; p < 8; p++) {
        const uint8_t *pairs = block + 32 + 64 * p;  /* k-pairs 2p and 2p + 1, 16 rows x 2 bytes each */
        b16 a0 = b16_load(pairs), a1 = b16_load(pairs + 16), b0 = b16_load(pairs + 32), b1 = b16_load(pairs + 48);
        uint8_t *dst = codes + p * STEP_BYTES;
        b16_store(dst, b16_add(b16_zip16_lo(a0, b0), bias));
        b16_store(dst + 16, b16_add(b16_zip16_hi(a0, b0), bias));
        b16_store(dst + 32, b16_add(b16_zip16_lo(a1, b1), bias));
        b16_store(dst + 48, b16_add(b16_zip16_hi(a1, b1), bias));
    }
    for (int j = 0; j < I8_STRIP; j++) {
        uint16_t d;
        memcpy(&d, block + 2 * j, 2);
        sz[j] = f16_to_f32(d);
        sz[I8_STRIP + j] = -16.f * sz[j];
    }
}

/* Strip s (16 rows) of a GGUF file's Q6_K rows (k / 256 blocks of 210 bytes: block_gemv.c), group g: codes q in
   0..63; the scales and zeros of its first 16 k's, then of its last 16. Group c = g % 8 of a block is chunk
   c % 4 of its half c / 4: ql bytes 32 (c & 1) .. + 32 of the half's 64, low nibbles for c % 4 < 2 else high,
   with bits 2 (c % 4) .. + 1 of the half's 32 qh bytes above them. */
static void pack_q6_k_group(const uint8_t *rows, int64_t k, int64_t s, int64_t g, uint8_t *codes, float *sz) {
    int64_t row_size = k / 256 * 210;
    int c = (int)(g % 8), quarter = c % 4;
    uint32_t words[I8_STRIP][8];  /* row j's 32 codes, 4 to a word */
    const b16 low4 = b16_set1(0x0F), low2 = b16_set1(0x03);
    for (int j = 0; j < I8_STRIP; j++) {
        const uint8_t *blk = rows + (s * I8_STRIP + j) * row_size + (g / 8) * 210;
        const uint8_t *ql = blk + 64 * (c / 4) + 32 * (quarter & 1), *qh = blk + 128 + 32 * (c / 4);
        for (int h = 0; h < 32; h += 16) {
            b16 lo = b16_shr_and(b16_load(ql + h), quarter < 2 ? 0 : 4, low4);
            b16 hi = b16_shr_and(b16_load(qh + h), 2 * quarter, low2);
            b16_store((uint8_t *)words[j] + h, b16_or(lo, b16_shl4(hi)));  /* no bit crosses a byte: masked first */
        }
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = f16_to_f32((uint16_t)(blk[208] | blk[209] << 8));
        for (int half = 0; half < 2; half++) {
            float scale = d * (float)sc[2 * c + half];  /* exact: 11 by 8 bits */
            sz[half * GROUP_FLOATS + j] = scale;
            sz[half * GROUP_FLOATS + I8_STRIP + j] = -32.f * scale;
        }
    }
    for (int p = 0; p < 8; p++)  /* step p: word p of each row */
        for (int j = 0; j < I8_STRIP; j++) memcpy(codes + p * STEP_BYTES + 4 * j, &words[j][p], 4);
}

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

/* Whether this build has the 8-bit prompt GEMM. */
int edgellm_int8_gemm_native(void) {
#ifdef I8_NATIVE
    return 1;
#else
    return 0;
#endif
}

/* Bytes of a packed (n, k) weight, and of the quantized activations of t tokens. */
int64_t edgellm_int8_panel_bytes(int64_t n, int64_t k) { return (n / I8_STRIP) * (k / I8_GROUP) * GROUP_STRIDE; }
int64_t edgellm_int8_act_bytes(int64_t t, int64_t k) { return t * row_bytes(k); }

#ifdef I8_NATIVE
/* Strips of 16 rows, a group at a time, from I4R64 codes (rows row0 .. row0 + rows of its n, scale_zero beside),
   from Q8R16 blocks holding Q5_0 values or from Q6_K rows (scale_zero NULL, row0 0). */
typedef struct {
    const uint8_t *src;
    const uint16_t *scale_zero;
    int64_t n, k, row0, groups;
    uint8_t *panel;
    int q6_k;
} PackPanel;

/* Jobs [j0, j1) of (strip, group). */
static void pack_groups(void *p, int64_t j0, int64_t j1) {
    const PackPanel *a = p;
    for (int64_t job = j0; job < j1; job++) {
        int64_t s = job / a->groups, g = job % a->groups;
        uint8_t *codes = a->panel + job * GROUP_STRIDE;
        float *sz = (float *)(codes + GROUP_BYTES);
        if (a->scale_zero != NULL)
            pack_i4r64_group(a->src, a->scale_zero, a->n, a->k, a->row0 + s * I8_STRIP, g, codes, sz);
        else if (a->q6_k)
            pack_q6_k_group(a->src, a->k, s, g, codes, sz);
        else
            pack_q8r16_group(a->src, a->k, s, g, codes, sz);
    }
}

static void pack_panel(const uint8_t *src, const uint16_t *scale_zero, int64_t n, int64_t k, int64_t row0,
                       int64_t rows, uint8_t *panel, int q6_k, int threads) {
    PackPanel a = {src, scale_zero, n, k, row0, k / I8_GROUP, panel, q6_k};
    team_for(rows / I8_STRIP * a.groups, threads, pack_groups, &a);
}
#endif

/* Pack rows row0 .. row0 + rows of an (n, k) I4R64 weight with one plane and groups of 32 (int4_layout.h);
   row0 and rows multiples of 64. */
void edgellm_int8_pack_i4r64(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t k, int64_t row0,
                             int64_t rows, void *panel, int threads) {
#ifdef I8_NATIVE
    pack_panel(packed, scale_zero, n, k, row0, rows, (uint8_t *)panel, 0, threads);
#else
    (void)packed, (void)scale_zero, (void)n, (void)k, (void)row0, (void)rows, (void)panel, (void)threads;
#endif
}

/* Pack n rows of Q8R16 blocks whose values are Q5_0's (-16..15: q5_0_as_q8_0's output). */
void edgellm_int8_pack_q8r16(const uint8_t *rows, int64_t n, int64_t k, void *panel, int threads) {
#ifdef I8_NATIVE
    pack_panel(rows, NULL, n, k, 0, n, (uint8_t *)panel, 0, threads);
#else
    (void)rows, (void)n, (void)k, (void)panel, (void)threads;
#endif
}

/* Pack n rows of a GGUF file's Q6_K blocks (k % 256 == 0, n % 16 == 0). */
void edgellm_int8_pack_q6_k(const uint8_t *rows, int64_t n, int64_t k, void *panel, int threads) {
#ifdef I8_NATIVE
    pack_panel(rows, NULL, n, k, 0, n, (uint8_t *)panel, 1, threads);
#else
    (void)rows, (void)n, (void)k, (void)panel, (void)threads;
#endif
}

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
int64_t edgellm_int8_quantize(const float *x, int64_t t, int64_t k, int r, void *act, int32_t *at, float *values,
                              int32_t *channels, int threads) {
#ifdef I8_NATIVE
    uint8_t *rows = (uint8_t *)act;
    int64_t rb = row_bytes(k);
    Quantize a = {x, t, k, r, rows, rb, at, values};
    team_run(threads, quantize_rows, &a);
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
    (void)x, (void)t, (void)k, (void)r, (void)act, (void)at, (void)values, (void)channels, (void)threads;
    return 0;
#endif
}

#ifdef I8_NATIVE
typedef struct {
    const uint8_t *rows;
    int64_t t, k;
    const void *panel;
    int64_t n;
    int bits;
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
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *strip = (const uint8_t *)a->panel + s * strip_bytes;
        strip_columns(strip, a->channels, a->u, a->bits == 6, cols);
        for (int64_t t0 = 0; t0 < a->t; t0 += I8_TILE) {
            Outliers o = {cols, a->at + t0 * a->r, a->values + t0 * a->r, a->r};
            tile_any(strip, a->rows + t0 * rb, rb, a->k, &o, a->out + t0 * a->ldo + s * I8_STRIP, a->ldo,
                     (int)(a->t - t0 < I8_TILE ? a->t - t0 : I8_TILE), a->bits);
        }
    }
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
    Gemm a = {rows, t, k, panel, n, bits, out, ldo, channels, u, at, values, r};
    team_run(threads, gemm_strips, &a);
#else
    (void)act, (void)t, (void)k, (void)panel, (void)n, (void)bits, (void)out, (void)ldo, (void)channels, (void)u,
        (void)at, (void)values, (void)r, (void)threads;
#endif
}
