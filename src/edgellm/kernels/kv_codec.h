/* A layer's keys or values as the decode layers read and write them, in the codecs of
   kv/codecs.py (the same bytes, written the same way; layer_types.h lists them). */
#pragma once
#include "layer_types.h"
#include "simd.h"

#define KV_INT8_GROUP 16
#define KV_INT4_GROUP 32

/* VL values at columns i.. of row `row` (= head * page_tokens + slot in the page) of a store of d columns, as fp32. */
ALWAYS_INLINE vf kv_load(const KVStore *s, int64_t row, int64_t d, int64_t i) {
    switch (s->codec) {
    case KV_F16: return vf_load_f16((const uint16_t *)s->q + row * d + i);
    case KV_BF16: return vf_load_bf16((const uint16_t *)s->q + row * d + i);
    case KV_INT8: {
        float scale = f16_to_f32(s->scale[row * (d / KV_INT8_GROUP) + i / KV_INT8_GROUP]);
        return vf_mul(vf_load_i8((const int8_t *)s->q + row * d + i), vf_set1(scale));
    }
    case KV_INT4: {
        int64_t g = row * (d / KV_INT4_GROUP) + i / KV_INT4_GROUP;
        vf q = vf_load_u4_pairs((const uint8_t *)s->q + row * (d / 2), i);
        return vf_fma(q, vf_set1(f16_to_f32(s->scale[g])), vf_set1(f16_to_f32(s->min[g])));
    }
    default: return vf_load((const float *)s->q + row * d + i);
    }
}

/* Encode d values x into row `row`, exactly as kv/codecs.py does (fp32 arithmetic, ties to even). */
static inline void kv_encode(const KVStore *s, int64_t row, const float *x, int64_t d) {
    if (s->codec == KV_F32) {
        memcpy((float *)s->q + row * d, x, (size_t)d * sizeof(float));
    } else if (s->codec == KV_F16) {
        for (int64_t j = 0; j < d; j += VL) vf_store_f16((uint16_t *)s->q + row * d + j, vf_load(x + j));
    } else if (s->codec == KV_BF16) {
        for (int64_t j = 0; j < d; j += VL) vf_store_bf16((uint16_t *)s->q + row * d + j, vf_load(x + j));
    } else if (s->codec == KV_INT8) {
        int8_t *q = (int8_t *)s->q + row * d;
        for (int64_t g = 0; g < d / KV_INT8_GROUP; g++) {
            const float *xg = x + g * KV_INT8_GROUP;
            float amax = 0.f;
            for (int j = 0; j < KV_INT8_GROUP; j++) amax = fabsf(xg[j]) > amax ? fabsf(xg[j]) : amax;
            float scale = f16_to_f32(f32_to_f16(amax / 127.f));
            scale = scale < 1e-8f ? 1e-8f : scale;
            for (int j = 0; j < KV_INT8_GROUP; j++) {
                float v = nearbyintf(xg[j] / scale);
                q[g * KV_INT8_GROUP + j] = (int8_t)(v > 127.f ? 127.f : (v < -127.f ? -127.f : v));
            }
            s->scale[row * (d / KV_INT8_GROUP) + g] = f32_to_f16(scale);
        }
    } else {
        uint8_t *q = (uint8_t *)s->q + row * (d / 2);
        for (int64_t g = 0; g < d / KV_INT4_GROUP; g++) {
            const float *xg = x + g * KV_INT4_GROUP;
            float low = xg[0], high = xg[0];
            for (int j = 1; j < KV_INT4_GROUP; j++) {
                low = xg[j] < low ? xg[j] : low;
                high = xg[j] > high ? xg[j] : high;
            }
            float scale = (high - low) / 15.f;
            scale = scale < 1e-8f ? 1e-8f : scale;
            for (int j = 0; j < KV_INT4_GROUP; j += 2) {
                float a = nearbyintf((xg[j] - low) / scale), b = nearbyintf((xg[j + 1] - low) / scale);
                a = a < 0.f ? 0.f : (a > 15.f ? 15.f : a);
                b = b < 0.f ? 0.f : (b > 15.f ? 15.f : b);
                q[(g * KV_INT4_GROUP + j) / 2] = (uint8_t)((int)a | ((int)b << 4));
            }
            int64_t at = row * (d / KV_INT4_GROUP) + g;
            s->scale[at] = f32_to_f16(scale);
            s->min[at] = f32_to_f16(low);
        }
    }
}

/* Store the new k, v (n_kv heads of d) for position pos; returns the slot count to scan. */
static inline int64_t kv_write(KVSlots *c, const float *k, const float *v, int64_t n_kv, int64_t d, int64_t pos) {
    int64_t slot = c->slot_pos ? pos % c->capacity : pos, row = slot % c->page_tokens;
    const KVPage *page = &c->pages[slot / c->page_tokens];
    for (int64_t g = 0; g < n_kv; g++) {
        kv_encode(&page->k, g * c->page_tokens + row, k + g * d, d);
        kv_encode(&page->v, g * c->page_tokens + row, v + g * d, d);
    }
    if (c->slot_pos) {  /* a ring: scan the slots ever written, this one included */
        c->slot_pos[slot] = pos;
        if (pos >= c->capacity) return c->capacity;
        return slot + 1 > c->used ? slot + 1 : c->used;
    }
    return pos + 1;
}

/* Exported for tests: encode `rows` rows of d values into a store, as the decode layers do. */
void edgellm_kv_encode(const float *x, int64_t rows, int64_t d, void *q, uint16_t *scale, uint16_t *min, int64_t codec);
