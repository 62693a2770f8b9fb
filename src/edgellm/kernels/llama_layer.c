/* One Llama decoder layer for one new token, end to end in C (the decode hot path).

   The same equations as models/llama.py, for a single sequence and a single position:

     n = RMSNorm(x) * w_attn
     q, k, v = W_qkv n (+ b);  q, k = RoPE(q), RoPE(k)       rotate-half, full-width cos/sin
     K[pos], V[pos] = k, v;    a_h = softmax(q_h K_g^T * scale) V_g,  g = h / (Hq / Hkv)
     x += W_o a
     m = RMSNorm(x) * w_mlp;   x += W_down (silu(W_gate m) * W_up m)

   Every matmul is edgellm_int4_gemv on torch's packed INT4 bytes (int4_gemv.c); the KV cache
   is the layer's fp32 store, (Hkv, capacity, D), written in place. Python calls this once
   per layer instead of ~70 eager ops (kernels/decode.py decides when it applies). */
#include <math.h>
#include <stdint.h>
#include <string.h>

void edgellm_int4_gemv(const float *x, int m, int64_t ka, const uint8_t *packed, const uint16_t *scale_zero,
                       int64_t n, int64_t kw, int64_t group, float *y, void *work, int threads);

typedef struct {
    const uint8_t *packed;
    const uint16_t *scale_zero;
    int64_t n, kw, ka, group;  /* kw = planes * ka */
} Int4Weight;

typedef struct {
    int64_t hidden, n_heads, n_kv, head_dim, inter, max_len;
    float eps, scale;
    const float *attn_norm, *mlp_norm, *qkv_bias;  /* qkv_bias may be NULL */
    Int4Weight qkv, o, gate_up, down;
} LlamaLayer;

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

static void gemv(const Int4Weight *w, const float *x, float *y, void *work, int threads) {
    edgellm_int4_gemv(x, 1, w->ka, w->packed, w->scale_zero, w->n, w->kw, w->group, y, work, threads);
}

/* Attention of one query per head over keys/values 0..len-1 of its KV head. */
static void attend(const LlamaLayer *L, const float *q, const float *kc, const float *vc, int64_t capacity,
                   int64_t len, float *scores, float *out, int threads) {
    int64_t d = L->head_dim, per_kv = L->n_heads / L->n_kv;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < L->n_heads; h++) {
        const float *qh = q + h * d;
        const float *k = kc + (h / per_kv) * capacity * d, *v = vc + (h / per_kv) * capacity * d;
        float *s = scores + h * len, best = -INFINITY, total = 0.f;
        for (int64_t t = 0; t < len; t++) {
            float dot = 0.f;
            for (int64_t i = 0; i < d; i++) dot += qh[i] * k[t * d + i];
            s[t] = dot * L->scale;
            best = s[t] > best ? s[t] : best;
        }
        for (int64_t t = 0; t < len; t++) total += (s[t] = expf(s[t] - best));
        float *o = out + h * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t t = 0; t < len; t++) {
            float p = s[t] / total;
            for (int64_t i = 0; i < d; i++) o[i] += p * v[t * d + i];
        }
    }
}

/* x (hidden) is updated in place; the new k, v land at slot `pos` of kc / vc, stores of
   (Hkv, capacity, D) with pos < capacity and pos < max_len. `buf` holds
   edgellm_llama_layer_floats(L) floats; `work` is edgellm_int4_gemv's scratch. */
void edgellm_llama_layer(const LlamaLayer *L, float *x, const float *cos, const float *sin, float *kc, float *vc,
                         int64_t pos, int64_t capacity, float *buf, void *work, int threads) {
    int64_t d = L->head_dim, qd = L->n_heads * d, kvd = L->n_kv * d;
    float *n = buf, *qkv = n + L->hidden, *att = qkv + qd + 2 * kvd, *proj = att + qd;
    float *gu = proj + L->hidden, *act = gu + 2 * L->inter, *scores = act + L->inter;

    rms_norm(x, L->attn_norm, L->hidden, L->eps, n);
    gemv(&L->qkv, n, qkv, work, threads);
    if (L->qkv_bias)
        for (int64_t i = 0; i < qd + 2 * kvd; i++) qkv[i] += L->qkv_bias[i];
    for (int64_t h = 0; h < L->n_heads + L->n_kv; h++) rope(qkv + h * d, cos, sin, d);
    for (int64_t g = 0; g < L->n_kv; g++) {
        memcpy(kc + (g * capacity + pos) * d, qkv + qd + g * d, (size_t)d * sizeof(float));
        memcpy(vc + (g * capacity + pos) * d, qkv + qd + kvd + g * d, (size_t)d * sizeof(float));
    }
    attend(L, qkv, kc, vc, capacity, pos + 1, scores, att, threads);
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

int64_t edgellm_llama_layer_floats(const LlamaLayer *L) {
    int64_t qd = L->n_heads * L->head_dim, kvd = L->n_kv * L->head_dim;
    return L->hidden * 2 + qd * 2 + 2 * kvd + 3 * L->inter + L->n_heads * L->max_len;
}
