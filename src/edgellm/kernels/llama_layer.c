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
    int64_t hidden, n_heads, n_kv, head_dim, inter, max_len;
    float eps, scale;
    const float *attn_norm, *mlp_norm, *qkv_bias;  /* qkv_bias may be NULL */
    Int4Weight qkv, o, gate_up, down;
} LlamaLayer;

int64_t edgellm_llama_layer_floats(const LlamaLayer *L) {
    int64_t qd = L->n_heads * L->head_dim, kvd = L->n_kv * L->head_dim;
    return L->hidden * 2 + qd * 2 + 2 * kvd + 3 * L->inter + L->n_heads * L->max_len;
}

/* x (hidden) is updated in place. `buf` holds edgellm_llama_layer_floats(L) floats; `work`
   is edgellm_int4_gemv's scratch. */
void edgellm_llama_layer(const LlamaLayer *L, float *x, const float *cos, const float *sin, KVSlots *cache,
                         int64_t pos, float *buf, void *work, int threads) {
    int64_t d = L->head_dim, qd = L->n_heads * d, kvd = L->n_kv * d;
    float *n = buf, *qkv = n + L->hidden, *att = qkv + qd + 2 * kvd, *proj = att + qd;
    float *gu = proj + L->hidden, *act = gu + 2 * L->inter, *scores = act + L->inter;

    rms_norm(x, L->attn_norm, L->hidden, L->eps, n);
    gemv(&L->qkv, n, qkv, work, threads);
    if (L->qkv_bias)
        for (int64_t i = 0; i < qd + 2 * kvd; i++) qkv[i] += L->qkv_bias[i];
    for (int64_t h = 0; h < L->n_heads + L->n_kv; h++) rope(qkv + h * d, cos, sin, d);
    int64_t slots = kv_write(cache, qkv + qd, qkv + qd + kvd, L->n_kv, d, pos);
    attend(cache, qkv, L->n_heads, L->n_kv, d, L->scale, slots, pos, scores, att, threads);
    gemv(&L->o, att, proj, work, threads);
    for (int64_t i = 0; i < L->hidden; i++) x[i] += proj[i];

    rms_norm(x, L->mlp_norm, L->hidden, L->eps, n);
    gemv(&L->gate_up, n, gu, work, threads);
    for (int64_t i = 0; i < L->inter; i++) {
        float g = gu[i];
        act[i] = g / (1.f + expf(-g)) * gu[L->inter + i];
    }
    gemv(&L->down, act, proj, work, threads);
    for (int64_t i = 0; i < L->hidden; i++) x[i] += proj[i];
}
