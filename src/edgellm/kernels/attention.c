/* Attention for a prompt chunk: T new queries over S cached keys. Scores and softmax in fp32;
   P.V in bf16 where the CPU has AVX512-BF16 at full rate and the chunk has BF16_VALUE_QUERIES or
   more (else fp32).

   PyTorch's flash kernel runs ~80-100 GFLOP/s here on these head sizes, and a ring cache's
   boolean mask doubles its work; this kernel vectorizes across keys instead of within a dot
   product. Keys are first transposed per KV head into Kt, blocks of KEY_BLOCK keys (D, KEY_BLOCK),
   so 2 VL scores come from D pairs of broadcast-FMAs; then a softmax with a polynomial exp; then
   P.V accumulates rows of V.

   Each work item is one KV head, its group of query heads and a few query positions, so the
   rows of a block share every Kt and V load (grouped-query attention for free).
   Visibility: mask == NULL means causal with the queries at the last T of the S positions
   (query t sees keys 0 .. S - T + t), and with window > 0 only the last `window` of those
   (a sliding-window layer: the keys are in position order); otherwise mask is a (T, S) byte
   array, 1 = visible. A block computes only the keys some row of it sees: [first, len).
   softcap > 0 (Gemma 2) caps each scaled score: s -> softcap tanh(s / softcap), with
   tanh(x) = 2 sigmoid(2x) - 1. */
#include <stdatomic.h>

#include "simd.h"

#define ROWS 8 /* query rows per block */
/* From this many queries on P.V may run in bf16: where the linears take the prompt GEMM
   (quant/linear.py UNPACK_ROWS). Fewer (a cached prompt's last tokens, a short chunk) run in fp32
   as the decode layers do, so a prompt's logits hardly depend on whether its prefix was cached,
   and V is not converted for a handful of queries. */
#define BF16_VALUE_QUERIES 32

/* Query rows per pass of the score and value loops, whose accumulators (2 vectors a row) must stay
   in registers: AVX2 has 16 (2 x 6 + the loads), the others 32. Each pass is compiled for its
   constant row count (FOR_ROWS): with a count known only at run time the accumulators lived on the
   stack and attention ran 1.5-2x slower. */
#if EDGELLM_AVX2
#define PASS_ROWS 6
#else
#define PASS_ROWS 8
#endif
#define KEY_BLOCK (2 * VL)  /* keys per block of Kt */
#define S_ALIGN 32          /* s_pad: a multiple of every variant's KEY_BLOCK */

/* P.V in bf16 (vdpbf16ps) where that is faster than fp32 FMAs: Zen 4 runs it at the FMA's rate,
   twice the multiply-adds; Intel's cores with AMX (build.py defines EDGELLM_HALF_RATE_BF16_DOT)
   run one every 2 cycles against 2 FMAs a cycle (measured on 2 cores of a Sapphire Rapids Xeon: 1.64 against
   6.6 per ns), where bf16 P.V made attention 12-17 % slower than fp32. */
#if defined(__AVX512BF16__) && !defined(EDGELLM_HALF_RATE_BF16_DOT)
#define VALUE_PAIRS 1
#else
#define VALUE_PAIRS 0
#endif

/* Rows of each pass: the block's rows split evenly (8 on AVX2 go 4 + 4: a 2-row pass after 6 would
   wait on FMA latency). */
static inline int pass_rows(int rows) {
    int passes = (rows + PASS_ROWS - 1) / PASS_ROWS;
    return (rows + passes - 1) / passes;
}

/* CALL(n) with the constant n equal to rows (1 .. PASS_ROWS). */
#if PASS_ROWS > 6
#define ROWS_7_8(CALL) case 7: CALL(7); break; default: CALL(8); break;
#else
#define ROWS_7_8(CALL) default: CALL(6); break;
#endif
#define FOR_ROWS(rows, CALL)                                          \
    switch (rows) {                                                   \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; \
    ROWS_7_8(CALL)                                                    \
    }

/* A block's `rows` in passes of pass_rows(rows): CALL(n) for each, with the pass's first row in i0. */
#define BY_PASSES(rows, CALL)                                                           \
    for (int i0 = 0, per_ = pass_rows(rows); i0 < (rows); i0 += per_) {                 \
        int n_ = (rows) - i0 < per_ ? (rows) - i0 : per_;                               \
        FOR_ROWS(n_, CALL)                                                              \
    }

typedef struct {
    const float *q; int64_t q_t, q_h;          /* q[t * q_t + h * q_h + d] */
    const float *k, *v; int64_t kv_h, kv_s;    /* k[h * kv_h + s * kv_s + d] */
    int64_t T, S, H, Hkv, D, s_pad, window;
    float scale, softcap;
    const uint8_t *mask;
    float *out;                                /* (T, H, D) */
    const float *kt;                           /* (Hkv, s_pad / KEY_BLOCK, D, KEY_BLOCK) */
    const uint32_t *vp;                        /* bf16 V pairs (Hkv, s_pad / 2, D), with AVX512-BF16 */
} Problem;

/* The keys query t sees with a mask-free (causal) problem: [lo, hi). */
static inline int64_t causal_end(const Problem *p, int64_t t) { return p->S - p->T + t + 1; }
static inline int64_t causal_start(const Problem *p, int64_t t) {
    int64_t lo = p->window > 0 ? causal_end(p, t) - p->window : 0;
    return lo > 0 ? lo : 0;
}

static inline vf finish_score(const Problem *p, vf acc) {
    vf s = vf_mul(acc, vf_set1(p->scale));
    if (p->softcap > 0.f) {
        vf tanh = vf_fma(vf_set1(2.f), vf_sigmoid(vf_mul(s, vf_set1(2.f / p->softcap))), vf_set1(-1.f));
        s = vf_mul(vf_set1(p->softcap), tanh);
    }
    return s;
}

/* `rows` query rows against `vecs` vectors of keys of a Kt block from `block` (both constants in
   each instance), stored at sc: every broadcast query element feeds `vecs` FMAs. */
ALWAYS_INLINE void score_keys(const Problem *p, const float *block, int rows, int vecs, const float *const *qrow,
                              float *sc) {
    vf acc[PASS_ROWS][2];
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < vecs; c++) acc[i][c] = vf_zero();
    for (int64_t d = 0; d < p->D; d++) {
        vf key[2];
        for (int c = 0; c < vecs; c++) key[c] = vf_load(block + d * KEY_BLOCK + c * VL);
        for (int i = 0; i < rows; i++) {
            vf x = vf_set1(qrow[i][d]);
            for (int c = 0; c < vecs; c++) acc[i][c] = vf_fma(x, key[c], acc[i][c]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < vecs; c++) vf_store(sc + i * p->s_pad + c * VL, finish_score(p, acc[i][c]));
}

/* One pass: `rows` (a constant in each instance) query rows against the keys [first, end) of one
   KV head's Kt, a whole block of 2 VL keys at a time where one fits, else VL keys (a window's
   first keys, or the last ones). */
ALWAYS_INLINE void score_pass(const Problem *p, const float *kt, int rows, const float *const *qrow, int64_t first,
                              int64_t end, float *sc) {
    for (int64_t j = first; j < end;) {
        const float *block = kt + (j / KEY_BLOCK) * KEY_BLOCK * p->D + j % KEY_BLOCK;
        int whole = j % KEY_BLOCK == 0 && j + KEY_BLOCK <= end;
        if (whole) score_keys(p, block, rows, 2, qrow, sc + j);
        else score_keys(p, block, rows, 1, qrow, sc + j);
        j += whole ? KEY_BLOCK : VL;
    }
}

/* Scores of `rows` query rows (heads h[i], positions t[i]) against keys [first, len), scaled;
   first is a multiple of 16 (Kt's vectors are padded to 16 keys). */
static void scores(const Problem *p, int64_t hk, int rows, const int64_t *h, const int64_t *t, int64_t first,
                   int64_t len, float *sc) {
    const float *kt = p->kt + hk * p->D * p->s_pad;
    const float *qrow[ROWS];
    for (int i = 0; i < rows; i++) qrow[i] = p->q + t[i] * p->q_t + h[i] * p->q_h;
    int64_t end = (len + 15) / 16 * 16;
#define SCORE_PASS(N) score_pass(p, kt, N, qrow + i0, first, end, sc + i0 * p->s_pad)
    BY_PASSES(rows, SCORE_PASS)
#undef SCORE_PASS
}

/* In place: scores -> unnormalized probabilities over [first, len) (zero up to the next 16);
   returns 1 / sum per row. */
static void softmax_rows(const Problem *p, int rows, const int64_t *t, int64_t first, int64_t len, float *sc,
                         float *inv_sum) {
    int64_t end = (len + 15) / 16 * 16;
    for (int i = 0; i < rows; i++) {
        float *s = sc + i * p->s_pad;
        int64_t lo = p->mask ? first : causal_start(p, t[i]), hi = p->mask ? len : causal_end(p, t[i]);
        for (int64_t j = first; j < lo; j++) s[j] = -INFINITY;
        for (int64_t j = hi; j < end; j++) s[j] = -INFINITY;
        if (p->mask) {
            const uint8_t *m = p->mask + t[i] * p->S;
            for (int64_t j = 0; j < len; j++) if (!m[j]) s[j] = -INFINITY;
        }
        vf mx = vf_set1(-INFINITY);
        for (int64_t j = first; j < end; j += VL) mx = vf_max(mx, vf_load(s + j));
        float m = vf_hmax(mx);
        if (m == -INFINITY) m = 0.f;
        vf sum = vf_zero();
        for (int64_t j = first; j < end; j += VL) {
            vf x = vf_sub(vf_load(s + j), vf_set1(m));
            vf e = vf_zero_below(x, vf_exp(x), -80.f);  /* masked keys: exactly 0 */
            vf_store(s + j, e);
            sum = vf_add(sum, e);
        }
        float total = vf_sum(sum);
        inv_sum[i] = total > 0.f ? 1.f / total : 0.f;
    }
}

/* Rows of the output for columns d0 .. d0 + 2 VL of D: the accumulated P.V times 1 / sum. */
static inline void store_rows(const Problem *p, int rows, const int64_t *h, const int64_t *t, int64_t d0,
                              vf acc[][2], const float *inv_sum) {
    for (int i = 0; i < rows; i++) {
        float *o = p->out + (t[i] * p->H + h[i]) * p->D + d0;
        vf_store(o, vf_mul(acc[i][0], vf_set1(inv_sum[i])));
        vf_store(o + VL, vf_mul(acc[i][1], vf_set1(inv_sum[i])));
    }
}

/* One pass of P . V in fp32, 2 VL columns of D at a time; `rows` a constant in each instance. */
ALWAYS_INLINE void value_pass(const Problem *p, const float *v, int rows, const int64_t *h, const int64_t *t,
                              int64_t first, int64_t len, const float *sc, const float *inv_sum) {
    for (int64_t d0 = 0; d0 < p->D; d0 += 2 * VL) {
        vf acc[PASS_ROWS][2];
        for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = vf_zero();
        for (int64_t j = first; j < len; j++) {
            vf v0 = vf_load(v + j * p->kv_s + d0), v1 = vf_load(v + j * p->kv_s + d0 + VL);
            for (int i = 0; i < rows; i++) {
                vf pij = vf_set1(sc[i * p->s_pad + j]);
                acc[i][0] = vf_fma(pij, v0, acc[i][0]);
                acc[i][1] = vf_fma(pij, v1, acc[i][1]);
            }
        }
        store_rows(p, rows, h, t, d0, acc, inv_sum);
    }
}

static void weighted_values(const Problem *p, int64_t hk, int rows, const int64_t *h, const int64_t *t,
                            int64_t first, int64_t len, const float *sc, const float *inv_sum) {
    const float *v = p->v + hk * p->kv_h;
#define VALUE_PASS(N) value_pass(p, v, N, h + i0, t + i0, first, len, sc + i0 * p->s_pad, inv_sum + i0)
    BY_PASSES(rows, VALUE_PASS)
#undef VALUE_PASS
}

#if VALUE_PAIRS
/* One pass of P . V with vdpbf16ps, 32 columns of D at a time; `rows` a constant in each instance. */
ALWAYS_INLINE void value_pass_bf16(const Problem *p, const uint32_t *vp, int rows, const int64_t *h, const int64_t *t,
                                   int64_t first, int64_t len, const uint16_t *pb, const float *inv_sum) {
    int64_t pairs = (len + 1) / 2;
    for (int64_t d0 = 0; d0 < p->D; d0 += 32) {
        __m512 acc[PASS_ROWS][2];
        for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t jp = first / 2; jp < pairs; jp++) {
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + jp * p->D + d0);
            __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + jp * p->D + d0 + 16);
            for (int i = 0; i < rows; i++) {
                __m512bh pij = (__m512bh)_mm512_set1_epi32(((const int32_t *)(pb + i * p->s_pad))[jp]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], pij, v0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], pij, v1);
            }
        }
        store_rows(p, rows, h, t, d0, acc, inv_sum);
    }
}

/* P . V with vdpbf16ps: probabilities and V rounded to bf16 (relative error ~2^-9, like the bf16
   activations of every linear). Scores stay fp32: their errors would be exponentiated. vp holds V
   as pairs of keys: element (j/2, d) = (V[j][d], V[j+1][d]). */
static void weighted_values_bf16(const Problem *p, int64_t hk, int rows, const int64_t *h, const int64_t *t,
                                 int64_t first, int64_t len, const float *sc, const float *inv_sum, uint16_t *pb) {
    int64_t pairs = (len + 1) / 2, row_len = pairs * 2;
    for (int i = 0; i < rows; i++)  /* probabilities as bf16, zero past len (the pad key's weight) */
        for (int64_t j = first; j < row_len; j += 16) {
            __m512 x = _mm512_maskz_loadu_ps(j + 16 <= len ? 0xFFFF : (__mmask16)((1u << (len - j > 0 ? len - j : 0)) - 1),
                                             sc + i * p->s_pad + j);
            _mm256_storeu_si256((__m256i *)(pb + i * p->s_pad + j), (__m256i)_mm512_cvtneps_pbh(x));
        }
    const uint32_t *vp = p->vp + hk * (p->s_pad / 2) * p->D;
#define VALUE_PASS(N) value_pass_bf16(p, vp, N, h + i0, t + i0, first, len, pb + i0 * p->s_pad, inv_sum + i0)
    BY_PASSES(rows, VALUE_PASS)
#undef VALUE_PASS
}

typedef struct {
    const float *v;
    int64_t kv_h, kv_s, S, D, s_pad;
    uint32_t *vp;
} ValuePairs;

/* Jobs [j0, j1) of (KV head, key pair). */
static void pack_pairs(void *p, int64_t j0, int64_t j1) {
    const ValuePairs *a = p;
    int64_t pairs = a->s_pad / 2, D = a->D;
    for (int64_t job = j0; job < j1; job++) {
        int64_t hk = job / pairs, jp = job % pairs, j = 2 * jp;
        const float *v = a->v + hk * a->kv_h;
        for (int64_t d = 0; d < D; d += 16) {
            __m512 x = j < a->S ? _mm512_loadu_ps(v + j * a->kv_s + d) : _mm512_setzero_ps();
            __m512 y = j + 1 < a->S ? _mm512_loadu_ps(v + (j + 1) * a->kv_s + d) : _mm512_setzero_ps();
            __m512i x16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
            __m512i y16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(y));
            _mm512_storeu_si512(a->vp + (hk * pairs + jp) * D + d, _mm512_or_si512(x16, _mm512_slli_epi32(y16, 16)));
        }
    }
}

/* V of every KV head as bf16 key pairs (see weighted_values_bf16), zero past S. */
static void pack_value_pairs(const float *v, int64_t kv_h, int64_t kv_s, int64_t S, int64_t Hkv, int64_t D,
                             int64_t s_pad, uint32_t *vp, int threads) {
    ValuePairs a = {v, kv_h, kv_s, S, D, s_pad, vp};
    team_for(Hkv * (s_pad / 2), threads, pack_pairs, &a);
}
#endif

/* Whether P . V of a chunk of T queries runs in bf16 (VALUE_PAIRS above, and T is a prompt's). */
int edgellm_attention_bf16_values(int64_t T) { return VALUE_PAIRS && T >= BF16_VALUE_QUERIES; }

typedef struct {
    const Problem *p;
    float *kt; /* p->kt, writable */
} Transpose;

/* Kt for jobs [j0, j1) of (KV head, KEY_BLOCK keys): zero past S. */
static void transpose_keys(void *arg, int64_t j0, int64_t j1) {
    const Problem *p = ((const Transpose *)arg)->p;
    int64_t blocks = p->s_pad / KEY_BLOCK, D = p->D;
    for (int64_t job = j0; job < j1; job++) {
        int64_t hk = job / blocks, first = job % blocks * KEY_BLOCK;
        float *block = ((const Transpose *)arg)->kt + hk * D * p->s_pad + first * D;
        for (int64_t j = first; j < first + KEY_BLOCK; j++)
            if (j < p->S)
                for (int64_t d = 0; d < D; d++) block[d * KEY_BLOCK + j - first] = p->k[hk * p->kv_h + j * p->kv_s + d];
            else
                for (int64_t d = 0; d < D; d++) block[d * KEY_BLOCK + j - first] = 0.f;
    }
}

/* A call's blocks of up to ROWS query rows: (KV head, chunk of its query heads, chunk of positions). */
typedef struct {
    const Problem *p;
    float *per_thread;
    int64_t group, heads_per_block, head_chunks, t_per_block, t_blocks, items;
    int bf16_values;
    atomic_llong next; /* later query blocks see more keys: threads take blocks as they finish, biggest first */
} Blocks;

static void attend_blocks(void *arg, int thread, int threads) {
    (void)threads;
    Blocks *b = arg;
    const Problem *p = b->p;
    float *sc = b->per_thread + (int64_t)thread * ROWS * p->s_pad * 3 / 2;
    uint16_t *pb = (uint16_t *)(sc + ROWS * p->s_pad); /* bf16 probabilities (AVX512-BF16 path) */
    (void)pb;
    for (int64_t item; (item = atomic_fetch_add_explicit(&b->next, 1, memory_order_relaxed)) < b->items;) {
        int64_t tb = b->items - 1 - item;
        int64_t hk = tb / (b->head_chunks * b->t_blocks), rest = tb % (b->head_chunks * b->t_blocks);
        int64_t hc = rest / b->t_blocks, t0 = (rest % b->t_blocks) * b->t_per_block;
        int64_t h[ROWS], t[ROWS];
        int rows = 0;
        for (int64_t tt = t0; tt < t0 + b->t_per_block && tt < p->T; tt++)
            for (int64_t g = hc * b->heads_per_block; g < (hc + 1) * b->heads_per_block && g < b->group; g++) {
                h[rows] = hk * b->group + g;
                t[rows++] = tt;
            }
        int64_t first = p->mask ? 0 : causal_start(p, t[0]) / 16 * 16, len = p->mask ? p->S : causal_end(p, t[rows - 1]);
        float inv_sum[ROWS];
        scores(p, hk, rows, h, t, first, len, sc);
        softmax_rows(p, rows, t, first, len, sc, inv_sum);
#if VALUE_PAIRS
        if (b->bf16_values) {
            weighted_values_bf16(p, hk, rows, h, t, first, len, sc, inv_sum, pb);
            continue;
        }
#endif
        weighted_values(p, hk, rows, h, t, first, len, sc, inv_sum);
    }
}

/* Floats of `work` the call needs: Kt, then per thread a score block and its bf16 copy, then
   (with AVX512-BF16) the bf16 V pairs. */
int64_t edgellm_attention_work(int64_t S, int64_t Hkv, int64_t D, int threads) {
    int64_t s_pad = (S + S_ALIGN - 1) / S_ALIGN * S_ALIGN;
    return Hkv * D * s_pad + (int64_t)threads * ROWS * s_pad * 3 / 2 + VALUE_PAIRS * Hkv * D * s_pad / 2;
}

/* D % 32 == 0; q, k, v rows contiguous in d. window: 0, or the sliding window (mask == NULL). */
void edgellm_attention(const float *q, int64_t q_t, int64_t q_h, const float *k, const float *v, int64_t kv_h,
                       int64_t kv_s, int64_t T, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale,
                       float softcap, const uint8_t *mask, int64_t window, float *out, float *work, int threads) {
    int64_t s_pad = (S + S_ALIGN - 1) / S_ALIGN * S_ALIGN;
    float *kt = work, *per_thread = work + Hkv * D * s_pad;
    uint32_t *vp = (uint32_t *)(per_thread + (int64_t)threads * ROWS * s_pad * 3 / 2);
    Problem p = {q, q_t, q_h, k, v, kv_h, kv_s, T, S, H, Hkv, D, s_pad, mask ? 0 : window, scale, softcap, mask, out,
                 kt, vp};
    int bf16_values = edgellm_attention_bf16_values(T);
    (void)bf16_values;  /* always 0 without VALUE_PAIRS */
#if VALUE_PAIRS
    if (bf16_values) pack_value_pairs(v, kv_h, kv_s, S, Hkv, D, s_pad, vp, threads);
#endif
    Transpose keys = {&p, kt};
    team_for(Hkv * (s_pad / KEY_BLOCK), threads, transpose_keys, &keys);
    int64_t group = H / Hkv;
    int64_t heads_per_block = group < ROWS ? group : ROWS;
    int64_t head_chunks = (group + heads_per_block - 1) / heads_per_block;
    int64_t t_per_block = ROWS / heads_per_block;
    int64_t t_blocks = (T + t_per_block - 1) / t_per_block;
    int64_t items = Hkv * head_chunks * t_blocks;
    Blocks blocks = {&p, per_thread, group, heads_per_block, head_chunks, t_per_block, t_blocks, items, bf16_values};
    atomic_init(&blocks.next, 0);
    team_run(threads, attend_blocks, &blocks);
}

