/* One Gemma 2 / Gemma 3 decoder layer for one new token of each of m sequences, in C: the
   equations of models/gemma.py (Gemma 2: no q/k norms (NULL), soft-capped scores: dims.softcap).

     n = PreNorm_attn(x);  q, k, v = W_qkv n;  q = RoPE(QNorm(q)), k = RoPE(KNorm(k))
     x += PostNorm_attn(W_o Attn(q, K, V))      sliding layers: a ring of the window
     m = PreNorm_mlp(x);   x += PostNorm_mlp(W_down (gelu_tanh(W_gate m) * W_up m)) */
#include "layer_ops.h"

/* Post-norm each row of B->proj in place (Gemma normalizes a sublayer's output before the residual add). */
static inline void post_norm(const LayerDims *D, const float *w, int m, float *proj) {
    for (int i = 0; i < m; i++) rms_norm(proj + i * D->hidden, w, D->hidden, D->eps, proj + i * D->hidden);
}

void edgellm_gemma_layer(const GemmaLayer *L, float *x, int m, const float *cos, const float *sin, KVSlots *caches,
                          const int64_t *pos, float *buf, void *work, int threads) {
    const LayerDims *D = &L->dims;
    int64_t d = D->head_dim, width = qkv_width(D);
    LayerBuffers B = layer_buffers(D, m, buf);

    for (int i = 0; i < m; i++) rms_norm(x + i * D->hidden, L->attn_norm, D->hidden, D->eps, B.n + i * D->hidden);
    gemv(&L->qkv, B.n, m, B.qkv, width, work, threads);
    for (int i = 0; i < m; i++)
        for (int64_t h = 0; h < D->n_heads + D->n_kv; h++)  /* q heads, then k heads */
            norm_rope_head(B.qkv + i * width + h * d, d, h < D->n_heads ? L->q_norm : L->k_norm, D->eps, cos + i * d,
                           sin + i * d);
    attention_out(D, &L->o, caches, pos, m, &B, work, threads);
    post_norm(D, L->post_attn_norm, m, B.proj);
    add_rows(x, B.proj, m, D->hidden);

    for (int i = 0; i < m; i++) rms_norm(x + i * D->hidden, L->mlp_norm, D->hidden, D->eps, B.n + i * D->hidden);
    gated_mlp(D, &L->gate_up, &L->down, ACT_GELU_TANH, m, &B, work, threads);
    post_norm(D, L->post_mlp_norm, m, B.proj);
    add_rows(x, B.proj, m, D->hidden);
}
