/* One Llama decoder layer for one new token of each of m sequences, end to end in C (the decode
   hot path).

   The same equations as models/llama.py, for one position per sequence:

     n = RMSNorm(x) * w_attn
     q, k, v = W_qkv n (+ b);  q, k = RoPE(q), RoPE(k)   (Qwen3: RoPE(QNorm(q)), RoPE(KNorm(k)) per head)
     K[pos], V[pos] = k, v;    a_h = softmax(q_h K_g^T * scale) V_g,  g = h / (Hq / Hkv)
     x += W_o a
     m = RMSNorm(x) * w_mlp;   x += W_down (silu(W_gate m) * W_up m)

   The m sequences share every weight read (one GEMV of m rows per projection); each attends over
   its own cache. Python calls this once per layer instead of ~70 eager ops (kernels/decode.py
   decides when it applies). */
#include "layer_ops.h"

/* x (m, hidden) is updated in place; cos, sin (m, head_dim) hold each sequence's position's angles.
   `buf` holds edgellm_layer_floats(&L->dims, m) floats; `work` the GEMVs' scratch. */
void edgellm_llama_layer(const LlamaLayer *L, float *x, int m, const float *cos, const float *sin, KVSlots *caches,
                         const int64_t *pos, float *buf, void *work, int threads) {
    const LayerDims *D = &L->dims;
    int64_t d = D->head_dim, width = qkv_width(D);
    LayerBuffers B = layer_buffers(D, m, buf);

    for (int i = 0; i < m; i++) rms_norm(x + i * D->hidden, L->attn_norm, D->hidden, D->eps, B.n + i * D->hidden);
    gemv(&L->qkv, B.n, m, B.qkv, width, work, threads);
    for (int i = 0; i < m; i++) {
        float *qkv = B.qkv + i * width;
        if (L->qkv_bias)
            for (int64_t j = 0; j < width; j++) qkv[j] += L->qkv_bias[j];
        for (int64_t h = 0; h < D->n_heads + D->n_kv; h++)  /* q heads, then k heads */
            norm_rope_head(qkv + h * d, d, h < D->n_heads ? L->q_norm : L->k_norm, D->eps, cos + i * d, sin + i * d);
    }
    attention_out(D, &L->o, caches, pos, m, &B, work, threads);
    add_rows(x, B.proj, m, D->hidden);

    for (int i = 0; i < m; i++) rms_norm(x + i * D->hidden, L->mlp_norm, D->hidden, D->eps, B.n + i * D->hidden);
    gated_mlp(D, &L->gate_up, &L->down, ACT_SILU, m, &B, work, threads);
    add_rows(x, B.proj, m, D->hidden);
}
