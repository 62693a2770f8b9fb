/* One decode attention work item's arithmetic (decode_attention.h splits the work): a chunk of one KV
   head's keys scored for a set of query vectors, their softmax, and the values they weigh — each key
   and value decoded from its codec once per pass of HEADS_PER_PASS query vectors, prefetched ahead. */
#pragma once
#include "kv_codec.h"

/* Whether slot t holds a position the query at `pos` sees. */
static inline int visible(const KVSlots *c, int64_t t, int64_t pos) {
    int64_t p = c->slot_pos ? c->slot_pos[t] : t;
    return p >= 0 && p <= pos && pos - p < (c->slot_pos ? c->capacity : pos + 1);
}

/* The end of the page run holding slot t, at most t1; and `row0` such that row0 + t is slot t's row
   of KV head g in that page's stores. */
static inline int64_t page_end(const KVSlots *c, int64_t t, int64_t t1) {
    int64_t end = (t / c->page_tokens + 1) * c->page_tokens;
    return end < t1 ? end : t1;
}

static inline int64_t page_row0(const KVSlots *c, int64_t g, int64_t t) {
    return (g - t / c->page_tokens) * c->page_tokens;
}

#define HEADS_PER_PASS 3  /* query heads a pass keeps accumulators for: 3 x 4 vectors (AVX2's 16 registers spill a few;
                             6 on AVX-512's 32 was no faster for a prompt's 8 rows of 3 heads) */
#define BY_PASS_HEADS(n, call)                                          \
    switch (n) {                                                        \
    case 3: call(3); break;                                             \
    case 2: call(2); break;                                             \
    default: call(1);                                                   \
    }

/* How far ahead of the keys being scored their rows (and the values' of the same slots) are
   prefetched, a few lines every 4 keys. A decode step finds every layer's keys and values evicted by
   the weights streamed since the last, in runs of one page per KV head (4 KB for SmolLM2's f16) too
   short for the hardware prefetcher, and a page's lines asked for in one burst stall the core once
   its misses in flight are full: bursts a page ahead read 23 KB a cached token (SmolLM2, f16) at
   ~21 GB/s on a Zen 5's two cores, this stream at ~31-35 (8 slots ahead 25, 16 29, 64 28). */
#define ATT_PREFETCH_SLOTS 32

static inline int64_t kv_row_bytes(int codec, int64_t d) {
    return codec == KV_F32 ? 4 * d : codec == KV_INT8 ? d : codec == KV_INT4 ? d / 2 : 2 * d;
}

/* Prefetch rows row .. row + 4 of a store of d columns in `codec`, with their scales (and mins). */
ALWAYS_INLINE void kv_prefetch_rows(const KVStore *s, int codec, int64_t row, int64_t d) {
    int64_t bytes = kv_row_bytes(codec, d);
    const uint8_t *q = (const uint8_t *)s->q + row * bytes;
    for (int64_t o = 0; o < 4 * bytes; o += 64) __builtin_prefetch(q + o);
    if (codec == KV_INT8 || codec == KV_INT4) {
        int64_t group = codec == KV_INT8 ? KV_INT8_GROUP : KV_INT4_GROUP;
        __builtin_prefetch(s->scale + row * (d / group));
        if (codec == KV_INT4) __builtin_prefetch(s->min + row * (d / group));
    }
}

/* Prefetch the keys (in `codec`, a constant) and values (in their own codec) of KV head g at slots
   t .. t + 4 (the page of t's; a run crossing into the next page prefetches a little past its
   rows, harmlessly). */
ALWAYS_INLINE void kv_prefetch_slots(const KVSlots *c, int codec, int64_t g, int64_t t, int64_t d) {
    const KVPage *page = &c->pages[t / c->page_tokens];
    int64_t row = page_row0(c, g, t) + t;
    kv_prefetch_rows(&page->k, codec, row, d);
    kv_prefetch_rows(&page->v, (int)page->v.codec, row, d);
}

/* sc[h * stride + t - t0] = q_h . K[row0 + t] for heads h0 .. h0 + nh (nh <= HEADS_PER_PASS),
   slots t0..t1 of one page, four keys at a time: each key vector is decoded once for all the heads,
   and four dot products are summed across lanes together. `codec` and `nh` are constants in each
   instance (a run-time nh left the accumulators on the stack: scores took ~1.4x as long). While
   scoring slot t it prefetches KV head g's slot t + ATT_PREFETCH_SLOTS of c, when that is before
   `ahead_end`. */
ALWAYS_INLINE void head_scores(const KVStore *k, int codec, int64_t row0, const float *q, int h0, int nh, int64_t d,
                               int64_t t0, int64_t t1, float *sc, int64_t stride,
                               const KVSlots *c, int64_t g, int64_t ahead_end) {
    KVStore store = *k;
    store.codec = codec;
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) {
        if (t + ATT_PREFETCH_SLOTS < ahead_end) kv_prefetch_slots(c, codec, g, t + ATT_PREFETCH_SLOTS, d);
        vf acc[HEADS_PER_PASS][4];
        for (int h = 0; h < nh; h++) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = vf_zero();
        for (int64_t i = 0; i < d; i += VL) {
            vf key[4];
            for (int j = 0; j < 4; j++) key[j] = kv_load(&store, row0 + t + j, d, i);
            for (int h = 0; h < nh; h++) {
                vf qh = vf_load(q + (h0 + h) * d + i);
                for (int j = 0; j < 4; j++) acc[h][j] = vf_fma(qh, key[j], acc[h][j]);
            }
        }
        for (int h = 0; h < nh; h++) {
            float *out = sc + (h0 + h) * stride + t - t0;
            vf_sum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3], out);
        }
    }
    for (; t < t1; t++)
        for (int h = 0; h < nh; h++) {
            vf acc = vf_zero();
            for (int64_t i = 0; i < d; i += VL) acc = vf_fma(vf_load(q + (h0 + h) * d + i), kv_load(&store, row0 + t, d, i), acc);
            sc[(h0 + h) * stride + t - t0] = vf_sum(acc);
        }
}

/* sc[v * stride + t - t0] = q_v . K_g[t] for `heads` query vectors (q already scaled): `group` heads
   of each of heads / group rows, row j at position pos[j]. Soft-capped where softcap > 0; -inf where
   its row does not see t, and from t1 up to the next whole vector. Keys are scored in fours from each
   page run's start up to the next four past t1 (within the page): a key's score is the same whatever
   t1 is. */
ALWAYS_INLINE void chunk_scores(const KVSlots *c, int codec, int64_t g, const float *q, int heads, int group, int64_t d,
                                float softcap, int64_t t0, int64_t t1, int64_t stride, const int64_t *pos, float *sc) {
    for (int64_t t = t0; t < t1 && t < t0 + ATT_PREFETCH_SLOTS; t += 4) kv_prefetch_slots(c, codec, g, t, d);
    for (int64_t a = t0, b; a < t1; a = b) {
        b = page_end(c, a, a + (t1 - a + 3) / 4 * 4);
        const KVStore *k = &c->pages[a / c->page_tokens].k;
        for (int h0 = 0; h0 < heads; h0 += HEADS_PER_PASS) {
            int64_t ahead_end = h0 == 0 ? t1 : 0;  /* the first pass prefetches for all */
#define HEADS(nh) head_scores(k, codec, page_row0(c, g, a), q, h0, nh, d, a, b, sc + a - t0, stride, c, g, ahead_end)
            int nh = heads - h0 < HEADS_PER_PASS ? heads - h0 : HEADS_PER_PASS;
            BY_PASS_HEADS(nh, HEADS)
#undef HEADS
        }
    }
    if (softcap > 0.f)
        for (int v = 0; v < heads; v++)
            for (int64_t t = t0; t < t1; t++) sc[v * stride + t - t0] = softcap * tanhf(sc[v * stride + t - t0] / softcap);
    int64_t end = t0 + (t1 - t0 + VL - 1) / VL * VL;
    for (int j = 0; j < heads / group; j++) {
        float *row = sc + j * group * stride;  /* slot t at row[h * stride + t - t0] */
        if (!c->slot_pos) {  /* a dense cache: row j sees slots up to its position */
            int64_t seen = pos[j] + 1 < t1 ? pos[j] + 1 : t1;
            for (int h = 0; h < group; h++)
                for (int64_t t = seen > t0 ? seen : t0; t < end; t++) row[h * stride + t - t0] = -INFINITY;
        } else {
            for (int64_t t = t0; t < end; t++)  /* empty ring slots hold zeros or old values: finite, masked here */
                if (t >= t1 || !visible(c, t, pos[j]))
                    for (int h = 0; h < group; h++) row[h * stride + t - t0] = -INFINITY;
        }
    }
}

#define VALUE_TILE 4  /* vectors of output columns a pass keeps in registers per head */

/* Columns i0 .. i0 + tile * VL of o_h = sum_t p_h[t] V_g[t] for heads h0 .. h0 + nh (p: the chunk's
   weights, each head's `stride` apart): the heads' tiles stay in registers over the keys (of every
   page of the chunk), each value vector decoded once. `codec`, `nh` and `tile` are constants in each
   instance (a run-time tile kept the sums on the stack and branched on it at every key). A head adds
   only the keys it weighs (a weight's bits all zero: never -0, softmax gives +0), so what a head gets
   does not depend on the pass's other heads, even where a value is not finite. */
ALWAYS_INLINE void value_tile(const KVSlots *c, int codec, int64_t g, const float *p, int h0, int nh, int tile,
                              int64_t d, int64_t i0, int64_t t0, int64_t t1, int64_t stride, float *o) {
    vf acc[HEADS_PER_PASS][VALUE_TILE];
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < tile; j++) acc[h][j] = vf_zero();
    for (int64_t a = t0, b; a < t1; a = b) {
        b = page_end(c, a, t1);
        KVStore store = c->pages[a / c->page_tokens].v;
        store.codec = codec;
        int64_t row0 = page_row0(c, g, a);
        for (int64_t t = a; t < b; t++) {
            uint32_t any = 0, zero = 0, bits;
            for (int h = 0; h < nh; h++) {
                memcpy(&bits, p + (h0 + h) * stride + t - t0, 4);
                any |= bits, zero |= (uint32_t)(bits == 0) << h;
            }
            if (!any) continue;
            vf value[VALUE_TILE];
            for (int j = 0; j < tile; j++) value[j] = kv_load(&store, row0 + t, d, i0 + j * VL);
            for (int h = 0; h < nh; h++) {
                if (zero >> h & 1) continue;  /* 0 x an overflowed (inf) value would be NaN */
                vf w = vf_set1(p[(h0 + h) * stride + t - t0]);
                for (int j = 0; j < tile; j++) acc[h][j] = vf_fma(w, value[j], acc[h][j]);
            }
        }
    }
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < tile; j++) vf_store(o + (h0 + h) * d + i0 + j * VL, acc[h][j]);
}

/* o_h for heads h0 .. h0 + nh, whole tiles of columns, then single vectors */
ALWAYS_INLINE void head_values(const KVSlots *c, int codec, int64_t g, const float *p, int h0, int nh, int64_t d,
                               int64_t t0, int64_t t1, int64_t stride, float *o) {
    int64_t i0 = 0;
    for (; i0 + VALUE_TILE * VL <= d; i0 += VALUE_TILE * VL)
        value_tile(c, codec, g, p, h0, nh, VALUE_TILE, d, i0, t0, t1, stride, o);
    for (; i0 < d; i0 += VL) value_tile(c, codec, g, p, h0, nh, 1, d, i0, t0, t1, stride, o);
}

/* head_values for all `heads` query vectors, HEADS_PER_PASS at a time (a masked key adds exact zeros
   to a head of a pass that another head needs it for) */
ALWAYS_INLINE void chunk_values(const KVSlots *c, int codec, int64_t g, const float *p, int heads, int64_t d,
                                int64_t t0, int64_t t1, int64_t stride, float *o) {
    for (int h0 = 0; h0 < heads; h0 += HEADS_PER_PASS) {
        int nh = heads - h0 < HEADS_PER_PASS ? heads - h0 : HEADS_PER_PASS;
#define HEADS(n) head_values(c, codec, g, p, h0, n, d, t0, t1, stride, o)
        BY_PASS_HEADS(nh, HEADS)
#undef HEADS
    }
}

/* In place over one head's scores s[0..len): e^(s - max), masked keys exactly 0; returns the max
   (0 when nothing is visible) and the sum in *total. */
static inline float chunk_softmax(float *s, int64_t len, float *total) {
    vf vmax = vf_set1(-INFINITY);
    int64_t j = 0;
    for (; j + VL <= len; j += VL) vmax = vf_max(vmax, vf_load(s + j));
    float m = vf_hmax(vmax);
    for (; j < len; j++) m = s[j] > m ? s[j] : m;
    if (m == -INFINITY) m = 0.f;
    vf sum = vf_zero();
    int64_t t = 0;
    for (; t + VL <= len; t += VL) {
        vf x = vf_sub(vf_load(s + t), vf_set1(m));
        vf e = vf_zero_below(x, vf_exp(x), -80.f);
        vf_store(s + t, e);
        sum = vf_add(sum, e);
    }
    float tail = 0.f;
    for (; t < len; t++) tail += (s[t] = s[t] == -INFINITY ? 0.f : expf(s[t] - m));
    *total = vf_sum(sum) + tail;
    return m;
}
