/* The gated MLP's middle for a prompt: h = act(gate) * up over a fused (M, 2I) gate|up output
   (bf16 or fp32, the compute dtype), in one pass (PyTorch spends an op per step, and its bf16
   tanh-GELU alone runs at ~1.5 G elements/s). */
#include "activation.h"

/* out (m, inter) = act(gate_up[:, :inter]) * gate_up[:, inter:] in `dtype` (simd.h); inter % 16 == 0. */
void edgellm_gated_act(const void *gate_up, int64_t m, int64_t inter, int act, void *out, int dtype, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < inter; j += VL) {
            vf x = vf_load_as(gate_up, r * 2 * inter + j, dtype), y = vf_load_as(gate_up, r * 2 * inter + inter + j, dtype);
            vf_store_as(out, r * inter + j, vf_mul(activate(x, act), y), dtype);
        }
}
