// What the grouped GEMMs (q8.c, q4.c) share: activations quantized per row and group to int8,
// and AMX's tile set-up and one group's tile products. Included by each; native_lib hashes it
// into each library's source SHA, so a change here asks for both to be rebuilt.
#ifndef BATCHMLX_GROUPED_H
#define BATCHMLX_GROUPED_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

// x[M, K] (row stride ldx) -> xq and xs[M, ng] = t per (row, group of G), t = max|x| / 127 (1
// for an all-zero group), q = round(x / t), stored as q + offset (q8's VNNI feeds unsigned
// bytes: offset 128; AMX and q4 take them signed: 0); xsum (if not NULL) the sum of a group's
// q, as float (at most 32 x 127: exact). The last group may be shorter (a multiple of 16).
// amx = 0: xq[M, K], xs and xsum [M, ng]. amx = 1 (G = 32), as A tiles: xq [M/16 (rounded
// up)][ng][16 rows][32], so that a tile is 512 bytes in a row whatever K (rows K bytes apart
// fall in one cache set when K is a multiple of 4,096: 2,048 and 8,192 are), and xs, xsum
// [M/16][ng][16] (a tile's 16 scales of a group in one cache line, not 16). A group holding
// NaN or infinity gets t = NaN, zeros (+ offset) and a sum of 0, so the product shows it, as a
// float GEMM's would.
static inline __attribute__((always_inline)) void quantize_groups(
    int M, int K, int G, const float* x, int64_t ldx, uint8_t* xq, float* xs, float* xsum,
    int amx, int offset) {
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
            size_t tile = ((size_t)m / 16 * ng + g) * 16 + m % 16;  // AMX: row in its tile
            uint8_t* q = amx ? xq + tile * G : xq + (size_t)m * K + g * G;
            size_t at = amx ? tile : (size_t)m * ng + g;
            if (nan != nan) {
                for (int k = 0; k < len; k++) q[k] = (uint8_t)offset;
                xs[at] = nan;
                if (xsum) xsum[at] = 0.f;
                continue;
            }
            __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            __m512i total = _mm512_setzero_si512();
            for (int k = 0; k < len; k += 16) {
                __m512i i = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + k), inv),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                total = _mm512_add_epi32(total, i);
                i = _mm512_add_epi32(i, _mm512_set1_epi32(offset));  // in [offset +- 127]
                _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi32_epi8(i));
            }
            xs[at] = amax > 0.f ? amax / 127.f : 1.f;
            if (xsum) xsum[at] = (float)_mm512_reduce_add_epi32(total);
        }
    }
}

// ---- AMX: C tiles 0-3 (the sums: at most 2 row tiles x 2 column tiles of 16 x 16), A tiles
// 4-5 (16 rows x one group of 32 signed activations), B tiles 6-7 (8 rows of 4 k x 16 columns:
// [K/4][16][4] bytes). TDPBSSD sums the same integers as vpdpbusd, exactly.
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
#define AG 32  // activations (and weights) per group on the AMX paths

struct tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// C and A tiles of `rows` rows (16, or the last row tile's)
AMX static void amx_config(int rows) {
    struct tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = t >= 4 && t < 6 ? AG : 64;
        cfg.rows[t] = t >= 6 ? AG / 4 : rows;
    }
    _tile_loadconfig(&cfg);
}

// Asks Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): 0 when granted.
static inline int amx_request(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1; }

// Group g's sums of MA row tiles (a0: the first's A tiles, [ng][16][32]; the second's follow
// ng tiles on) x NB column tiles (b0, b1: [K/4][16][4] each) into out[2 * a + b]
AMX static inline __attribute__((always_inline)) void amx_group(
    const int MA, const int NB, const int8_t* a0, const int8_t* b0, const int8_t* b1, int g,
    int ng, int32_t (*out)[16][16]) {
    _tile_zero(0);
    if (NB == 2) _tile_zero(1);
    if (MA == 2) _tile_zero(2);
    if (MA == 2 && NB == 2) _tile_zero(3);
    _tile_loadd(4, a0 + g * 512, AG);
    if (MA == 2) _tile_loadd(5, a0 + (size_t)(ng + g) * 512, AG);
    _tile_loadd(6, b0 + (size_t)g * (AG / 4) * 64, 64);
    if (NB == 2) _tile_loadd(7, b1 + (size_t)g * (AG / 4) * 64, 64);
    _tile_dpbssd(0, 4, 6);
    if (NB == 2) _tile_dpbssd(1, 4, 7);
    if (MA == 2) _tile_dpbssd(2, 5, 6);
    if (MA == 2 && NB == 2) _tile_dpbssd(3, 5, 7);
    _tile_stored(0, out[0], 64);
    if (NB == 2) _tile_stored(1, out[1], 64);
    if (MA == 2) _tile_stored(2, out[2], 64);
    if (MA == 2 && NB == 2) _tile_stored(3, out[3], 64);
}

// A block's finished rows from yb[32][32] to y[., N]: MA row tiles of R rows, NB column tiles
static inline __attribute__((always_inline)) void amx_store(const int MA, const int NB,
                                                            const int R, float (*yb)[32],
                                                            float* y, int N, int m0, int n) {
    for (int a = 0; a < MA; a++)
        for (int r = 0; r < R; r++)
            for (int b = 0; b < NB; b++)
                _mm512_storeu_ps(y + ((size_t)m0 + 16 * a + r) * N + n + 16 * b,
                                 _mm512_load_ps(&yb[16 * a + r][16 * b]));
}

#endif
