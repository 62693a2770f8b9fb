/* The gated MLPs' activations, vectorized: both are x·sigmoid(z).
     silu(x)      = x·sigmoid(x)
     gelu_tanh(x) = x·(1 + tanh(u))/2 = x·sigmoid(2u),  u = sqrt(2/pi)·(x + 0.044715 x^3) */
#ifndef EDGELLM_ACTIVATION_H
#define EDGELLM_ACTIVATION_H
#include "simd.h"

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

static inline vf activate(vf x, int act) {
    if (act == ACT_SILU) return vf_mul(x, vf_sigmoid(x));
    vf x3 = vf_mul(vf_mul(x, x), x);
    vf u = vf_fma(vf_set1(0.044715f), x3, x);
    return vf_mul(x, vf_sigmoid(vf_mul(vf_set1(2.f * 0.7978845608028654f), u)));
}
#endif
