/* Attention for one new token per sequence over its KV cache (the decode layers' attention).

   Work is split into (KV head, key chunk) items, so two threads share even a single KV head
   (Gemma 3) and long contexts (a chunk walks the cache's pages: prefix blocks shared with other
   sequences lie anywhere in memory): each item reads its keys and values once per three query heads of
   the group (grouped-query attention), decoding each vector from its codec once for all three,
   and leaves per head a partial softmax — its largest score m, the sum l of e^(s - m) and the
   unnormalized output o. The partials are then merged per head, as in flash-decoding:

     M = max_c m_c,   out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c */
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include "kv_codec.h"

#define ATT_CHUNK 256  /* keys per work item at most */
#define ATT_MAX_THREADS 64  /* attend_floats' bound */
#define ATT_MAX_ROWS 8      /* rows per attend_rows call: a decode step's sequences */
#define ATT_MAX_GROUP_FLOATS 4096  /* a KV head's queries (query heads per KV head x head_dim) at most */

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

#define HEADS_PER_PASS 3  /* query heads a pass keeps accumulators for: 3 x 4 vectors (AVX2's 16 registers spill a few) */

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
    int64_t len = stride, t = t0;
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
            float *out = sc + (h0 + h) * len + t - t0;
            vf_sum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3], out);
        }
    }
    for (; t < t1; t++)
        for (int h = 0; h < nh; h++) {
            vf acc = vf_zero();
            for (int64_t i = 0; i < d; i += VL) acc = vf_fma(vf_load(q + (h0 + h) * d + i), kv_load(&store, row0 + t, d, i), acc);
            sc[(h0 + h) * len + t - t0] = vf_sum(acc);
        }
}

/* sc[h][t - t0] = q_h . K_g[t] for the `group` query heads of KV head g (q already scaled),
   soft-capped where softcap > 0, -inf where not visible. */
ALWAYS_INLINE void chunk_scores(const KVSlots *c, int codec, int64_t g, const float *q, int group, int64_t d,
                                float softcap, int64_t t0, int64_t t1, int64_t pos, float *sc) {
    for (int64_t t = t0; t < t1 && t < t0 + ATT_PREFETCH_SLOTS; t += 4) kv_prefetch_slots(c, codec, g, t, d);
    for (int64_t a = t0, b; a < t1; a = b) {
        b = page_end(c, a, t1);
        const KVStore *k = &c->pages[a / c->page_tokens].k;
        for (int h0 = 0; h0 < group; h0 += HEADS_PER_PASS) {
            int64_t ahead_end = h0 == 0 ? t1 : 0;  /* the first pass prefetches for all */
#define HEADS(nh) head_scores(k, codec, page_row0(c, g, a), q, h0, nh, d, a, b, sc + a - t0, t1 - t0, c, g, ahead_end)
            if (group - h0 >= 3) HEADS(3);
            else if (group - h0 == 2) HEADS(2);
            else HEADS(1);
#undef HEADS
        }
    }
    if (softcap > 0.f)
        for (int64_t i = 0; i < group * (t1 - t0); i++) sc[i] = softcap * tanhf(sc[i] / softcap);
    for (int64_t t = t0; t < t1; t++)  /* empty ring slots hold zeros or old values: finite, masked here */
        if (!visible(c, t, pos))
            for (int h = 0; h < group; h++) sc[h * (t1 - t0) + t - t0] = -INFINITY;
}

#define VALUE_TILE 4  /* vectors of output columns a pass keeps in registers per head */

/* o_h = sum_t p_h[t] V_g[t] for heads h0 .. h0 + nh of the group (p: the chunk's weights, each head's
   len = t1 - t0 apart): column tiles outermost, so each head's tile stays in registers over the keys
   (of every page of the chunk) and each value vector is decoded once per pass. `codec` and `nh` are
   constants in each instance. */
ALWAYS_INLINE void head_values(const KVSlots *c, int codec, int64_t g, const float *p, int h0, int nh, int64_t d,
                               int64_t t0, int64_t t1, float *o) {
    int64_t len = t1 - t0;
    for (int64_t i0 = 0; i0 < d; i0 += VALUE_TILE * VL) {
        int tile = (int)((d - i0) / VL < VALUE_TILE ? (d - i0) / VL : VALUE_TILE);
        vf acc[HEADS_PER_PASS][VALUE_TILE];
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < tile; j++) acc[h][j] = vf_zero();
        for (int64_t a = t0, b; a < t1; a = b) {
            b = page_end(c, a, t1);
            KVStore store = c->pages[a / c->page_tokens].v;
            store.codec = codec;
            int64_t row0 = page_row0(c, g, a);
            for (int64_t t = a; t < b; t++) {
                int any = 0;
                for (int h = 0; h < nh; h++) any |= p[(h0 + h) * len + t - t0] != 0.f;
                if (!any) continue;
                vf value[VALUE_TILE];
                for (int j = 0; j < tile; j++) value[j] = kv_load(&store, row0 + t, d, i0 + j * VL);
                for (int h = 0; h < nh; h++) {
                    vf w = vf_set1(p[(h0 + h) * len + t - t0]);
                    for (int j = 0; j < tile; j++) acc[h][j] = vf_fma(w, value[j], acc[h][j]);
                }
            }
        }
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < tile; j++) vf_store(o + (h0 + h) * d + i0 + j * VL, acc[h][j]);
    }
}

/* head_values for all the group's heads, HEADS_PER_PASS at a time */
ALWAYS_INLINE void chunk_values(const KVSlots *c, int codec, int64_t g, const float *p, int group, int64_t d,
                                int64_t t0, int64_t t1, float *o) {
    for (int h0 = 0; h0 < group; h0 += HEADS_PER_PASS)
        if (group - h0 >= 3) head_values(c, codec, g, p, h0, 3, d, t0, t1, o);
        else if (group - h0 == 2) head_values(c, codec, g, p, h0, 2, d, t0, t1, o);
        else head_values(c, codec, g, p, h0, 1, d, t0, t1, o);
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

#define BY_CODEC(codec, call_with)                                      \
    switch (codec) {                                                    \
    case KV_F16: call_with(KV_F16); break;                              \
    case KV_BF16: call_with(KV_BF16); break;                            \
    case KV_INT8: call_with(KV_INT8); break;                            \
    case KV_INT4: call_with(KV_INT4); break;                            \
    default: call_with(KV_F32);                                         \
    }

/* out = head h's attention from its KV head's `chunks` partials (attend_rows' item layout). */
static inline void merge_chunks(const float *partial, int64_t chunks, int64_t size, int group, int64_t d, int64_t h,
                                float *out) {
    int64_t g = h / group, hg = h % group;
    float best = -INFINITY, total = 0.f;
    for (int64_t ch = 0; ch < chunks; ch++) {
        const float *m = partial + (g * chunks + ch) * size + group * d;
        if (m[group + hg] > 0.f && m[hg] > best) best = m[hg];
    }
    for (int64_t i = 0; i < d; i += VL) vf_store(out + i, vf_zero());
    for (int64_t ch = 0; ch < chunks; ch++) {
        const float *o = partial + (g * chunks + ch) * size, *m = o + group * d;
        if (m[group + hg] <= 0.f) continue;
        float w = expf(m[hg] - best);
        total += w * m[group + hg];
        for (int64_t i = 0; i < d; i += VL) vf_store(out + i, vf_fma(vf_set1(w), vf_load(o + hg * d + i), vf_load(out + i)));
    }
    vf inv = vf_set1(total > 0.f ? 1.f / total : 0.f);
    for (int64_t i = 0; i < d; i += VL) vf_store(out + i, vf_mul(vf_load(out + i), inv));
}

/* Floats of scratch attend_rows() needs for m rows of n_heads query heads (n_kv KV heads) over up to
   max_len slots each. */
static inline int64_t attend_floats(int64_t n_heads, int64_t n_kv, int64_t d, int64_t max_len, int m, int threads) {
    int64_t chunks = (max_len + ATT_CHUNK - 1) / ATT_CHUNK + threads;
    return m * n_heads * chunks * (ATT_CHUNK + d + 2);
}

/* One row's share of attend_rows' items. */
typedef struct {
    int64_t chunks, first, per, scores;  /* first: its first item; scores: where that item's scores start */
} RowItems;

typedef struct {
    const KVSlots *caches;
    const float *q;
    int64_t q_stride;
    int m, group;
    int64_t d;
    float scale, softcap;
    const int64_t *slots, *pos;
    const RowItems *rows;
    float *partial, *score_base;
    int64_t size;
} AttendItems;

/* Items [it0, it1) of attend_rows: each one (row, KV head, key chunk)'s partial o, m and l. */
static void attend_items(void *p, int64_t it0, int64_t it1) {
    const AttendItems *a = p;
    int group = a->group;
    int64_t d = a->d;
    for (int64_t it = it0; it < it1; it++) {
        int i = 0;
        while (i + 1 < a->m && a->rows[i + 1].first <= it) i++;
        const RowItems *r = &a->rows[i];
        const KVSlots *c = &a->caches[i];
        int64_t local = it - r->first, g = local / r->chunks, t0 = (local % r->chunks) * r->per;
        int64_t t1 = t0 + r->per < a->slots[i] ? t0 + r->per : a->slots[i];
        float *sc = a->score_base + r->scores + local * group * r->per, *o = a->partial + it * a->size;
        float *mx = o + group * d, *l = mx + group;
        if (t0 >= t1) {
            for (int h = 0; h < group; h++) mx[h] = 0.f, l[h] = 0.f;
            continue;
        }
        /* the group's queries times the scale, on the stack: a multiply per score less, and the
           compiler knows the score stores leave them alone (kept in o's place, the scores took
           ~13 % longer). attend_rows checked that they fit. */
        float qs[ATT_MAX_GROUP_FLOATS];
        const float *q = a->q + i * a->q_stride + g * group * d;
        for (int64_t j = 0; j < group * d; j += VL) vf_store(qs + j, vf_mul(vf_load(q + j), vf_set1(a->scale)));
#define SCORES(codec) chunk_scores(c, codec, g, qs, group, d, a->softcap, t0, t1, a->pos[i], sc)
        BY_CODEC(c->pages[0].k.codec, SCORES)
        for (int h = 0; h < group; h++) mx[h] = chunk_softmax(sc + h * (t1 - t0), t1 - t0, &l[h]);
#define VALUES(codec) chunk_values(c, codec, g, sc, group, d, t0, t1, o)
        BY_CODEC(c->pages[0].v.codec, VALUES)
#undef SCORES
#undef VALUES
    }
}

/* out[i] (n_heads x d, rows out_stride apart) = attention of row i's query (one per head; rows
   q_stride apart) over the first slots[i] slots of its cache caches[i], for m rows of distinct
   caches: every row's (KV head, key chunk) items in one parallel loop — one region a layer, not
   one per sequence each with SmolLM2's 3 KV heads split 2:1 over two threads. Each row's chunks
   are what they would be alone, so its floats do not depend on its batch. scratch holds
   attend_floats(...) floats. */
static inline void attend_rows(const KVSlots *caches, const float *q, int64_t q_stride, int m, int64_t n_heads,
                               int64_t n_kv, int64_t d, float scale, float softcap, const int64_t *slots,
                               const int64_t *pos, float *scratch, float *out, int64_t out_stride, int threads) {
    int group = (int)(n_heads / n_kv);
    if (group * d > ATT_MAX_GROUP_FLOATS) {  /* kernels/decode.py declines such a model: never here */
        fprintf(stderr, "edgellm: decode attention takes at most %d query floats per KV head, got %lld\n",
                ATT_MAX_GROUP_FLOATS, (long long)(group * d));
        abort();
    }
    threads = threads < ATT_MAX_THREADS ? threads : ATT_MAX_THREADS;
    RowItems rows[ATT_MAX_ROWS];
    int64_t items = 0, size = group * (d + 2), scores = 0;
    for (int i = 0; i < m; i++) {
        int64_t chunks = (slots[i] + ATT_CHUNK - 1) / ATT_CHUNK;
        if (chunks * n_kv < threads) chunks = (threads + n_kv - 1) / n_kv;  /* at least one item per thread */
        if (chunks > slots[i]) chunks = slots[i];
        RowItems r = {chunks, items, (slots[i] + chunks - 1) / chunks, scores};
        rows[i] = r;
        items += n_kv * chunks;
        scores += n_kv * chunks * group * r.per;
    }
    float *partial = scratch;                    /* per item: o (group x d), then m (group), l (group) */
    float *score_base = partial + items * size;  /* per item: group x per */
    AttendItems a = {caches, q, q_stride, m, group, d, scale, softcap, slots, pos, rows, partial, score_base, size};
    pool_for(items, threads, attend_items, &a);
    for (int i = 0; i < m; i++)
        for (int64_t h = 0; h < n_heads; h++)  /* merge each head's chunks */
            merge_chunks(partial + rows[i].first * size, rows[i].chunks, size, group, d, h, out + i * out_stride + h * d);
}
