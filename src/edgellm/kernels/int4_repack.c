/* GGUF blocks of the affine formats (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0) straight into edgellm's
   I4R64 layout (int4_layout.h), at load: the same bytes quant/linear.py's `Int4Linear.from_affine`
   writes from quant/ggml.py's `integer_affine`, without a float or a 16-bit copy of the weight.

   Each block is w = q * scale + zero per 32 weights, q < 2^bits, scale and zero the file's fp16
   values (times a Q4_K sub-block's 6-bit factors). Up to 4 bits: one plane, (q, scale, zero + 8 scale)
   for the kernels' (q - 8). Five to eight bits: two planes side by side along K, q = 16 hi + lo:
   (hi, 16 scale, 128 scale) then (lo, scale, 8 scale + zero). Scale and zero pairs round to bf16
   (nearest even). The products and sums are single roundings in this order (no fused multiply-add:
   fp-contract off), as PyTorch's elementwise float32 ops compute them. */
#include "intdot.h"
#include "pool.h"

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12 };
#define I4_ROWS 64

static inline float half_at(const uint8_t *p) { return f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* Group g (32 weights) of a row's blocks: q[0..32), its scale and zero (w = q * scale + zero). */
__attribute__((optimize("fp-contract=off")))
static void affine_group(const uint8_t *row, int type, int64_t g, uint8_t *q, float *scale, float *zero) {
    if (type == T_Q4_K) {
        const uint8_t *b = row + (g / 8) * 144, *qs = b + 16 + 32 * ((g % 8) / 2);
        int s = (int)(g % 8), sc, mn, high = s & 1;
        k_scale_min(b + 4, s, &sc, &mn);
        for (int i = 0; i < 32; i++) q[i] = high ? qs[i] >> 4 : qs[i] & 0xF;
        *scale = half_at(b) * (float)sc;
        *zero = -(half_at(b + 2) * (float)mn);
        return;
    }
    if (type == T_Q8_0) {
        const uint8_t *b = row + g * 34;
        for (int i = 0; i < 32; i++) q[i] = (uint8_t)((int8_t)b[2 + i] + 128);
        *scale = half_at(b), *zero = -128.0f * *scale;
        return;
    }
    int size = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
    int qs_at = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
    const uint8_t *b = row + g * size, *qs = b + qs_at;
    for (int i = 0; i < 16; i++) q[i] = qs[i] & 0xF, q[16 + i] = qs[i] >> 4;
    if (type == T_Q5_0 || type == T_Q5_1) {
        const uint8_t *qh = b + (type == T_Q5_0 ? 2 : 4);
        for (int i = 0; i < 32; i++) q[i] |= ((qh[i / 8] >> (i % 8)) & 1) << 4;
    }
    *scale = half_at(b);
    if (type == T_Q4_1 || type == T_Q5_1) *zero = half_at(b + 2);
    else *zero = (type == T_Q4_0 ? -8.0f : -16.0f) * *scale;
}

typedef struct {
    const uint8_t *blocks;
    int type, planes;
    int64_t n, k, row_bytes, n_total, row0;
    uint8_t *packed;      /* (n_total, planes * k / 2) */
    uint16_t *scale_zero; /* (planes * k / 32, n_total, 2) bf16 */
} Repack;

static inline void put_nibble(const Repack *a, int64_t row, int64_t kk, uint8_t v) {
    int64_t kw = a->planes * a->k, within = row % I4_ROWS;
    uint8_t *byte = a->packed + (row / I4_ROWS) * I4_ROWS * (kw / 2) + kk * 32 + within % 32;
    *byte = within < 32 ? (uint8_t)((*byte & 0xF0) | v) : (uint8_t)((*byte & 0x0F) | (v << 4));
}

static inline void put_pair(const Repack *a, int64_t group, int64_t row, float scale, float zero) {
    uint16_t *pair = a->scale_zero + (group * a->n_total + row) * 2;
    pair[0] = f32_to_bf16(scale), pair[1] = f32_to_bf16(zero);
}

__attribute__((optimize("fp-contract=off")))
static void repack_rows(void *p, int64_t r0, int64_t r1) {
    const Repack *a = p;
    int64_t groups = a->k / 32;
    uint8_t q[32];
    float scale, zero;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = a->blocks + r * a->row_bytes;
        int64_t out = a->row0 + r;
        for (int64_t g = 0; g < groups; g++) {
            affine_group(row, a->type, g, q, &scale, &zero);
            if (a->planes == 1) {
                for (int i = 0; i < 32; i++) put_nibble(a, out, g * 32 + i, q[i]);
                put_pair(a, g, out, scale, zero + 8.0f * scale);
            } else {
                for (int i = 0; i < 32; i++) {
                    put_nibble(a, out, g * 32 + i, q[i] >> 4);
                    put_nibble(a, out, a->k + g * 32 + i, q[i] & 15);
                }
                put_pair(a, g, out, 16.0f * scale, 128.0f * scale);
                put_pair(a, groups + g, out, scale, 8.0f * scale + zero);
            }
        }
    }
}

/* Part rows r .. r + 64, a whole run of the layout (its first global row a multiple of 64): per group
   of 32 k's the 64 rows' integers, then each k's 32 bytes at once (the nibble by nibble writes of
   repack_rows took ~3x longer). */
__attribute__((optimize("fp-contract=off")))
static void repack_run(const Repack *a, int64_t r) {
    int64_t groups = a->k / 32, out = a->row0 + r;
    uint8_t *run = a->packed + out * (a->planes * a->k / 2), q[I4_ROWS][32];
    float scale, zero;
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < I4_ROWS; j++) {
            affine_group(a->blocks + (r + j) * a->row_bytes, a->type, g, q[j], &scale, &zero);
            if (a->planes == 1) {
                put_pair(a, g, out + j, scale, zero + 8.0f * scale);
            } else {
                put_pair(a, g, out + j, 16.0f * scale, 128.0f * scale);
                put_pair(a, groups + g, out + j, scale, 8.0f * scale + zero);
            }
        }
        for (int i = 0; i < 32; i++) {
            uint8_t *hi = run + (g * 32 + i) * 32, *lo = run + (a->k + g * 32 + i) * 32;
            for (int b = 0; b < 32; b++) {
                uint8_t low = q[b][i], high = q[32 + b][i];
                if (a->planes == 1) {
                    hi[b] = (uint8_t)(low | high << 4);
                } else {
                    hi[b] = (uint8_t)(low >> 4 | (high >> 4) << 4);
                    lo[b] = (uint8_t)((low & 15) | (high & 15) << 4);
                }
            }
        }
    }
}

static void repack_runs(void *p, int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; u++) repack_run(p, u * I4_ROWS);
}

static int64_t affine_block_bytes(int type) { /* per 32 weights; 0: not an affine type */
    switch (type) {
        case T_Q4_0: return 18;
        case T_Q4_1: return 20;
        case T_Q5_0: return 22;
        case T_Q5_1: return 24;
        case T_Q8_0: return 34;
        case T_Q4_K: return 144 / 8;
        default: return 0;
    }
}

/* out (n, k) fp32 = rows idx[0..n) of a tensor of GGUF blocks of an affine `type` (k weights a row):
   an embedding table's lookups, each weight q * scale + zero as in ggml's own dequantization
   (Q4_K's d·sc·q - dmin·m to the bit). Returns 0, or -1 for a type or row length it does not take. */
__attribute__((optimize("fp-contract=off")))
int edgellm_affine_rows_to_float(const uint8_t *blocks, int type, int64_t k, const int64_t *idx, int64_t n, float *out) {
    int64_t block_bytes = affine_block_bytes(type), row_bytes = k / 32 * block_bytes;
    if (!block_bytes || k <= 0 || k % (type == T_Q4_K ? 256 : 32)) return -1;
    uint8_t q[32];
    float scale, zero;
    for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < k / 32; g++) {
            affine_group(blocks + idx[i] * row_bytes, type, g, q, &scale, &zero);
            for (int j = 0; j < 32; j++) out[i * k + g * 32 + j] = (float)q[j] * scale + zero;
        }
    return 0;
}

/* Rows row0 .. row0 + n of an I4R64 weight of n_total rows (`planes` of k weights each) from n rows of
   GGUF blocks of `type` (k weights a row); returns 0, or -1 for a type or shape it does not take.
   On edgellm's pool (as q8r16.c's repack, not an OpenMP team), in runs of 64 global rows: a byte holds
   rows i and 32 + i of a run, so two calls for parts that share a run must not run at once. */
int edgellm_i4r64_from_blocks(const uint8_t *blocks, int type, int64_t n, int64_t k, int planes, uint8_t *packed,
                              uint16_t *scale_zero, int64_t n_total, int64_t row0, int threads) {
    int64_t block_bytes = affine_block_bytes(type);
    if (!block_bytes) return -1;
    int wide = type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0; /* more than 4 bits: two planes */
    if (k <= 0 || k % (type == T_Q4_K ? 256 : 32) || n_total % I4_ROWS || row0 < 0 || n < 0 || row0 + n > n_total ||
        planes < 1 + wide || planes > 2)
        return -1;
    Repack a = {blocks, type, planes, n, k, k / 32 * block_bytes, n_total, row0, packed, scale_zero};
    /* runs of 64 global rows that lie wholly inside the part go to the threads; partial runs at
       either end stay on this thread */
    int64_t first = (row0 + I4_ROWS - 1) / I4_ROWS * I4_ROWS - row0, last = (row0 + n) / I4_ROWS * I4_ROWS - row0;
    if (first >= last) {
        repack_rows(&a, 0, n);
        return 0;
    }
    repack_rows(&a, 0, first);
    Repack runs = a;
    runs.blocks += first * a.row_bytes, runs.row0 += first;
    pool_for((last - first) / I4_ROWS, threads, repack_runs, &runs);
    repack_rows(&a, last, n);
    return 0;
}
