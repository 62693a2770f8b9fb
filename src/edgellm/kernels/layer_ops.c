/* The exported size of a layer's scratch buffer (layer_buffers in layer_ops.h), and the KV encoder
   the decode layers use, for tests. */
#include "layer_ops.h"

int64_t edgellm_layer_floats(const LayerDims *D, int m) {
    int64_t qd = D->n_heads * D->head_dim;
    return m * (2 * D->hidden + qkv_width(D) + qd + 3 * D->inter + 3 * MAX_LORA_RANK) + attend_floats(D->n_heads, D->head_dim, D->max_len, ATT_MAX_THREADS);
}

void edgellm_kv_encode(const float *x, int64_t rows, int64_t d, void *q, uint16_t *scale, uint16_t *min, int64_t codec) {
    KVStore s = {q, scale, min, codec};
    for (int64_t r = 0; r < rows; r++) kv_encode(&s, r, x + r * d, d);
}
