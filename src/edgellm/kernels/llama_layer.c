/* One Llama decoder layer for one new token of each of m sequences, end to end in C (the decode
   hot path).

   The same equations as models/llama.py, for one position per sequence:

     n = RMSNorm(x) * w_attn
     q, k, v = W_qkv n (+ b);  q, k = RoPE(q), RoPE(k)   (Qwen3: RoPE(QNorm(q)), RoPE(KNorm(k)) per head)
     K[pos], V[pos] = k, v;    a_h = softmax(q_h K_g^T * scale) V_g,  g = h / (Hq / Hkv)
     x += W_o a
     m = RMSNorm(x) * w_mlp;   x += W_down (silu(W_gate m) * W_up m)

   The m sequences share every weight read (one GEMV of m rows per projection); each attends over
   its own cache. edgellm_decoder_layers (layer_ops.c) runs it for every layer in one call from
   Python, instead of ~70 eager ops per layer (models/native/decoder.py decides when it applies). */
#include "layer_ops.h"

/* x (m, hidden) is updated in place; cos, sin (m, head_dim) hold each sequence's position's angles.
   `buf` holds edgellm_layer_floats(&L->dims, m) floats; `work` the GEMVs' scratch; `lora` NULL or one
   adapter per row (NULL: that row runs the base alone). */
void edgellm_llama_layer(const LlamaLayer *L, float *x, int m, const float *cos, const float *sin, KVSlots *caches,
                         const int64_t *pos, float *buf, void *work, int threads, const LoraLayer *const *lora) {
    const LayerDims *D = &L->dims;
    LayerBuffers B = layer_buffers(D, m, buf);

    attention_in(D, x, L->attn_norm, &L->qkv, L->qkv_bias, L->q_norm, L->k_norm, cos, sin, m, lora, &B, work, threads);
    attention_out(D, &L->o, caches, pos, m, lora, &B, work, threads);
    add_rows(x, B.proj, m, D->hidden);

    norm_rows(D, x, L->mlp_norm, m, B.n);
    gated_mlp(D, &L->gate_up, &L->down, ACT_SILU, m, lora, &B, work, threads);
    add_rows(x, B.proj, m, D->hidden);
}
