/* Pieces shared by the native decoder layers (llama_layer.c, gemma_layer.c): m sequences, one new
   token each, fp32 activations. */
#pragma once
#include "decode_attention.h"
#include "activation.h"
#include "norm_rope.h"
#include "lora_ops.h"

void edgellm_int4_gemv(const float *x, int m, int64_t ka, const uint8_t *packed, const uint16_t *scale_zero,
                       int64_t n, int64_t kw, int64_t group, float *y, int64_t ldy, void *work, int threads);

void edgellm_block_gemv(const float *x, int m, int64_t k, const uint8_t *blocks, int type, int64_t n,
                        const uint16_t *row_scale, float *y, int64_t ldy, void *work, int threads);

typedef struct {
    const void *w;
    int dtype, m;
    const float *x;
    int64_t k, ldy;
    float *y;
} DenseGemv;

static void dense_rows(void *p, int64_t r0, int64_t r1) {
    const DenseGemv *a = p;
    for (int64_t r = r0; r < r1; r++)
        for (int i = 0; i < a->m; i++) {
            vf acc = vf_zero();
            for (int64_t j = 0; j < a->k; j += VL)
                acc = vf_fma(vf_load_as(a->w, r * a->k + j, a->dtype), vf_load(a->x + i * a->k + j), acc);
            a->y[i * a->ldy + r] = vf_sum(acc);
        }
}

/* y[i][r] = W x[i] for dense W (n, k) of `dtype`, m rows; rows of W split across threads. */
static inline void dense_gemv(const void *w, int dtype, const float *x, int m, int64_t n, int64_t k, float *y,
                              int64_t ldy, int threads) {
    DenseGemv a = {w, dtype, m, x, k, ldy, y};
    pool_for(n, threads, dense_rows, &a);
}

/* One layer's scratch for m sequences, carved out of one buffer of edgellm_layer_floats(D, m) floats. */
typedef struct {
    float *n, *qkv, *att, *proj, *gu, *act, *lora, *scores;
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
    B.lora = B.act + m * D->inter;
    B.scores = B.lora + m * 3 * MAX_LORA_RANK;
    return B;
}

/* y (m, out) = W x (m, in) for one part, m <= MAX_SEQS. */
static inline void gemv_part(const WeightPart *p, const float *x, int m, float *y, int64_t ldy, void *work, int threads) {
    if (p->kind == WEIGHT_BF16 || p->kind == WEIGHT_F32)
        dense_gemv(p->data, p->kind == WEIGHT_BF16 ? DTYPE_BF16 : DTYPE_F32, x, m, p->n, p->ka, y, ldy, threads);
    else if (p->kind == WEIGHT_INT4)
        edgellm_int4_gemv(x, m, p->ka, p->data, p->scale_zero, p->n, p->kw, p->group, y, ldy, work, threads);
    else edgellm_block_gemv(x, m, p->ka, p->data, (int)p->kind, p->n, p->scale_zero, y, ldy, work, threads);
}

int edgellm_int8_gemm_takes(int form);
int64_t edgellm_int8_act_bytes(int64_t t, int64_t k);
int64_t edgellm_int8_quantize_pooled(const float *x, int64_t t, int64_t k, int r, void *act, int32_t *at,
                                     float *values, int32_t *channels, int threads);
void edgellm_int8_gemm_weight(const void *act, int64_t t, int64_t k, const uint8_t *weight, const uint16_t *scale_zero,
                              int64_t n, int form, float *out, int64_t ldo, const int32_t *channels, int64_t u,
                              const int32_t *at, const float *values, int r, int threads);

/* Each token's largest activations the int8 prompt GEMM multiplies in fp32 (kernels/int8_prompt.py OUTLIERS
   says why 8) */
#define PROMPT_OUTLIERS 8

static inline int64_t layer_widest(const LayerDims *D) {
    int64_t qd = D->n_heads * D->head_dim, w = D->hidden > D->inter ? D->hidden : D->inter;
    return w > qd ? w : qd;
}

static inline int64_t round_up64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* The layer functions' `work`: the GEMVs' quantized activations (MAX_SEQS rows), then for prompt rows
   the int8 GEMM's (m rows) with each token's outliers and their channels. */
int64_t edgellm_block_gemv_work(int m, int64_t k);

static inline int64_t gemv_work_bytes(const LayerDims *D) {
    return round_up64(edgellm_block_gemv_work(MAX_SEQS, layer_widest(D)));
}

static inline int64_t prompt_work_bytes(const LayerDims *D, int m) {
    int64_t k = layer_widest(D);
    return round_up64(edgellm_int8_act_bytes(m, k)) + round_up64(2 * 4 * (int64_t)m * PROMPT_OUTLIERS) + 4 * k;
}

/* y (m, out) = W x for a prompt's m > MAX_SEQS rows: the parts the int8 GEMM takes through it, their
   activations quantized once for all of them, each strip of the weight packed as it is used; the other
   parts (and all where this build has no int8 GEMM) as GEMVs of MAX_SEQS rows. */
static inline void prompt_gemm(const LayerDims *D, const Projection *w, const float *x, int m, float *y, int64_t ldy,
                               void *work, int threads) {
    int64_t k = w->parts[0].ka, u = 0;
    int r = k < PROMPT_OUTLIERS ? (int)k : PROMPT_OUTLIERS, int8 = 0, takes[MAX_PARTS];
    for (int64_t i = 0; i < w->count; i++) int8 |= takes[i] = edgellm_int8_gemm_takes((int)w->parts[i].int8_form);
    uint8_t *act = (uint8_t *)work + gemv_work_bytes(D);
    int32_t *at = (int32_t *)(act + round_up64(edgellm_int8_act_bytes(m, k)));
    float *values = (float *)(at + (int64_t)m * r);
    int32_t *channels = (int32_t *)(at + round_up64(2 * 4 * (int64_t)m * PROMPT_OUTLIERS) / 4);
    if (int8) u = edgellm_int8_quantize_pooled(x, m, k, r, act, at, values, channels, threads);
    for (int64_t i = 0; i < w->count; i++) {
        const WeightPart *p = &w->parts[i];
        if (takes[i])
            edgellm_int8_gemm_weight(act, m, k, p->data, p->scale_zero, p->n, (int)p->int8_form, y, ldy, channels, u,
                                     at, values, r, threads);
        else
            for (int i0 = 0; i0 < m; i0 += MAX_SEQS)
                gemv_part(p, x + i0 * k, m - i0 < MAX_SEQS ? m - i0 : MAX_SEQS, y + i0 * ldy, ldy, work, threads);
        y += p->n;
    }
}

/* y (m, out) = W x (m, in) for every part of the projection, parts side by side in each row. */
static inline void gemv(const LayerDims *D, const Projection *w, const float *x, int m, float *y, int64_t ldy,
                        void *work, int threads) {
    if (m > MAX_SEQS) {
        prompt_gemm(D, w, x, m, y, ldy, work, threads);
        return;
    }
    for (int64_t i = 0; i < w->count; i++) {
        gemv_part(&w->parts[i], x, m, y, ldy, work, threads);
        y += w->parts[i].n;
    }
}

/* out[i] = RMSNorm(x[i]) * w for m rows of `hidden` (out may be x). */
static inline void norm_rows(const LayerDims *D, const float *x, const float *w, int m, float *out) {
    for (int i = 0; i < m; i++) rms_norm(x + i * D->hidden, w, D->hidden, D->eps, out + i * D->hidden);
}

/* B->qkv = W_qkv RMSNorm(x) (+ each row's LoRA) (+ bias), then each q and k head normed (q_norm /
   k_norm) and rotated: the attention input of every decoder layer. bias, q_norm, k_norm and lora
   (one adapter per row, lora_ops.h) may be NULL. */
static inline void attention_in(const LayerDims *D, const float *x, const float *attn_norm, const Projection *qkv,
                                const float *bias, const float *q_norm, const float *k_norm, const float *cos,
                                const float *sin, int m, const LoraLayer *const *lora, const LayerBuffers *B, void *work,
                                int threads) {
    int64_t d = D->head_dim, width = qkv_width(D), widths[3] = {D->n_heads * d, D->n_kv * d, D->n_kv * d};
    norm_rows(D, x, attn_norm, m, B->n);
    gemv(D, qkv, B->n, m, B->qkv, width, work, threads);
    lora_add(lora, LORA_Q, 3, widths, B->n, D->hidden, m, B->qkv, width, B->lora, threads);
    for (int i = 0; i < m; i++) {
        float *row = B->qkv + i * width;
        if (bias)
            for (int64_t j = 0; j < width; j++) row[j] += bias[j];
        for (int64_t h = 0; h < D->n_heads + D->n_kv; h++)  /* q heads, then k heads */
            norm_rope_head(row + h * d, d, h < D->n_heads ? q_norm : k_norm, D->eps, cos + i * d, sin + i * d);
    }
}

/* After q, k, v of every sequence in B->qkv are final: store each k, v, attend over its own cache,
   and project: B->proj = W_o attn (+ each row's LoRA). */
static inline void attention_out(const LayerDims *D, const Projection *o, KVSlots *caches, const int64_t *pos, int m,
                                 const LoraLayer *const *lora, const LayerBuffers *B, void *work, int threads) {
    int64_t d = D->head_dim, qd = D->n_heads * d, kvd = D->n_kv * d, width = qkv_width(D), slots[ATT_MAX_ROWS];
    /* Rows of one sequence come in order, each seeing the ones before it (attention masks the later
       ones' keys); but a new key must not overwrite a ring slot that an earlier row still sees. So
       waves: each wave's keys written, then the wave attended in one call; a ring's row joins its
       sequence's wave only where its slot is still empty (a young ring: a prompt's first window). */
    for (int i0 = 0, i1; i0 < m; i0 = i1) {
        for (i1 = i0 + 1; i1 < m && i1 - i0 < ATT_MAX_ROWS; i1++) {
            const KVSlots *c = &caches[i1];
            int repeated = 0;
            for (int j = i0; j < i1; j++)
                repeated |= caches[j].pages == c->pages && c->slot_pos
                            && (c->slot_pos[pos[i1] % c->capacity] >= 0 || pos[i1] - pos[j] >= c->capacity);
            if (repeated) break;
        }
        for (int i = i0; i < i1; i++) {
            const float *qkv = B->qkv + i * width;
            slots[i - i0] = kv_write(&caches[i], qkv + qd, qkv + qd + kvd, D->n_kv, d, pos[i]);
        }
        attend_rows(caches + i0, B->qkv + i0 * width, width, i1 - i0, D->n_heads, D->n_kv, d, D->scale, D->softcap,
                    slots, pos + i0, B->scores, B->att + i0 * qd, qd, threads);
    }
    gemv(D, o, B->att, m, B->proj, D->hidden, work, threads);
    lora_add(lora, LORA_O, 1, &D->hidden, B->att, qd, m, B->proj, D->hidden, B->lora, threads);
}

/* B->proj = W_down (act(W_gate m) * W_up m) for m in B->n (gate and up fused, gate first);
   act is ACT_SILU or ACT_GELU_TANH (activation.h); each projection plus each row's LoRA. */
static inline void gated_mlp(const LayerDims *D, const Projection *gate_up, const Projection *down, int act, int m,
                             const LoraLayer *const *lora, const LayerBuffers *B, void *work, int threads) {
    int64_t widths[2] = {D->inter, D->inter};
    gemv(D, gate_up, B->n, m, B->gu, 2 * D->inter, work, threads);
    lora_add(lora, LORA_GATE, 2, widths, B->n, D->hidden, m, B->gu, 2 * D->inter, B->lora, threads);
    for (int i = 0; i < m; i++) {
        const float *gate = B->gu + i * 2 * D->inter, *up = gate + D->inter;
        for (int64_t j = 0; j < D->inter; j += VL)
            vf_store(B->act + i * D->inter + j, vf_mul(activate(vf_load(gate + j), act), vf_load(up + j)));
    }
    gemv(D, down, B->act, m, B->proj, D->hidden, work, threads);
    lora_add(lora, LORA_DOWN, 1, &D->hidden, B->act, D->inter, m, B->proj, D->hidden, B->lora, threads);
}

/* x[i] += B->proj[i] for m rows of `hidden` */
static inline void add_rows(float *x, const float *y, int m, int64_t hidden) {
    for (int64_t j = 0; j < m * hidden; j += VL) vf_store(x + j, vf_add(vf_load(x + j), vf_load(y + j)));
}
