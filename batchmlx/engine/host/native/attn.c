/* Paged decode attention: one query token per row, its keys and values read block by block
 * through the row's block table straight from the paged KV pool (no gather, no dense copy).
 *
 * Batch-invariant by construction. A row's result is a function of its own query and keys:
 * per (row, KV head, block) the scores are q.k summed over D in one fixed order, then the
 * block is merged into the row's running (max, sum, out) with a block-wise online softmax
 * (FlashAttention-2's update: rescale by exp(old max - new max), add exp(s - new max) and
 * p.V key by key), blocks in position order. Nothing depends on the batch, its width, the
 * longest row or how rows are split over threads (each row is computed by one call). A prefix
 * of blocks every row shares (cascade) is walked block-major across the rows, so each block
 * is read once for all of them while in cache; each (row, block) step is the same arithmetic
 * in the same order as a row alone, so the cascade is a loop order, not another computation.
 *
 * Layouts: the pool (float32, or float16 where `half`: widened exactly by F16C's vcvtph2ps)
 * has rows ((block * H + head) * bs + offset) of D; q and out (float32)
 * [rows, H * rep, D] (query head h * rep + r reads KV head h), q already scaled; tables
 * [rows, tw] int32 block ids; counts [rows] keys each row sees (positions 0 .. count-1);
 * window > 0: only the last `window` of them; softcap > 0: scores -> softcap * tanh(s /
 * softcap). D must be a multiple of 16 (at most MAX_D).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef ATTN_SOURCE_SHA
#define ATTN_SOURCE_SHA "unknown"
#endif

#define MAX_D 512
#define MAX_REP 16

const char *attn_source_sha(void) { return ATTN_SOURCE_SHA; }

/* exp(x) for 16 lanes, x <= ~88 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r,
 * 2^n applied by scalef; below -100 it gives 0). Used for every exponential here, so a
 * row's bits never depend on libm or on which lanes hold which keys. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-100.0f);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LE_OQ), e, _mm512_setzero_ps());
}

/* cap * tanh(s / cap), tanh(y) = 1 - 2 / (exp(2y) + 1) (exp16's, so fixed bits) */
static inline __m512 softcap16(__m512 s, float cap) {
    __m512 y = _mm512_div_ps(s, _mm512_set1_ps(cap));
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-20.0f)), _mm512_set1_ps(20.0f));
    __m512 e = exp16(_mm512_add_ps(y, y));
    __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                             _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

/* out lane j = the sum of a[j]'s 16 lanes: pairs, then quads within 128-bit lanes, then
 * across them (4 levels of shuffles and adds, the same order for every key) */
static inline __m512 reduce16(const __m512 *a) {
    __m512 x[8], y[4], z[2];
    for (int k = 0; k < 8; k++)
        x[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                             _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int m = 0; m < 4; m++) {
        const __m512d u = _mm512_castps_pd(x[2 * m]), v = _mm512_castps_pd(x[2 * m + 1]);
        y[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
    }
    for (int m = 0; m < 2; m++)
        z[m] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * m], y[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * m], y[2 * m + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                         _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

typedef struct {
    const void *kpool, *vpool; /* float32, or float16 where half */
    int half;
    int h, rep, d, bs;
    int window;
    float softcap;
} Shape;

/* One (row, KV head, block) step: keys lo..hi-1 of the block (offsets within it) merged into
 * the rep query heads' states. q [rep, D]; state: m [rep], l [rep], acc [rep, D]. */
/* 16 elements of a pool from element i, as float32 (float16: F16C's exact widening) */
static inline __m512 load16(const void *p, size_t i, const int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) void attend_block_d(
    const Shape *sh, const float *q, int block, int head, int lo, int hi, float *m, float *l,
    float *acc, const int d, const int half, const int rep) {
    const int bs = sh->bs, nv = d / 16;
    /* columns of acc kept in registers at once for every query head: P.V reads each V
     * vector once for all of them */
    const int cb = rep <= 3 ? 4 : rep <= 6 ? 2 : 1;
    const size_t run = ((size_t)block * sh->h + head) * (size_t)bs * d;
    const void *kb = sh->kpool, *vb = sh->vpool; /* element offsets from run */
    float s[MAX_REP][16], alpha[MAX_REP];
    for (int k0 = lo; k0 < hi; k0 += 16) {
        const int n = hi - k0 < 16 ? hi - k0 : 16;
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        /* scores: per key, D summed 16 lanes at a time in order, then the 16 keys' lanes
         * summed in one fixed tree (reduce16). Each key read (and widened) once for all the
         * rep query heads: per head it was read rep times (~1.3x the kernel's time at 135M's
         * rep 3) */
        __m512 a[MAX_REP][16];
        for (int j = 0; j < 16; j++) {
            if (j >= n) {
                for (int r = 0; r < rep; r++) a[r][j] = _mm512_setzero_ps();
                continue;
            }
            const size_t kr = run + (size_t)(k0 + j) * d;
            __m512 kv[MAX_D / 16];
            for (int c = 0; c < nv; c++) kv[c] = load16(kb, kr + 16 * c, half);
            for (int r = 0; r < rep; r++) {
                const float *qr = q + (size_t)r * d;
                __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
                for (int c = 1; c < nv; c++)
                    x = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[c], x);
                a[r][j] = x;
            }
        }
        for (int r = 0; r < rep; r++) _mm512_storeu_ps(s[r], reduce16(a[r]));
        /* per query head: the block's max, the running state's rescale, exp and sum */
        for (int r = 0; r < rep; r++) {
            __m512 sc = _mm512_maskz_loadu_ps(valid, s[r]);
            if (sh->softcap > 0.0f) sc = softcap16(sc, sh->softcap);
            sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), sc);
            const float top = _mm512_reduce_max_ps(sc);
            const float mnew = top > m[r] ? top : m[r];
            alpha[r] = m[r] == -INFINITY ? 0.0f
                                         : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m[r] - mnew)));
            __m512 p = exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mnew)));
            p = _mm512_maskz_mov_ps(valid, p);
            l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(p);
            m[r] = mnew;
            _mm512_storeu_ps(s[r], p);
        }
        /* P.V: each output element acc * alpha, then + p_j v_j for j in key order (the same
         * operations in the same order whatever the loop nest) */
        for (int c0 = 0; c0 < nv; c0 += cb) {
            const int w = nv - c0 < cb ? nv - c0 : cb;
            __m512 o[MAX_REP][4];
            for (int r = 0; r < rep; r++)
                for (int c = 0; c < w; c++)
                    o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)r * d + 16 * (c0 + c)),
                                            _mm512_set1_ps(alpha[r]));
            for (int j = 0; j < n; j++) {
                const size_t vr = run + (size_t)(k0 + j) * d + 16 * c0;
                for (int c = 0; c < w; c++) {
                    const __m512 v = load16(vb, vr + 16 * c, half);
                    for (int r = 0; r < rep; r++)
                        o[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[r][j]), v, o[r][c]);
                }
            }
            for (int r = 0; r < rep; r++)
                for (int c = 0; c < w; c++)
                    _mm512_storeu_ps(acc + (size_t)r * d + 16 * (c0 + c), o[r][c]);
        }
    }
}

/* attend_block_d compiled for the common head sizes and query groups as constants (loops
 * unrolled, accumulators in registers; the same operations in the same order, so the same
 * bits as the generic one) */
#define FOR_REP(D, HALF)                                                                     \
    switch (sh->rep) {                                                                       \
    case 1: attend_block_d(sh, q, block, head, lo, hi, m, l, acc, D, HALF, 1); return;       \
    case 2: attend_block_d(sh, q, block, head, lo, hi, m, l, acc, D, HALF, 2); return;       \
    case 3: attend_block_d(sh, q, block, head, lo, hi, m, l, acc, D, HALF, 3); return;       \
    case 4: attend_block_d(sh, q, block, head, lo, hi, m, l, acc, D, HALF, 4); return;       \
    default: attend_block_d(sh, q, block, head, lo, hi, m, l, acc, D, HALF, sh->rep); return; \
    }

static void attend_block(const Shape *sh, const float *q, int block, int head, int lo, int hi,
                         float *m, float *l, float *acc) {
    if (sh->half) {
        if (sh->d == 64) FOR_REP(64, 1)
        if (sh->d == 128) FOR_REP(128, 1)
        attend_block_d(sh, q, block, head, lo, hi, m, l, acc, sh->d, 1, sh->rep);
        return;
    }
    if (sh->d == 64) FOR_REP(64, 0)
    if (sh->d == 128) FOR_REP(128, 0)
    attend_block_d(sh, q, block, head, lo, hi, m, l, acc, sh->d, 0, sh->rep);
}

/* Keys [lo, hi) of block number b (positions b*bs ..) that the row sees: (lo, hi) offsets,
 * lo >= hi when none. */
static inline void block_span(const Shape *sh, int b, int count, int *lo, int *hi) {
    const int first = sh->window > 0 && count > sh->window ? count - sh->window : 0;
    const int p0 = b * sh->bs;
    *lo = first > p0 ? first - p0 : 0;
    *hi = count - p0 < sh->bs ? count - p0 : sh->bs;
}

/* Block b of one row, every KV head. State per (row, KV head): m [rep], l [rep], acc [rep, D]. */
/* Asks for block `next`'s keys and values, every head (a row's blocks lie anywhere in the
 * pool: the hardware prefetcher sees one run at a time). */
static void prefetch_block(const Shape *sh, int next) {
    const size_t size = sh->half ? 2 : 4, bytes = (size_t)sh->bs * sh->d * size * sh->h;
    const char *k = (const char *)sh->kpool + (size_t)next * bytes;
    const char *v = (const char *)sh->vpool + (size_t)next * bytes;
    for (size_t o = 0; o < bytes; o += 64) {
        _mm_prefetch(k + o, _MM_HINT_T0);
        _mm_prefetch(v + o, _MM_HINT_T0);
    }
}

/* next: the block id to prefetch meanwhile, or -1 */
static void row_block(const Shape *sh, const float *q, const int32_t *tables, int tw,
                      const int32_t *counts, float *state, int row, int b, int next) {
    int lo, hi;
    block_span(sh, b, counts[row], &lo, &hi);
    if (lo >= hi) return;
    if (next >= 0) prefetch_block(sh, next);
    const int rep = sh->rep, d = sh->d;
    const size_t per_head = (size_t)rep * (d + 2);
    const int block = tables[(size_t)row * tw + b];
    for (int h = 0; h < sh->h; h++) {
        float *st = state + ((size_t)row * sh->h + h) * per_head;
        attend_block(sh, q + ((size_t)row * sh->h + h) * rep * d, block, h, lo, hi, st, st + rep,
                     st + 2 * rep);
    }
}

/* Rows r0..r1-1. shared: the first `shared` blocks of every row's table are the same blocks
 * (a shared prefix): walked block-major over the rows. Returns 0, or -1 for a shape it does
 * not take (D not a multiple of 16 or past MAX_D, rep past MAX_REP) or no memory. */
int attn_decode(const float *q, const void *kpool, const void *vpool, int half,
                const int32_t *tables, int tw, const int32_t *counts, int r0, int r1, int h,
                int rep, int d, int bs, int shared, int window, float softcap, float *out) {
    if (d % 16 || d > MAX_D || rep > MAX_REP || rep < 1 || r1 <= r0) return r1 <= r0 ? 0 : -1;
    const Shape sh = {kpool, vpool, half != 0, h, rep, d, bs, window, softcap};
    const int hq = h * rep;
    const size_t per_row = (size_t)hq * (d + 2);
    float *state = malloc((size_t)(r1 - r0) * per_row * sizeof(float));
    if (!state) return -1;
    float *st0 = state - (size_t)r0 * per_row; /* indexed by absolute row */
    for (int row = r0; row < r1; row++)
        for (int i = 0; i < h; i++) {
            float *st = st0 + (size_t)row * per_row + (size_t)i * rep * (d + 2);
            for (int r = 0; r < rep; r++) st[r] = -INFINITY;
            for (size_t j = rep; j < (size_t)rep * (d + 2); j++) st[j] = 0.0f;
        }
    for (int b = 0; b < shared; b++)
        for (int row = r0; row < r1; row++) row_block(&sh, q, tables, tw, counts, st0, row, b, -1);
    for (int row = r0; row < r1; row++) {
        const int nb = (counts[row] + bs - 1) / bs;
        for (int b = shared; b < nb; b++) {
            const int next = b + 1 < nb ? tables[(size_t)row * tw + b + 1]
                             : row + 1 < r1 && shared < (counts[row + 1] + bs - 1) / bs
                                 ? tables[(size_t)(row + 1) * tw + shared] : -1;
            row_block(&sh, q, tables, tw, counts, st0, row, b, next);
        }
        for (int i = 0; i < h; i++) {
            const float *st = st0 + (size_t)row * per_row + (size_t)i * rep * (d + 2);
            for (int r = 0; r < rep; r++) {
                float *o = out + ((size_t)row * hq + (size_t)i * rep + r) * d;
                const float *acc = st + 2 * rep + (size_t)r * d;
                for (int j = 0; j < d; j++) o[j] = acc[j] / st[rep + r];
            }
        }
    }
    free(state);
    return 0;
}

/* pool row rows[i] = src[i] (n rows of d floats; where half, rounded to float16 to nearest
 * even by F16C, as numpy and MLX round) */
void attn_scatter(const float *src, int n, int d, const int32_t *rows, void *pool, int half) {
    for (int i = 0; i < n; i++) {
        const float *s = src + (size_t)i * d;
        if (!half) {
            float *o = (float *)pool + (size_t)rows[i] * d;
            for (int j = 0; j < d; j++) o[j] = s[j];
            continue;
        }
        uint16_t *o = (uint16_t *)pool + (size_t)rows[i] * d;
        int j = 0;
        for (; j + 16 <= d; j += 16)
            _mm256_storeu_si256((__m256i *)(o + j),
                                _mm512_cvtps_ph(_mm512_loadu_ps(s + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if (j < d) { /* a last part of under 16 (AVX-512F has no masked 16-bit store) */
            uint16_t t[16];
            const __mmask16 m = (__mmask16)((1u << (d - j)) - 1);
            _mm256_storeu_si256((__m256i *)t, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, s + j),
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            for (int i2 = 0; j + i2 < d; i2++) o[j + i2] = t[i2];
        }
    }
}

/* out[i] = pool run runs[i] (n runs of `len` elements each), widened to float32 */
void attn_gather(const void *pool, int half, const int32_t *runs, int n, int len, float *out) {
    for (int i = 0; i < n; i++) {
        float *o = out + (size_t)i * len;
        const size_t at = (size_t)runs[i] * len;
        int j = 0;
        if (half) {
            for (; j + 16 <= len; j += 16) _mm512_storeu_ps(o + j, load16(pool, at + j, 1));
            for (; j < len; j++)
                o[j] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(((const uint16_t *)pool)[at + j])));
        } else {
            for (; j < len; j++) o[j] = ((const float *)pool)[at + j];
        }
    }
}
