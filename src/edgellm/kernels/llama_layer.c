/* One Llama decoder layer for one new token, end to end in C (the decode hot path).

   The same equations as models/llama.py, for a single sequence and a single position:

     n = RMSNorm(x) * w_attn
     q, k, v = W_qkv n (+ b);  q, k = RoPE(q), RoPE(k)
     K[pos], V[pos] = k, v;    a_h = softmax(q_h K_g^T * scale) V_g,  g = h / (Hq / Hkv)
     x += W_o a
     m = RMSNorm(x) * w_mlp;   x += W_down (silu(W_gate m) * W_up m)

   Every matmul is edgellm_int4_gemv on torch's packed INT4 bytes (int4_gemv.c); the KV cache
   is the layer's own fp32 store, written in place. Python calls this once per layer instead
   of ~70 eager ops (kernels/decode.py decides when it applies). */
#include "layer_ops.h"

typedef struct {
    LayerDims dims;
    const float *attn_norm, *mlp_norm, *qkv_bias;  /* qkv_bias may be NULL */
    Projection qkv, o, gate_up, down;
} LlamaLayer;

static inline float silu(float g) { return g / (1.f + expf(-g)); }

/* x (hidden) is updated in place. `buf` holds edgellm_layer_floats(&L->dims) floats; `work`
   is edgellm_int4_gemv's scratch. */
void edgellm_llama_layer(const LlamaLayer *L, float *x, const float *cos, const float *sin, KVSlots *cache,
                         int64_t pos, float *buf, void *work, int threads) {
    const LayerDims *D = &L->dims;
    int64_t d = D->head_dim, width = (D->n_heads + 2 * D->n_kv) * d;
    LayerBuffers B = layer_buffers(D, buf);

    rms_norm(x, L->attn_norm, D->hidden, D->eps, B.n);
    gemv(&L->qkv, B.n, B.qkv, work, threads);
    if (L->qkv_bias)
        for (int64_t i = 0; i < width; i++) B.qkv[i] += L->qkv_bias[i];
    for (int64_t h = 0; h < D->n_heads + D->n_kv; h++) rope(B.qkv + h * d, cos, sin, d);
    attention_out(D, &L->o, cache, pos, &B, work, threads);
    for (int64_t i = 0; i < D->hidden; i++) x[i] += B.proj[i];

    rms_norm(x, L->mlp_norm, D->hidden, D->eps, B.n);
    gated_mlp(D, &L->gate_up, &L->down, silu, &B, work, threads);
    for (int64_t i = 0; i < D->hidden; i++) x[i] += B.proj[i];
}
