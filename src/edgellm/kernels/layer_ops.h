/* Pieces shared by the native decoder layers (llama_layer.c, gemma3_layer.c): one token, fp32. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

void edgellm_int4_gemv(const float *x, int m, int64_t ka, const uint8_t *packed, const uint16_t *scale_zero,
                       int64_t n, int64_t kw, int64_t group, float *y, void *work, int threads);

void edgellm_block_gemv(const float *x, int m, int64_t k, const uint8_t *blocks, int type, int64_t n, float *y,
                        void *work, int threads);

/* One stored weight: torch-packed INT4 (kind WEIGHT_INT4, scale_zero set), a dense bf16 (n, ka)
   matrix (WEIGHT_BF16: GGUF types with neither an exact INT4 form nor a block kernel, e.g. F16),
   or GGUF Q8_0 / Q5_0 / Q6_K blocks read in place (kind = the ggml type number, block_gemv.c). */
enum { WEIGHT_INT4 = -1, WEIGHT_BF16 = -2 };
typedef struct {
    int64_t kind;
    const uint8_t *data;
    const uint16_t *scale_zero;
    int64_t n, kw, ka, group;  /* kw = planes * ka */
} WeightPart;

/* A projection: up to three parts stacked along the output (fused q|k|v, gate|up). */
#define MAX_PARTS 3
typedef struct {
    WeightPart parts[MAX_PARTS];
    int64_t count;
} Projection;

/* y = W x for dense bf16 W (n, k), k % 16 == 0; rows split across threads. */
static inline void bf16_gemv(const uint16_t *w, const float *x, int64_t n, int64_t k, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = w + r * k;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 16)
            acc = _mm512_fmadd_ps(bf16_to_ps(_mm256_loadu_si256((const __m256i *)(row + i))), _mm512_loadu_ps(x + i), acc);
        y[r] = _mm512_reduce_add_ps(acc);
    }
}

/* Sizes every decoder layer shares; the first member of each architecture's layer struct. */
typedef struct {
    int64_t hidden, n_heads, n_kv, head_dim, inter, max_len;
    float eps, scale;
} LayerDims;

/* One layer's scratch, carved out of one float buffer of edgellm_layer_floats(D) floats. */
typedef struct {
    float *n, *qkv, *att, *proj, *gu, *act, *scores;
} LayerBuffers;

static inline LayerBuffers layer_buffers(const LayerDims *D, float *buf) {
    int64_t qd = D->n_heads * D->head_dim, kvd = D->n_kv * D->head_dim;
    LayerBuffers B;
    B.n = buf;
    B.qkv = B.n + D->hidden;
    B.att = B.qkv + qd + 2 * kvd;
    B.proj = B.att + qd;
    B.gu = B.proj + D->hidden;
    B.act = B.gu + 2 * D->inter;
    B.scores = B.act + D->inter;
    return B;
}

/* Where this layer's keys and values live: (Hkv, capacity, D) stores of fp32 (half = 0) or
   IEEE fp16 (half = 1, the default KV precision: half the bytes, so long contexts read half as
   much per token). A dense cache holds positions 0..pos at slots 0..pos (slot_pos = NULL); a ring
   of `capacity` = window slots holds position p at slot p % capacity, with slot_pos[] naming each
   slot's position (-1: empty), and a query at p sees positions in (p - window, p]. */
typedef struct {
    void *k, *v;
    int64_t capacity;
    int64_t *slot_pos;
    int64_t half;
} KVSlots;

/* 16 stored values at element offset i of a store, as fp32. */
static inline __m512 kv_load(const void *store, int64_t i, int64_t half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)store + i)));
    return _mm512_loadu_ps((const float *)store + i);
}

static inline void kv_store(void *store, int64_t i, const float *x, int64_t d, int64_t half) {
    if (!half) {
        memcpy((float *)store + i, x, (size_t)d * sizeof(float));
        return;
    }
    for (int64_t j = 0; j < d; j += 16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)store + i + j),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* rotate-half RoPE with full-width cos/sin: x*cos + (-x2, x1)*sin */
static inline void rope(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

static inline void gemv(const Projection *w, const float *x, float *y, void *work, int threads) {
    for (int64_t i = 0; i < w->count; i++) {
        const WeightPart *p = &w->parts[i];
        if (p->kind == WEIGHT_BF16) bf16_gemv((const uint16_t *)p->data, x, p->n, p->ka, y, threads);
        else if (p->kind == WEIGHT_INT4)
            edgellm_int4_gemv(x, 1, p->ka, p->data, p->scale_zero, p->n, p->kw, p->group, y, work, threads);
        else edgellm_block_gemv(x, 1, p->ka, p->data, (int)p->kind, p->n, y, work, threads);
        y += p->n;
    }
}

/* Store the new k, v (n_kv heads of d) for position pos; returns the slot count to scan. */
static inline int64_t kv_write(KVSlots *c, const float *k, const float *v, int64_t n_kv, int64_t d, int64_t pos) {
    int64_t slot = c->slot_pos ? pos % c->capacity : pos;
    for (int64_t g = 0; g < n_kv; g++) {
        kv_store(c->k, (g * c->capacity + slot) * d, k + g * d, d, c->half);
        kv_store(c->v, (g * c->capacity + slot) * d, v + g * d, d, c->half);
    }
    if (c->slot_pos) {
        c->slot_pos[slot] = pos;
        return c->capacity;
    }
    return pos + 1;
}

/* q . k over d floats (d % 16 == 0): vector accumulators, so no serial dependency chain. */
static inline float dot(const float *q, const void *k, int64_t at, int64_t d, int64_t half) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), kv_load(k, at + i, half), acc);
    return _mm512_reduce_add_ps(acc);
}

/* One query per head over the visible slots of its KV head (grouped-query attention). */
static inline void attend(const KVSlots *c, const float *q, int64_t n_heads, int64_t n_kv, int64_t d, float scale,
                          int64_t slots, int64_t pos, float *scores, float *out, int threads) {
    int64_t per_kv = n_heads / n_kv;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < n_heads; h++) {
        const float *qh = q + h * d;
        int64_t base = (h / per_kv) * c->capacity * d;  /* this KV head's first element */
        float *s = scores + h * slots, best = -INFINITY, total = 0.f;
        for (int64_t t = 0; t < slots; t++) {
            int64_t p = c->slot_pos ? c->slot_pos[t] : t;
            if (p < 0 || p > pos || pos - p >= (c->slot_pos ? c->capacity : pos + 1)) {
                s[t] = -INFINITY;
                continue;
            }
            s[t] = dot(qh, c->k, base + t * d, d, c->half) * scale;
            best = s[t] > best ? s[t] : best;
        }
        for (int64_t t = 0; t < slots; t++) total += (s[t] = s[t] == -INFINITY ? 0.f : expf(s[t] - best));
        for (int64_t t = 0; t < slots; t++) s[t] /= total;
        float *o = out + h * d;
        for (int64_t i = 0; i < d; i += 16) {  /* 16 output columns at a time over the slots */
            __m512 acc = _mm512_setzero_ps();
            for (int64_t t = 0; t < slots; t++)
                if (s[t] != 0.f) acc = _mm512_fmadd_ps(_mm512_set1_ps(s[t]), kv_load(c->v, base + t * d + i, c->half), acc);
            _mm512_storeu_ps(o + i, acc);
        }
    }
}

/* After q, k, v in B->qkv are final: store k, v, attend, and project: B->proj = W_o attn. */
static inline void attention_out(const LayerDims *D, const Projection *o, KVSlots *cache, int64_t pos,
                                 const LayerBuffers *B, void *work, int threads) {
    int64_t d = D->head_dim, qd = D->n_heads * d, kvd = D->n_kv * d;
    int64_t slots = kv_write(cache, B->qkv + qd, B->qkv + qd + kvd, D->n_kv, d, pos);
    attend(cache, B->qkv, D->n_heads, D->n_kv, d, D->scale, slots, pos, B->scores, B->att, threads);
    gemv(o, B->att, B->proj, work, threads);
}

/* B->proj = W_down (act(W_gate m) * W_up m) for m in B->n (gate and up fused, gate first). */
static inline void gated_mlp(const LayerDims *D, const Projection *gate_up, const Projection *down,
                             float (*act)(float), const LayerBuffers *B, void *work, int threads) {
    gemv(gate_up, B->n, B->gu, work, threads);
    for (int64_t i = 0; i < D->inter; i++) B->act[i] = act(B->gu[i]) * B->gu[D->inter + i];
    gemv(down, B->act, B->proj, work, threads);
}
