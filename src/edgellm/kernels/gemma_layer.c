/* One Gemma 2 / Gemma 3 decoder layer for one new token of each of m sequences, in C: the
   equations of models/gemma.py (Gemma 2: no q/k norms (NULL), soft-capped scores: dims.softcap).

     n = PreNorm_attn(x);  q, k, v = W_qkv n;  q = RoPE(QNorm(q)), k = RoPE(KNorm(k))
     x += PostNorm_attn(W_o Attn(q, K, V))      sliding layers: a ring of the window
     m = PreNorm_mlp(x);   x += PostNorm_mlp(W_down (gelu_tanh(W_gate m) * W_up m)) */
#include "layer_ops.h"

void edgellm_gemma_layer(const GemmaLayer *L, float *x, int m, const float *cos, const float *sin, KVSlots *caches,
                          const int64_t *pos, float *buf, void *work, int threads, const LoraLayer *const *lora) {
    const LayerDims *D = &L->dims;
    LayerBuffers B = layer_buffers(D, m, buf);

    attention_in(D, x, L->attn_norm, &L->qkv, NULL, L->q_norm, L->k_norm, cos, sin, m, lora, &B, work, threads);
    attention_out(D, &L->o, caches, pos, m, lora, &B, work, threads);
    norm_rows(D, B.proj, L->post_attn_norm, m, B.proj);  /* Gemma norms a sublayer's output before the add */
    add_rows(x, B.proj, m, D->hidden);

    norm_rows(D, x, L->mlp_norm, m, B.n);
    gated_mlp(D, &L->gate_up, &L->down, ACT_GELU_TANH, m, lora, &B, work, threads);
    norm_rows(D, B.proj, L->post_mlp_norm, m, B.proj);
    add_rows(x, B.proj, m, D->hidden);
}
