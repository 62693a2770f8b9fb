/* LoRA on the native decode path: each row of a layer call may carry its own adapter (or none),
   and every adapted projection part adds scale * B (A x) to its output, W itself untouched
   (shared and quantized). Rows with different adapters run in the same call, as gathered
   low-rank products (S-LoRA / Punica): never one call per adapter. A and B^T are int8 rows with a
   scale each (layer_types.h); B's row scales fold into t, so the B stage is plain FMAs.

   Two stages per projection, each a parallel loop: t = scale * A x for every (row, part, rank)
   (dot products over `in`, four rank rows a job), then y[:, part] += B t, split over tiles of
   LORA_COLUMNS output columns of every row's parts (runs of vector FMAs along the output). Both
   read their bytes as one contiguous run per job (the layouts below): an adapter comes from
   memory every decode step, and short rows read side by side stalled on latency. */
#pragma once
#include "layer_types.h"
#include "simd.h"

#define LORA_COLUMNS 64 /* output columns per job of the B stage */

static inline const LoraPair *lora_pair(const LoraLayer *const *lora, int row, int part) {
    const LoraLayer *l = lora[row];
    return l && l->part[part].a ? &l->part[part] : NULL;
}

#define LORA_RANKS 4 /* rank rows per job of the A stage: four accumulators share each load of x */
#define LORA_CHUNK 16 /* A's rows are interleaved in chunks of this many values (layout below) */

/* t[r] = scale * a_scale[r] * bt_scale[r] * (A x)[r] for r in [r0, r0 + LORA_RANKS) of one row and one part.
   A is stored in groups of LORA_RANKS rows, each group as (in / LORA_CHUNK, LORA_RANKS, LORA_CHUNK):
   the four rows a job reads together are one contiguous run; rows past the last whole group follow
   plainly (row r at r * in). */
static inline void lora_down(const LoraPair *p, const float *x, int64_t in, int64_t r0, float *t) {
    if (r0 + LORA_RANKS <= p->rank) {
        const int8_t *a = p->a + r0 * in;
        vf acc0 = vf_zero(), acc1 = vf_zero(), acc2 = vf_zero(), acc3 = vf_zero();
        for (int64_t j = 0; j < in; j += LORA_CHUNK, a += LORA_RANKS * LORA_CHUNK)
            for (int64_t k = 0; k < LORA_CHUNK; k += VL) {
                vf xj = vf_load(x + j + k);
                acc0 = vf_fma(vf_load_i8(a + k), xj, acc0);
                acc1 = vf_fma(vf_load_i8(a + LORA_CHUNK + k), xj, acc1);
                acc2 = vf_fma(vf_load_i8(a + 2 * LORA_CHUNK + k), xj, acc2);
                acc3 = vf_fma(vf_load_i8(a + 3 * LORA_CHUNK + k), xj, acc3);
            }
        vf_sum4(acc0, acc1, acc2, acc3, t + r0);
    } else {
        for (int64_t r = r0; r < p->rank; r++) {  /* a rank that is not a multiple of LORA_RANKS: the last rows */
            vf acc = vf_zero();
            for (int64_t j = 0; j < in; j += VL) acc = vf_fma(vf_load_i8(p->a + r * in + j), vf_load(x + j), acc);
            t[r] = vf_sum(acc);
        }
    }
    for (int64_t r = r0; r < r0 + LORA_RANKS && r < p->rank; r++) t[r] *= p->scale * p->a_scale[r] * p->bt_scale[r];
}

/* y[c0:c1) += B t for one row and one part, c0 a multiple of LORA_COLUMNS and c1 the end of that
   tile: four vectors of columns at a time, each its own chain of FMAs over the rank. B^T is stored
   in tiles of LORA_COLUMNS columns (all rank rows of a tile together: one contiguous read). */
static inline void lora_up(const LoraPair *p, const float *t, int64_t c0, int64_t c1, float *y) {
    const int8_t *tile = p->bt + c0 * p->rank;
    int64_t tw = c1 - c0;
    int64_t c = c0;
    for (; c + 4 * VL <= c1; c += 4 * VL) {
        vf acc0 = vf_load(y + c), acc1 = vf_load(y + c + VL), acc2 = vf_load(y + c + 2 * VL), acc3 = vf_load(y + c + 3 * VL);
        for (int64_t r = 0; r < p->rank; r++) {
            const int8_t *row = tile + r * tw + (c - c0);
            vf tr = vf_set1(t[r]);
            acc0 = vf_fma(tr, vf_load_i8(row), acc0);
            acc1 = vf_fma(tr, vf_load_i8(row + VL), acc1);
            acc2 = vf_fma(tr, vf_load_i8(row + 2 * VL), acc2);
            acc3 = vf_fma(tr, vf_load_i8(row + 3 * VL), acc3);
        }
        vf_store(y + c, acc0), vf_store(y + c + VL, acc1), vf_store(y + c + 2 * VL, acc2), vf_store(y + c + 3 * VL, acc3);
    }
    for (; c < c1; c += VL) {
        vf acc = vf_load(y + c);
        for (int64_t r = 0; r < p->rank; r++) acc = vf_fma(vf_set1(t[r]), vf_load_i8(tile + r * tw + (c - c0)), acc);
        vf_store(y + c, acc);
    }
}

typedef struct {
    const LoraLayer *const *lora;
    int first, count, groups;
    const int64_t *widths, *offsets, *blocks;
    int64_t row_blocks, in, ldy;
    const float *x;
    float *y, *t;
} LoraAdd;

/* t for jobs [j0, j1) of (row, part, LORA_RANKS rows of A) */
static void lora_down_jobs(void *p, int64_t j0, int64_t j1) {
    const LoraAdd *a = p;
    for (int64_t job = j0; job < j1; job++) {
        int i = (int)(job / (a->count * a->groups)), part = (int)(job / a->groups % a->count);
        const LoraPair *pair = lora_pair(a->lora, i, a->first + part);
        int64_t r0 = job % a->groups * LORA_RANKS;
        if (pair && r0 < pair->rank)
            lora_down(pair, a->x + i * a->in, a->in, r0, a->t + ((int64_t)i * a->count + part) * MAX_LORA_RANK);
    }
}

/* y += B t for jobs [j0, j1) of (row, LORA_COLUMNS columns of a part) */
static void lora_up_jobs(void *p, int64_t j0, int64_t j1) {
    const LoraAdd *a = p;
    for (int64_t job = j0; job < j1; job++) {
        int i = (int)(job / a->row_blocks), part = 0;
        int64_t b = job % a->row_blocks;
        while (b >= a->blocks[part]) b -= a->blocks[part++];
        const LoraPair *pair = lora_pair(a->lora, i, a->first + part);
        if (!pair) continue;
        int64_t c0 = b * LORA_COLUMNS, c1 = c0 + LORA_COLUMNS < a->widths[part] ? c0 + LORA_COLUMNS : a->widths[part];
        lora_up(pair, a->t + ((int64_t)i * a->count + part) * MAX_LORA_RANK, c0, c1, a->y + i * a->ldy + a->offsets[part]);
    }
}

/* For the `count` consecutive parts from `first` (q|k|v, o, gate|up, down) of widths[], side by
   side in each row of y (row stride ldy): y[i] += scale B (A x[i]) under row i's adapter.
   x (m, in); t holds m * 3 * MAX_LORA_RANK floats. lora == NULL: nothing to add. */
static inline void lora_add(const LoraLayer *const *lora, int first, int count, const int64_t *widths,
                            const float *x, int64_t in, int m, float *y, int64_t ldy, float *t, int threads) {
    if (!lora) return;
    int64_t offsets[3], blocks[3], row_blocks = 0, rank = 0;
    for (int i = 0; i < m; i++)
        for (int p = 0; p < count; p++) {
            const LoraPair *pair = lora_pair(lora, i, first + p);
            if (pair && pair->rank > rank) rank = pair->rank;
        }
    if (rank == 0) return;  /* no row adapts these parts */
    int groups = (int)((rank + LORA_RANKS - 1) / LORA_RANKS);
    for (int p = 0, off = 0; p < count; off += (int)widths[p], p++) {
        offsets[p] = off;
        blocks[p] = (widths[p] + LORA_COLUMNS - 1) / LORA_COLUMNS;
        row_blocks += blocks[p];
    }
    LoraAdd a = {lora, first, count, groups, widths, offsets, blocks, row_blocks, in, ldy, x, y, t};
    pool_for((int64_t)m * count * groups, threads, lora_down_jobs, &a);
    pool_for(m * row_blocks, threads, lora_up_jobs, &a);
}
