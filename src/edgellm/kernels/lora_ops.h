/* LoRA on the native decode path: each row of a layer call may carry its own adapter (or none),
   and every adapted projection part adds scale * B (A x) to its output, W itself untouched
   (shared and quantized). Rows with different adapters run in the same call, as gathered
   low-rank products (S-LoRA / Punica): never one call per adapter.

   Two stages per projection, in one parallel region: t = scale * A x for every (row, part, rank)
   (dot products over `in`), then y[:, part] += B t, split over column blocks of every row's
   parts (B^T is stored (rank, out) so this is a run of vector FMAs along the output). */
#pragma once
#include "layer_types.h"
#include "simd.h"

#define LORA_COLUMNS 64 /* output columns per job of the B stage */

static inline const LoraPair *lora_pair(const LoraLayer *const *lora, int row, int part) {
    const LoraLayer *l = lora[row];
    return l && l->part[part].a ? &l->part[part] : NULL;
}

/* t = scale * A x for one row and one part, t of `rank` floats. */
static inline void lora_down(const LoraPair *p, const float *x, int64_t in, float *t) {
    for (int64_t r = 0; r < p->rank; r++) {
        vf acc = vf_zero();
        for (int64_t j = 0; j < in; j += VL) acc = vf_fma(vf_load_bf16(p->a + r * in + j), vf_load(x + j), acc);
        t[r] = p->scale * vf_sum(acc);
    }
}

/* y[c0:c1) += B t for one row and one part (width = the part's output columns). */
static inline void lora_up(const LoraPair *p, const float *t, int64_t width, int64_t c0, int64_t c1, float *y) {
    for (int64_t c = c0; c < c1; c += VL) {
        vf acc = vf_load(y + c);
        for (int64_t r = 0; r < p->rank; r++) acc = vf_fma(vf_set1(t[r]), vf_load_bf16(p->bt + r * width + c), acc);
        vf_store(y + c, acc);
    }
}

/* For the `count` consecutive parts from `first` (q|k|v, o, gate|up, down) of widths[], side by
   side in each row of y (row stride ldy): y[i] += scale B (A x[i]) under row i's adapter.
   x (m, in); t holds m * 3 * MAX_LORA_RANK floats. lora == NULL: nothing to add. */
static inline void lora_add(const LoraLayer *const *lora, int first, int count, const int64_t *widths,
                            const float *x, int64_t in, int m, float *y, int64_t ldy, float *t, int threads) {
    if (!lora) return;
    int64_t offsets[3], blocks[3], row_blocks = 0;
    for (int p = 0, off = 0; p < count; off += (int)widths[p], p++) {
        offsets[p] = off;
        blocks[p] = (widths[p] + LORA_COLUMNS - 1) / LORA_COLUMNS;
        row_blocks += blocks[p];
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static, 1)
        for (int job = 0; job < m * count; job++) {  /* one (row, part) each: A is read once per row */
            const LoraPair *p = lora_pair(lora, job / count, first + job % count);
            if (p) lora_down(p, x + (int64_t)(job / count) * in, in, t + (int64_t)job * MAX_LORA_RANK);
        }
#pragma omp for schedule(static)
        for (int64_t job = 0; job < m * row_blocks; job++) {
            int i = (int)(job / row_blocks), p = 0;
            int64_t b = job % row_blocks;
            while (b >= blocks[p]) b -= blocks[p++];
            const LoraPair *pair = lora_pair(lora, i, first + p);
            if (!pair) continue;
            int64_t c0 = b * LORA_COLUMNS, c1 = c0 + LORA_COLUMNS < widths[p] ? c0 + LORA_COLUMNS : widths[p];
            lora_up(pair, t + ((int64_t)i * count + p) * MAX_LORA_RANK, widths[p], c0, c1, y + i * ldy + offsets[p]);
        }
    }
}
