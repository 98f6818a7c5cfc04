// Grouped 4-bit weight x int8 activation GEMM for the `q4` host format (engine/host/q4.py):
// a 4-bit GGUF's values (Q4_0, Q4_1, Q4_K's sub-blocks) kept as they are, 4 bits in memory
// and in the GEMM, with AVX-512 VNNI (and AMX tiles from 8 rows); one call a GEMM (q4_matmul),
// its columns split over pool.h's threads. What it shares with q8.c is in grouped.h and pool.h.
//
//   w[n, k] = s[n, g] * q[n, k] + b[n, g],  q in 0..15, groups g of 32 along K
//   y[m, n] = sum over g, in order, of xs[m, g] * (s[n, g] * dot_g + b[n, g] * sumx[m, g])
//
// with dot_g = sum_{k in g} xq[m, k] q[n, k] and sumx[m, g] = sum_{k in g} xq[m, k]: the
// activations quantized per row and group of 32 to int8 as q8.c's q8_quantize does (the same
// arithmetic, here signed, with each group's integer sum beside). The nibbles are the unsigned
// operand of vpdpbusd and the activations the signed one, so the sums need no offset. Batch
// invariance by construction, as q8.c: the integer sums are exact, and each output element's
// float epilogue is the same instructions per group, in group order, whatever M, the row block
// a row falls in or the columns a thread takes.
#include <stdlib.h>

#include "grouped.h"
#include "pool.h"

#define G 32   // values per group (and per scale and bias)
#define MR 6   // rows per block: 6 x 4 accumulators + 4 weight vectors + broadcast + mask

#ifndef Q4_SOURCE_SHA
#define Q4_SOURCE_SHA "unknown"
#endif

const char* q4_source_sha(void) { return Q4_SOURCE_SHA; }

// x[M, K] (row stride ldx, K a multiple of 32) -> xq[M, K] int8, xs[M, ng] and xsum[M, ng],
// the sum of each group's q: grouped.h's quantize_groups, q8_quantize's arithmetic (signed),
// in q8's tile layout for AMX (amx = 1).
void q4_quantize(int M, int K, const float* x, int64_t ldx, int8_t* xq, float* xs, float* xsum,
                 int amx) {
    quantize_groups(M, K, G, x, ldx, (uint8_t*)xq, xs, xsum, amx, 0);
}

// One group's float epilogue for 16 outputs, the same instructions on both paths and for
// every element: t = s * dot + b * sumx, y = xs * t for the first group, y += xs * t after.
static inline __attribute__((always_inline)) void epilogue(float* yp, __m512i dot, __m512 s,
                                                           __m512 b, float xs, float xsum,
                                                           int first) {
    __m512 t = _mm512_fmadd_ps(b, _mm512_set1_ps(xsum), _mm512_mul_ps(s, _mm512_cvtepi32_ps(dot)));
    __m512 sx = _mm512_set1_ps(xs);
    _mm512_storeu_ps(yp, first ? _mm512_mul_ps(t, sx) : _mm512_fmadd_ps(t, sx, _mm512_loadu_ps(yp)));
}

// R rows from m0, NT tiles of 16 columns from n. wp: [N/16][K/8][16][4] bytes, each byte two
// values of one column: k .. k+3 in the low nibbles, k+4 .. k+7 in the high ones (one 64-byte
// load gives vpdpbusd's operand for 4 k twice); ws, wb: [N/16][ng][16] (a tile's groups in a
// row, as q8.c's scales).
static inline __attribute__((always_inline)) void block(
    const int R, const int NT, int K, int N, const int8_t* xq, const float* xs,
    const float* xsum, const uint8_t* wp, const float* ws, const float* wb, float* y, int m0,
    int n) {
    int ng = K / G;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i acc[MR][4];
    // the float sums live in y itself, as in q8.c
    for (int g = 0; g < ng; g++) {
        for (int j = 0; j < NT; j++)
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_setzero_si512();
        for (int k = g * G; k < (g + 1) * G; k += 8) {
            const uint8_t* p = wp + ((size_t)(n / 16) * (K / 8) + k / 8) * 64;
            __m512i w[4];
            for (int j = 0; j < NT; j++)
                w[j] = _mm512_and_si512(
                    _mm512_loadu_si512((const void*)(p + (size_t)j * (K / 8) * 64)), low);
            for (int r = 0; r < R; r++) {
                __m512i a = _mm512_set1_epi32(*(const int32_t*)(xq + (size_t)(m0 + r) * K + k));
                for (int j = 0; j < NT; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], w[j], a);
            }
            for (int j = 0; j < NT; j++)
                w[j] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(
                    (const void*)(p + (size_t)j * (K / 8) * 64)), 4), low);
            for (int r = 0; r < R; r++) {
                __m512i a =
                    _mm512_set1_epi32(*(const int32_t*)(xq + (size_t)(m0 + r) * K + k + 4));
                for (int j = 0; j < NT; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], w[j], a);
            }
        }
        for (int j = 0; j < NT; j++) {
            size_t at = ((size_t)(n / 16 + j) * ng + g) * 16;
            __m512 s = _mm512_loadu_ps(ws + at), b = _mm512_loadu_ps(wb + at);
            for (int r = 0; r < R; r++) {
                size_t xa = (size_t)(m0 + r) * ng + g;
                epilogue(y + (size_t)(m0 + r) * N + n + 16 * j, acc[r][j], s, b, xs[xa],
                         xsum[xa], g == 0);
            }
        }
    }
}

#define ROWS(NT)                                                                  \
    switch (R) {                                                                  \
    case 6: block(6, NT, K, N, xq, xs, xsum, wp, ws, wb, y, m, n); break;         \
    case 5: block(5, NT, K, N, xq, xs, xsum, wp, ws, wb, y, m, n); break;         \
    case 4: block(4, NT, K, N, xq, xs, xsum, wp, ws, wb, y, m, n); break;         \
    case 3: block(3, NT, K, N, xq, xs, xsum, wp, ws, wb, y, m, n); break;         \
    case 2: block(2, NT, K, N, xq, xs, xsum, wp, ws, wb, y, m, n); break;         \
    default: block(1, NT, K, N, xq, xs, xsum, wp, ws, wb, y, m, n); break;        \
    }

// Columns [n0, n1) (multiples of 16) of y[M, N]; N a multiple of 16, K of 32.
void q4_gemm(int M, int N, int K, const int8_t* xq, const float* xs, const float* xsum,
             const uint8_t* wp, const float* ws, const float* wb, float* y, int n0, int n1) {
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

// ---- AMX (after q8.py's probe found it usable and Linux granted the tile state, which
// q8_amx_init asks for the whole process): q8.c's tiles (grouped.h), C tiles 0-3 (at most 2 x
// 2 of 16 x 16 sums), A tiles 4-5 (16 rows x one group of 32 activations, signed:
// q4_quantize's amx = 1), B tiles 6-7 (8 rows of 4 k x 16 columns). The weights of 32
// columns are unpacked once for all K into a panel of bytes in q8.c's B layout
// ([2][K/4][16][4]), read by every row tile; TDPBSSD sums the same integers as vpdpbusd (values 0..15 as signed bytes), and the
// epilogue is the same, so both paths give the same bits.

// columns [n, n + 16 nb) of every k into bt ([nb][K/4][16][4] bytes, values 0..15)
static void unpack_panel(int K, const uint8_t* wp, int n, int nb, int8_t* bt) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t* p = wp + (size_t)(n / 16 + b) * (K / 8) * 64;
        int8_t* o = bt + (size_t)b * K * 16;
        for (int k8 = 0; k8 < K / 8; k8++) {
            __m512i v = _mm512_loadu_si512((const void*)(p + (size_t)k8 * 64));
            _mm512_store_si512((void*)(o + (size_t)k8 * 128), _mm512_and_si512(v, low));
            _mm512_store_si512((void*)(o + (size_t)k8 * 128 + 64),
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
}

// one group's epilogue from the stored C tiles into yb (the block's y); `first` a constant
static inline __attribute__((always_inline)) void amx_epilogue(
    const int MA, const int NB, const int R, const int first, const int32_t (*buf)[16][16],
    const float* xs, const float* xsum, const float* ws, const float* wb, float (*yb)[32],
    int m0, int n, int g, int ng) {
    size_t xa = ((size_t)m0 / 16 * ng + g) * 16;  // 16 rows' scales (and sums) in a line
    for (int b = 0; b < NB; b++) {
        size_t at = ((size_t)(n / 16 + b) * ng + g) * 16;
        __m512 s = _mm512_loadu_ps(ws + at), bias = _mm512_loadu_ps(wb + at);
        for (int a = 0; a < MA; a++)
            for (int r = 0; r < R; r++) {
                size_t x = xa + (size_t)a * ng * 16 + r;
                epilogue(&yb[16 * a + r][16 * b], _mm512_load_si512(buf[2 * a + b][r]), s, bias,
                         xs[x], xsum[x], first);
            }
    }
}

// MA row tiles of R rows (16 but in the last, shorter one) from m0, NB column tiles from n
// (their unpacked panel bt), group by group; the epilogue of one group runs from one of two
// buffers while the tiles compute the next into the other
AMX static inline __attribute__((always_inline)) void amx_block(
    const int MA, const int NB, const int R, int K, int N, const int8_t* xq, const float* xs,
    const float* xsum, const int8_t* bt, const float* ws, const float* wb, float* y, int m0,
    int n, const uint8_t* next) {
    int ng = K / G;
    int32_t buf[2][4][16][16] __attribute__((aligned(64)));
    float yb[32][32] __attribute__((aligned(64)));
    const int8_t* b0 = bt;
    const int8_t* b1 = bt + (size_t)K * 16;
    const int8_t* a0 = xq + (size_t)m0 / 16 * ng * 512;
    for (int g = 0; g < ng; g++) {
        int32_t(*out)[16][16] = buf[g & 1];
        if (next)  // the next panel's nibbles on their way while these tiles compute
            for (int t = 0; t < 2; t++)
                for (int l = 0; l < 4; l++)
                    _mm_prefetch((const char*)next + (size_t)t * (K / 8) * 64 + g * 256 + l * 64,
                                 _MM_HINT_T0);
        amx_group(MA, NB, a0, b0, b1, g, ng, out);
        if (g == 1)
            amx_epilogue(MA, NB, R, 1, (const int32_t(*)[16][16])buf[0], xs, xsum, ws, wb, yb,
                         m0, n, 0, ng);
        else if (g > 1)
            amx_epilogue(MA, NB, R, 0, (const int32_t(*)[16][16])buf[(g - 1) & 1], xs, xsum, ws,
                         wb, yb, m0, n, g - 1, ng);
    }
    const int32_t(*last)[16][16] = (const int32_t(*)[16][16])buf[(ng - 1) & 1];
    if (ng == 1) amx_epilogue(MA, NB, R, 1, last, xs, xsum, ws, wb, yb, m0, n, 0, ng);
    else amx_epilogue(MA, NB, R, 0, last, xs, xsum, ws, wb, yb, m0, n, ng - 1, ng);
    amx_store(MA, NB, R, yb, y, N, m0, n);
}

#define AMX_BLOCK(MA, NB, R) \
    amx_block(MA, NB, R, K, N, xq, xs, xsum, bt, ws, wb, y, m, n, m == 0 ? next : 0)

// q4_gemm's product through AMX tiles, bit for bit the same, from activations in tiles
// (q4_quantize's amx = 1): columns [n0, n1), 32 at a time (16 at the end), each 32's panel
// unpacked once for every row.
AMX void q4_gemm_amx(int M, int N, int K, const int8_t* xq, const float* xs, const float* xsum,
                     const uint8_t* wp, const float* ws, const float* wb, float* y, int n0,
                     int n1) {
    int8_t* bt = aligned_alloc(64, (size_t)K * 32);
    if (!bt) return;  // (K * 32 bytes: 448 KB at K = 14,336)
    int full = M / 16 * 16;
    for (int n = n0; n < n1;) {
        int nb = n1 - n >= 32 ? 2 : 1;
        unpack_panel(K, wp, n, nb, bt);
        // (two tiles from n + 32: at most 16 columns past n1, read ahead only)
        const uint8_t* next = n + 32 < n1 ? wp + (size_t)(n / 16 + 2) * (K / 8) * 64 : 0;
        int m = 0;
        if (full) {
            amx_config(16);
            for (; m + 32 <= full; m += 32) {
                if (nb == 2) AMX_BLOCK(2, 2, 16);
                else AMX_BLOCK(2, 1, 16);
            }
            if (m < full) {
                if (nb == 2) AMX_BLOCK(1, 2, 16);
                else AMX_BLOCK(1, 1, 16);
                m += 16;
            }
        }
        if (M > full) {
            int R = M - full;
            amx_config(R);
            if (nb == 2) AMX_BLOCK(1, 2, R);
            else AMX_BLOCK(1, 1, R);
        }
        n += 16 * nb;
    }
    _tile_release();
    free(bt);
}

// ---- q4_matmul: one call per GEMM, split over pool.h's workers
struct q4_job {
    int M, N, K, amx;
    const int8_t* xq;
    const float* xs;
    const float* xsum;
    const uint8_t* wp;
    const float* ws;
    const float* wb;
    float* y;
};

static void q4_columns(const void* args, int n0, int n1) {
    const struct q4_job* j = args;
    if (j->amx)
        q4_gemm_amx(j->M, j->N, j->K, j->xq, j->xs, j->xsum, j->wp, j->ws, j->wb, j->y, n0, n1);
    else
        q4_gemm(j->M, j->N, j->K, j->xq, j->xs, j->xsum, j->wp, j->ws, j->wb, j->y, n0, n1);
}

// y[M, N] = x[M, K] . w^T in one call, as q8_matmul: x quantized into xq / xs / xsum
// (q4_quantize), then the columns split `chunk` at a time over this thread and up to threads
// - 1 workers (1: this thread alone). Any split gives the same bits. N < 2^19.
void q4_matmul(int M, int N, int K, const float* x, int64_t ldx, int8_t* xq, float* xs,
               float* xsum, const uint8_t* wp, const float* ws, const float* wb, float* y,
               int amx, int threads, int chunk) {
    q4_quantize(M, K, x, ldx, xq, xs, xsum, amx);
    struct q4_job j = {M, N, K, amx, xq, xs, xsum, wp, ws, wb, y};
    pool_run(q4_columns, &j, N, chunk, threads);
}

// Workers started, and the columns they computed (for tests)
int q4_pool_workers(void) { return pool_workers(); }
int64_t q4_pool_helped(void) { return pool_helped(); }
