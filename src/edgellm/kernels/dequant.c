/* Prefill-time unpacking of the I4R64 INT4 layout (int4_layout.h) into a float weight, so a long
   prompt runs on PyTorch's GEMM (bf16 where the CPU multiplies bf16 natively, else fp32) while the
   model keeps only the 4-bit bytes: the float copy lives in one reused scratch buffer.

   One k of a 64-row block is 64 consecutive rows, so the natural output is the transposed
   weight Wt (K, N), row k contiguous in n, which the GEMM takes as x @ Wt as fast as x @ W^T.
   With planes = 2 the two 4-bit planes (k and ka + k) are summed in fp32 and rounded once. */
#include "int4_layout.h"

/* Row block nb of Wt: columns [nb*64, nb*64 + 64) of every k. */
static void unpack_block(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw, int64_t group,
                         int planes, int64_t nb, int64_t row0, int64_t rows, void *wt, int dtype) {
    const uint8_t *w = packed + nb * I4_ROWS * kw / 2;
    int64_t ka = kw / planes;
    for (int64_t k = 0; k < ka; k++) {
        for (int64_t r = 0; r < I4_ROWS; r += VL) {
            vf out = vf_zero();
            for (int p = 0; p < planes; p++) {
                int64_t kp = p * ka + k;
                vf scale, zero;
                vf_load_bf16_pairs(scale_zero + ((kp / group) * n + nb * I4_ROWS + r) * 2, &scale, &zero);
                vf q = vf_load_nibbles(w + kp * 32 + r % 32, r >= 32);
                out = vf_add(out, vf_fma(vf_sub(q, vf_set1(8.f)), scale, zero));
            }
            vf_store_as(wt, k * rows + nb * I4_ROWS - row0 + r, out, dtype);
        }
    }
}

typedef struct {
    const uint8_t *packed;
    const uint16_t *scale_zero;
    int64_t n, kw, group;
    int planes;
    int64_t row0, rows;
    void *wt;
    int dtype;
} Unpack;

static void unpack_blocks(void *p, int64_t b0, int64_t b1) {
    const Unpack *a = p;
    for (int64_t nb = a->row0 / I4_ROWS + b0; nb < a->row0 / I4_ROWS + b1; nb++)
        unpack_block(a->packed, a->scale_zero, a->n, a->kw, a->group, a->planes, nb, a->row0, a->rows, a->wt, a->dtype);
}

/* wt (ka, rows) = rows row0 .. row0 + rows of the dequantized (n, kw = planes * ka) weight,
   transposed, as bf16 (dtype 1) or fp32 (dtype 0). n, row0 and rows are multiples of 64. */
void edgellm_int4_unpack(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw, int64_t group,
                         int planes, int64_t row0, int64_t rows, void *wt, int dtype, int threads) {
    Unpack a = {packed, scale_zero, n, kw, group, planes, row0, rows, wt, dtype};
    team_for(rows / I4_ROWS, threads, unpack_blocks, &a);
}
