/* Compares two builds of the kernel library (a vector variant and the scalar reference) on the same
   pseudo-random inputs, kernel by kernel, where Python cannot run them: the NEON build under
   qemu-aarch64 (tests/kernels/test_neon.py). Prints one line per check; exits 1 if any differs
   beyond its tolerance.

   usage: variant_driver CANDIDATE.so REFERENCE.so */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/edgellm/kernels/layer_types.h"

static void *cand, *ref;
static int failures;

static void *sym(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "missing %s\n", name);
        exit(2);
    }
    return f;
}
#define BOTH(type, name) \
    type name##_c = (type)sym(cand, #name), name##_r = (type)sym(ref, #name); \
    (void)name##_c, (void)name##_r

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (uint32_t)(state >> 16);
}
static float uniform(void) { return (float)(next_u32() & 0xFFFFFF) / 16777216.f * 2.f - 1.f; }
static void fill_f32(float *x, int64_t n, float scale) { for (int64_t i = 0; i < n; i++) x[i] = uniform() * scale; }
static void fill_bytes(uint8_t *x, int64_t n) { for (int64_t i = 0; i < n; i++) x[i] = (uint8_t)next_u32(); }

static uint16_t to_half(float f) {  /* normal-range values only (above 6.1e-5) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(((u >> 16) & 0x8000) | ((((u >> 23) & 0xFF) - 112) << 10) | ((u >> 13) & 0x3FF));
}
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}
static void put_half(uint8_t *p, float f) { uint16_t h = to_half(f); memcpy(p, &h, 2); }

/* |a - b| <= tol * max |b| */
static void check(const char *what, const float *a, const float *b, int64_t n, float tol) {
    float worst = 0.f, scale = 1e-30f;
    for (int64_t i = 0; i < n; i++) scale = fabsf(b[i]) > scale ? fabsf(b[i]) : scale;
    for (int64_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        worst = d > worst || d != d ? d : worst;
    }
    int ok = worst <= tol * scale;
    printf("%s %s: max diff %.3g of %.3g\n", ok ? "ok  " : "FAIL", what, worst, scale);
    failures += !ok;
}

static float *floats(int64_t n) { return calloc((size_t)n + 64, sizeof(float)); }

typedef void (*int4_gemv_t)(const float *, int, int64_t, const uint8_t *, const uint16_t *, int64_t, int64_t, int64_t,
                            float *, int64_t, void *, int);
typedef int64_t (*work_t)(int, int64_t, int64_t);

static void test_int4_gemv(void) {
    BOTH(int4_gemv_t, edgellm_int4_gemv);
    BOTH(work_t, edgellm_int4_gemv_work);
    int64_t n = 128, ka = 256, shapes[][2] = {{1, 32}, {2, 32}, {1, 64}};
    for (int s = 0; s < 3; s++) {
        int64_t planes = shapes[s][0], group = shapes[s][1], kw = planes * ka;
        uint8_t *packed = malloc((size_t)(n * kw / 2));
        uint16_t *sz = malloc((size_t)(kw / group * n * 2) * 2);
        fill_bytes(packed, n * kw / 2);
        for (int64_t i = 0; i < kw / group * n * 2; i++) sz[i] = to_bf16(uniform() * 0.02f);
        for (int m = 1; m <= 8; m += 3) {
            float *x = floats(m * ka), *a = floats(m * n), *b = floats(m * n);
            fill_f32(x, m * ka, 3.f);
            void *work = malloc((size_t)edgellm_int4_gemv_work_c(m, ka, group));
            edgellm_int4_gemv_c(x, m, ka, packed, sz, n, kw, group, a, n, work, 1);
            edgellm_int4_gemv_r(x, m, ka, packed, sz, n, kw, group, b, n, work, 1);
            char what[96];
            snprintf(what, sizeof what, "int4_gemv planes=%lld group=%lld m=%d", (long long)planes, (long long)group, m);
            check(what, a, b, m * n, 1e-5f);
            free(x), free(a), free(b), free(work);
        }
        typedef void (*unpack_t)(const uint8_t *, const uint16_t *, int64_t, int64_t, int64_t, int, int64_t, int64_t,
                                 void *, int, int);
        BOTH(unpack_t, edgellm_int4_unpack);
        float *a = floats(ka * n), *b = floats(ka * n);
        edgellm_int4_unpack_c(packed, sz, n, kw, group, (int)planes, 64, 64, a, 0, 1);
        edgellm_int4_unpack_r(packed, sz, n, kw, group, (int)planes, 64, 64, b, 0, 1);
        check("int4_unpack fp32", a, b, ka * 64, 1e-6f);
        free(a), free(b), free(packed), free(sz);
    }
}

/* n rows of random blocks of `type` with finite scales around `d`. */
static uint8_t *random_blocks(int type, int64_t n, int64_t k, float d, int64_t *row_bytes) {
    int64_t bb = type == 8 ? 34 : type == 6 ? 22 : type == 13 ? 176 : type == 14 ? 210 : 32;
    int64_t per = type == 13 || type == 14 ? 256 : 32;
    *row_bytes = k / per * bb;
    uint8_t *blocks = malloc((size_t)(n * *row_bytes));
    fill_bytes(blocks, n * *row_bytes);
    for (int64_t b = 0; b < n * k / per; b++) {
        uint8_t *p = blocks + b * bb;
        if (type == 8 || type == 6) put_half(p, d * (1.f + 0.5f * uniform()));
        if (type == 13) put_half(p, d * (1.f + 0.5f * uniform())), put_half(p + 2, d * (1.f + 0.5f * uniform()));
        if (type == 14) put_half(p + 208, d * (1.f + 0.5f * uniform()));
    }
    return blocks;
}

static void test_block_gemv(void) {
    typedef void (*gemv_t)(const float *, int, int64_t, const uint8_t *, int, int64_t, const uint16_t *, float *,
                           int64_t, void *, int);
    typedef int64_t (*bwork_t)(int, int64_t);
    typedef void (*to_float_t)(const uint8_t *, int, int64_t, int64_t, const uint16_t *, void *, int, int);
    BOTH(gemv_t, edgellm_block_gemv);
    BOTH(bwork_t, edgellm_block_gemv_work);
    BOTH(to_float_t, edgellm_blocks_to_float);
    typedef void (*repack_t)(const uint8_t *, int64_t, int64_t, uint8_t *, int);
    BOTH(repack_t, edgellm_q8_0_to_q8r16);
    int types[] = {8, 6, 13, 14, 24, 100};
    const char *names[] = {"Q8_0", "Q5_0", "Q5_K", "Q6_K", "I8", "Q8R16"};
    int64_t n = 48, k = 512, rb;
    for (int t = 0; t < 6; t++) {
        uint8_t *blocks = random_blocks(types[t] == 100 ? 8 : types[t], n, k, 0.01f, &rb);
        if (types[t] == 100) {  /* Q8_0 rows interleaved by 16: both builds write the same bytes */
            uint8_t *a = malloc((size_t)(n * rb)), *b = malloc((size_t)(n * rb));
            edgellm_q8_0_to_q8r16_c(blocks, n, k, a, 2);
            edgellm_q8_0_to_q8r16_r(blocks, n, k, b, 1);
            int same = memcmp(a, b, (size_t)(n * rb)) == 0;
            printf("%s q8_0_to_q8r16\n", same ? "ok  " : "FAIL");
            failures += !same;
            free(blocks), free(b);
            blocks = a;
        }
        uint16_t *row_scale = NULL;
        if (types[t] == 24) {
            row_scale = malloc((size_t)n * 2);
            for (int64_t r = 0; r < n; r++) row_scale[r] = to_bf16(0.01f * (1.5f + uniform()));
        }
        for (int m = 1; m <= 8; m += 7) {
            float *x = floats(m * k), *a = floats(m * n), *b = floats(m * n);
            fill_f32(x, m * k, 2.f);
            void *work = malloc((size_t)edgellm_block_gemv_work_c(m, k));
            edgellm_block_gemv_c(x, m, k, blocks, types[t], n, row_scale, a, n, work, 1);
            edgellm_block_gemv_r(x, m, k, blocks, types[t], n, row_scale, b, n, work, 1);
            char what[64];
            snprintf(what, sizeof what, "block_gemv %s m=%d", names[t], m);
            check(what, a, b, m * n, types[t] == 100 ? 0.f : 1e-5f);  /* Q8R16: the same floats */
            free(x), free(a), free(b), free(work);
        }
        float *a = floats(n * k), *b = floats(n * k);
        edgellm_blocks_to_float_c(blocks, types[t], n, k, row_scale, a, 0, 1);
        edgellm_blocks_to_float_r(blocks, types[t], n, k, row_scale, b, 0, 1);
        char what[64];
        snprintf(what, sizeof what, "blocks_to_float %s", names[t]);
        check(what, a, b, n * k, 1e-6f);
        free(a), free(b), free(blocks), free(row_scale);
    }
}

static void test_attention(void) {
    typedef void (*att_t)(const float *, int64_t, int64_t, const float *, const float *, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float, const uint8_t *, int64_t, float *, float *,
                          int);
    typedef int64_t (*awork_t)(int64_t, int64_t, int64_t, int);
    typedef int (*flag_t)(int64_t);
    BOTH(att_t, edgellm_attention);
    BOTH(awork_t, edgellm_attention_work);
    BOTH(flag_t, edgellm_attention_bf16_values);
    int64_t H = 6, Hkv = 2, D = 64, cases[][3] = {{37, 37, 0}, {9, 70, 0}, {40, 80, 24}};
    for (int c = 0; c < 3; c++) {
        int64_t T = cases[c][0], S = cases[c][1], window = cases[c][2];
        float tol = edgellm_attention_bf16_values_c(T) ? 1e-2f : 1e-5f;  /* P.V in bf16: relative 2^-9 */
        float *q = floats(T * H * D), *k = floats(Hkv * S * D), *v = floats(Hkv * S * D);
        float *a = floats(T * H * D), *b = floats(T * H * D);
        fill_f32(q, T * H * D, 2.f), fill_f32(k, Hkv * S * D, 1.f), fill_f32(v, Hkv * S * D, 1.f);
        float *work = floats(edgellm_attention_work_c(S, Hkv, D, 1));
        float cap = c == 1 ? 3.f : 0.f;  /* Gemma 2's soft-capped scores in one case */
        edgellm_attention_c(q, H * D, D, k, v, S * D, D, T, S, H, Hkv, D, 0.125f, cap, NULL, window, a, work, 1);
        edgellm_attention_r(q, H * D, D, k, v, S * D, D, T, S, H, Hkv, D, 0.125f, cap, NULL, window, b, work, 1);
        char what[64];
        snprintf(what, sizeof what, "attention T=%lld S=%lld window=%lld", (long long)T, (long long)S, (long long)window);
        check(what, a, b, T * H * D, tol);
        free(q), free(k), free(v), free(a), free(b), free(work);
    }
}

/* Decode attention's rows of one sequence in one call (a prompt's piece) against each row alone, in
   ONE build: the floats must be the same bit for bit (greedy speculation relies on it). Alone, a
   row's page holds NaN past its position, as a sequence's last page does. */
#define RT_HKV 2
#define RT_D 64
#define RT_PAGE 30
#define RT_PAGES 9
typedef int64_t (*decode_att_t)(const KVSlots *, const float *, int, int64_t, int64_t, int64_t, float, float,
                                const int64_t *, const int64_t *, float *, float *, int);
typedef int64_t (*decode_att_floats_t)(int64_t, int64_t, int64_t, int64_t, int, int);
typedef void (*kv_encode_t)(const float *, int64_t, int64_t, void *, uint16_t *, uint16_t *, int64_t);

/* pages of one sequence's keys k and values v (RT_HKV x RT_PAGES * RT_PAGE x RT_D) in `codec`, slots
   from `written` on NaN; their buffers in mem (2 per store) */
static void rows_cache(kv_encode_t encode, int codec, const float *k, const float *v, int64_t written,
                       KVPage *pages, void **mem) {
    int64_t bytes = codec == KV_F32 ? 4 * RT_D : RT_D, scales = RT_D / 16, slots = RT_PAGES * RT_PAGE;
    for (int p = 0; p < RT_PAGES; p++)
        for (int kv = 0; kv < 2; kv++) {
            uint8_t *q = malloc((size_t)(RT_HKV * RT_PAGE * bytes));
            uint16_t *scale = malloc((size_t)(RT_HKV * RT_PAGE * scales) * 2);
            for (int64_t g = 0; g < RT_HKV; g++)
                for (int64_t t = 0; t < RT_PAGE; t++) {
                    int64_t row = g * RT_PAGE + t, slot = p * RT_PAGE + t;
                    if (slot < written) {
                        encode((kv ? v : k) + (g * slots + slot) * RT_D, 1, RT_D, q + row * bytes, scale + row * scales,
                               NULL, codec);
                    } else {
                        memset(q + row * bytes, 0xFF, (size_t)bytes);  /* f32: NaN */
                        for (int64_t i = 0; i < scales; i++) scale[row * scales + i] = 0x7E00;  /* f16 NaN */
                    }
                }
            KVStore store = {q, scale, NULL, codec};
            if (kv) pages[p].v = store; else pages[p].k = store;
            mem[2 * (2 * p + kv)] = q, mem[2 * (2 * p + kv) + 1] = scale;
        }
}

static void test_rows_together_in(void *lib, const char *name) {
    decode_att_t attend = (decode_att_t)sym(lib, "edgellm_decode_attention");
    decode_att_floats_t need = (decode_att_floats_t)sym(lib, "edgellm_decode_attention_floats");
    kv_encode_t encode = (kv_encode_t)sym(lib, "edgellm_kv_encode");
    int64_t slots = RT_PAGES * RT_PAGE, firsts[] = {0, 250};
    float *k = floats(RT_HKV * slots * RT_D), *v = floats(RT_HKV * slots * RT_D);
    fill_f32(k, RT_HKV * slots * RT_D, 1.f), fill_f32(v, RT_HKV * slots * RT_D, 1.f);
    for (int codec = KV_F32; codec <= KV_INT8; codec += KV_INT8 - KV_F32)
        for (int group = 1; group <= 3; group++)
            for (int f = 0; f < 2; f++) {
                int64_t heads = group * RT_HKV, pos[8], filled[8];
                float *q = floats(8 * heads * RT_D), *together = floats(8 * heads * RT_D), *alone = floats(heads * RT_D);
                float *scratch = floats(need(heads, RT_HKV, RT_D, slots, 8, 1));
                fill_f32(q, 8 * heads * RT_D, 2.f);
                KVPage pages[RT_PAGES];
                void *mem[4 * RT_PAGES];
                KVSlots table[8];
                for (int j = 0; j < 8; j++) pos[j] = firsts[f] + j, filled[j] = pos[j] + 1;
                rows_cache(encode, codec, k, v, pos[7] + 1, pages, mem);
                for (int j = 0; j < 8; j++) table[j] = (KVSlots){pages, RT_PAGE, slots, NULL, slots};
                attend(table, q, 8, heads, RT_HKV, RT_D, 0.125f, 0.f, filled, pos, scratch, together, 1);
                for (int i = 0; i < 4 * RT_PAGES; i++) free(mem[i]);
                int same = 1;
                for (int j = 0; j < 8; j++) {
                    rows_cache(encode, codec, k, v, pos[j] + 1, pages, mem);
                    attend(table, q + j * heads * RT_D, 1, heads, RT_HKV, RT_D, 0.125f, 0.f, filled + j, pos + j, scratch,
                           alone, 1);
                    same &= !memcmp(alone, together + j * heads * RT_D, (size_t)(heads * RT_D) * sizeof(float));
                    for (int i = 0; i < 4 * RT_PAGES; i++) free(mem[i]);
                }
                printf("%s %s decode attention: 8 rows of one sequence at %lld.. (%s KV, %d heads a KV head) "
                       "as each alone, bit for bit\n", same ? "ok  " : "FAIL", name, (long long)firsts[f],
                       codec == KV_F32 ? "f32" : "int8", group);
                failures += !same;
                free(q), free(together), free(alone), free(scratch);
            }
    free(k), free(v);
}

static void test_rows_together(void) {
    test_rows_together_in(cand, "candidate");
    test_rows_together_in(ref, "reference");
}

static void test_row_kernels(void) {
    typedef void (*act_t)(const void *, int64_t, int64_t, int, void *, int, int);
    typedef void (*nr_t)(float *, int64_t, int64_t, int64_t, int64_t, const float *, float, const float *, const float *, int);
    typedef void (*norm_t)(const float *, int64_t, int64_t, const float *, float, void *, int, int);
    typedef void (*add_t)(const float *, const void *, int64_t, int64_t, const float *, float, float *, int, int);
    BOTH(act_t, edgellm_gated_act);
    BOTH(nr_t, edgellm_norm_rope);
    BOTH(norm_t, edgellm_rms_norm);
    BOTH(add_t, edgellm_add_rms_norm);
    int64_t rows = 5, d = 128;
    float *x = floats(rows * 2 * d), *w = floats(d), *a = floats(rows * 2 * d), *b = floats(rows * 2 * d);
    float *cs = floats(rows * d), *sn = floats(rows * d);
    fill_f32(x, rows * 2 * d, 4.f), fill_f32(w, d, 1.f), fill_f32(cs, rows * d, 1.f), fill_f32(sn, rows * d, 1.f);
    for (int act = 0; act < 2; act++) {
        edgellm_gated_act_c(x, rows, d, act, a, 0, 1);
        edgellm_gated_act_r(x, rows, d, act, b, 0, 1);
        check(act ? "gated_act gelu_tanh" : "gated_act silu", a, b, rows * d, 1e-5f);
    }
    memcpy(a, x, (size_t)(rows * d) * 4), memcpy(b, x, (size_t)(rows * d) * 4);
    edgellm_norm_rope_c(a, rows, 2, d / 2, d, w, 1e-6f, cs, sn, 1);
    edgellm_norm_rope_r(b, rows, 2, d / 2, d, w, 1e-6f, cs, sn, 1);
    check("norm_rope", a, b, rows * d, 1e-5f);
    edgellm_rms_norm_c(x, rows, d, w, 1e-6f, a, 0, 1);
    edgellm_rms_norm_r(x, rows, d, w, 1e-6f, b, 0, 1);
    check("rms_norm", a, b, rows * d, 1e-5f);
    edgellm_add_rms_norm_c(x, x + rows * d, rows, d, w, 1e-6f, a, 0, 1);
    edgellm_add_rms_norm_r(x, x + rows * d, rows, d, w, 1e-6f, b, 0, 1);
    check("add_rms_norm", a, b, rows * d, 1e-5f);
    free(x), free(w), free(a), free(b), free(cs), free(sn);
}

static void test_kv_encode(void) {
    typedef void (*enc_t)(const float *, int64_t, int64_t, void *, uint16_t *, uint16_t *, int64_t);
    BOTH(enc_t, edgellm_kv_encode);
    int64_t rows = 7, d = 64;
    float *x = floats(rows * d);
    fill_f32(x, rows * d, 3.f);
    const char *names[] = {"kv_encode f32", "kv_encode f16", "kv_encode int8", "kv_encode int4"};
    for (int codec = 0; codec < 4; codec++) {
        uint8_t qa[4096], qb[4096];
        uint16_t sa[64], sb[64], ma[64], mb[64];
        memset(qa, 0, sizeof qa), memset(qb, 0, sizeof qb), memset(sa, 0, sizeof sa), memset(sb, 0, sizeof sb);
        memset(ma, 0, sizeof ma), memset(mb, 0, sizeof mb);
        edgellm_kv_encode_c(x, rows, d, qa, sa, ma, codec);
        edgellm_kv_encode_r(x, rows, d, qb, sb, mb, codec);
        int ok = !memcmp(qa, qb, sizeof qa) && !memcmp(sa, sb, sizeof sa) && !memcmp(ma, mb, sizeof ma);
        printf("%s %s: %s\n", ok ? "ok  " : "FAIL", names[codec], ok ? "identical bytes" : "bytes differ");
        failures += !ok;
    }
    free(x);
}

/* A random Llama or Gemma 3 layer (INT4 q|k|v, Q8_0 o, Q6_K gate|up, Q5_K down) decoding 3
   sequences for a few positions, keys and values in the given codecs (INT8 / INT4). */
static void test_layer(int gemma, int k_codec, int v_codec) {
    typedef void (*layer_t)(const void *, float *, int, const float *, const float *, KVSlots *, const int64_t *,
                            float *, void *, int, const LoraLayer *const *);
    typedef int64_t (*floats_t)(const LayerDims *, int);
    BOTH(layer_t, edgellm_llama_layer);
    BOTH(layer_t, edgellm_gemma_layer);
    BOTH(floats_t, edgellm_layer_floats);
    enum { M = 3, STEPS = 5 };
    LayerDims dims = {256, 4, 2, 64, 512, 16, 1e-5f, 0.125f, gemma ? 5.f : 0.f};  /* Gemma 2's soft-capped scores */
    int64_t qkv_n = (4 + 2 * 2) * 64, rb;
    uint8_t *qkv = malloc((size_t)(qkv_n * 256 / 2));
    uint16_t *sz = malloc((size_t)(256 / 32 * qkv_n * 2) * 2);
    fill_bytes(qkv, qkv_n * 256 / 2);
    for (int64_t i = 0; i < 256 / 32 * qkv_n * 2; i++) sz[i] = to_bf16(uniform() * 0.005f);
    /* scales for weights of ~0.03: activations stay of order 1 through the layer */
    uint8_t *o = random_blocks(8, 256, 256, 3e-4f, &rb), *gu = random_blocks(14, 1024, 256, 1e-4f, &rb);
    uint8_t *down = random_blocks(13, 256, 512, 1e-4f, &rb);
    float *norms = floats(4 * 256 + 2 * 64);
    for (int i = 0; i < 4 * 256 + 2 * 64; i++) norms[i] = 1.f + 0.1f * uniform();
    Projection P[4] = {{{{WEIGHT_INT4, qkv, sz, qkv_n, 256, 256, 32}}, 1}, {{{8, o, NULL, 256, 256, 256, 32}}, 1},
                       {{{14, gu, NULL, 1024, 256, 256, 32}}, 1}, {{{13, down, NULL, 256, 512, 512, 32}}, 1}};
    LlamaLayer L = {dims, norms, norms + 256, NULL, norms + 1024, norms + 1088, P[0], P[1], P[2], P[3]};  /* Qwen3's q/k norms */
    GemmaLayer G = {dims, norms, norms + 256, norms + 512, norms + 768, norms + 1024, norms + 1088, P[0], P[1], P[2], P[3]};
    float *xa = floats(M * 256), *xb = floats(M * 256), *cs = floats(M * 64), *sn = floats(M * 64);
    fill_f32(xa, M * 256, 1.f);
    memcpy(xb, xa, M * 256 * 4);
    int64_t kvn = 2 * 16 * 64;  /* values per sequence: 2 heads x 16 slots x 64 */
    uint8_t *q[2][2];
    uint16_t *scale[2][2], *mins[2][2];
    int codecs[2] = {k_codec, v_codec};
    for (int lib = 0; lib < 2; lib++)
        for (int kv = 0; kv < 2; kv++) {
            q[lib][kv] = calloc((size_t)(M * kvn), 1);
            scale[lib][kv] = calloc((size_t)(M * kvn / 16), 2);
            mins[lib][kv] = calloc((size_t)(M * kvn / 32), 2);
        }
    /* rows 0 and 2 under a rank-8 LoRA on every projection (row 2 with half its scale), row 1 the base alone */
    int64_t ins[LORA_PARTS] = {256, 256, 256, 256, 256, 256, 512};  /* o reads the 4 x 64 attention */
    LoraLayer adapters[2];
    int8_t *lora_w = malloc(2 * 8 * 4096 * LORA_PARTS);
    float *lora_s = floats(16);
    for (int64_t i = 0; i < 2 * 8 * 4096 * LORA_PARTS; i++) lora_w[i] = (int8_t)(uniform() * 127.f);
    for (int i = 0; i < 16; i++) lora_s[i] = 4e-4f * (1.f + 0.5f * uniform());
    for (int a = 0; a < 2; a++)
        for (int p = 0; p < LORA_PARTS; p++) {
            LoraPair pair = {lora_w + (a * LORA_PARTS + p) * 8 * 4096, lora_w + (a * LORA_PARTS + p) * 8 * 4096 + 8 * ins[p],
                             lora_s, lora_s + 8, 8, a ? 1.f : 2.f};
            adapters[a].part[p] = pair;
        }
    const LoraLayer *rows[M] = {&adapters[0], NULL, &adapters[1]};
    float *buf = floats(edgellm_layer_floats_c(&dims, M));
    void *work = malloc(1 << 20);
    for (int step = 0; step < STEPS; step++) {
        int64_t pos[M] = {step, step + 3, step};
        for (int i = 0; i < M * 64; i++) cs[i] = cosf(0.1f * (float)(i + step)), sn[i] = sinf(0.1f * (float)(i + step));
        for (int lib = 0; lib < 2; lib++) {
            KVSlots slots[M];
            KVPage pages[M][2];  /* each sequence's 16 slots as two pages of 8, the second first in memory */
            for (int i = 0; i < M; i++) {
                KVStore s[2];
                for (int kv = 0; kv < 2; kv++) {
                    int64_t per = codecs[kv] == KV_INT4 ? kvn / 2 : kvn, groups = codecs[kv] == KV_INT4 ? 32 : 16;
                    KVStore one = {q[lib][kv] + i * per, scale[lib][kv] + i * kvn / groups, mins[lib][kv] + i * kvn / 32,
                                   codecs[kv]};
                    s[kv] = one;
                }
                for (int half = 0; half < 2; half++) {  /* rows (head, slot) of slots 8 half.. start at row 16 (1 - half) */
                    int64_t first_row = 16 * (1 - half);
                    KVPage page = {s[0], s[1]};
                    KVStore *st[2] = {&page.k, &page.v};
                    for (int kv = 0; kv < 2; kv++) {
                        int int4 = codecs[kv] == KV_INT4;
                        st[kv]->q = (uint8_t *)st[kv]->q + first_row * (int4 ? 32 : 64);
                        st[kv]->scale += first_row * 64 / (int4 ? 32 : 16);  /* a scale per 32 / 16 values */
                        st[kv]->min += first_row * 64 / 32;
                    }
                    pages[i][half] = page;
                }
                KVSlots c = {pages[i], 8, 16, NULL};
                slots[i] = c;
            }
            layer_t run = gemma ? (lib ? edgellm_gemma_layer_r : edgellm_gemma_layer_c)
                                : (lib ? edgellm_llama_layer_r : edgellm_llama_layer_c);
            run(gemma ? (const void *)&G : (const void *)&L, lib ? xb : xa, M, cs, sn, slots, pos, buf, work, 1, rows);
        }
    }
    char what[96];
    snprintf(what, sizeof what, "%s_layer 3 sequences (2 LoRAs), %s K / %s V, %d steps", gemma ? "gemma" : "llama",
             k_codec == KV_INT8 ? "int8" : "int4", v_codec == KV_INT8 ? "int8" : "int4", STEPS);
    /* each step stores quantized K and V: a key that differs in its last float bit between the two
       builds can round to the next INT4 level, which later steps then read (~1e-3 measured) */
    check(what, xa, xb, M * 256, 3e-3f);
    for (int lib = 0; lib < 2; lib++)
        for (int kv = 0; kv < 2; kv++) free(q[lib][kv]), free(scale[lib][kv]), free(mins[lib][kv]);
    free(qkv), free(sz), free(o), free(gu), free(down), free(norms), free(xa), free(xb), free(cs), free(sn);
    free(buf), free(work), free(lora_w), free(lora_s);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CANDIDATE.so REFERENCE.so\n", argv[0]);
        return 2;
    }
    cand = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    ref = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!cand || !ref) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    test_int4_gemv();
    test_block_gemv();
    test_attention();
    test_rows_together();
    test_row_kernels();
    test_kv_encode();
    test_layer(0, KV_INT8, KV_INT4);
    test_layer(1, KV_INT4, KV_INT8);
    printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
}
