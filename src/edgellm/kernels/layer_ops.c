/* The exported size of a layer's scratch buffer (layer_buffers in layer_ops.h), the KV encoder
   and the decode attention the decode layers use (for tests), and edgellm_decoder_layers: a whole
   decode step's layers in one call. */
#include "layer_ops.h"

int64_t edgellm_layer_floats(const LayerDims *D, int m) {
    int64_t qd = D->n_heads * D->head_dim;
    return m * (2 * D->hidden + qkv_width(D) + qd + 3 * D->inter + 3 * MAX_LORA_RANK) + attend_floats(D->n_heads, D->n_kv, D->head_dim, D->max_len, m < ATT_MAX_ROWS ? m : ATT_MAX_ROWS, ATT_MAX_THREADS);
}

/* The bytes of the layer functions' `work` for m rows (layer_ops.h gemv_work_bytes, prompt_work_bytes). */
int64_t edgellm_layer_work_bytes(const LayerDims *D, int m) {
    return gemv_work_bytes(D) + (m > MAX_SEQS ? prompt_work_bytes(D, m) : 0);
}

/* The most rows of one prompt a layer call takes (layer_types.h). */
int edgellm_max_prompt_rows(void) { return MAX_PROMPT_ROWS; }

void edgellm_kv_encode(const float *x, int64_t rows, int64_t d, void *q, uint16_t *scale, uint16_t *min, int64_t codec) {
    KVStore s = {q, scale, min, codec};
    for (int64_t r = 0; r < rows; r++) kv_encode(&s, r, x + r * d, d);
}

/* Exported for tests: attend_rows (decode_attention.h), m rows over their caches, with the scratch
   edgellm_decode_attention_floats names; returns the work items it ran. */
int64_t edgellm_decode_attention_floats(int64_t n_heads, int64_t n_kv, int64_t d, int64_t max_len, int m, int threads) {
    return attend_floats(n_heads, n_kv, d, max_len, m, threads);
}

int64_t edgellm_decode_attention(const KVSlots *caches, const float *q, int m, int64_t n_heads, int64_t n_kv,
                                 int64_t d, float scale, float softcap, const int64_t *slots, const int64_t *pos,
                                 float *scratch, float *out, int threads) {
    return attend_rows(caches, q, n_heads * d, m, n_heads, n_kv, d, scale, softcap, slots, pos, scratch, out,
                       n_heads * d, threads);
}

/* The most query floats per KV head (query heads per KV head x head_dim) the decode layers take. */
int64_t edgellm_decode_attention_max_group_floats(void) { return ATT_MAX_GROUP_FLOATS; }

/* One architecture's layer function (edgellm_llama_layer, edgellm_gemma_layer). */
typedef void (*LayerFn)(const void *layer, float *x, int m, const float *cos, const float *sin, KVSlots *caches,
                        const int64_t *pos, float *buf, void *work, int threads, const LoraLayer *const *lora);

/* A whole decode step's layers in one call (from Python, ~30 us of call and argument building per
   layer: ~1 ms a token for SmolLM2's 30). Per layer i: layers[i], its rotation cos[i] / sin[i], row
   j's cache row_slots[j][i] (each row's sequence keeps its layers' KVSlots in one array, built once
   in Python, not 30 structs a row every step) and adapters lora[i * m ..] (lora NULL: none). */
void edgellm_decoder_layers(LayerFn run, const void *const *layers, int n_layers, float *x, int m,
                            const float *const *cos, const float *const *sin, const KVSlots *const *row_slots,
                            const int64_t *pos, float *buf, void *work, int threads, const LoraLayer *const *lora) {
    KVSlots slots[MAX_PROMPT_ROWS];
    for (int i = 0; i < n_layers; i++) {
        for (int j = 0; j < m; j++) slots[j] = row_slots[j][i];
        run(layers[i], x, m, cos[i], sin[i], slots, pos, buf, work, threads, lora ? lora + (int64_t)i * m : NULL);
    }
}
