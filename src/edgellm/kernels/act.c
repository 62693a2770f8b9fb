/* The gated MLP's middle for a prompt: h = act(gate) * up over a fused (M, 2I) gate|up output
   (bf16 or fp32, the compute dtype), in one pass (PyTorch spends an op per step, and its bf16
   tanh-GELU alone runs at ~1.5 G elements/s). */
#include "activation.h"

typedef struct {
    const void *gate_up;
    int64_t inter;
    int act, dtype;
    void *out;
} GatedAct;

static void gated_act_rows(void *p, int64_t r0, int64_t r1) {
    const GatedAct *a = p;
    int64_t inter = a->inter;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t j = 0; j < inter; j += VL) {
            vf x = vf_load_as(a->gate_up, r * 2 * inter + j, a->dtype);
            vf y = vf_load_as(a->gate_up, r * 2 * inter + inter + j, a->dtype);
            vf_store_as(a->out, r * inter + j, vf_mul(activate(x, a->act), y), a->dtype);
        }
}

/* out (m, inter) = act(gate_up[:, :inter]) * gate_up[:, inter:] in `dtype` (simd.h); inter % 16 == 0. */
void edgellm_gated_act(const void *gate_up, int64_t m, int64_t inter, int act, void *out, int dtype, int threads) {
    GatedAct a = {gate_up, inter, act, dtype, out};
    team_for(m, threads, gated_act_rows, &a);
}
