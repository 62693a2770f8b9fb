/* Activations quantized per group to int16 for the VNNI GEMVs (vpdpwssd: two int16 products
   per int32 lane). Error ~1/65534 of the group's max, well under bf16's 1/256. */
#ifndef EDGELLM_ACTIVATIONS_H
#define EDGELLM_ACTIVATIONS_H
#include <math.h>
#include <stdint.h>

/* x[0..k) per group: qx as (k/2) int32 words of two int16, scale dx and sum per group. */
static inline void quantize_activations(const float *x, int64_t k, int64_t group, int32_t *qx_pairs, float *dx,
                                        float *sums) {
    for (int64_t g = 0; g < k / group; g++) {
        const float *xs = x + g * group;
        float amax = 0.f, sum = 0.f;
        for (int64_t i = 0; i < group; i++) {
            float a = fabsf(xs[i]);
            amax = a > amax ? a : amax;
            sum += xs[i];
        }
        float d = amax > 0.f ? amax / 32767.f : 1.f;
        float inv = 1.f / d;
        for (int64_t i = 0; i < group; i += 2) {
            int32_t lo = (int32_t)lrintf(xs[i] * inv), hi = (int32_t)lrintf(xs[i + 1] * inv);
            qx_pairs[(g * group + i) / 2] = (lo & 0xFFFF) | (hi << 16);
        }
        dx[g] = d;
        sums[g] = sum;
    }
}
#endif
