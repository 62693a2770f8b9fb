/* The 6-bit scale and min of sub-block s of a Q4_K / Q5_K super-block (their 12-byte packing at q), for
   block_gemv.c, int4_repack.c and int8_pack.c. */
#pragma once
#include <stdint.h>

static inline void k_scale_min(const uint8_t *q, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = q[s] & 63;
        *mn = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
        *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}
