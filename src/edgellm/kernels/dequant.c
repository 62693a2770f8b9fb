/* Prefill-time unpacking of torch's packed INT4 CPU layout into a bf16 weight, so a long
   prompt runs on the bf16 GEMM (~2.5-3x the INT4 kernel's speed at M >= 32) while the
   model keeps only the 4-bit bytes: the bf16 copy lives in one reused scratch buffer.

   The packed layout (int4_pack.h) stores, per 64-row block and per k, 32 bytes whose
   byte i holds row i (low nibble) and row 32 + i (high nibble): 64 consecutive rows of one
   column. So the natural output is the transposed weight Wt (K, N), row k contiguous in n,
   which the GEMM takes as x @ Wt as fast as x @ W^T. With planes = 2 the two 4-bit planes
   (k and ka + k) are summed in fp32 and rounded to bf16 once. */
#include <immintrin.h>
#include <stdint.h>

#include "int4_pack.h"
#include "vec_math.h"

/* Row block nb of Wt: columns [nb*64, nb*64 + 64) of every k. */
static void unpack_block(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw,
                         int64_t group, int planes, int64_t nb, int64_t row0, int64_t rows, uint16_t *wt) {
    const uint8_t *w = packed + nb * 64 * kw / 2;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    int64_t ka = kw / planes;
    for (int64_t k = 0; k < ka; k++) {
        __m512 out[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int p = 0; p < planes; p++) {
            int64_t kp = p * ka + k;
            __m256i b = _mm256_loadu_si256((const __m256i *)(w + kp * 32));
            __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
            __m512 q[4] = {
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))),
            };
            const uint16_t *sz = scale_zero + ((kp / group) * n + nb * 64) * 2;
            for (int r = 0; r < 4; r++) {
                __m512 scale, offset;
                int4_scale_offset(sz + r * 32, &scale, &offset);
                out[r] = _mm512_add_ps(out[r], _mm512_fmadd_ps(q[r], scale, offset));
            }
        }
        uint16_t *dst = wt + k * rows + nb * 64 - row0;
        for (int r = 0; r < 4; r++)
            _mm256_storeu_si256((__m256i *)(dst + r * 16), ps_to_bf16(out[r]));
    }
}

/* wt (ka, rows) bf16 = rows row0 .. row0 + rows of the dequantized (n, kw = planes * ka) packed
   weight, transposed. n, row0 and rows are multiples of 64. */
void edgellm_int4_unpack_bf16(const uint8_t *packed, const uint16_t *scale_zero, int64_t n, int64_t kw,
                              int64_t group, int planes, int64_t row0, int64_t rows, uint16_t *wt, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = row0 / 64; nb < (row0 + rows) / 64; nb++)
        unpack_block(packed, scale_zero, n, kw, group, planes, nb, row0, rows, wt);
}
