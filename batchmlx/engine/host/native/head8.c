// The LM head (and a tied embedding) in 8-bit weights against bf16 activations, for the int8
// and q4 host formats (engine/host/head8.py), with AVX-512 BF16.
//
//   w[n, k] = q[n, k] * s[n, g],  q int8 (|q| <= 127), groups g of 32 along K
//   y[m, n] = sum over g, in order, of s[n, g] * dot_g(m, n)   (one fused multiply-add a group)
//
// with dot_g = the bf16 products of x[m, k] (rounded to bf16 once) and q[n, k] over the group,
// summed by 16 vdpbf16ps in pair order from zero. q is exact in bf16 (8 significant bits), so
// the weights are a Q8_0 file's own values: q and its scale are the file's. Batch invariance
// by construction: every output element is the same instructions in the same order whatever M,
// the block of rows a row falls in, or the columns a thread takes (one arithmetic at every
// width: no other path).
//
// Layout: q as [N/16][K/2][16][2] (each 32 bytes: one k pair of 16 columns, vdpbf16ps's lanes),
// s as [N/16][K/32][16].
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "runner.h"
#include "widen.h"

#define G 32   // values per scale
#define T 16   // columns per tile (one vector of outputs)
#define MR 6   // rows per block: MR x CT group sums + CT weight vectors + a broadcast
#define CT 4   // tiles per block
// How far ahead of the weights it widens a pass prefetches them (bytes). A one-row head
// streams its table from memory, and a block's lines were asked for only as its widening began:
// the 135M head at one row, 2 threads, 2.74 -> 1.7 ms through AMX, 1.90 -> 1.4 without (a
// 2-core Xeon; 64 KB-1 MB all within noise of each other)
#define PREFETCH_AHEAD (256 << 10)

#ifndef HEAD8_SOURCE_SHA
#define HEAD8_SOURCE_SHA "unknown"
#endif

const char* head8_source_sha(void) { return HEAD8_SOURCE_SHA; }

// x[M, K] float32 (row stride ldx) -> bf16 bits [M, K], rounded to nearest even (MLX's and
// oneDNN's rounding of a float to bf16).
void head8_to_bf16(int M, int K, const float* x, int64_t ldx, uint16_t* out) {
    for (int m = 0; m < M; m++) {
        const float* r = x + (size_t)m * ldx;
        uint16_t* o = out + (size_t)m * K;
        int k = 0;
        for (; k + 16 <= K; k += 16)
            _mm256_storeu_si256((__m256i*)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r + k)));
        for (; k < K; k++) {
            __m512 v = _mm512_set1_ps(r[k]);
            __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
            o[k] = (uint16_t)_mm256_extract_epi16(b, 0);
        }
    }
}

// One k pair of one tile: 32 int8 -> 32 bf16 (exact: |q| <= 127), lanes as vdpbf16ps reads them.
static inline __attribute__((always_inline)) __m512bh widen(const int8_t* p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __attribute__((always_inline)) __m512bh pair(const uint16_t* x, int kp) {
    uint32_t v;
    memcpy(&v, x + 2 * kp, 4);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

// R rows x C tiles (constants where inlined) from the widened weights wb ([K/2][C] vectors):
// each group's sums from zero over its 16 pairs, then y = s * sum + y (+0 for the first group).
static inline __attribute__((always_inline)) void block(int R, int C, int K, const uint16_t* x,
                                                        int64_t ldx, const __m512bh* wb,
                                                        const float* s, float* y, int64_t ldy) {
    __m512 acc[MR][CT];
    int ng = K / G;
    for (int g = 0; g < ng; g++) {
        for (int i = 0; i < R; i++)
            for (int c = 0; c < C; c++) acc[i][c] = _mm512_setzero_ps();
        for (int p = 0; p < G / 2; p++) {
            int kp = g * (G / 2) + p;
            const __m512bh* w = wb + (size_t)kp * C;
            for (int i = 0; i < R; i++) {
                __m512bh b = pair(x + (size_t)i * ldx, kp);
                for (int c = 0; c < C; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w[c], b);
            }
        }
        for (int c = 0; c < C; c++) {
            __m512 sc = _mm512_loadu_ps(s + ((size_t)c * ng + g) * T);
            for (int i = 0; i < R; i++) {
                float* yp = y + (size_t)i * ldy + c * T;
                __m512 prev = g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yp);
                _mm512_storeu_ps(yp, _mm512_fmadd_ps(acc[i][c], sc, prev));
            }
        }
    }
}

// One row of C tiles, widening the weights as it reads them (no scratch: one row reads each
// weight once). The same instructions per element as `block`.
static inline __attribute__((always_inline)) void row_direct(int C, int K, const uint16_t* x,
                                                             const int8_t* q, const float* s,
                                                             float* y) {
    __m512 total[CT], acc[CT];
    int ng = K / G;
    for (int c = 0; c < C; c++) total[c] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        for (int c = 0; c < C; c++) acc[c] = _mm512_setzero_ps();
        for (int p = 0; p < G / 2; p++) {
            int kp = g * (G / 2) + p;
            __m512bh b = pair(x, kp);
            for (int c = 0; c < C; c++) {
                const int8_t* src = q + ((size_t)c * K / 2 + kp) * 2 * T;
                if (p % 2 == 0) _mm_prefetch((const char*)src + PREFETCH_AHEAD, _MM_HINT_T0);
                acc[c] = _mm512_dpbf16_ps(acc[c], widen(src), b);
            }
        }
        for (int c = 0; c < C; c++)
            total[c] = _mm512_fmadd_ps(acc[c], _mm512_loadu_ps(s + ((size_t)c * ng + g) * T), total[c]);
    }
    for (int c = 0; c < C; c++) _mm512_storeu_ps(y + c * T, total[c]);
}

static void rows_c(int M, int C, int K, const uint16_t* x, int64_t ldx, const __m512bh* wb,
                   const float* s, float* y, int64_t ldy) {
    int m = 0;
    if (C == CT) {
        for (; m + MR <= M; m += MR) block(MR, CT, K, x + (size_t)m * ldx, ldx, wb, s, y + (size_t)m * ldy, ldy);
        for (; m < M; m++) block(1, CT, K, x + (size_t)m * ldx, ldx, wb, s, y + (size_t)m * ldy, ldy);
    } else {
        for (; m + MR <= M; m += MR) block(MR, 1, K, x + (size_t)m * ldx, ldx, wb, s, y + (size_t)m * ldy, ldy);
        for (; m < M; m++) block(1, 1, K, x + (size_t)m * ldx, ldx, wb, s, y + (size_t)m * ldy, ldy);
    }
}

// y[M, n0:n1] = x[M, K] . w[n0:n1]^T: x bf16 bits (row stride ldx), y float32 (row stride
// ldy); n0 and n1 multiples of 16, K of 32. CT tiles at a time (one at the end): their weights
// widened once into wb, read by every block of MR rows; a single row widens as it reads.
void head8_gemm(int M, int K, const uint16_t* x, int64_t ldx, const int8_t* q, const float* s,
                float* y, int64_t ldy, int n0, int n1) {
    int ng = K / G;
    __m512bh wb[(K / 2) * CT];
    for (int t = n0 / T; t < n1 / T;) {
        int C = n1 / T - t >= CT ? CT : 1;
        const int8_t* qt = q + (size_t)t * K * T;
        const float* st = s + (size_t)t * ng * T;
        float* yt = y + (size_t)t * T;
        if (M == 1) {
            if (C == CT) row_direct(CT, K, x, qt, st, yt);
            else row_direct(1, K, x, qt, st, yt);
        } else {
            for (int kp = 0; kp < K / 2; kp++)
                for (int c = 0; c < C; c++)
                    wb[(size_t)kp * C + c] = widen(qt + ((size_t)c * K / 2 + kp) * 2 * T);
            rows_c(M, C, K, x, ldx, wb, st, yt, ldy);
        }
        t += C;
    }
}

// ---- AMX (where q8.py's amx() holds and the CPU has AMX-BF16): the same layout and the same
// order of work, but TDPBF16PS's own sums, which are not vdpbf16ps's bits (measured: its pair
// sums round otherwise), so a machine runs one or the other at every width, never both: a row's
// logits are then the same whatever the batch. Per group of 32, C tiles from zero (tilezero),
// one TDPBF16PS each, then y = s * C + y (+0 for the first group) as above. A tiles hold 16
// rows of x (the caller pads x to a multiple of 16 rows: one tile configuration for every
// call), B tiles a column tile's 16 k pairs of one group, widened once a block of 32 columns.
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

struct tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

AMX static void amx_config(int rows) {
    struct tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {  // 0-3: C, 4-5: A (`rows` rows), 6-7: B (16); 64 bytes a row
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 6 ? 16 : rows;
    }
    _tile_loadconfig(&cfg);
}

// One group's epilogue from its stored C tiles: yb = s * C + yb (+0 for the first group).
static inline __attribute__((always_inline)) void amx_epilogue(
    const int MA, const int NB, const int* R, int first, const float (*buf)[16][16],
    const float* s, int g, int ng, float (*yb)[32]) {
    for (int b = 0; b < NB; b++) {
        __m512 sc = _mm512_loadu_ps(s + ((size_t)b * ng + g) * T);
        for (int a = 0; a < MA; a++)
            for (int r = 0; r < R[a]; r++) {
                float* yp = &yb[16 * a + r][16 * b];
                __m512 prev = first ? _mm512_setzero_ps() : _mm512_load_ps(yp);
                _mm512_store_ps(yp, _mm512_fmadd_ps(_mm512_load_ps(buf[2 * a + b][r]), sc, prev));
            }
    }
}

// The next column block's weights widened while this one's tiles compute (`ahead`): a tile
// load of bf16 just stored by vector stores waits for them (measured at one row: 5.7 ms for the
// 135M head, against 0.7 for the tiles alone and 1.6 for the widening alone).
struct ahead {
    const int8_t* q;  // the next block's first tile (NULL: none, or widened already)
    __m512bh* wb;     // where its widened weights go ([nb][K/2])
    int nb;
};

static inline __attribute__((always_inline)) void widen_group(const struct ahead* next, int K,
                                                              int g) {
    if (next->q == NULL) return;
    for (int b = 0; b < next->nb; b++)
        for (int p = 0; p < G / 2; p++) {
            int kp = g * (G / 2) + p;
            const int8_t* src = next->q + ((size_t)b * K / 2 + kp) * 2 * T;
            if (p % 2 == 0) _mm_prefetch((const char*)src + PREFETCH_AHEAD, _MM_HINT_T0);
            next->wb[(size_t)b * (K / 2) + kp] = widen(src);
        }
}

// MA row tiles of 16 rows (R[a] of each kept) from x, NB column tiles from their widened
// weights wb ([NB][K/2]). A group's epilogue runs after the next group's tile products are
// issued (two buffers), so that the two overlap; and beside them, that group of the next
// column block is widened.
AMX static inline __attribute__((always_inline)) void amx_block(
    const int MA, const int NB, const int* R, int K, const uint16_t* x, int64_t ldx,
    const __m512bh* wb, const float* s, float* y, int64_t ldy, const struct ahead* next) {
    int ng = K / G;
    float buf[2][4][16][16] __attribute__((aligned(64)));
    float yb[32][32] __attribute__((aligned(64)));  // y's rows lie N floats apart: kept here
    for (int g = 0; g < ng; g++) {
        _tile_zero(0);
        if (NB == 2) _tile_zero(1);
        if (MA == 2) _tile_zero(2);
        if (MA == 2 && NB == 2) _tile_zero(3);
        _tile_loadd(4, x + (size_t)g * G, ldx * 2);
        if (MA == 2) _tile_loadd(5, x + (size_t)16 * ldx + (size_t)g * G, ldx * 2);
        _tile_loadd(6, wb + (size_t)g * (G / 2), 64);
        if (NB == 2) _tile_loadd(7, wb + (size_t)(K / 2 + g * (G / 2)), 64);
        _tile_dpbf16ps(0, 4, 6);
        if (NB == 2) _tile_dpbf16ps(1, 4, 7);
        if (MA == 2) _tile_dpbf16ps(2, 5, 6);
        if (MA == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
        float(*out)[16][16] = buf[g & 1];
        _tile_stored(0, out[0], 64);
        if (NB == 2) _tile_stored(1, out[1], 64);
        if (MA == 2) _tile_stored(2, out[2], 64);
        if (MA == 2 && NB == 2) _tile_stored(3, out[3], 64);
        if (g == 1) amx_epilogue(MA, NB, R, 1, (const float(*)[16][16])buf[0], s, 0, ng, yb);
        if (g > 1) amx_epilogue(MA, NB, R, 0, (const float(*)[16][16])buf[(g - 1) & 1], s, g - 1, ng, yb);
        widen_group(next, K, g);
    }
    amx_epilogue(MA, NB, R, ng == 1, (const float(*)[16][16])buf[(ng - 1) & 1], s, ng - 1, ng, yb);
    for (int a = 0; a < MA; a++)
        for (int r = 0; r < R[a]; r++)
            for (int b = 0; b < NB; b++)
                _mm512_storeu_ps(y + (size_t)(16 * a + r) * ldy + 16 * b, _mm512_load_ps(&yb[16 * a + r][16 * b]));
}

// head8_gemm through AMX: from 16 rows, x's rows padded to a multiple of 16 (the padding any
// finite value); below, tiles of M rows, 2 for one (x padded to 2): each row's sums are its
// own either way (tested).
AMX void head8_gemm_amx(int M, int K, const uint16_t* x, int64_t ldx, const int8_t* q,
                        const float* s, float* y, int64_t ldy, int n0, int n1) {
    int ng = K / G;
    if (M <= 0) return;  // (a tile of no rows is no tile)
    __m512bh wb[2 * K];  // two blocks' [2][K/2]: this one's, and the next one's as it is widened
    amx_config(M < 2 ? 2 : M < 16 ? M : 16);  // (1-row tiles ran at half 2-row tiles' speed)
    int first = n1 / T - n0 / T >= 2 ? 2 : 1;
    struct ahead start = {q + (size_t)(n0 / T) * K * T, wb, first};
    for (int g = 0; g < ng; g++) widen_group(&start, K, g);
    for (int t = n0 / T, i = 0; t < n1 / T; i++) {
        int NB = n1 / T - t >= 2 ? 2 : 1, u = t + NB;
        int nb = n1 / T - u >= 2 ? 2 : 1;
        const __m512bh* cur = wb + (size_t)(i & 1) * K;
        struct ahead next = {u < n1 / T ? q + (size_t)u * K * T : NULL, wb + (size_t)((i + 1) & 1) * K, nb};
        const float* st = s + (size_t)t * ng * T;
        for (int m = 0; m < M; m += 32) {
            int R[2] = {M - m < 16 ? M - m : 16, M - m - 16 < 16 ? M - m - 16 : 16};
            const uint16_t* xm = x + (size_t)m * ldx;
            float* ym = y + (size_t)m * ldy + (size_t)t * T;
            if (R[1] > 0 && NB == 2) amx_block(2, 2, R, K, xm, ldx, cur, st, ym, ldy, &next);
            else if (R[1] > 0) amx_block(2, 1, R, K, xm, ldx, cur, st, ym, ldy, &next);
            else if (NB == 2) amx_block(1, 2, R, K, xm, ldx, cur, st, ym, ldy, &next);
            else amx_block(1, 1, R, K, xm, ldx, cur, st, ym, ldy, &next);
            next.q = NULL;  // widened once, beside the first row block
        }
        t = u;
    }
    _tile_release();
}

// ---- head8_gemm_pooled: one call, its columns handed to another library's workers (q8.c's
// q8_pool_run: the GEMMs' spinning workers, native/runner.h) in units of 64 columns (the
// widest block of either path), `chunk` units at a time. Handed to a Python pool in two equal
// halves instead, each call paid the hand-off and its thread took the core from the GEMMs'
// spinning worker. Either path is one thread's per column: the same bits however it is split.
struct head8_job {
    int M, K, N, amx;
    const uint16_t* x;
    int64_t ldx;
    const int8_t* q;
    const float* s;
    float* y;
    int64_t ldy;
};

static void head8_units(const void* arg, int u0, int u1) {
    const struct head8_job* j = arg;
    int n0 = u0 * 64, n1 = u1 * 64 < j->N ? u1 * 64 : j->N;
    if (j->amx)
        head8_gemm_amx(j->M, j->K, j->x, j->ldx, j->q, j->s, j->y, j->ldy, n0, n1);
    else
        head8_gemm(j->M, j->K, j->x, j->ldx, j->q, j->s, j->y, j->ldy, n0, n1);
}

void head8_gemm_pooled(int M, int K, const uint16_t* x, int64_t ldx, const int8_t* q,
                       const float* s, float* y, int64_t ldy, int N, int amx, pool_runner runner,
                       int threads, int chunk) {
    struct head8_job j = {M, K, N, amx, x, ldx, q, s, y, ldy};
    runner(head8_units, &j, (N + 63) / 64, chunk < 1 ? 1 : chunk, threads);
}

// Linux's leave to use the tile state (this process, every thread): 0 granted.
int head8_amx_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1; }

// The rows `ids` of the table, dequantized: out[i, k] = q[id, k] * s[id, k / 32] in float32
// (a Q8_0 file's value exactly: an 8-bit q times an 11-bit scale is exact).
void head8_rows(int count, const int64_t* ids, int K, const int8_t* q, const float* s,
                float* out) {
    int ng = K / G;
    for (int i = 0; i < count; i++) {
        int64_t id = ids[i], t = id / T, lane = id % T;
        const int8_t* qt = q + (size_t)t * K * T + lane * 2;
        const float* st = s + (size_t)t * ng * T + lane;
        float* o = out + (size_t)i * K;
        for (int kp = 0; kp < K / 2; kp++) {
            float sc = st[(size_t)(kp * 2 / G) * T];
            o[2 * kp] = (float)qt[(size_t)kp * 2 * T] * sc;
            o[2 * kp + 1] = (float)qt[(size_t)kp * 2 * T + 1] * sc;
        }
    }
}

// A float table's rounding to the head's 8 bits, straight into its layout, at a first start
// (numpy's passes over a 1.7B head: ~1.3 s). w[N, K] (row stride ldw) of `dtype` (widen.h);
// per group of 32: s = max|w| x (1/127) (the float nearest 1/127, as head8.py's round_groups
// takes it), q = round(w x (1 / s)) in [-127, 127]; s = 0 and zeros for an all-zero group, NaN
// and zeros for one holding NaN or infinity. The same bits as round_groups (numpy), its
// reference. N a multiple of 16, K of 32.
void head8_round(int N, int K, const void* w, int dtype, int64_t ldw, int8_t* values,
                 float* scales) {
    const float third = (float)(1.0 / 127.0);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i rows = widen_tile_rows();  // word w of row r in `bytes`: its pairs 2w, 2w + 1
    int ng = K / G;
    for (int t = 0; t < N / T; t++)
        for (int g = 0; g < ng; g++) {
            int32_t bytes[T][8];  // a tile's 16 rows' 32 values of the group, as int8
            for (int r = 0; r < T; r++) {
                const void* row = widen_row(w, dtype, ldw, t * T + r);
                __m512 a = widen16(row, dtype, g * G), b = widen16(row, dtype, g * G + 16);
                int finite = !widen_nonfinite(a, b);
                float s = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) *
                          third;
                __m512 inv = _mm512_set1_ps(finite && s > 0.f ? 1.f / s : 0.f);
                __m512i qa = _mm512_cvt_roundps_epi32(
                    _mm512_mul_ps(a, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m512i qb = _mm512_cvt_roundps_epi32(
                    _mm512_mul_ps(b, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                if (!finite) qa = qb = _mm512_setzero_si512();
                qa = _mm512_min_epi32(_mm512_max_epi32(qa, lo), hi);
                qb = _mm512_min_epi32(_mm512_max_epi32(qb, lo), hi);
                _mm_storeu_si128((__m128i*)&bytes[r][0], _mm512_cvtepi32_epi8(qa));
                _mm_storeu_si128((__m128i*)&bytes[r][4], _mm512_cvtepi32_epi8(qb));
                scales[((size_t)t * ng + g) * T + r] = finite ? s : __builtin_nanf("");
            }
            // [N/16][K/2][16][2]: the group's 16 k pairs, a 32-byte line each, from 8 gathers
            uint16_t* line = (uint16_t*)values + ((size_t)t * (K / 2) + (size_t)g * (G / 2)) * T;
            for (int wd = 0; wd < 8; wd++) {
                __m512i both = _mm512_i32gather_epi32(rows, &bytes[0][wd], 4);
                _mm256_storeu_si256((__m256i*)(line + (2 * wd) * T), _mm512_cvtepi32_epi16(both));
                _mm256_storeu_si256((__m256i*)(line + (2 * wd + 1) * T),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16)));
            }
        }
}
