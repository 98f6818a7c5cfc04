// Grouped int8 GEMM for the `int8` host format (engine/host/q8.py): AVX-512 VNNI, and AMX
// where the CPU has it and lets us use it (q8.py probes that once, in a child process).
//
//   y[m, n] = sum over groups g, in order, of (xs[m, g] * ws[g, n]) * sum_{k in g} xq[m, k] w[n, k]
//
// Weights and activations are int8 in groups of G along K, each group with its own float32
// scale (activations quantized here, per row and group, on the fly), as llama.cpp's Q8_0 and
// OpenVINO's dynamic quantization do. Batch invariance by construction: the integer sums are
// exact, and the float epilogue of every output element is the same multiply and FMA per
// group, in group order, whatever M, the row block a row falls in, or the columns a thread
// takes, and whether VNNI or AMX computed it: both sum the same integers exactly, then run the
// same float epilogue, s = ws * xs, y = cvt(sum) * s for the first group, fma(cvt(sum), s, y)
// after. Built without -march=native (q8.py builds it, and checks the CPU): the AMX code has
// target attributes of its own, so the library loads and runs VNNI on a CPU without AMX.
#include "grouped.h"
#include "pool.h"
#include "widen.h"

#define MR 6  // rows per block: 6 x 4 accumulators + 4 weight vectors + 1 broadcast < 32 zmm

#ifndef Q8_SOURCE_SHA
#define Q8_SOURCE_SHA "unknown"
#endif

const char* q8_source_sha(void) { return Q8_SOURCE_SHA; }

// x[M, K] (row stride ldx) -> xq and xs[M, ng] (grouped.h's quantize_groups): for VNNI (amx =
// 0) xq[M, K] holds q + 128 (unsigned bytes); for AMX (amx = 1, G = 32) q signed, as A tiles.
void q8_quantize(int M, int K, int G, const float* x, int64_t ldx, uint8_t* xq, float* xs,
                 int amx) {
    quantize_groups(M, K, G, x, ldx, xq, xs, NULL, amx, amx ? 0 : 128);
}

// One group's float epilogue for 16 outputs: the same instructions on both paths.
static inline __attribute__((always_inline)) void epilogue(float* yp, __m512i sum, __m512 wsv,
                                                           float xs, int first) {
    __m512 s = _mm512_mul_ps(wsv, _mm512_set1_ps(xs));
    __m512 v = _mm512_cvtepi32_ps(sum);
    _mm512_storeu_ps(yp, first ? _mm512_mul_ps(v, s) : _mm512_fmadd_ps(v, s, _mm512_loadu_ps(yp)));
}

// R rows from m0, NT tiles of 16 columns from n. wp: [N/16][K/4][16][4] (a tile's 16 columns
// x 4 consecutive k per 64 bytes, dpbusd's layout and AMX's B tiles'); ws, wc: [N/16][ng][16]
// (a tile's groups in a row: [ng][N] put each group's 16 scales on another page at N = 16,384,
// and the 1.7B's GEMMs lost ~15% to it); wc = -128 * sum_g w: the accumulators start there,
// which takes the +128 of the activations out.
static inline __attribute__((always_inline)) void block(
    const int R, const int NT, int K, int G, int N, const uint8_t* xq, const float* xs,
    const int8_t* wp, const float* ws, const int32_t* wc, float* y, int m0, int n) {
    int ng = (K + G - 1) / G;
    __m512i acc[MR][4];
    // the float sums live in y itself (in registers they would spill: 48 vectors)
    for (int g = 0; g < ng; g++) {
        for (int j = 0; j < NT; j++) {
            const int32_t* c = wc + ((size_t)(n / 16 + j) * ng + g) * 16;
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_loadu_si512((const void*)c);
        }
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
            __m512 wsv = _mm512_loadu_ps(ws + ((size_t)(n / 16 + j) * ng + g) * 16);
            for (int r = 0; r < R; r++)
                epilogue(y + (size_t)(m0 + r) * N + n + 16 * j, acc[r][j], wsv,
                         xs[(size_t)(m0 + r) * ng + g], g == 0);
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

// ---- AMX (grouped.h: the tiles' set-up and a group's products): C tiles (the sums) of MA row
// tiles x NB column tiles (at most 2 x 2: tiles 0-3), A tiles of activations (rows x one group
// of 32 bytes: 4-5), B tiles of weights (8 rows of 4 k x 16 columns, q8_gemm's layout: 6-7).
// Activations signed here (q8_quantize's amx = 1) and
// TDPBSSD, so the sums start at zero: the same integers as VNNI's. One group per product, its
// C tiles stored to one of two buffers, and the epilogue of the group before runs from the
// other meanwhile. Needs G = 32 and K a multiple of 32 (q8.py sends other shapes to VNNI).
// Measured at 256 rows (one 135M layer, 1 thread): ~300 GMAC/s, VNNI's ~130; the tile part
// alone ~480, the epilogue alone ~520, so they overlap only in part. Tried and slower: y in
// registers with one 16 x 16 C tile and 4 groups in flight (~260), two groups per epilogue
// pass (half the loads and stores of y: ~285).

// one group's epilogue from the stored C tiles into yb[32][32] (the block's y); `first` is
// g == 0, a constant in each call (a test per row cost ~10% here)
static inline __attribute__((always_inline)) void amx_epilogue(
    const int MA, const int NB, const int R, const int first, int N,
    const int32_t (*buf)[16][16], const float* xs, const float* ws, float (*yb)[32], int m0,
    int n, int g, int ng) {
    const float* xg = xs + ((size_t)m0 / 16 * ng + g) * 16;  // 16 rows' scales in a line
    for (int b = 0; b < NB; b++) {
        __m512 wsv = _mm512_loadu_ps(ws + ((size_t)(n / 16 + b) * ng + g) * 16);
        for (int a = 0; a < MA; a++)
            for (int r = 0; r < R; r++)
                epilogue(&yb[16 * a + r][16 * b], _mm512_load_si512(buf[2 * a + b][r]), wsv,
                         xg[(size_t)a * ng * 16 + r], first);
    }
}

// MA row tiles of R rows (R = 16 but in the last, shorter one) from m0, NB column tiles from n
AMX static inline __attribute__((always_inline)) void amx_block(
    const int MA, const int NB, const int R, int K, int N, const int8_t* xq, const float* xs,
    const int8_t* wp, const float* ws, float* y, int m0, int n) {
    int ng = K / AG;
    int32_t buf[2][4][16][16] __attribute__((aligned(64)));
    float yb[32][32] __attribute__((aligned(64)));  // y's rows are 4 KB apart for N = 1,024 ...
    const int8_t* b0 = wp + (size_t)(n / 16) * (K / 4) * 64;
    const int8_t* b1 = b0 + (size_t)(K / 4) * 64;
    const int8_t* a0 = xq + (size_t)m0 / 16 * ng * 512;
    for (int g = 0; g < ng; g++) {
        int32_t(*out)[16][16] = buf[g & 1];
        // this group's B tiles of the next block (NB tiles on, which follow these in memory: 8
        // lines each) asked for into L2 now: a GEMM of a few row tiles streams its weights
        // once, and one core alone keeps too few loads in flight to draw more than ~10 GB/s.
        // 30 135M layers' GEMMs, 2 threads, a 2-core Xeon: 8 rows 8.7-8.8 -> 7.0-7.4 ms, 32
        // rows 15.1-15.6 -> 14.1-14.6, 64 rows 26.7-27.5 -> 24.6-25.1, 128 level; a width-8
        // decode step 19.7-20.8 -> 18.1-18.3 ms
        const char* next = (const char*)(b0 + (size_t)g * (AG / 4) * 64) + (size_t)NB * K * 16;
        for (int t = 0; t < NB; t++)
            for (int l = 0; l < 8; l++)
                _mm_prefetch(next + (size_t)t * K * 16 + l * 64, _MM_HINT_T1);
        amx_group(MA, NB, a0, b0, b1, g, ng, out);
        if (g == 1)
            amx_epilogue(MA, NB, R, 1, N, (const int32_t(*)[16][16])buf[0], xs, ws, yb, m0, n,
                         0, ng);
        else if (g > 1)
            amx_epilogue(MA, NB, R, 0, N, (const int32_t(*)[16][16])buf[(g - 1) & 1], xs, ws,
                         yb, m0, n, g - 1, ng);
    }
    const int32_t(*last)[16][16] = (const int32_t(*)[16][16])buf[(ng - 1) & 1];
    if (ng == 1) amx_epilogue(MA, NB, R, 1, N, last, xs, ws, yb, m0, n, 0, ng);
    else amx_epilogue(MA, NB, R, 0, N, last, xs, ws, yb, m0, n, ng - 1, ng);
    amx_store(MA, NB, R, yb, y, N, m0, n);
}

AMX static void amx_rows(int MA, int R, int N, int K, const int8_t* xq, const float* xs,
                         const int8_t* wp, const float* ws, float* y, int m, int n0, int n1) {
    for (int n = n0; n < n1;) {  // R is 16 but in the last row tile
        int nb = n1 - n >= 32 ? 2 : 1;
        if (MA == 2 && nb == 2) amx_block(2, 2, 16, K, N, xq, xs, wp, ws, y, m, n);
        else if (MA == 2) amx_block(2, 1, 16, K, N, xq, xs, wp, ws, y, m, n);
        else if (R == 16 && nb == 2) amx_block(1, 2, 16, K, N, xq, xs, wp, ws, y, m, n);
        else if (R == 16) amx_block(1, 1, 16, K, N, xq, xs, wp, ws, y, m, n);
        else if (nb == 2) amx_block(1, 2, R, K, N, xq, xs, wp, ws, y, m, n);
        else amx_block(1, 1, R, K, N, xq, xs, wp, ws, y, m, n);
        n += 16 * nb;
    }
}

// q8_gemm's product through AMX tiles (after q8_amx_init), bit for bit the same, from signed
// activations in tiles (q8_quantize's amx = 1). G must be 32 and K a multiple of 32.
AMX void q8_gemm_amx(int M, int N, int K, int G, const int8_t* xq, const float* xs,
                     const int8_t* wp, const float* ws, const int32_t* wc, float* y, int n0,
                     int n1) {
    (void)G, (void)wc;  // the sums need no offset
    int full = M / 16 * 16, m = 0;
    if (full) {
        amx_config(16);
        for (; m + 32 <= full; m += 32) amx_rows(2, 16, N, K, xq, xs, wp, ws, y, m, n0, n1);
        if (m < full) amx_rows(1, 16, N, K, xq, xs, wp, ws, y, m, n0, n1);
    }
    if (M > full) {
        amx_config(M - full);
        amx_rows(1, M - full, N, K, xq, xs, wp, ws, y, full, n0, n1);
    }
    _tile_release();
}

// Asks Linux for the AMX tile state (grouped.h's amx_request): 0 when granted.
int q8_amx_init(void) { return amx_request(); }

// Whether AMX runs here and gives VNNI's bits, on a product with full and short tiles of both
// kinds and 3 groups: 0 yes, 1 the bits differ, 2 no AMX permission. A CPU that advertises AMX
// but traps it ends the process: q8.py runs this in a child.
static uint32_t lcg(uint32_t* r) { return *r = *r * 1103515245u + 12345u; }

int q8_amx_selftest(void) {
    enum { M = 37, N = 48, K = 96, NG = K / AG };
    static float x[M * K], xs[M * NG], ws[NG * N], y0[M * N], y1[M * N];
    static uint8_t xq[M * K], xt[48 * K];
    static float xt_s[48 * NG];
    static int8_t wp[N * K];
    static int32_t wc[NG * N];
    if (q8_amx_init()) return 2;
    uint32_t r = 12345;
    for (int i = 0; i < M * K; i++) x[i] = (float)(int)(lcg(&r) >> 16) - 32768.f;
    for (int i = 0; i < N * K; i++) wp[i] = (int8_t)(lcg(&r) >> 24 | 1);  // -127..127
    for (int i = 0; i < NG * N; i++) ws[i] = 1e-3f * (float)(1 + (lcg(&r) >> 24));
    for (int g = 0; g < NG; g++)
        for (int n = 0; n < N; n++) {  // -128 x the group's weights, as Q8Weights.pack
            int32_t c = 0;
            for (int k = g * AG; k < (g + 1) * AG; k++)
                c -= 128 * wp[((n / 16) * (K / 4) + k / 4) * 64 + n % 16 * 4 + k % 4];
            wc[(n / 16 * NG + g) * 16 + n % 16] = c;
        }
    q8_quantize(M, K, AG, x, K, xq, xs, 0);
    q8_gemm(M, N, K, AG, xq, xs, wp, ws, wc, y0, 0, N);
    q8_quantize(M, K, AG, x, K, xt, xt_s, 1);
    q8_gemm_amx(M, N, K, AG, (const int8_t*)xt, xt_s, wp, ws, wc, y1, 0, N);
    return memcmp(y0, y1, sizeof y0) ? 1 : 0;
}

// ---- q8_matmul: one call per GEMM, split over pool.h's workers
struct q8_job {
    int M, N, K, G, amx;
    const uint8_t* xq;
    const float* xs;
    const int8_t* wp;
    const float* ws;
    const int32_t* wc;
    float* y;
};

static void q8_columns(const void* args, int n0, int n1) {
    const struct q8_job* j = args;
    if (j->amx)
        q8_gemm_amx(j->M, j->N, j->K, j->G, (const int8_t*)j->xq, j->xs, j->wp, j->ws, j->wc,
                    j->y, n0, n1);
    else
        q8_gemm(j->M, j->N, j->K, j->G, j->xq, j->xs, j->wp, j->ws, j->wc, j->y, n0, n1);
}

// y[M, N] = x[M, K] . w^T in one call: x's activations quantized into xq / xs (q8_quantize),
// then the columns split `chunk` at a time over this thread and up to threads - 1 workers (1:
// this thread alone). Any split gives the same bits (each column's sums are one thread's, in
// one order). N < 2^19.
void q8_matmul(int M, int N, int K, int G, const float* x, int64_t ldx, uint8_t* xq, float* xs,
               const int8_t* wp, const float* ws, const int32_t* wc, float* y, int amx,
               int threads, int chunk) {
    q8_quantize(M, K, G, x, ldx, xq, xs, amx);
    struct q8_job j = {M, N, K, G, amx, xq, xs, wp, ws, wc, y};
    pool_run(q8_columns, &j, N, chunk, threads);
}

// The pool for another library's work (attn.c's attn_decode_pooled): run(args, c0, c1) over
// columns [0, N), `chunk` at a time, here and on up to threads - 1 of the same workers, so
// that a process has one set of spinning workers, not one per library
void q8_pool_run(pool_columns run, const void* args, int N, int chunk, int threads) {
    pool_run(run, args, N, chunk, threads);
}

// Workers started, and the columns they computed (for tests)
int q8_pool_workers(void) { return pool_workers(); }
int64_t q8_pool_helped(void) { return pool_helped(); }

// ---- q8_pack: a weight table into Q8Weights' buffer (q8.py) in one pass, at a first start
// (numpy's passes over a 1.7B model: the layout's transpose and the group sums after the
// quantizer, ~5.6 s of a 15.5 s start; here ~0.5 ns a weight, ~0.9 s on one thread). w[N, K] (row stride ldw) of
// `dtype` (widen.h), rounded exactly as quantize_groups rounds activations (offset 0), so the
// bits are q8.py's quantize_groups_numpy's. Out: wp [N/16][K/4][16][4] int8, ws [N/16][ng][16]
// float32, wc [N/16][ng][16] int32 = -128 x the group's sum. Tiles of 16 rows split over the
// pool: each tile's bytes are one thread's.
struct q8_pack_job {
    int K, G, dtype;
    int64_t ldw;
    const void* w;
    int8_t* wp;
    float* ws;
    int32_t* wc;
};

// One tile's group of 32 (the common shape: G = 32, K a multiple of it): the 16 rows' values
// in registers, then the tile's 8 lines of the group written whole (a gather a line), where
// q8_pack_group's per-row passes wrote them 4 bytes at a time (~2.5x as long).
static inline __attribute__((always_inline)) void q8_pack_tile32(
    const struct q8_pack_job* j, int t, int g, int ng) {
    int32_t bytes[16][8];  // the 16 rows' 32 values as int8, 4 to a word
    size_t at = ((size_t)t * ng + g) * 16;
    for (int r = 0; r < 16; r++) {
        const void* row = widen_row(j->w, j->dtype, j->ldw, 16 * t + r);
        __m512 a = widen16(row, j->dtype, g * 32), b = widen16(row, j->dtype, g * 32 + 16);
        int bad = widen_nonfinite(a, b);  // (as the sum of v x 0 tells it elsewhere)
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        __m512 inv = _mm512_set1_ps(bad ? 0.f : amax > 0.f ? 127.f / amax : 0.f);
        __m512i ia = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, inv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i ib = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, inv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (bad) ia = ib = _mm512_setzero_si512();
        _mm_storeu_si128((__m128i*)&bytes[r][0], _mm512_cvtepi32_epi8(ia));
        _mm_storeu_si128((__m128i*)&bytes[r][4], _mm512_cvtepi32_epi8(ib));
        j->ws[at + r] = bad ? __builtin_nanf("") : amax > 0.f ? amax / 127.f : 1.f;
        j->wc[at + r] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
    }
    const __m512i rows = widen_tile_rows();  // word w of row r: bytes[r][w]
    int32_t* line = (int32_t*)j->wp + ((size_t)t * (j->K / 4) + (size_t)g * 8) * 16;
    for (int w = 0; w < 8; w++)
        _mm512_storeu_si512(line + w * 16, _mm512_i32gather_epi32(rows, &bytes[0][w], 4));
}

// One row's group of any length (a multiple of 16): the general shape
static inline __attribute__((always_inline)) void q8_pack_group(
    const struct q8_pack_job* j, int t, int r, int g, int ng) {
    int K = j->K, G = j->G;
    const void* row = widen_row(j->w, j->dtype, j->ldw, 16 * t + r);
    int len = K - g * G < G ? K - g * G : G;
    __m512 mx = _mm512_setzero_ps(), bad = _mm512_setzero_ps();
    for (int k = 0; k < len; k += 16) {
        __m512 v = widen16(row, j->dtype, g * G + k);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
        bad = _mm512_add_ps(bad, _mm512_mul_ps(v, _mm512_setzero_ps()));
    }
    float amax = _mm512_reduce_max_ps(mx);
    int nan = _mm512_reduce_add_ps(bad) != _mm512_reduce_add_ps(bad);
    size_t at = ((size_t)t * ng + g) * 16 + r;
    __m512 inv = _mm512_set1_ps(nan ? 0.f : amax > 0.f ? 127.f / amax : 0.f);
    __m512i total = _mm512_setzero_si512();
    for (int k = 0; k < len; k += 16) {
        __m512i i = _mm512_cvt_roundps_epi32(_mm512_mul_ps(widen16(row, j->dtype, g * G + k), inv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (nan) i = _mm512_setzero_si512();  // (NaN x 0 is NaN)
        total = _mm512_add_epi32(total, i);
        int32_t four[4];
        _mm_storeu_si128((__m128i*)four, _mm512_cvtepi32_epi8(i));
        // 16 values: 4 words of 4 k, each to its own line of the tile's layout
        size_t k4 = (size_t)(g * G + k) / 4;
        for (int q = 0; q < 4; q++) ((int32_t*)j->wp)[((size_t)t * (K / 4) + k4 + q) * 16 + r] = four[q];
    }
    j->ws[at] = nan ? __builtin_nanf("") : amax > 0.f ? amax / 127.f : 1.f;
    j->wc[at] = -128 * _mm512_reduce_add_epi32(total);
}

static void q8_pack_tiles(const void* args, int t0, int t1) {
    const struct q8_pack_job* j = args;
    int ng = (j->K + j->G - 1) / j->G;
    for (int t = t0; t < t1; t++)
        for (int g = 0; g < ng; g++) {
            if (j->G == 32 && (g + 1) * 32 <= j->K) {
                q8_pack_tile32(j, t, g, ng);
                continue;
            }
            for (int r = 0; r < 16; r++) q8_pack_group(j, t, r, g, ng);
        }
}

// N and K multiples of 16; N / 16 < 2^19. Split over `threads` (this one and the pool's).
void q8_pack(int N, int K, int G, const void* w, int dtype, int64_t ldw, int8_t* wp, float* ws,
             int32_t* wc, int threads) {
    struct q8_pack_job j = {K, G, dtype, ldw, w, wp, ws, wc};
    pool_run(q8_pack_tiles, &j, N / 16, 4, threads);
}

// ---- q8_experts: a mixture's experts in one call (engine/host/experts.py), each expert's
// GEMM on its own rows. Per expert a call of q8_matmul's each was (4-12 rows at a decode
// width of 32, 16 calls a layer) ~52 us of mostly hand-offs; here one quantizing pass, then
// (expert, column chunk) pieces from one counter over the pool. Each expert's rows take
// q8_matmul's path for that many rows (AMX from amx_rows, else VNNI), and both give the same
// bits for a row whatever its neighbours: a row's result is q8_matmul's of that row alone.
struct q8_experts_job {
    int N, K, G;
    const int32_t* rows;  // [A + 1]: expert a's rows are [rows[a], rows[a + 1]) of x and y
    const int32_t* qrow;  // [A]: where its quantized rows start in xq / xs (16-row aligned)
    const uint8_t* amx;   // [A]: 1 where its rows go through AMX
    const int32_t* experts;  // [A]: its index into weights
    const uint64_t* weights;  // [E][3]: each expert's wp, ws, wc (Q8Weights.addresses)
    const uint8_t* xq;
    const float* xs;
    float* y;
};

// columns [v0, v1) of the experts' columns laid end to end (expert a's: [a N, (a + 1) N))
static void q8_expert_columns(const void* args, int v0, int v1) {
    const struct q8_experts_job* j = args;
    int N = j->N, K = j->K, ng = (K + j->G - 1) / j->G;
    while (v0 < v1) {
        int a = v0 / N, n0 = v0 % N, n1 = n0 + (v1 - v0) < N ? n0 + (v1 - v0) : N;
        int m = j->rows[a], M = j->rows[a + 1] - m;
        const uint64_t* w = j->weights + (size_t)3 * j->experts[a];
        const uint8_t* xq = j->xq + (size_t)j->qrow[a] * K;
        const float* xs = j->xs + (size_t)j->qrow[a] * ng;
        const int8_t* wp = (const int8_t*)(uintptr_t)w[0];
        const float* ws = (const float*)(uintptr_t)w[1];
        const int32_t* wc = (const int32_t*)(uintptr_t)w[2];
        float* y = j->y + (size_t)m * N;
        if (M > 0 && j->amx[a])
            q8_gemm_amx(M, N, K, j->G, (const int8_t*)xq, xs, wp, ws, wc, y, n0, n1);
        else if (M > 0)
            q8_gemm(M, N, K, j->G, xq, xs, wp, ws, wc, y, n0, n1);
        v0 += n1 - n0;
    }
}

// y[rows[a]:rows[a + 1], N] = x[rows[a]:rows[a + 1], K] . w_e^T for e = experts[a], a < A:
// activations quantized into xq / xs (room for M + 16 A rows), through AMX where an expert has
// at least amx_rows rows (0: never; G = 32 and K a multiple of 32 then), the experts' columns
// split `chunk` at a time (a multiple of 16; of 32 with AMX) as q8_matmul's. Returns -1, having
// done nothing, unless 0 < A <= 1,024, each experts[a] < E and rows ascend from 0 to at most M
// (x's and y's rows). A N < 2^19 to be split.
int q8_experts(int A, const int32_t* experts, int E, const int32_t* rows, int M, int N, int K,
               int G, const float* x, int64_t ldx, uint8_t* xq, float* xs,
               const uint64_t* weights, float* y, int amx_rows, int threads, int chunk) {
    int32_t qrow[1024];
    uint8_t amx[1024];
    int ng = (K + G - 1) / G, at = 0;
    if (A < 1 || A > 1024 || rows[0] != 0 || rows[A] > M) return -1;
    for (int a = 0; a < A; a++)
        if (experts[a] < 0 || experts[a] >= E || rows[a + 1] < rows[a]) return -1;
    for (int a = 0; a < A; a++) {
        int m = rows[a + 1] - rows[a];
        amx[a] = amx_rows > 0 && m >= amx_rows;
        qrow[a] = at;
        if (m > 0)
            q8_quantize(m, K, G, x + (size_t)rows[a] * ldx, ldx, xq + (size_t)at * K,
                        xs + (size_t)at * ng, amx[a]);
        at += (m + 15) / 16 * 16;  // AMX reads its last row tile whole
    }
    struct q8_experts_job j = {N, K, G, rows, qrow, amx, experts, weights, xq, xs, y};
    pool_run(q8_expert_columns, &j, A * N, chunk, threads);
    return 0;
}
