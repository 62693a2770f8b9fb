/* One Gemma 3 decoder layer for one new token, in C: the equations of models/gemma3.py.

     n = PreNorm_attn(x);  q, k, v = W_qkv n;  q = RoPE(QNorm(q)), k = RoPE(KNorm(k))
     x += PostNorm_attn(W_o Attn(q, K, V))      sliding layers: a ring of the window
     m = PreNorm_mlp(x);   x += PostNorm_mlp(W_down (gelu_tanh(W_gate m) * W_up m)) */
#include "layer_ops.h"

typedef struct {
    LayerDims dims;
    const float *attn_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm, *q_norm, *k_norm;
    Projection qkv, o, gate_up, down;
} GemmaLayer;

static inline float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

void edgellm_gemma3_layer(const GemmaLayer *L, float *x, const float *cos, const float *sin, KVSlots *cache,
                          int64_t pos, float *buf, void *work, int threads) {
    const LayerDims *D = &L->dims;
    int64_t d = D->head_dim;
    LayerBuffers B = layer_buffers(D, buf);

    rms_norm(x, L->attn_norm, D->hidden, D->eps, B.n);
    gemv(&L->qkv, B.n, B.qkv, work, threads);
    for (int64_t h = 0; h < D->n_heads + D->n_kv; h++) {  /* q heads, then k heads */
        rms_norm(B.qkv + h * d, h < D->n_heads ? L->q_norm : L->k_norm, d, D->eps, B.qkv + h * d);
        rope(B.qkv + h * d, cos, sin, d);
    }
    attention_out(D, &L->o, cache, pos, &B, work, threads);
    rms_norm(B.proj, L->post_attn_norm, D->hidden, D->eps, B.proj);
    for (int64_t i = 0; i < D->hidden; i++) x[i] += B.proj[i];

    rms_norm(x, L->mlp_norm, D->hidden, D->eps, B.n);
    gated_mlp(D, &L->gate_up, &L->down, gelu_tanh, &B, work, threads);
    rms_norm(B.proj, L->post_mlp_norm, D->hidden, D->eps, B.proj);
    for (int64_t i = 0; i < D->hidden; i++) x[i] += B.proj[i];
}
