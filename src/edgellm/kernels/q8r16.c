/* edgellm's "Q8R16" layout: GGUF Q8_0 blocks (fp16 d, 32 int8 q; w = d * q) with rows interleaved
   sixteen at a time, so that one vector holds the same weights of 16 rows (docs/kernels.md). Per
   group of 16 rows, per block b of 32 k's, 544 bytes (16 Q8_0 blocks, the same bytes reordered):

     16 fp16 d, row j's at byte 2j;   then per k-pair p < 16: 16 rows x (q[2p], q[2p + 1]), row j's at 2j

   Written once at load from the file's Q8_0 rows (edgellm_q8_0_to_q8r16), the same bytes on every
   machine. Why: a GEMV over plain Q8_0 rows turns each block of each row into a dot product summed
   across lanes and scaled on its own (five or six instructions for 32 multiply-adds, per activation
   row); here a lane is a row, a k-pair of 16 rows is one widening and one vpdpwssd per activation
   row, and the sixteen rows' scales apply to a whole vector per block. The tied 262k x 640 head of
   Gemma 3 with 4 activation rows: 15.7 -> 9.7 ms (AVX-512, 2 vCPUs), SmolLM2's 49k x 576 head
   0.78 -> 0.54 ms at 1 row and 2.43 -> 0.66 ms at 4.

   Products: per block, exact int32 sums of q * qx (int16 activations, intdot.h), then one fma
   per block and row in block order: acc = fma(float(dot), d * dx[b], acc). Every variant, and every
   number of activation rows, computes exactly these floats. */
#include "intdot.h"

#define R16 16                 /* rows per group */
#define R16_BLOCK 544          /* bytes per group and block of 32 k's */
#define R16_MAX_M 8
#define R16_PREFETCH 2048      /* bytes ahead: one core alone keeps too few lines in flight (2 KB: 0.87-0.91x the time of 6 KB at 1 row) */

typedef struct {
    const uint8_t *src;
    int64_t nb;
    uint8_t *dst;
} R16Pack;

static void r16_pack_groups(void *p, int64_t g0, int64_t g1) {
    const R16Pack *a = p;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t b = 0; b < a->nb; b++) {
            uint8_t *out = a->dst + (g * a->nb + b) * R16_BLOCK;
            for (int j = 0; j < R16; j++) {
                const uint8_t *block = a->src + ((g * R16 + j) * a->nb + b) * 34;
                memcpy(out + 2 * j, block, 2);
                for (int p = 0; p < 16; p++) memcpy(out + 32 + 32 * p + 2 * j, block + 2 + 2 * p, 2);
            }
        }
}

/* dst (n / 16 groups) = src's n Q8_0 rows of k weights, interleaved; n % 16 == 0, k % 32 == 0. At
   load, on edgellm's pool (Gemma 3's 178 MB head, its page faults included: 107 -> 64 ms on 2
   threads); not on an OpenMP team: one started in the loading thread would slow the engine thread's
   own (two teams on two cores: service decode 155 -> 61 tok/s, measured). */
void edgellm_q8_0_to_q8r16(const uint8_t *src, int64_t n, int64_t k, uint8_t *dst, int threads) {
    R16Pack a = {src, k / 32, dst};
    pool_for(n / R16, threads, r16_pack_groups, &a);
}

/* Weight q[2p + e] of row j in a group's block. */
static inline int8_t r16_q(const uint8_t *block, int j, int p, int e) { return (int8_t)block[32 + 32 * p + 2 * j + e]; }

/* out[0..k) = row j of a group (the group's first block at `group`), as fp32 or bf16 from `at`. */
static void r16_row(const uint8_t *group, int64_t nb, int j, void *out, int64_t at, int dtype) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = group + b * R16_BLOCK;
        int8_t q[32];
        for (int p = 0; p < 16; p++) q[2 * p] = r16_q(block, j, p, 0), q[2 * p + 1] = r16_q(block, j, p, 1);
        vf d = vf_set1(f16_to_f32((uint16_t)(block[2 * j] | block[2 * j + 1] << 8)));
        for (int i = 0; i < 32; i += VL) vf_store_as(out, at + b * 32 + i, vf_mul(vf_load_i8(q + i), d), dtype);
    }
}

typedef struct {
    const uint8_t *packed;
    int64_t k;
    void *out;
    int dtype;
} R16Rows;

static void r16_rows(void *p, int64_t r0, int64_t r1) {
    const R16Rows *a = p;
    int64_t nb = a->k / 32;
    for (int64_t r = r0; r < r1; r++)
        r16_row(a->packed + r / R16 * nb * R16_BLOCK, nb, (int)(r % R16), a->out, r * a->k, a->dtype);
}

/* out (n, k) = the weights of n rows from `packed` (a group boundary), as fp32 or bf16: a prompt's GEMM. */
void edgellm_q8r16_to_float(const uint8_t *packed, int64_t n, int64_t k, void *out, int dtype, int threads) {
    R16Rows a = {packed, k, out, dtype};
    team_for(n, threads, r16_rows, &a);
}

/* out (count, k) fp32 = rows rows[0..count) of the whole table at `packed`: embedding lookups. */
void edgellm_q8r16_rows(const uint8_t *packed, int64_t k, const int64_t *rows, int64_t count, float *out) {
    int64_t nb = k / 32;
    for (int64_t i = 0; i < count; i++)
        r16_row(packed + rows[i] / R16 * nb * R16_BLOCK, nb, (int)(rows[i] % R16), out, i * k, DTYPE_F32);
}

static inline void r16_prefetch(const uint8_t *block) {
    for (int line = 0; line < R16_BLOCK; line += 64) __builtin_prefetch(block + R16_PREFETCH + line);
}

/* Activation rows a pass keeps accumulators for (in registers where the ISA has them). */
#if EDGELLM_AVX512
#define R16_TILE 8
#elif EDGELLM_AVX2 || EDGELLM_NEON
#define R16_TILE 4
#else
#define R16_TILE 8
#endif

/* dot[i] (lane l: row r0 + l of the group) = the exact int32 dot product of one block's 32 weights
   with activation row i's block b, for `rows` activation rows; each k-pair of the VL rows is
   widened once for all of them. */
ALWAYS_INLINE void r16_block_dots(const uint8_t *blk, int r0, int rows, const Act *a, int64_t b, vi *dot) {
    for (int i = 0; i < rows; i++) dot[i] = vi_zero();
#if EDGELLM_AVX512 || EDGELLM_AVX2
#pragma GCC unroll 16  /* else GCC keeps the k-pairs a loop for 8 rows and copies every accumulator each turn */
    for (int p = 0; p < 16; p++) {  /* lane l: row r0 + l's (q[2p], q[2p + 1]) as int16 */
        const uint8_t *pairs = blk + 32 + 32 * p + 2 * r0;
#if EDGELLM_AVX512
        __m512i wq = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)pairs));
#else
        __m256i wq = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)pairs));
#endif
        for (int i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, a[i].q + b * 32 + 2 * p, 4);
#if EDGELLM_AVX512
            dot[i] = dpwssd512(dot[i], wq, _mm512_set1_epi32(pair));
#else
            dot[i] = madd_acc(dot[i], wq, _mm256_set1_epi32(pair));
#endif
        }
    }
#elif EDGELLM_NEON
    /* two k-pairs zipped: each row's 4 consecutive k's in a 32-bit lane, for sdot with the
       activation's two signed bytes (q = 256 hi + lo) */
    int32x4_t hi[R16_TILE], lo[R16_TILE];
    for (int i = 0; i < rows; i++) hi[i] = lo[i] = vdupq_n_s32(0);
    for (int p = 0; p < 16; p += 2) {
        uint16x4_t u = vreinterpret_u16_u8(vld1_u8(blk + 32 + 32 * p + 2 * r0));
        uint16x4_t v = vreinterpret_u16_u8(vld1_u8(blk + 32 + 32 * (p + 1) + 2 * r0));
        int8x16_t wq = vreinterpretq_s8_u16(vcombine_u16(vzip1_u16(u, v), vzip2_u16(u, v)));
        for (int i = 0; i < rows; i++) {
            int32_t xh, xl;
            memcpy(&xh, a[i].hi + b * 32 + 2 * p, 4);
            memcpy(&xl, a[i].lo + b * 32 + 2 * p, 4);
            hi[i] = vdotq_s32(hi[i], wq, vreinterpretq_s8_s32(vdupq_n_s32(xh)));
            lo[i] = vdotq_s32(lo[i], wq, vreinterpretq_s8_s32(vdupq_n_s32(xl)));
        }
    }
    for (int i = 0; i < rows; i++) dot[i] = vaddq_s32(vshlq_n_s32(hi[i], 8), lo[i]);
#else
    for (int p = 0; p < 16; p++)
        for (int i = 0; i < rows; i++)
            dot[i] += r16_q(blk, r0, p, 0) * a[i].q[b * 32 + 2 * p] + r16_q(blk, r0, p, 1) * a[i].q[b * 32 + 2 * p + 1];
#endif
}

/* a * b + c rounded once in every variant (the scalar one's plain expression need not be fused) */
static inline vf r16_fma(vf a, vf b, vf c) {
#if EDGELLM_SCALAR
    return fmaf(a, b, c);
#else
    return vf_fma(a, b, c);
#endif
}

/* y[i][r0 .. r0 + VL) for `rows` activation rows, over a group's nb blocks. */
ALWAYS_INLINE void r16_pass(const uint8_t *w, int64_t nb, int r0, int rows, const Act *a, float *y, int64_t ldy,
                            int first) {
    vf acc[R16_TILE];
    for (int i = 0; i < rows; i++) acc[i] = vf_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * R16_BLOCK;
        if (first) r16_prefetch(blk);  /* the group's first pass: later ones find the lines in cache */
        vf d = vf_load_f16((const uint16_t *)blk + r0);
        vi dot[R16_TILE];
        r16_block_dots(blk, r0, rows, a, b, dot);
        for (int i = 0; i < rows; i++) acc[i] = r16_fma(vf_from_vi(dot[i]), vf_mul(d, vf_set1(a[i].dx[b])), acc[i]);
    }
    for (int i = 0; i < rows; i++) vf_store(y + i * ldy + r0, acc[i]);
}

/* y[i][16 g .. 16 g + 16) for the m activation rows, from one group's nb blocks: VL rows a pass,
   R16_TILE activation rows at a time, each tile a constant size (its accumulators in registers). */
ALWAYS_INLINE void r16_group(const uint8_t *w, int64_t nb, int m, const Act *act, float *y, int64_t ldy) {
    for (int r0 = 0; r0 < R16; r0 += VL)
        for (int i0 = 0; i0 < m; i0 += R16_TILE) {
            const Act *a = act + i0;
            float *out = y + i0 * ldy;
            int first = r0 == 0 && i0 == 0;
            switch (m - i0 < R16_TILE ? m - i0 : R16_TILE) {
#define R16_CASE(n) case n: if (R16_TILE >= n) r16_pass(w, nb, r0, n, a, out, ldy, first); break;
            R16_CASE(1) R16_CASE(2) R16_CASE(3) R16_CASE(4) R16_CASE(5) R16_CASE(6) R16_CASE(7) R16_CASE(8)
#undef R16_CASE
            }
        }
}

typedef struct {
    const Act *act;
    int m;
    int64_t nb;
    const uint8_t *packed;
    float *y;
    int64_t ldy;
} R16Gemv;

static void r16_groups(void *p, int64_t g0, int64_t g1) {
    const R16Gemv *a = p;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *w = a->packed + g * a->nb * R16_BLOCK;
        float *out = a->y + g * R16;
        switch (a->m) {  /* a constant m keeps the accumulators in registers */
        case 1: r16_group(w, a->nb, 1, a->act, out, a->ldy); break;
        case 2: r16_group(w, a->nb, 2, a->act, out, a->ldy); break;
        case 4: r16_group(w, a->nb, 4, a->act, out, a->ldy); break;
        case 8: r16_group(w, a->nb, 8, a->act, out, a->ldy); break;
        default: r16_group(w, a->nb, a->m, a->act, out, a->ldy);
        }
    }
}

/* y[i][0..n) (row i at y + i * ldy) = x[m][k] @ W^T for W (n, k) in Q8R16, m <= 8; `work` holds
   edgellm_block_gemv_work(m, k) bytes. */
void edgellm_q8r16_gemv(const float *x, int m, int64_t k, const uint8_t *packed, int64_t n, float *y, int64_t ldy,
                        void *work, int threads) {
    Act act[R16_MAX_M];
    for (int i = 0; i < m; i++) act[i] = quantize_act(x + i * k, k, 32, (uint8_t *)work + i * act_bytes(k, 32));
    R16Gemv a = {act, m, k / 32, packed, y, ldy};
    pool_for(n / R16, threads, r16_groups, &a);
}
