/* Greedy decoding's argmax over a vocabulary of logits, on the calling thread: torch's reductions
   over 49k-262k logits run as an OpenMP region, whose worker then spins for milliseconds on the
   core the next decode step's kernels need (pool.h). */
#include "simd.h"

#define ARGMAX_BLOCK 1024

static float block_max(const float *x, int64_t n) {
    vf m = vf_set1(-INFINITY);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) m = vf_max(m, vf_load(x + i));
    float best = vf_hmax(m);
    for (; i < n; i++) best = x[i] > best ? x[i] : best;
    return best;
}

/* The index of the first largest of x[0..n) (finite logits; n >= 1). */
int64_t edgellm_argmax(const float *x, int64_t n) {
    float best = -INFINITY;
    int64_t at = 0;
    for (int64_t b = 0; b < n; b += ARGMAX_BLOCK) {  /* the first block holding the maximum */
        float m = block_max(x + b, n - b < ARGMAX_BLOCK ? n - b : ARGMAX_BLOCK);
        if (m > best) best = m, at = b;
    }
    while (at < n - 1 && x[at] != best) at++;
    return at;
}
