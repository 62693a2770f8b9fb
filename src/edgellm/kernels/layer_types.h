/* The structures Python (models/native/decoder.py) and the decoder layers share: weights, KV stores and
   layer descriptors. Plain C, no vector types, so a test driver can build them too. */
#ifndef EDGELLM_LAYER_TYPES_H
#define EDGELLM_LAYER_TYPES_H
#include <stdint.h>

/* One stored weight: INT4 in the I4R64 layout (kind WEIGHT_INT4, scale_zero set), a dense bf16 or
   fp32 (n, ka) matrix (GGUF types with neither an INT4 form nor a block kernel, e.g. F16), or GGUF
   Q8_0 / Q5_0 / Q5_K / Q6_K blocks read in place, or edgellm's INT8 rows with their bf16 scales in
   scale_zero (kind = the ggml type number, block_gemv.c). int8_form: the form in which the int8
   prompt GEMM takes the weight as it is (int8_layout.h: 4, I4R64 of one plane and groups of 32; 5, Q8R16
   blocks holding Q5_0 values; 6, Q6_K and 13, Q5_K in strips of 16 rows; 8, Q8R16 blocks of a real Q8_0,
   where the build takes byte codes), 0 where it does not. */
enum { WEIGHT_INT4 = -1, WEIGHT_BF16 = -2, WEIGHT_F32 = -3 };
typedef struct {
    int64_t kind;
    const uint8_t *data;
    const uint16_t *scale_zero;
    int64_t n, kw, ka, group;  /* kw = planes * ka */
    int64_t int8_form;
} WeightPart;

/* A projection: up to three parts stacked along the output (fused q|k|v, gate|up). */
#define MAX_PARTS 3
typedef struct {
    WeightPart parts[MAX_PARTS];
    int64_t count;
} Projection;

/* Keys or values in one of kv/codecs.py's codecs (kv_codec.h reads and writes them):
     KV_F32, KV_F16, KV_BF16   q = (H, capacity, D) floats
     KV_INT8          q int8 (H, capacity, D), fp16 scale per 16 values: x = q * scale
     KV_INT4          q (H, capacity, D / 2) two values a byte (element 2j low nibble of byte j),
                      fp16 scale and min per 32 values: x = q * scale + min */
enum { KV_F32 = 0, KV_F16 = 1, KV_INT8 = 2, KV_INT4 = 3, KV_BF16 = 4 };
typedef struct {
    void *q;
    uint16_t *scale, *min;
    int64_t codec;
} KVStore;

/* A run of page_tokens token slots of one layer: K and V, each (H, page_tokens, D) in its codec. */
typedef struct {
    KVStore k, v;
} KVPage;

/* Where one layer's keys and values live: slot t is row head * page_tokens + t % page_tokens of
   pages[t / page_tokens]. A dense cache holds positions 0..pos at slots 0..pos (slot_pos = NULL)
   in pages that are the KV blocks of kv/sequence.py (SequenceKV), so sequences with a common prefix point at
   the same pages. A ring (one page) of `capacity` = window slots holds position p at slot
   p % capacity, with slot_pos[] naming each slot's position (-1: empty), and a query at p sees
   positions in (p - window, p]; slots from `used` on were never written (a young ring), so
   attention skips them. */
typedef struct {
    const KVPage *pages;
    int64_t page_tokens, capacity;
    int64_t *slot_pos;
    int64_t used;
} KVSlots;

/* Sizes every decoder layer shares; the first member of each architecture's layer struct. */
typedef struct {
    int64_t hidden, n_heads, n_kv, head_dim, inter, max_len;
    float eps, scale;
    float softcap; /* attention scores s -> softcap tanh(s / softcap) (Gemma 2); 0: none */
} LayerDims;

typedef struct {
    LayerDims dims;
    const float *attn_norm, *mlp_norm;
    const float *qkv_bias, *q_norm, *k_norm;  /* NULL where absent: Qwen2 has the bias, Qwen3 the norms */
    Projection qkv, o, gate_up, down;
} LlamaLayer;

typedef struct {
    LayerDims dims;
    const float *attn_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm, *q_norm, *k_norm;
    Projection qkv, o, gate_up, down;
} GemmaLayer;

/* LoRA (lora_ops.h): one adapter's low-rank pair for one projection, adding scale * B (A x) to that
   projection's output: A (rank, in) and B^T (rank, out) as int8 rows, row r of A times a_scale[r]
   and of B^T times bt_scale[r] (a decode step reads every adapter byte from memory: int8 halves
   bf16's bytes); a == NULL: the part is not adapted. */
enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_PARTS };
typedef struct {
    const int8_t *a, *bt;
    const float *a_scale, *bt_scale;
    int64_t rank;
    float scale;
} LoraPair;

/* One adapter's pairs for one layer. A layer call takes one pointer per row (NULL: the base alone),
   so the rows of one batch may each run under another adapter. */
typedef struct {
    LoraPair part[LORA_PARTS];
} LoraLayer;

#define MAX_LORA_RANK 256
#define MAX_SEQS 8 /* sequences one layer call decodes together */
/* rows of one prompt a layer call takes: beyond MAX_SEQS its projections are GEMMs (layer_ops.h prompt_gemm) */
#define MAX_PROMPT_ROWS 128
#endif
