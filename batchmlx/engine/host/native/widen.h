// A weight table's values as float32, whatever the folder stored: float32, bf16 (its bits) or
// float16. Packing reads the table as it lies (a first start widened each table to float32
// in a copy first). Included by q8.c and head8.c; native_lib hashes it into both SHAs.
#ifndef BATCHMLX_WIDEN_H
#define BATCHMLX_WIDEN_H

#include <immintrin.h>
#include <stdint.h>

enum { WIDEN_F32 = 0, WIDEN_BF16 = 1, WIDEN_F16 = 2 };

// values k .. k + 15 of `row` (bf16 -> float32 is exact: its bits are a float's high half;
// float16 -> float32 is exact too)
static inline __attribute__((always_inline)) __m512 widen16(const void* row, int dtype, int k) {
    if (dtype == WIDEN_F32) return _mm512_loadu_ps((const float*)row + k);
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + k));
    if (dtype == WIDEN_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

// the address of row n of a table of `dtype` with row stride ld (elements)
static inline const void* widen_row(const void* w, int dtype, int64_t ld, int n) {
    size_t size = dtype == WIDEN_F32 ? 4 : 2;
    return (const char*)w + (size_t)n * (size_t)ld * size;
}

// Whether a or b holds a NaN or an infinity: all exponent bits set (a group of 32 values that
// the quantizers zero, with a NaN scale)
static inline __attribute__((always_inline)) int widen_nonfinite(__m512 a, __m512 b) {
    const __m512i expo = _mm512_set1_epi32(0x7f800000);
    return (_mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), expo), expo) |
            _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(b), expo), expo)) != 0;
}

// The gather offsets (in 4-byte words) of word w of each of a tile's 16 rows in int32
// bytes[16][8] (a group of 32 int8 values a row): the packers' transpose into a tile's lines
static inline __attribute__((always_inline)) __m512i widen_tile_rows(void) {
    return _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
}

#endif
