/* One Gemma 3 decoder layer for one new token, in C: the equations of models/gemma3.py.

     n = PreNorm_attn(x);  q, k, v = W_qkv n;  q = RoPE(QNorm(q)), k = RoPE(KNorm(k))
     x += PostNorm_attn(W_o Attn(q, K, V))      sliding layers: a ring of the window
     m = PreNorm_mlp(x);   x += PostNorm_mlp(W_down (gelu_tanh(W_gate m) * W_up m)) */
#include "layer_ops.h"

typedef struct {
    int64_t hidden, n_heads, n_kv, head_dim, inter, max_len;
    float eps, scale;
    const float *attn_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm, *q_norm, *k_norm;
    Int4Weight qkv, o, gate_up, down;
} GemmaLayer;

int64_t edgellm_gemma3_layer_floats(const GemmaLayer *L) {
    int64_t qd = L->n_heads * L->head_dim, kvd = L->n_kv * L->head_dim;
    return L->hidden * 2 + qd * 2 + 2 * kvd + 3 * L->inter + L->n_heads * L->max_len;
}

static inline float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

void edgellm_gemma3_layer(const GemmaLayer *L, float *x, const float *cos, const float *sin, KVSlots *cache,
                          int64_t pos, float *buf, void *work, int threads) {
    int64_t d = L->head_dim, qd = L->n_heads * d, kvd = L->n_kv * d;
    float *n = buf, *qkv = n + L->hidden, *att = qkv + qd + 2 * kvd, *proj = att + qd;
    float *gu = proj + L->hidden, *act = gu + 2 * L->inter, *scores = act + L->inter;

    rms_norm(x, L->attn_norm, L->hidden, L->eps, n);
    gemv(&L->qkv, n, qkv, work, threads);
    for (int64_t h = 0; h < L->n_heads; h++) {
        rms_norm(qkv + h * d, L->q_norm, d, L->eps, qkv + h * d);
        rope(qkv + h * d, cos, sin, d);
    }
    for (int64_t h = L->n_heads; h < L->n_heads + L->n_kv; h++) {
        rms_norm(qkv + h * d, L->k_norm, d, L->eps, qkv + h * d);
        rope(qkv + h * d, cos, sin, d);
    }
    int64_t slots = kv_write(cache, qkv + qd, qkv + qd + kvd, L->n_kv, d, pos);
    attend(cache, qkv, L->n_heads, L->n_kv, d, L->scale, slots, pos, scores, att, threads);
    gemv(&L->o, att, proj, work, threads);
    rms_norm(proj, L->post_attn_norm, L->hidden, L->eps, proj);
    for (int64_t i = 0; i < L->hidden; i++) x[i] += proj[i];

    rms_norm(x, L->mlp_norm, L->hidden, L->eps, n);
    gemv(&L->gate_up, n, gu, work, threads);
    for (int64_t i = 0; i < L->inter; i++) act[i] = gelu_tanh(gu[i]) * gu[L->inter + i];
    gemv(&L->down, act, proj, work, threads);
    rms_norm(proj, L->post_mlp_norm, L->hidden, L->eps, proj);
    for (int64_t i = 0; i < L->hidden; i++) x[i] += proj[i];
}
