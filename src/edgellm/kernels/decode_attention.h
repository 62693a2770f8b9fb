/* Attention for one new token per sequence over its KV cache (the decode layers' attention).

   Work is split into (KV head, key chunk) items, so two threads share even a single KV head
   (Gemma 3) and long contexts (a chunk walks the cache's pages: prefix blocks shared with other
   sequences lie anywhere in memory): each item reads its keys and values once per three query heads of
   the group (grouped-query attention), decoding each vector from its codec once for all three,
   and leaves per head a partial softmax — its largest score m, the sum l of e^(s - m) and the
   unnormalized output o. The partials are then merged per head, as in flash-decoding:

     M = max_c m_c,   out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c

   Rows of one dense cache (a prompt's piece, a speculative check's guesses) are attended together:
   an item's keys and values are read once for all of their queries, each row masked at its own
   position. Its floats are those of the row alone: the chunk boundaries are the same for every slot
   count of an aligned run (key_chunks), keys are scored in fours up to the next four past the last,
   and a softmax sums whole vectors — what another row adds beyond a row's own keys is exact zeros. */
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include "attend_chunk.h"

#define ATT_CHUNK 256  /* keys per work item at most */
#define ATT_ALIGN 32   /* chunk lengths are multiples of it (see key_chunks) */
#define ATT_SCORE_PAD 16  /* a chunk's score row holds its keys and up to this many more (fours, whole vectors) */
#define ATT_MAX_THREADS 64  /* attend_floats' bound */
#define ATT_MAX_ROWS 8      /* rows per attend_rows call: a decode step's sequences */
#define ATT_MAX_GROUP_FLOATS 4096  /* a KV head's queries (query heads per KV head x head_dim) at most */

#define BY_CODEC(codec, call_with)                                      \
    switch (codec) {                                                    \
    case KV_F16: call_with(KV_F16); break;                              \
    case KV_BF16: call_with(KV_BF16); break;                            \
    case KV_INT8: call_with(KV_INT8); break;                            \
    case KV_INT4: call_with(KV_INT4); break;                            \
    default: call_with(KV_F32);                                         \
    }

/* out = query vector v's attention (KV head g's) from the `chunks` partials of its row set's items
   (attend_rows' layout: item (g, chunk) at (g * chunks + chunk) * size; `heads` vectors an item). */
static inline void merge_chunks(const float *partial, int64_t chunks, int64_t size, int heads, int64_t d, int64_t g,
                                int v, float *out) {
    float best = -INFINITY, total = 0.f;
    for (int64_t ch = 0; ch < chunks; ch++) {
        const float *m = partial + (g * chunks + ch) * size + heads * d;
        if (m[heads + v] > 0.f && m[v] > best) best = m[v];
    }
    for (int64_t i = 0; i < d; i += VL) vf_store(out + i, vf_zero());
    for (int64_t ch = 0; ch < chunks; ch++) {
        const float *o = partial + (g * chunks + ch) * size, *m = o + heads * d;
        if (m[heads + v] <= 0.f) continue;
        float w = expf(m[v] - best);
        total += w * m[heads + v];
        for (int64_t i = 0; i < d; i += VL) vf_store(out + i, vf_fma(vf_set1(w), vf_load(o + v * d + i), vf_load(out + i)));
    }
    vf inv = vf_set1(total > 0.f ? 1.f / total : 0.f);
    for (int64_t i = 0; i < d; i += VL) vf_store(out + i, vf_mul(vf_load(out + i), inv));
}

/* A row's key chunks: *per slots each (a multiple of ATT_ALIGN, at most ATT_CHUNK), as many as its
   `slots` need. Both follow from the slot count rounded up to ATT_ALIGN, so the rows of one sequence
   within an aligned run of positions split their keys alike, and attend together as each would alone.
   At least one item per thread where the KV heads are fewer (Gemma 3: one). */
static inline int64_t key_chunks(int64_t slots, int64_t n_kv, int threads, int64_t *per) {
    int64_t run = (slots + ATT_ALIGN - 1) / ATT_ALIGN * ATT_ALIGN;
    int64_t chunks = (run + ATT_CHUNK - 1) / ATT_CHUNK;
    if (chunks * n_kv < threads) chunks = (threads + n_kv - 1) / n_kv;
    *per = ((run + chunks - 1) / chunks + ATT_ALIGN - 1) / ATT_ALIGN * ATT_ALIGN;
    return (slots + *per - 1) / *per;
}

/* Floats of scratch attend_rows() needs for m rows of n_heads query heads (n_kv KV heads) over up to
   max_len slots each. */
static inline int64_t attend_floats(int64_t n_heads, int64_t n_kv, int64_t d, int64_t max_len, int m, int threads) {
    int64_t chunks = (max_len + ATT_CHUNK - 1) / ATT_CHUNK + threads;
    return m * n_heads * chunks * (ATT_CHUNK + ATT_SCORE_PAD + d + 2);
}

/* Rows r0 .. r0 + rows of an attend_rows call attended as one: consecutive rows of one dense cache
   (or a row alone), and their share of the items. */
typedef struct {
    int r0, rows, heads;      /* heads: query vectors an item holds, rows x query heads per KV head */
    int64_t slots, chunks, per, first;  /* slots: its rows' most; first: the set's first item */
    float *partial, *scores;  /* per item: o (heads x d), m (heads), l (heads); heads x (per + ATT_SCORE_PAD) scores */
} RowSet;

typedef struct {
    const KVSlots *caches;
    const float *q;
    int64_t q_stride;
    int sets, group;
    int64_t d;
    float scale, softcap;
    const int64_t *pos;
    const RowSet *set;
} AttendItems;

/* Items [it0, it1) of attend_rows: each one (row set, KV head, key chunk)'s partial o, m and l. */
static void attend_items(void *p, int64_t it0, int64_t it1) {
    const AttendItems *a = p;
    int group = a->group;
    int64_t d = a->d;
    for (int64_t it = it0; it < it1; it++) {
        int i = 0;
        while (i + 1 < a->sets && a->set[i + 1].first <= it) i++;
        const RowSet *r = &a->set[i];
        const KVSlots *c = &a->caches[r->r0];
        int heads = r->heads;
        int64_t local = it - r->first, g = local / r->chunks, t0 = (local % r->chunks) * r->per;
        int64_t t1 = t0 + r->per < r->slots ? t0 + r->per : r->slots, stride = r->per + ATT_SCORE_PAD;
        float *sc = r->scores + local * heads * stride, *o = r->partial + local * heads * (d + 2);
        float *mx = o + heads * d, *l = mx + heads;  /* t0 < t1: a set has the chunks its longest row needs */
        /* the rows' queries of KV head g times the scale, on the stack: a multiply per score less, and
           the compiler knows the score stores leave them alone (kept in o's place, the scores took
           ~13 % longer). attend_rows sized the sets to fit. */
        float qs[ATT_MAX_GROUP_FLOATS];
        for (int j = 0; j < r->rows; j++) {
            const float *q = a->q + (r->r0 + j) * a->q_stride + g * group * d;
            for (int64_t e = 0; e < group * d; e += VL)
                vf_store(qs + j * group * d + e, vf_mul(vf_load(q + e), vf_set1(a->scale)));
        }
#define SCORES(codec) chunk_scores(c, codec, g, qs, heads, group, d, a->softcap, t0, t1, stride, a->pos + r->r0, sc)
        BY_CODEC(c->pages[0].k.codec, SCORES)
        int64_t padded = (t1 - t0 + VL - 1) / VL * VL;
        for (int h = 0; h < heads; h++) mx[h] = chunk_softmax(sc + h * stride, padded, &l[h]);
#define VALUES(codec) chunk_values(c, codec, g, sc, heads, d, t0, t1, stride, o)
        BY_CODEC(c->pages[0].v.codec, VALUES)
#undef SCORES
#undef VALUES
    }
}

/* Whether row i of an attend_rows call joins set r (the rows before it): the same cache (dense, or a
   ring: each row masks the slots it does not see), keys split alike, and room on the stack for one
   more row's queries. */
static inline int joins(const RowSet *r, const KVSlots *caches, int i, int64_t per, int group, int64_t d) {
    const KVSlots *c = &caches[r->r0];
    return caches[i].pages == c->pages && per == r->per && (r->rows + 1) * group * d <= ATT_MAX_GROUP_FLOATS;
}

/* out[i] (n_heads x d, rows out_stride apart) = attention of row i's query (one per head; rows
   q_stride apart) over the first slots[i] slots of its cache caches[i], at position pos[i], for m
   rows: every row set's (KV head, key chunk) items in one parallel loop — one region a layer, not
   one per sequence each with SmolLM2's 3 KV heads split 2:1 over two threads. Consecutive rows of
   one dense cache make one set, whose items read each key once for all of them. A row's floats do
   not depend on what else is in the call. scratch holds attend_floats(...) floats. Returns the
   items it ran. */
static inline int64_t attend_rows(const KVSlots *caches, const float *q, int64_t q_stride, int m, int64_t n_heads,
                                  int64_t n_kv, int64_t d, float scale, float softcap, const int64_t *slots,
                                  const int64_t *pos, float *scratch, float *out, int64_t out_stride, int threads) {
    int group = (int)(n_heads / n_kv);
    if (group * d > ATT_MAX_GROUP_FLOATS) {  /* models/native/decoder.py declines such a model: never here */
        fprintf(stderr, "edgellm: decode attention takes at most %d query floats per KV head, got %lld\n",
                ATT_MAX_GROUP_FLOATS, (long long)(group * d));
        abort();
    }
    if (m > ATT_MAX_ROWS) {  /* attention_out calls in waves of at most that many */
        fprintf(stderr, "edgellm: decode attention takes at most %d rows a call, got %d\n", ATT_MAX_ROWS, m);
        abort();
    }
    threads = threads < ATT_MAX_THREADS ? threads : ATT_MAX_THREADS;
    RowSet set[ATT_MAX_ROWS];
    int sets = 0;
    for (int i = 0; i < m; i++) {
        int64_t per, chunks = key_chunks(slots[i], n_kv, threads, &per);
        if (sets && joins(&set[sets - 1], caches, i, per, group, d)) {
            RowSet *r = &set[sets - 1];
            r->rows++, r->heads += group;
            if (slots[i] > r->slots) r->slots = slots[i], r->chunks = chunks;
        } else {
            RowSet r = {i, 1, group, slots[i], chunks, per, 0, NULL, NULL};
            set[sets++] = r;
        }
    }
    int64_t items = 0, partial_floats = 0;
    for (int k = 0; k < sets; k++) {
        set[k].first = items;
        items += n_kv * set[k].chunks;
        partial_floats += n_kv * set[k].chunks * set[k].heads * (d + 2);
    }
    float *next_partial = scratch, *next_scores = scratch + partial_floats;
    for (int k = 0; k < sets; k++) {
        int64_t n = n_kv * set[k].chunks * set[k].heads;
        set[k].partial = next_partial, next_partial += n * (d + 2);
        set[k].scores = next_scores, next_scores += n * (set[k].per + ATT_SCORE_PAD);
    }
    AttendItems a = {caches, q, q_stride, sets, group, d, scale, softcap, pos, set};
    pool_for(items, threads, attend_items, &a);
    for (int k = 0; k < sets; k++)
        for (int j = 0; j < set[k].rows; j++)
            for (int64_t h = 0; h < n_heads; h++)  /* merge each head's chunks */
                merge_chunks(set[k].partial, set[k].chunks, set[k].heads * (d + 2), set[k].heads, d, h / group,
                             j * group + (int)(h % group), out + (set[k].r0 + j) * out_stride + h * d);
    return items;
}
