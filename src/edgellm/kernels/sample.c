/* Sampling's passes over a vocabulary of logits, on the calling thread (as argmax.c, and for the
   same reason: torch's softmax, sort and multinomial over 49k-262k logits each wake its OpenMP
   team, whose threads then spin on the cores the next decode step needs, pool.h).
   Weights are w_i = e^((x_i - shift) * scale): shift the largest logit, scale 1 / temperature. */
#include <stdlib.h>
#include "simd.h"

#define SAMPLE_BLOCK 1024

static inline vf weights(vf x, float scale, float shift) {  /* -inf logits (masked tokens): exactly 0 */
    return vf_zero_below(x, vf_exp(vf_mul(vf_sub(x, vf_set1(shift)), vf_set1(scale))), -INFINITY);
}

/* The weights of x[0..n) (n <= SAMPLE_BLOCK) into w (when w is not NULL); returns their sum. */
static float block_weights(const float *x, int64_t n, float scale, float shift, float *w) {
    vf sum = vf_zero();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf v = weights(vf_load(x + i), scale, shift);
        sum = vf_add(sum, v);
        if (w) vf_store(w + i, v);
    }
    float total = vf_sum(sum);
    if (i < n) {  /* the tail through a padded vector: its padding is -inf, weight 0 */
        float tail[VL], out[VL];
        for (int64_t j = 0; j < VL; j++) tail[j] = i + j < n ? x[i + j] : -INFINITY;
        vf v = weights(vf_load(tail), scale, shift);
        total += vf_sum(v);
        vf_store(out, v);
        for (int64_t j = i; j < n && w; j++) w[j] = out[j - i];
    }
    return total;
}

/* The sum of the weights of x[0..n): the softmax's denominator. */
double edgellm_exp_sum(const float *x, int64_t n, float scale, float shift) {
    double sum = 0;
    for (int64_t b = 0; b < n; b += SAMPLE_BLOCK)
        sum += block_weights(x + b, n - b < SAMPLE_BLOCK ? n - b : SAMPLE_BLOCK, scale, shift, NULL);
    return sum;
}

/* A token drawn from softmax(x * scale) by inverse CDF: the first i whose running weight passes
   u (in [0, 1)) times the total; never a token of weight 0. Two passes: block sums, then the
   block that holds the draw. */
int64_t edgellm_draw(const float *x, int64_t n, float scale, float shift, double u) {
    int64_t blocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double *sums = malloc(sizeof(double) * (size_t)blocks), total = 0;
    float w[SAMPLE_BLOCK];
    if (!sums) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t m = n - b * SAMPLE_BLOCK < SAMPLE_BLOCK ? n - b * SAMPLE_BLOCK : SAMPLE_BLOCK;
        total += sums[b] = block_weights(x + b * SAMPLE_BLOCK, m, scale, shift, NULL);
    }
    double target = u * total, before = 0;
    int64_t b = 0;
    while (b < blocks - 1 && (before + sums[b] <= target || sums[b] == 0)) before += sums[b++];
    free(sums);
    int64_t start = b * SAMPLE_BLOCK, m = n - start < SAMPLE_BLOCK ? n - start : SAMPLE_BLOCK, last = -1;
    block_weights(x + start, m, scale, shift, w);
    for (int64_t i = 0; i < m; i++) {
        if (w[i] == 0) continue;
        last = start + i;
        before += w[i];
        if (before > target) return last;
    }
    return last;  /* rounding left the target just past the block's end: its last token of weight */
}

/* (value, index) pairs ordered as a descending sort would place them: larger values first, the
   lower index first among equal ones. */
typedef struct { float value; int64_t index; } Logit;

static int before(Logit a, Logit b) { return a.value > b.value || (a.value == b.value && a.index < b.index); }

static void sift_down(Logit *heap, int64_t k, int64_t i) {  /* a heap whose root comes last in order */
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= k) return;
        if (child + 1 < k && before(heap[child], heap[child + 1])) child++;
        if (!before(heap[i], heap[child])) return;
        Logit t = heap[i]; heap[i] = heap[child]; heap[child] = t;
        i = child;
    }
}

/* The k largest logits of x[0..n) (k <= n), largest first, into ids and values; 0, or -1 (nothing
   written) when there is no memory for the heap. */
int64_t edgellm_top_logits(const float *x, int64_t n, int64_t k, int64_t *ids, float *values) {
    Logit *heap = malloc(sizeof(Logit) * (size_t)k);
    if (!heap) return -1;
    for (int64_t i = 0; i < k; i++) heap[i] = (Logit){x[i], i};
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    int64_t i = k;
    for (; i + VL <= n; i += VL) {  /* a whole vector at or below the k-th largest so far: the common case */
        if (vf_hmax(vf_load(x + i)) <= heap[0].value) continue;
        for (int64_t j = i; j < i + VL; j++)
            if (x[j] > heap[0].value) heap[0] = (Logit){x[j], j}, sift_down(heap, k, 0);
    }
    for (; i < n; i++)
        if (x[i] > heap[0].value) heap[0] = (Logit){x[i], i}, sift_down(heap, k, 0);
    for (int64_t end = k - 1; end >= 0; end--) {  /* pop the last in order to the back */
        ids[end] = heap[0].index, values[end] = heap[0].value;
        heap[0] = heap[end];
        sift_down(heap, end, 0);
    }
    free(heap);
    return 0;
}
