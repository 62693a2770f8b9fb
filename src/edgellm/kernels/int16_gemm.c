/* Prompt GEMMs in integers for CPUs with AVX-VNNI but no native bf16 (Intel client cores since
   Alder Lake; the `avx2` variant built with -mavxvnni): `vpdpwssd` makes 16 int16 products per
   instruction where an fp32 FMA makes 8, so these run ~1.7x PyTorch's fp32 GEMM at the same width.

   Both operands are quantized per group of 64 along K, symmetrically:
     weights      qw = round(w / sw),  sw = max |w| / W_MAX   (W_MAX = 1023: 11 bits)
     activations  qx = round(x / sx),  sx = max |x| / ACT_MAX (int16, as in the decode GEMVs)
     y[t][n] = sum_g sw[n][g] * sx[t][g] * sum_{k in g} qw[n][k] * qx[t][k]
   64 * 1023 * 32639 < 2^31, so every group's sum is exact in int32. The weights were 4-8 bit
   GGUF/edgellm blocks, dequantized to fp32 just before (dequant.c, block_gemv.c): requantizing
   them to 11 bits adds an error of at most max|w| / 2046 per weight, ~1/70 of a 4-bit step
   (bf16 weights, what the AVX-512 path multiplies, round at 1/256 of each value).

   The weight is packed per call into strips of 16 rows: for each pair of k's, 16 int32 lanes
   holding (qw[n][k], qw[n][k + 1]), which is what vpdpwssd multiplies against one broadcast
   activation pair. A tile is 16 rows x up to 6 tokens: 12 accumulators. */
#include "intdot.h"

#define IG_STRIP 16
#define IG_GROUP 64
#define IG_TILE 6
#define W_MAX 1023

#if EDGELLM_AVX2 && defined(__AVXVNNI__)
#define IG_NATIVE 1

/* Lanes (q0[j] & 0xFFFF) | (q1[j] << 16): the pair (k, k + 1) of 8 rows. */
static inline __m256i pairs8(__m256 w0, __m256 w1, __m256 inv) {
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(w0, inv)), b = _mm256_cvtps_epi32(_mm256_mul_ps(w1, inv));
    return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(b, 16));
}

static inline __m256 scale_of(__m256 amax, float *out) {
    __m256 nonzero = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
    _mm256_storeu_ps(out, _mm256_blendv_ps(_mm256_set1_ps(1.f), _mm256_div_ps(amax, _mm256_set1_ps(W_MAX)), nonzero));
    return _mm256_and_ps(nonzero, _mm256_div_ps(_mm256_set1_ps(W_MAX), amax));
}

/* Strip s, group g of a weight stored transposed: row k of Wt holds every n (int4_unpack's output). */
static void pack_group_cols(const float *wt, int64_t ldw, int64_t s, int64_t g, int32_t *panel, float *scales) {
    const float *w = wt + g * IG_GROUP * ldw + s * IG_STRIP;
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    for (int j = 0; j < IG_GROUP; j++) {
        m0 = _mm256_max_ps(m0, vf_abs(_mm256_loadu_ps(w + j * ldw)));
        m1 = _mm256_max_ps(m1, vf_abs(_mm256_loadu_ps(w + j * ldw + 8)));
    }
    __m256 inv0 = scale_of(m0, scales), inv1 = scale_of(m1, scales + 8);
    for (int j = 0; j < IG_GROUP; j += 2) {
        const float *r0 = w + j * ldw, *r1 = r0 + ldw;
        _mm256_storeu_si256((__m256i *)(panel + (j / 2) * IG_STRIP), pairs8(_mm256_loadu_ps(r0), _mm256_loadu_ps(r1), inv0));
        _mm256_storeu_si256((__m256i *)(panel + (j / 2) * IG_STRIP + 8),
                            pairs8(_mm256_loadu_ps(r0 + 8), _mm256_loadu_ps(r1 + 8), inv1));
    }
}

/* In-register transpose of 8x8 int32. */
static inline void transpose8(__m256i v[8]) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_castsi256_ps(v[i]);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            r[i + j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0x44);
            r[i + j + 2] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0xEE);
        }
    /* r[0..3] hold columns 0, 2, 1, 3 of rows 0-3 (per 128-bit lane), r[4..7] of rows 4-7 */
    const int order[4] = {0, 2, 1, 3};
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_castps_si256(_mm256_permute2f128_ps(r[order[j]], r[4 + order[j]], 0x20));
        v[j + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(r[order[j]], r[4 + order[j]], 0x31));
    }
}

/* Strip s, group g of a weight stored by rows (blocks_to_float's output), 8 rows at a time. */
static void pack_group_rows(const float *w, int64_t ldw, int64_t s, int64_t g, int32_t *panel, float *scales) {
    for (int h = 0; h < IG_STRIP; h += 8) {
        const float *rows = w + (s * IG_STRIP + h) * ldw + g * IG_GROUP;
        float amax[8] __attribute__((aligned(32)));
        for (int r = 0; r < 8; r++) {
            __m256 m = _mm256_setzero_ps();
            for (int j = 0; j < IG_GROUP; j += 8) m = _mm256_max_ps(m, vf_abs(_mm256_loadu_ps(rows + r * ldw + j)));
            amax[r] = vf_hmax(m);
        }
        float inv[8] __attribute__((aligned(32)));
        _mm256_store_ps(inv, scale_of(_mm256_load_ps(amax), scales + h));
        for (int c = 0; c < IG_GROUP; c += 16) {  /* 8 pairs of k per row */
            __m256i v[8];
            for (int r = 0; r < 8; r++) {
                __m256 iv = _mm256_set1_ps(inv[r]);
                __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(rows + r * ldw + c), iv));
                __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(rows + r * ldw + c + 8), iv));
                v[r] = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  /* 16 int16 in k order */
            }
            transpose8(v);
            for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(panel + (c / 2 + j) * IG_STRIP + h), v[j]);
        }
    }
}

/* out[t][0..16) for tt <= IG_TILE tokens of one strip, their activations quantized (intdot.h). */
ALWAYS_INLINE void tile(const int32_t *panel, const float *sw, const Act *act, int64_t k, float *out, int64_t ldo,
                        int tt) {
    int64_t groups = k / IG_GROUP;
    __m256 acc[IG_TILE][2];
    for (int i = 0; i < tt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int32_t *w = panel + g * (IG_GROUP / 2) * IG_STRIP;
        __m256i dot[IG_TILE][2];
        for (int i = 0; i < tt; i++) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
        for (int p = 0; p < IG_GROUP / 2; p++) {
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + p * IG_STRIP));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + p * IG_STRIP + 8));
            for (int i = 0; i < tt; i++) {
                int32_t pair;  /* activations k, k + 1 */
                memcpy(&pair, act[i].q + g * IG_GROUP + 2 * p, 4);
                __m256i xp = _mm256_set1_epi32(pair);
                dot[i][0] = madd_acc(dot[i][0], w0, xp);
                dot[i][1] = madd_acc(dot[i][1], w1, xp);
            }
        }
        __m256 s0 = _mm256_loadu_ps(sw + g * IG_STRIP), s1 = _mm256_loadu_ps(sw + g * IG_STRIP + 8);
        for (int i = 0; i < tt; i++) {
            __m256 d = _mm256_set1_ps(act[i].dx[g]);
            acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][0]), _mm256_mul_ps(s0, d), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][1]), _mm256_mul_ps(s1, d), acc[i][1]);
        }
    }
    for (int i = 0; i < tt; i++) {
        _mm256_storeu_ps(out + i * ldo, acc[i][0]);
        _mm256_storeu_ps(out + i * ldo + 8, acc[i][1]);
    }
}

/* one instance per token count, so that the accumulators stay in registers */
static void tile_any(const int32_t *panel, const float *sw, const Act *act, int64_t k, float *out, int64_t ldo,
                     int tt) {
    switch (tt) {
    case 6: tile(panel, sw, act, k, out, ldo, 6); break;
    case 5: tile(panel, sw, act, k, out, ldo, 5); break;
    case 4: tile(panel, sw, act, k, out, ldo, 4); break;
    case 3: tile(panel, sw, act, k, out, ldo, 3); break;
    case 2: tile(panel, sw, act, k, out, ldo, 2); break;
    default: tile(panel, sw, act, k, out, ldo, 1); break;
    }
}
#endif

/* Whether this build has the integer prompt GEMM. */
int edgellm_int16_gemm_native(void) {
#ifdef IG_NATIVE
    return 1;
#else
    return 0;
#endif
}

/* Bytes of the packed form of an (n, k) weight, and of the work space for t tokens. */
int64_t edgellm_int16_gemm_panel_bytes(int64_t n, int64_t k) { return n * k * 2 + n * (k / IG_GROUP) * 4; }
int64_t edgellm_int16_gemm_work_bytes(int64_t t, int64_t k) { return t * (act_bytes(k, IG_GROUP) + (int64_t)sizeof(Act)); }

#ifdef IG_NATIVE
typedef struct {
    const float *w;
    int64_t row_stride, col_stride, k, groups;
    int32_t *q;
    float *scales;
} Int16Pack;

/* Jobs [j0, j1) of (strip, group). */
static void pack_groups(void *p, int64_t j0, int64_t j1) {
    const Int16Pack *a = p;
    for (int64_t job = j0; job < j1; job++) {
        int64_t s = job / a->groups, g = job % a->groups;
        int32_t *dst = a->q + (s * (a->k / 2) + g * (IG_GROUP / 2)) * IG_STRIP;
        float *sw = a->scales + job * IG_STRIP;
        if (a->col_stride == 1)
            pack_group_rows(a->w, a->row_stride, s, g, dst, sw);
        else
            pack_group_cols(a->w, a->col_stride, s, g, dst, sw);
    }
}

typedef struct {
    const float *x;
    int64_t t, k, groups, tiles;
    const int32_t *q;
    const float *scales;
    Act *act;
    uint8_t *rows;
    float *out;
    int64_t ldo;
} Int16Gemm;

/* Tokens [i0, i1): their quantized rows. */
static void quantize_tokens(void *p, int64_t i0, int64_t i1) {
    const Int16Gemm *a = p;
    for (int64_t i = i0; i < i1; i++)
        a->act[i] = quantize_act(a->x + i * a->k, a->k, IG_GROUP, a->rows + i * act_bytes(a->k, IG_GROUP));
}

/* Jobs [j0, j1) of (strip, tile of tokens). */
static void gemm_tiles(void *p, int64_t j0, int64_t j1) {
    const Int16Gemm *a = p;
    for (int64_t job = j0; job < j1; job++) {
        int64_t s = job / a->tiles, t0 = job % a->tiles * IG_TILE;
        tile_any(a->q + s * (a->k / 2) * IG_STRIP, a->scales + s * a->groups * IG_STRIP, a->act + t0, a->k,
                 a->out + t0 * a->ldo + s * IG_STRIP, a->ldo, (int)(a->t - t0 < IG_TILE ? a->t - t0 : IG_TILE));
    }
}
#endif

/* Pack n rows of a float weight: element (row i, column j) at w[i * row_stride + j * col_stride],
   one of the strides 1 (by rows, or transposed). n % 16 == 0, k % 64 == 0. */
void edgellm_int16_gemm_pack(const float *w, int64_t row_stride, int64_t col_stride, int64_t n, int64_t k, void *panel,
                             int threads) {
#ifdef IG_NATIVE
    int32_t *q = (int32_t *)panel;
    Int16Pack a = {w, row_stride, col_stride, k, k / IG_GROUP, q, (float *)(q + n * k / 2)};
    team_for(n / IG_STRIP * a.groups, threads, pack_groups, &a);
#else
    (void)w, (void)row_stride, (void)col_stride, (void)n, (void)k, (void)panel, (void)threads;
#endif
}

/* out (t, n), row stride ldo, = x (t, k) fp32 times the packed (n, k) weight, transposed. */
void edgellm_int16_gemm(const float *x, int64_t t, int64_t k, const void *panel, int64_t n, float *out, int64_t ldo,
                        void *work, int threads) {
#ifdef IG_NATIVE
    const int32_t *q = (const int32_t *)panel;
    Act *act = (Act *)work;  /* then each token's quantized row */
    Int16Gemm a = {x, t, k, k / IG_GROUP, (t + IG_TILE - 1) / IG_TILE, q, (const float *)(q + n * k / 2), act,
                   (uint8_t *)(act + t), out, ldo};
    team_for(t, threads, quantize_tokens, &a);
    team_for(n / IG_STRIP * a.tiles, threads, gemm_tiles, &a);
#else
    (void)x, (void)t, (void)k, (void)panel, (void)n, (void)out, (void)ldo, (void)work, (void)threads;
#endif
}
