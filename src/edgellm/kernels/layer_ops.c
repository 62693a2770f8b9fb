/* The exported size of a layer's scratch buffer (layer_buffers in layer_ops.h). */
#include "layer_ops.h"

int64_t edgellm_layer_floats(const LayerDims *D) {
    int64_t qd = D->n_heads * D->head_dim, kvd = D->n_kv * D->head_dim;
    return D->hidden * 2 + qd * 2 + 2 * kvd + 3 * D->inter + D->n_heads * D->max_len;
}
