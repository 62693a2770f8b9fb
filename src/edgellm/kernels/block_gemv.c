/* Matrix-vector products straight on a GGUF file's own blocks (no converted copy), for decode,
   and their dequantization to bf16 / fp32 for the GEMM of a prompt.

   Q8_0: 34-byte blocks of 32: fp16 d, 32 int8 q;                       w = d * q
   Q5_0: 22-byte blocks of 32: fp16 d, 32 high bits qh, 16 bytes of nibbles
         (element j < 16: low nibble of byte j, element j + 16: its high nibble; bit j of qh
         is element j's fifth bit);                                     w = d * (q - 16)
   Q5_K: 176-byte super-blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs
         for 8 sub-blocks of 32, 32 bytes qh, 128 bytes qs: sub-blocks 2c and 2c + 1 are the low
         and high nibbles of qs[32c:32c+32], their fifth bits bits 2c and 2c + 1 of qh;
                                                                        w = d * sc * q - dmin * m
   Q6_K: 210-byte super-blocks of 256: 128 bytes of low nibbles ql, 64 bytes of high bit pairs qh,
         16 int8 scales (one per 16 weights), fp16 d;                  w = d * scale * (q - 32)
         (per half of 128: ql[0:32], ql[32:64] and qh[0:32] give weights 0-31 (low nibbles,
         qh bits 0-1), 32-63 (bits 2-3), 64-95 (high nibbles, bits 4-5), 96-127 (bits 6-7))
   I8:   edgellm's INT8 scheme (quant/schemes.py; ggml's number for int8): rows of K int8 with one
         bf16 scale per row in `row_scale`;                             w = scale * q
   Each 32 weights become a w32 of int8, widened once to the dot product's form (intdot.h), and
   meet the int16 activations in fma_dot_wide, which ends with one float fma by d * dx (AVX2
   scales four blocks per fma instead: small_row_dots). */
#define MAX_M 8
#include "k_rows.h"

/* Bytes ahead to prefetch, in whole rows: one core alone keeps too few lines in flight to stream at
   the memory's speed (Q8_0 head, 2 threads: 13 -> 19 GB/s of ~21 measured) */
#define PREFETCH_BYTES 6144
/* ggml type numbers, and edgellm's Q8R16 (Q8_0 rows interleaved by 16: q8r16.c) */
enum { BLOCK_Q5_0 = 6, BLOCK_Q8_0 = 8, BLOCK_Q5_K = 13, BLOCK_Q6_K = 14, BLOCK_I8 = 24, BLOCK_Q8R16 = 100 };

void edgellm_q8r16_gemv(const float *x, int m, int64_t k, const uint8_t *packed, int64_t n, float *y, int64_t ldy,
                        void *work, int threads);
void edgellm_q8r16_to_float(const uint8_t *packed, int64_t n, int64_t k, void *out, int dtype, int threads);

static inline int64_t row_bytes(int type, int64_t k) {
    switch (type) {
    case BLOCK_Q8_0: return k / 32 * 34;
    case BLOCK_Q5_0: return k / 32 * 22;
    case BLOCK_Q5_K: return k / 256 * Q5_K_BYTES;
    case BLOCK_I8: return k;
    default: return k / 256 * Q6_K_BYTES;
    }
}

/* Blocks of 32 weights: bytes per block, and the block's scale (I8 rows: 1, the row's scale comes last). */
static inline int64_t small_bytes(int type) { return type == BLOCK_Q8_0 ? 34 : (type == BLOCK_Q5_0 ? 22 : 32); }
static inline int small_type(int type) { return type == BLOCK_Q8_0 || type == BLOCK_Q5_0 || type == BLOCK_I8; }

/* The 32 integer weights of one Q8_0 / Q5_0 / I8 block, as int8 (Q5_0: q - 16). */
static inline w32 small_block(const uint8_t *b, int type) {
    if (type == BLOCK_I8) return w32_load((const int8_t *)b);
    if (type == BLOCK_Q8_0) return w32_load((const int8_t *)(b + 2));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    return w32_sub_const(w32_or(w32_nibbles(b + 6), w32_bit4(qh)), 16);
}

/* A small block's weights in the dot product's form (Q5_0 has its own, cheaper path). */
static inline wide32 small_wide(const uint8_t *b, int type) {
    if (type == BLOCK_Q5_0) return q5_0_wide(b);
    return widen_at((const int8_t *)(type == BLOCK_Q8_0 ? b + 2 : b));
}

/* A small block's scale d (I8: 1, its row's scale is applied by the caller). */
static inline float small_scale(const uint8_t *b, int type) { return type == BLOCK_I8 ? 1.f : half_at(b); }

/* The four 32-weight chunks of one Q6_K half (ql: 64 bytes, qh: 32), as int8 q - 32. */
static inline void q6_k_half(const uint8_t *ql, const uint8_t *qh, w32 q[4]) {
    for (int c = 0; c < 4; c++)
        q[c] = w32_sub_const(w32_or(w32_nibble_plane(ql + 32 * (c & 1), c >> 1), w32_bits_at4(qh, 2 * c, 2)), 32);
}

/* Sub-block s of a Q5_K super-block: 32 weights 0..31. */
static inline w32 q5_k_sub(const uint8_t *block, int s) {
    return w32_or(w32_nibble_plane(block + 48 + 32 * (s / 2), s & 1), w32_bits_at4(block + 16, s, 1));
}

/* One Q5_K / Q6_K super-block as 8 chunks of 32 weights: chunk c is q[c] * s0[c] (first 16) or
   * s1[c] (last 16), minus off[c]. */
typedef struct {
    w32 q[8];
    float s0[8], s1[8], off[8];
} Superblock;

ALWAYS_INLINE void superblock(const uint8_t *blk, int type, Superblock *sb) {
    if (type == BLOCK_Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = half_at(blk + 208);
        q6_k_half(blk, blk + 128, sb->q);
        q6_k_half(blk + 64, blk + 160, sb->q + 4);
        for (int c = 0; c < 8; c++) sb->s0[c] = d * sc[2 * c], sb->s1[c] = d * sc[2 * c + 1], sb->off[c] = 0.f;
        return;
    }
    float d = half_at(blk), dmin = half_at(blk + 2);
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        k_scale_min(blk + 4, s, &sc, &mn);
        sb->q[s] = q5_k_sub(blk, s);
        sb->s0[s] = sb->s1[s] = d * (float)sc;
        sb->off[s] = dmin * (float)mn;
    }
}

/* acc + block b of a row . the activation row's block b */
static inline vf small_term(vf acc, wide32 w, float d, const Act *act, int64_t b) {
    float s = d * act->dx[b];
    return fma_dot_wide(acc, w, act, b * 32, s, s);
}

#if EDGELLM_AVX2
/* The int32 dot products of four consecutive blocks with one activation row, summed per block:
   lane j holds block j's. */
static inline __m128i four_block_sums(const wide32 w[4], const Act *act, int64_t b) {
    __m256i d[4];
    for (int j = 0; j < 4; j++) {
        const int16_t *q = act->q + (b + j) * 32;
        d[j] = madd_acc(madd_acc(_mm256_setzero_si256(), w[j].lo, _mm256_loadu_si256((const __m256i *)q)),
                        w[j].hi, _mm256_loadu_si256((const __m256i *)(q + 16)));
    }
    __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* out[i] = row . activation row i for blocks of 32 on AVX2: four blocks' sums are reduced together
   and scaled by one 4-lane fma (d * dx for the four at once), instead of a scalar scale, a
   broadcast and an 8-lane fma per block, a third of a block's instructions. Every m sums in the
   same order (a sequence decoded in a batch gets the logits it gets alone). */
ALWAYS_INLINE void small_row_dots(const uint8_t *row, int type, int64_t k, int m, const Act *act, float *out) {
    int64_t bb = small_bytes(type), nblocks = k / 32, b = 0;
    __m128 acc[MAX_M];
    for (int i = 0; i < m; i++) acc[i] = _mm_setzero_ps();
    for (; b + 3 < nblocks; b += 4) {
        const uint8_t *blk = row + b * bb;
        wide32 w[4];
        for (int j = 0; j < 4; j++) w[j] = small_wide(blk + j * bb, type);
        __m128i d = _mm_set1_epi16(0x3C00);  /* fp16 1.0: I8 scales come per row */
        if (type != BLOCK_I8) {  /* built in the register: four 2-byte stores read back as one load stall */
            d = _mm_insert_epi16(d, half_bits(blk), 0);  /* constant lanes: clang takes no loop index here */
            d = _mm_insert_epi16(d, half_bits(blk + bb), 1);
            d = _mm_insert_epi16(d, half_bits(blk + 2 * bb), 2);
            d = _mm_insert_epi16(d, half_bits(blk + 3 * bb), 3);
        }
        __m128 dw = _mm_cvtph_ps(d);
        for (int i = 0; i < m; i++)
            acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(four_block_sums(w, &act[i], b)),
                                  _mm_mul_ps(dw, _mm_loadu_ps(act[i].dx + b)), acc[i]);
    }
    for (int i = 0; i < m; i++) {
        __m128 h = _mm_add_ps(acc[i], _mm_movehl_ps(acc[i], acc[i]));
        out[i] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
    for (; b < nblocks; b++) {
        const uint8_t *blk = row + b * bb;
        wide32 w = small_wide(blk, type);
        float d = small_scale(blk, type);
        for (int i = 0; i < m; i++) out[i] += vf_sum(small_term(vf_zero(), w, d, &act[i], b));
    }
}
#else
/* out[i] = row . activation row i for blocks of 32. Blocks go four at a time into four
   accumulators per activation row, so the fma chains of consecutive blocks overlap; every m sums
   in the same order (a sequence decoded in a batch gets the logits it gets alone). */
ALWAYS_INLINE void small_row_dots(const uint8_t *row, int type, int64_t k, int m, const Act *act, float *out) {
    int64_t bb = small_bytes(type), nblocks = k / 32, b = 0;
    vf acc[MAX_M][4];
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = vf_zero();
    for (; b + 3 < nblocks; b += 4)
        for (int j = 0; j < 4; j++) {
            const uint8_t *blk = row + (b + j) * bb;
            wide32 w = small_wide(blk, type);  /* once for every activation row */
            float d = small_scale(blk, type);
            for (int i = 0; i < m; i++) acc[i][j] = small_term(acc[i][j], w, d, &act[i], b + j);
        }
    for (; b < nblocks; b++) {
        const uint8_t *blk = row + b * bb;
        wide32 w = small_wide(blk, type);
        float d = small_scale(blk, type);
        for (int i = 0; i < m; i++) acc[i][0] = small_term(acc[i][0], w, d, &act[i], b);
    }
    for (int i = 0; i < m; i++) out[i] = vf_sum(vf_add(vf_add(acc[i][0], acc[i][1]), vf_add(acc[i][2], acc[i][3])));
}
#endif


/* out[i] = row . activation row i, for one row of blocks; every m sums in the same order. */
ALWAYS_INLINE void row_dots(const uint8_t *row, int type, int64_t k, int m, const Act *act, float *out) {
    if (small_type(type)) {
        small_row_dots(row, type, k, m, act, out);
        return;
    }
    vf acc[MAX_M];
    float offset[MAX_M];
    for (int i = 0; i < m; i++) acc[i] = vf_zero(), offset[i] = 0.f;
    int64_t bytes = type == BLOCK_Q6_K ? Q6_K_BYTES : Q5_K_BYTES;
    for (int64_t b = 0; b < k / 256; b++) {
        Superblock sb;
        superblock(row + b * bytes, type, &sb);
        for (int c = 0; c < 8; c++) {
            int64_t g = b * 8 + c;  /* 32-weight group */
            wide32 w = widen(sb.q[c]);
#if EDGELLM_AVX512
            /* the chunk's two scales as one vector for every activation row: fma_dot_wide's test of
               s0 == s1 per row and chunk mispredicted on Q6_K's scales (Gemma's 8-row pieces 5.1 ->
               4.4 ms); the same products, lane by lane */
            __m512 sw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sb.s0[c]), _mm512_set1_ps(sb.s1[c]));
            for (int i = 0; i < m; i++)
                acc[i] = fma_dot_scaled(acc[i], w, &act[i], g * 32, _mm512_mul_ps(sw, _mm512_set1_ps(act[i].dx[g])));
#else
            for (int i = 0; i < m; i++)
                acc[i] = fma_dot_wide(acc[i], w, &act[i], g * 32, sb.s0[c] * act[i].dx[g], sb.s1[c] * act[i].dx[g]);
#endif
            if (type != BLOCK_Q6_K)  /* Q6_K has no offsets */
                for (int i = 0; i < m; i++) offset[i] += sb.off[c] * act[i].sum[g];
        }
    }
    for (int i = 0; i < m; i++) out[i] = vf_sum(acc[i]) - offset[i];
}

typedef struct {
    const Act *act;
    int m;
    int64_t k;
    const uint8_t *blocks;
    const uint16_t *row_scale;
    float *y;
    int64_t ldy;
    const float *const *q6_offsets;  /* AVX-512, Q6_K: each activation row's (q6_offsets) */
} BlockGemv;

ALWAYS_INLINE void gemv_rows(const BlockGemv *a, int type, int64_t r0, int64_t r1) {
    int64_t rb = row_bytes(type, a->k), ahead = (PREFETCH_BYTES + rb - 1) / rb;
    for (int64_t r = r0; r < r1; r++) {
        float out[MAX_M];
        for (int64_t p = 0; p < rb; p += 64) __builtin_prefetch(a->blocks + (r + ahead) * rb + p);
        const uint8_t *row = a->blocks + r * rb;
#if EDGELLM_AVX512 || EDGELLM_AVX2
#define ROW_DOTS(M) (type == BLOCK_Q6_K   ? q6_k_row_dots(row, a->k, M, a->act, a->q6_offsets, out) \
                     : type == BLOCK_Q5_K ? q5_k_row_dots(row, a->k, M, a->act, out)        \
                                          : row_dots(row, type, a->k, M, a->act, out))
#else
#define ROW_DOTS(M) row_dots(row, type, a->k, M, a->act, out)
#endif
        switch (a->m) {  /* a constant m keeps the sums in registers (Gemma's 8-row pieces 5.5 -> 5.1 ms) */
        case 1: ROW_DOTS(1); break;
        case 2: ROW_DOTS(2); break;
        case 4: ROW_DOTS(4); break;
        case 8: ROW_DOTS(8); break;
        default: ROW_DOTS(a->m);
        }
#undef ROW_DOTS
        float scale = a->row_scale ? bf16_to_f32(a->row_scale[r]) : 1.f;
        for (int i = 0; i < a->m; i++) a->y[i * a->ldy + r] = out[i] * scale;
    }
}

/* one function per block type, so each loop is compiled for its format */
#define GEMV_ROWS(T) \
    static void gemv_rows_##T(void *p, int64_t r0, int64_t r1) { gemv_rows(p, BLOCK_##T, r0, r1); }
GEMV_ROWS(I8)
GEMV_ROWS(Q8_0)
GEMV_ROWS(Q5_0)
GEMV_ROWS(Q5_K)
GEMV_ROWS(Q6_K)

#if EDGELLM_AVX512 || EDGELLM_AVX2
int64_t edgellm_block_gemv_work(int m, int64_t k) { return m * (act_bytes(k, 32) + q6_offset_bytes(k)); }
#else
int64_t edgellm_block_gemv_work(int m, int64_t k) { return m * act_bytes(k, 32); }
#endif

/* y[i][0..n) (row i at y + i * ldy) = x[m][k] @ W^T for W given as n rows of GGUF blocks of `type`
   (Q8_0, Q5_0, Q5_K, Q6_K; I8 with its bf16 `row_scale`, else NULL; Q8R16), m <= 8. `work` holds
   edgellm_block_gemv_work(m, k) bytes. */
void edgellm_block_gemv(const float *x, int m, int64_t k, const uint8_t *blocks, int type, int64_t n,
                        const uint16_t *row_scale, float *y, int64_t ldy, void *work, int threads) {
    if (type == BLOCK_Q8R16) {
        edgellm_q8r16_gemv(x, m, k, blocks, n, y, ldy, work, threads);
        return;
    }
    Act act[MAX_M];
    for (int i = 0; i < m; i++) act[i] = quantize_act(x + i * k, k, 32, (uint8_t *)work + i * act_bytes(k, 32));
    BlockGemv a = {act, m, k, blocks, type == BLOCK_I8 ? row_scale : NULL, y, ldy, NULL};
#if EDGELLM_AVX512 || EDGELLM_AVX2
    const float *offsets[MAX_M];
#if EDGELLM_AVX512 || defined(__AVXVNNI__)  /* AVX2 without VNNI: quantize_act has split them already */
    if (type == BLOCK_Q6_K || type == BLOCK_Q5_K)  /* their rows (k_rows.h) read the activations' bytes */
        for (int i = 0; i < m; i++) split_bytes(act[i].q, k, (int8_t *)act[i].hi, (int8_t *)act[i].lo);
#endif
    if (type == BLOCK_Q6_K) {
        for (int i = 0; i < m; i++)
            offsets[i] = q6_offsets(&act[i], k, (float *)((uint8_t *)work + m * act_bytes(k, 32) + i * q6_offset_bytes(k)));
        a.q6_offsets = offsets;
    }
#endif
    PoolRange rows = type == BLOCK_I8    ? gemv_rows_I8
                     : type == BLOCK_Q8_0 ? gemv_rows_Q8_0
                     : type == BLOCK_Q5_0 ? gemv_rows_Q5_0
                     : type == BLOCK_Q5_K ? gemv_rows_Q5_K
                                          : gemv_rows_Q6_K;
    pool_for(n, threads, rows, &a);
}

/* dst: nblocks Q8_0 blocks holding exactly the weights of src's Q5_0 blocks (q - 16 fits int8):
   where the fifth bits cost more to unpack than the wider blocks cost to read (quant/blocks.py). */
void edgellm_q5_0_to_q8_0(const uint8_t *src, int64_t nblocks, uint8_t *dst) {
    for (int64_t b = 0; b < nblocks; b++) {
        memcpy(dst + b * 34, src + b * 22, 2);
        w32_store((int8_t *)(dst + b * 34 + 2), small_block(src + b * 22, BLOCK_Q5_0));
    }
}

/* 32 weights w * s0 (first 16) / s1 (last 16) - offset, stored as `dtype` at dst. */
static inline void store_chunk(w32 w, float s0, float s1, float offset, void *dst, int64_t at, int dtype) {
    int8_t q[32];
    w32_store(q, w);
    for (int j = 0; j < 32; j += VL)
        vf_store_as(dst, at + j, vf_sub(vf_mul(vf_load_i8(q + j), vf_set1(j < 16 ? s0 : s1)), vf_set1(offset)), dtype);
}

ALWAYS_INLINE void row_to_float(const uint8_t *row, int type, int64_t k, float row_scale, void *out, int64_t at, int dtype) {
    if (small_type(type)) {
        int64_t bb = small_bytes(type);
        for (int64_t b = 0; b < k / 32; b++) {
            float d = type == BLOCK_I8 ? row_scale : half_at(row + b * bb);
            store_chunk(small_block(row + b * bb, type), d, d, 0.f, out, at + b * 32, dtype);
        }
        return;
    }
    int64_t bytes = type == BLOCK_Q6_K ? Q6_K_BYTES : Q5_K_BYTES;
    for (int64_t b = 0; b < k / 256; b++) {
        Superblock sb;
        superblock(row + b * bytes, type, &sb);
        for (int c = 0; c < 8; c++) store_chunk(sb.q[c], sb.s0[c], sb.s1[c], sb.off[c], out, at + b * 256 + c * 32, dtype);
    }
}

typedef struct {
    const uint8_t *blocks;
    int type;
    int64_t k;
    const uint16_t *row_scale;
    void *out;
    int dtype;
} ToFloat;

static void rows_to_float(void *p, int64_t r0, int64_t r1) {
    const ToFloat *a = p;
    int64_t rb = row_bytes(a->type, a->k);
    for (int64_t r = r0; r < r1; r++)
        row_to_float(a->blocks + r * rb, a->type, a->k, a->row_scale ? bf16_to_f32(a->row_scale[r]) : 1.f, a->out,
                     r * a->k, a->dtype);
}

/* out (n, k) = the dequantized weight as bf16 (dtype 1) or fp32 (dtype 0), for a prompt's GEMM. */
void edgellm_blocks_to_float(const uint8_t *blocks, int type, int64_t n, int64_t k, const uint16_t *row_scale,
                             void *out, int dtype, int threads) {
    if (type == BLOCK_Q8R16) {  /* n rows from a group boundary */
        edgellm_q8r16_to_float(blocks, n, k, out, dtype, threads);
        return;
    }
    ToFloat a = {blocks, type, k, row_scale, out, dtype};
    team_for(n, threads, rows_to_float, &a);
}
