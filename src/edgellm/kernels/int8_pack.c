/* The int8 prompt GEMM's weight panels (int8_layout.h): a weight's rows packed per call, unchanged, into
   strips of 16 rows, a group at a time: 8 steps of 4 k's, each 16 words of 4 codes (row r's q[k .. k + 3]),
   then the strip's 16 scales and 16 zeros of the group (Q6_K: of each half). From I4R64 codes, Q8R16 blocks
   holding Q5_0 values, or a GGUF file's Q6_K rows. */
#include "int8_layout.h"
#include "k_scales.h"

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

/* Group s (16 rows) of Q8R16 blocks, block g: codes q + bias, scales, zeros -bias * d. Bias 16 for blocks
   holding Q5_0 values (-16..15: codes 0..31), 128 for a real Q8_0's (codes 0..255, byte-code builds only). */
static void pack_q8r16_group(const uint8_t *rows, int64_t k, int64_t s, int64_t g, int bias_value, uint8_t *codes,
                             float *sz) {
    const uint8_t *block = rows + (s * (k / 32) + g) * 544;  /* q8r16.c: 16 fp16 d, then 16 k-pairs x 16 rows */
    const b16 bias = b16_set1((uint8_t)bias_value);  /* added modulo 256: -128..127 + 128 is 0..255 */
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
        sz[I8_STRIP + j] = -(float)bias_value * sz[j];
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

/* Strip s (16 rows) of a GGUF file's Q5_K rows (k / 256 blocks of 176 bytes: block_gemv.c), group g: sub-block
   c = g % 8 of its block, codes 0..31 (the low or high nibbles of qs[32 (c / 2) ..], bit c of each qh byte the
   fifth bit), scale d * sc and zero -dmin * m from the block's 6-bit pair. */
static void pack_q5_k_group(const uint8_t *rows, int64_t k, int64_t s, int64_t g, uint8_t *codes, float *sz) {
    int64_t row_size = k / 256 * 176;
    int c = (int)(g % 8), sc, mn;
    uint32_t words[I8_STRIP][8];  /* row j's 32 codes, 4 to a word */
    const b16 low4 = b16_set1(0x0F), low1 = b16_set1(0x01);
    for (int j = 0; j < I8_STRIP; j++) {
        const uint8_t *blk = rows + (s * I8_STRIP + j) * row_size + (g / 8) * 176;
        for (int h = 0; h < 32; h += 16) {
            b16 lo = b16_shr_and(b16_load(blk + 48 + 32 * (c / 2) + h), 4 * (c & 1), low4);
            b16 hi = b16_shr_and(b16_load(blk + 16 + h), c, low1);
            b16_store((uint8_t *)words[j] + h, b16_or(lo, b16_shl4(hi)));  /* masked first: no bit crosses */
        }
        k_scale_min(blk + 4, c, &sc, &mn);
        sz[j] = f16_to_f32((uint16_t)(blk[0] | blk[1] << 8)) * (float)sc;
        sz[I8_STRIP + j] = -f16_to_f32((uint16_t)(blk[2] | blk[3] << 8)) * (float)mn;
    }
    for (int p = 0; p < 8; p++)  /* step p: word p of each row */
        for (int j = 0; j < I8_STRIP; j++) memcpy(codes + p * STEP_BYTES + 4 * j, &words[j][p], 4);
}
#endif

/* Bytes of a packed (n, k) weight. */
int64_t edgellm_int8_panel_bytes(int64_t n, int64_t k) { return (n / I8_STRIP) * (k / I8_GROUP) * GROUP_STRIDE; }

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
            pack_q8r16_group(a->src, a->k, s, g, 16, codes, sz);
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

/* Pack strip s (rows 16 s .. 16 s + 15) of a whole weight as its model holds it into `out`
   ((k / 32) * GROUP_STRIDE bytes), in one of the forms of int8_layout.h: I4R64 codes with scale_zero (one
   plane, groups of 32), Q8R16 blocks holding Q5_0 values or a real Q8_0's (where the build takes byte codes:
   edgellm_int8_gemm_takes), Q6_K or Q5_K rows. For GEMMs that pack each strip just before they use it
   (int8_gemm.c edgellm_int8_gemm_weight), so the strip is still in the core's cache. */
void edgellm_int8_pack_strip(const uint8_t *src, const uint16_t *scale_zero, int64_t n, int64_t k, int64_t s,
                             int form, uint8_t *out) {
#ifdef I8_NATIVE
    for (int64_t g = 0; g < k / I8_GROUP; g++) {
        uint8_t *codes = out + g * GROUP_STRIDE;
        float *sz = (float *)(codes + GROUP_BYTES);
        if (form == I8_FORM_I4R64)
            pack_i4r64_group(src, scale_zero, n, k, s * I8_STRIP, g, codes, sz);
        else if (form == I8_FORM_Q6_K)
            pack_q6_k_group(src, k, s, g, codes, sz);
        else if (form == I8_FORM_Q5_K)
            pack_q5_k_group(src, k, s, g, codes, sz);
        else
            pack_q8r16_group(src, k, s, g, form == I8_FORM_Q8_0_R16 ? 128 : 16, codes, sz);
    }
#else
    (void)src, (void)scale_zero, (void)n, (void)k, (void)s, (void)form, (void)out;
#endif
}
