/* Pieces shared by the native decoder layers (llama_layer.c, gemma3_layer.c): m sequences, one new
   token each, fp32 activations. */
#pragma once
#include "kv_codec.h"
#include "norm_rope.h"

void edgellm_int4_gemv(const float *x, int m, int64_t ka, const uint8_t *packed, const uint16_t *scale_zero,
                       int64_t n, int64_t kw, int64_t group, float *y, int64_t ldy, void *work, int threads);

void edgellm_block_gemv(const float *x, int m, int64_t k, const uint8_t *blocks, int type, int64_t n,
                        const uint16_t *row_scale, float *y, int64_t ldy, void *work, int threads);

/* y[i][r] = W x[i] for dense W (n, k) of `dtype`, m rows; rows of W split across threads. */
static inline void dense_gemv(const void *w, int dtype, const float *x, int m, int64_t n, int64_t k, float *y,
                              int64_t ldy, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < m; i++) {
            vf acc = vf_zero();
            for (int64_t j = 0; j < k; j += VL) acc = vf_fma(vf_load_as(w, r * k + j, dtype), vf_load(x + i * k + j), acc);
            y[i * ldy + r] = vf_sum(acc);
        }
}

/* One layer's scratch for m sequences, carved out of one buffer of edgellm_layer_floats(D, m) floats. */
typedef struct {
    float *n, *qkv, *att, *proj, *gu, *act, *scores;
} LayerBuffers;

static inline int64_t qkv_width(const LayerDims *D) { return (D->n_heads + 2 * D->n_kv) * D->head_dim; }

static inline LayerBuffers layer_buffers(const LayerDims *D, int m, float *buf) {
    LayerBuffers B;
    B.n = buf;
    B.qkv = B.n + m * D->hidden;
    B.att = B.qkv + m * qkv_width(D);
    B.proj = B.att + m * D->n_heads * D->head_dim;
    B.gu = B.proj + m * D->hidden;
    B.act = B.gu + m * 2 * D->inter;
    B.scores = B.act + m * D->inter;
    return B;
}

/* y (m, out) = W x (m, in) for every part of the projection, parts side by side in each row. */
static inline void gemv(const Projection *w, const float *x, int m, float *y, int64_t ldy, void *work, int threads) {
    for (int64_t i = 0; i < w->count; i++) {
        const WeightPart *p = &w->parts[i];
        if (p->kind == WEIGHT_BF16 || p->kind == WEIGHT_F32)
            dense_gemv(p->data, p->kind == WEIGHT_BF16 ? DTYPE_BF16 : DTYPE_F32, x, m, p->n, p->ka, y, ldy, threads);
        else if (p->kind == WEIGHT_INT4)
            edgellm_int4_gemv(x, m, p->ka, p->data, p->scale_zero, p->n, p->kw, p->group, y, ldy, work, threads);
        else edgellm_block_gemv(x, m, p->ka, p->data, (int)p->kind, p->n, p->scale_zero, y, ldy, work, threads);
        y += p->n;
    }
}

/* Whether slot t holds a position the query at `pos` sees. */
static inline int visible(const KVSlots *c, int64_t t, int64_t pos) {
    int64_t p = c->slot_pos ? c->slot_pos[t] : t;
    return p >= 0 && p <= pos && pos - p < (c->slot_pos ? c->capacity : pos + 1);
}

/* s[t] = q . K[row0 + t] * scale over the visible slots (-inf elsewhere); returns the largest.
   `codec` is a constant in each caller below, so each codec gets its own loop. */
ALWAYS_INLINE float key_scores(const KVSlots *c, int codec, int64_t row0, const float *q, int64_t d, float scale,
                               int64_t slots, int64_t pos, float *s) {
    KVStore k = c->k;
    k.codec = codec;
    float best = -INFINITY;
    for (int64_t t = 0; t < slots; t++) {
        if (!visible(c, t, pos)) {
            s[t] = -INFINITY;
            continue;
        }
        vf acc = vf_zero();
        for (int64_t i = 0; i < d; i += VL) acc = vf_fma(vf_load(q + i), kv_load(&k, row0 + t, d, i), acc);
        s[t] = vf_sum(acc) * scale;
        best = s[t] > best ? s[t] : best;
    }
    return best;
}

/* o = sum_t p[t] V[row0 + t], VL columns at a time over the slots. */
ALWAYS_INLINE void weighted_values(const KVSlots *c, int codec, int64_t row0, const float *p, int64_t slots, int64_t d,
                                   float *o) {
    KVStore v = c->v;
    v.codec = codec;
    for (int64_t i = 0; i < d; i += VL) {
        vf acc = vf_zero();
        for (int64_t t = 0; t < slots; t++)
            if (p[t] != 0.f) acc = vf_fma(vf_set1(p[t]), kv_load(&v, row0 + t, d, i), acc);
        vf_store(o + i, acc);
    }
}

#define BY_CODEC(codec, call_with)                                      \
    switch (codec) {                                                    \
    case KV_F16: call_with(KV_F16); break;                              \
    case KV_INT8: call_with(KV_INT8); break;                            \
    case KV_INT4: call_with(KV_INT4); break;                            \
    default: call_with(KV_F32);                                         \
    }

/* One query per head over the visible slots of its KV head (grouped-query attention). */
static inline void attend(const KVSlots *c, const float *q, int64_t n_heads, int64_t n_kv, int64_t d, float scale,
                          int64_t slots, int64_t pos, float *scores, float *out, int threads) {
    int64_t per_kv = n_heads / n_kv;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < n_heads; h++) {
        const float *qh = q + h * d;
        int64_t row0 = (h / per_kv) * c->capacity;  /* this KV head's first row */
        float *s = scores + h * slots, best = -INFINITY, total = 0.f;
#define SCORES(codec) best = key_scores(c, codec, row0, qh, d, scale, slots, pos, s)
        BY_CODEC(c->k.codec, SCORES)
        for (int64_t t = 0; t < slots; t++) total += (s[t] = s[t] == -INFINITY ? 0.f : expf(s[t] - best));
        for (int64_t t = 0; t < slots; t++) s[t] /= total;
#define VALUES(codec) weighted_values(c, codec, row0, s, slots, d, out + h * d)
        BY_CODEC(c->v.codec, VALUES)
    }
}

/* After q, k, v of every sequence in B->qkv are final: store each k, v, attend over its own cache,
   and project: B->proj = W_o attn. */
static inline void attention_out(const LayerDims *D, const Projection *o, KVSlots *caches, const int64_t *pos, int m,
                                 const LayerBuffers *B, void *work, int threads) {
    int64_t d = D->head_dim, qd = D->n_heads * d, kvd = D->n_kv * d;
    for (int i = 0; i < m; i++) {
        const float *qkv = B->qkv + i * qkv_width(D);
        int64_t slots = kv_write(&caches[i], qkv + qd, qkv + qd + kvd, D->n_kv, d, pos[i]);
        attend(&caches[i], qkv, D->n_heads, D->n_kv, d, D->scale, slots, pos[i], B->scores, B->att + i * qd, threads);
    }
    gemv(o, B->att, m, B->proj, D->hidden, work, threads);
}

/* B->proj = W_down (act(W_gate m) * W_up m) for m in B->n (gate and up fused, gate first). */
static inline void gated_mlp(const LayerDims *D, const Projection *gate_up, const Projection *down,
                             float (*act)(float), int m, const LayerBuffers *B, void *work, int threads) {
    gemv(gate_up, B->n, m, B->gu, 2 * D->inter, work, threads);
    for (int i = 0; i < m; i++)
        for (int64_t j = 0; j < D->inter; j++)
            B->act[i * D->inter + j] = act(B->gu[i * 2 * D->inter + j]) * B->gu[i * 2 * D->inter + D->inter + j];
    gemv(down, B->act, m, B->proj, D->hidden, work, threads);
}

/* x[i] += B->proj[i] for m rows of `hidden` */
static inline void add_rows(float *x, const float *y, int m, int64_t hidden) {
    for (int64_t j = 0; j < m * hidden; j += VL) vf_store(x + j, vf_add(vf_load(x + j), vf_load(y + j)));
}
