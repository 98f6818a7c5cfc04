// Grouped int8 GEMM for the `int8` host format (engine/host/q8.py), AVX-512 VNNI.
//
//   y[m, n] = sum over groups g, in order, of (xs[m, g] * ws[g, n]) * sum_{k in g} xq[m, k] w[n, k]
//
// Weights and activations are int8 in groups of G along K, each group with its own float32
// scale (activations quantized here, per row and group, on the fly), as llama.cpp's Q8_0 and
// OpenVINO's dynamic quantization do. Batch invariance by construction: the integer sums are
// exact, and the float epilogue of every output element is the same multiply and FMA per
// group, in group order, whatever M, the row block a row falls in, or the columns a thread
// takes. Built without -march=native (engine/host/q8.py builds it; q8.py checks the CPU).
#include <immintrin.h>
#include <stdint.h>

#define MR 6  // rows per block: 6 x 4 accumulators + 4 weight vectors + 1 broadcast < 32 zmm

#ifndef Q8_SOURCE_SHA
#define Q8_SOURCE_SHA "unknown"
#endif

const char* q8_source_sha(void) { return Q8_SOURCE_SHA; }

// x[M, K] (row stride ldx) -> xq[M, K] u8 = round(x / t) + 128 and xs[M, ng] = t per (row,
// group), t = max|x| / 127 (1 for an all-zero group). A group holding NaN or infinity gets
// t = NaN and zeros, so the product shows it, as a float GEMM's would.
void q8_quantize(int M, int K, int G, const float* x, int64_t ldx, uint8_t* xq, float* xs) {
    int ng = (K + G - 1) / G;
    for (int m = 0; m < M; m++) {
        const float* row = x + (size_t)m * ldx;
        for (int g = 0; g < ng; g++) {
            const float* p = row + g * G;
            int len = K - g * G < G ? K - g * G : G;
            __m512 mx = _mm512_setzero_ps(), bad = _mm512_setzero_ps();
            for (int k = 0; k < len; k += 16) {
                __m512 v = _mm512_loadu_ps(p + k);
                mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
                bad = _mm512_add_ps(bad, _mm512_mul_ps(v, _mm512_setzero_ps()));  // NaN if any
            }
            float amax = _mm512_reduce_max_ps(mx);
            float nan = _mm512_reduce_add_ps(bad);
            uint8_t* q = xq + (size_t)m * K + g * G;
            if (nan != nan) {
                for (int k = 0; k < len; k++) q[k] = 128;
                xs[(size_t)m * ng + g] = nan;
                continue;
            }
            __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            for (int k = 0; k < len; k += 16) {
                __m512i i = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + k), inv),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                i = _mm512_add_epi32(i, _mm512_set1_epi32(128));
                _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtusepi32_epi8(i));
            }
            xs[(size_t)m * ng + g] = amax > 0.f ? amax / 127.f : 1.f;
        }
    }
}

// R rows from m0, NT tiles of 16 columns from n. wp: [N/16][K/4][16][4] (a tile's 16 columns
// x 4 consecutive k per 64 bytes, dpbusd's layout); ws, wc: [ng][N] (wc = 128 * sum_g w).
static inline __attribute__((always_inline)) void block(
    const int R, const int NT, int K, int G, int N, const uint8_t* xq, const float* xs,
    const int8_t* wp, const float* ws, const int32_t* wc, float* y, int m0, int n) {
    int ng = (K + G - 1) / G;
    __m512i acc[MR][4];
    // the float sums live in y itself (in registers they would spill: 48 vectors)
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NT; j++)
            _mm512_storeu_ps(y + (size_t)(m0 + r) * N + n + 16 * j, _mm512_setzero_ps());
    for (int g = 0; g < ng; g++) {
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NT; j++) acc[r][j] = _mm512_setzero_si512();
        int kend = (g + 1) * G < K ? (g + 1) * G : K;
        for (int k = g * G; k < kend; k += 4) {
            __m512i w[4];
            for (int j = 0; j < NT; j++)
                w[j] = _mm512_loadu_si512(
                    (const void*)(wp + ((size_t)(n / 16 + j) * (K / 4) + k / 4) * 64));
            for (int r = 0; r < R; r++) {
                __m512i a = _mm512_set1_epi32(*(const int32_t*)(xq + (size_t)(m0 + r) * K + k));
                for (int j = 0; j < NT; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], a, w[j]);
            }
        }
        for (int j = 0; j < NT; j++) {
            __m512i comp = _mm512_loadu_si512((const void*)(wc + (size_t)g * N + n + 16 * j));
            __m512 wsv = _mm512_loadu_ps(ws + (size_t)g * N + n + 16 * j);
            for (int r = 0; r < R; r++) {
                __m512 s = _mm512_mul_ps(wsv, _mm512_set1_ps(xs[(size_t)(m0 + r) * ng + g]));
                __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], comp));
                float* yp = y + (size_t)(m0 + r) * N + n + 16 * j;
                _mm512_storeu_ps(yp, _mm512_fmadd_ps(v, s, _mm512_loadu_ps(yp)));
            }
        }
    }
}

#define ROWS(NT)                                                                  \
    switch (R) {                                                                  \
    case 6: block(6, NT, K, G, N, xq, xs, wp, ws, wc, y, m, n); break;            \
    case 5: block(5, NT, K, G, N, xq, xs, wp, ws, wc, y, m, n); break;            \
    case 4: block(4, NT, K, G, N, xq, xs, wp, ws, wc, y, m, n); break;            \
    case 3: block(3, NT, K, G, N, xq, xs, wp, ws, wc, y, m, n); break;            \
    case 2: block(2, NT, K, G, N, xq, xs, wp, ws, wc, y, m, n); break;            \
    default: block(1, NT, K, G, N, xq, xs, wp, ws, wc, y, m, n); break;           \
    }

// Columns [n0, n1) (multiples of 16) of y[M, N]; N and K multiples of 16, G of 16.
void q8_gemm(int M, int N, int K, int G, const uint8_t* xq, const float* xs, const int8_t* wp,
             const float* ws, const int32_t* wc, float* y, int n0, int n1) {
    for (int n = n0; n < n1;) {
        int nt = (n1 - n) >= 64 ? 4 : 1;
        for (int m = 0; m < M; m += MR) {
            int R = M - m < MR ? M - m : MR;
            if (nt == 4) {
                ROWS(4)
            } else {
                ROWS(1)
            }
        }
        n += 16 * nt;
    }
}
