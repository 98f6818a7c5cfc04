/* Paged decode attention: one query token per row, its keys and values read block by block
 * through the row's block table straight from the paged KV pool (no gather, no dense copy).
 *
 * Batch-invariant by construction. A row's result is a function of its own query and keys:
 * per (row, KV head, block) the scores are q.k summed over D in one fixed order, then the
 * block is merged into the row's running (max, sum, out) with a block-wise online softmax
 * (FlashAttention-2's update: rescale by exp(old max - new max), add exp(s - new max) and
 * p.V key by key), blocks in position order. Nothing depends on the batch, its width, the
 * longest row or how rows are split over threads (a row's KV head is one thread's work). A
 * prefix of blocks every row shares (cascade) is walked block-major across the rows, so each
 * block is read once for all of them while in cache; each (row, block) step is the same
 * arithmetic in the same order as a row alone: the cascade is a loop order, not another
 * computation.
 *
 * Layouts: the pool (float32, or float16 where `half`: widened exactly by F16C's vcvtph2ps)
 * has rows ((block * H + head) * bs + offset) of D; q and out (float32)
 * [rows, H * rep, D] (query head h * rep + r reads KV head h), q already scaled; tables
 * [rows, tw] int32 block ids; counts [rows] keys each row sees (positions 0 .. count-1);
 * window > 0: only the last `window` of them; softcap > 0: scores -> softcap * tanh(s /
 * softcap). D must be a multiple of 16 (at most MAX_D).
 *
 * A call's rows may be a prompt's queries instead (tiles): where AMX-BF16 runs they take
 * attn_amx.h's arithmetic, whose tile products serve many rows at once; a prompt token
 * always takes it and a generated one never, so a row's bits stay its own.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "runner.h"

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

/* Keys [lo, hi) of positions p0 .. p0 + len - 1 that a row of `count` keys sees (its last
 * `window` where one is set): offsets from p0, lo >= hi when none. */
static inline void key_span(const Shape *sh, int p0, int len, int count, int *lo, int *hi) {
    const int first = sh->window > 0 && count > sh->window ? count - sh->window : 0;
    *lo = first > p0 ? first - p0 : 0;
    *hi = count - p0 < len ? count - p0 : len;
}

/* key_span of block number b (positions b*bs ..) */
static inline void block_span(const Shape *sh, int b, int count, int *lo, int *hi) {
    key_span(sh, b * sh->bs, sh->bs, count, lo, hi);
}

/* Asks for the keys and values of one KV head in block `next` (a sequence's blocks lie
 * anywhere in the pool: the hardware prefetcher sees one run at a time). */
static void prefetch_block(const Shape *sh, int next, int head) {
    const size_t size = sh->half ? 2 : 4, bytes = (size_t)sh->bs * sh->d * size;
    const size_t at = ((size_t)next * sh->h + head) * bytes;
    const char *k = (const char *)sh->kpool + at, *v = (const char *)sh->vpool + at;
    for (size_t o = 0; o < bytes; o += 64) {
        _mm_prefetch(k + o, _MM_HINT_T0);
        _mm_prefetch(v + o, _MM_HINT_T0);
    }
}

/* The work of one call: units u = row * h + head (a row's KV head and its rep query heads),
 * each computed whole by one thread. State per unit: m [rep], l [rep], acc [rep, D]. */
typedef struct {
    Shape sh;
    const float *q;
    const int32_t *tables;
    const int32_t *counts;
    int tw, shared;
    float *out;
    int failed; /* a part found no memory */
    int tiles;  /* the rows are a prompt's queries: through tiles where they run (attn_amx.h) */
    int rows;   /* head_major: units u = head * rows + row (the tile path's claims), else u =
                 * row * h + head */
    int head_major;
} Job;

/* Block b of unit u (row, head) merged into its state st; next: a block to prefetch meanwhile
 * (its KV head next_head), or -1 */
static void unit_block(const Job *j, int u, int b, float *st, int next, int next_head) {
    const Shape *sh = &j->sh;
    const int row = u / sh->h, head = u % sh->h, rep = sh->rep;
    int lo, hi;
    block_span(sh, b, j->counts[row], &lo, &hi);
    if (lo >= hi) return;
    if (next >= 0) prefetch_block(sh, next, next_head);
    attend_block(sh, j->q + (size_t)u * rep * sh->d, j->tables[(size_t)row * j->tw + b], head,
                 lo, hi, st, st + rep, st + 2 * rep);
}

#include "attn_amx.h"

/* Units [u0, u1): the blocks every row shares first, block-major over the units (each read
 * once for all of them while in cache), then each unit's own blocks in order. The same
 * (unit, block) steps in the same order whichever units a call takes: the same bits. */
static void decode_units(const void *arg, int u0, int u1) {
    Job *j = (Job *)arg;
    const Shape *sh = &j->sh;
    if (j->tiles && amx_takes(sh)) {
        decode_units_amx(arg, u0, u1);
        return;
    }
    const int rep = sh->rep, d = sh->d, bs = sh->bs, h = sh->h;
    const size_t per_unit = (size_t)rep * (d + 2);
    float *state = malloc((size_t)(u1 - u0) * per_unit * sizeof(float));
    if (!state) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int u = u0; u < u1; u++) {
        float *st = state + (size_t)(u - u0) * per_unit;
        for (int r = 0; r < rep; r++) st[r] = -INFINITY;
        for (size_t i = rep; i < per_unit; i++) st[i] = 0.0f;
    }
    for (int b = 0; b < j->shared; b++)
        for (int u = u0; u < u1; u++)
            unit_block(j, u, b, state + (size_t)(u - u0) * per_unit, -1, 0);
    for (int u = u0; u < u1; u++) {
        const int row = u / h;
        const int nb = (j->counts[row] + bs - 1) / bs;
        float *st = state + (size_t)(u - u0) * per_unit;
        for (int b = j->shared; b < nb; b++) {
            int next = -1, next_head = u % h;
            if (b + 1 < nb) {
                next = j->tables[(size_t)row * j->tw + b + 1];
            } else if (u + 1 < u1) { /* the next unit's first own block */
                const int r2 = (u + 1) / h;
                next_head = (u + 1) % h;
                if (j->shared < (j->counts[r2] + bs - 1) / bs)
                    next = j->tables[(size_t)r2 * j->tw + j->shared];
            }
            unit_block(j, u, b, st, next, next_head);
        }
        for (int r = 0; r < rep; r++) {
            float *o = j->out + ((size_t)u * rep + r) * d;
            const float *acc = st + 2 * rep + (size_t)r * d;
            const __m512 inv = _mm512_set1_ps(st[rep + r]);
            for (int c = 0; c < d; c += 16)
                _mm512_storeu_ps(o + c, _mm512_div_ps(_mm512_loadu_ps(acc + c), inv));
        }
    }
    free(state);
}

/* Whether the kernel takes the shape: D a multiple of 16, at most MAX_D; rep 1..MAX_REP */
static int shape_ok(int d, int rep) { return d % 16 == 0 && d <= MAX_D && rep >= 1 && rep <= MAX_REP; }

/* Rows r0..r1-1 in this thread. shared: the first `shared` blocks of every row's table are
 * the same blocks (a shared prefix). Returns 0, or -1 for a shape it does not take (D not a
 * multiple of 16 or past MAX_D, rep past MAX_REP) or no memory. */
int attn_decode(const float *q, const void *kpool, const void *vpool, int half,
                const int32_t *tables, int tw, const int32_t *counts, int r0, int r1, int h,
                int rep, int d, int bs, int shared, int tiles, int window, float softcap,
                float *out) {
    if (r1 <= r0) return 0;
    if (!shape_ok(d, rep)) return -1;
    Job j = {{kpool, vpool, half != 0, h, rep, d, bs, window, softcap}, q, tables, counts, tw,
             shared, out, 0, tiles, 0, 0};
    decode_units(&j, r0 * h, r1 * h);
    return j.failed ? -1 : 0;
}

void attn_scatter(const float *src, int n, int d, const int32_t *rows, void *pool, int half);

/* attn_decode over all `rows`, its (row, KV head) units handed `chunk` at a time to `runner`'s
 * threads (the GEMMs' spinning workers: a hand-off costs about a microsecond, where a Python
 * pool's cost ~30-50 us, more than a narrow step's attention layer). Any split: the same bits. */
int attn_decode_pooled(const float *q, const void *kpool, const void *vpool, int half,
                       const int32_t *tables, int tw, const int32_t *counts, int rows, int h,
                       int rep, int d, int bs, int shared, int tiles, int window,
                       float softcap, float *out, pool_runner runner, int threads, int chunk) {
    if (rows <= 0) return 0;
    if (!shape_ok(d, rep)) return -1;
    Job j = {{kpool, vpool, half != 0, h, rep, d, bs, window, softcap}, q, tables, counts, tw,
             shared, out, 0, tiles, rows, 0};
    /* the tile path's claims take a KV head's rows together: the more rows a claim holds,
     * the more of them a step's tiles serve */
    j.head_major = tiles && amx_takes(&j.sh);
    runner(decode_units, &j, rows * h, chunk < 1 ? 1 : chunk, threads);
    return j.failed ? -1 : 0;
}

/* A decode layer in one call: the step's new keys and values (k, v: n_write rows of D, float32)
 * into the pool rows `write` (attn_scatter), then attn_decode_pooled. A one-row step's layer
 * was ~65 us of Python around ~20 us of kernel as five calls. */
int attn_decode_step(const float *k, const float *v, const int32_t *write, int n_write,
                     const float *q, void *kpool, void *vpool, int half, const int32_t *tables,
                     int tw, const int32_t *counts, int rows, int h, int rep, int d, int bs,
                     int shared, int tiles, int window, float softcap, float *out,
                     pool_runner runner, int threads, int chunk) {
    if (!shape_ok(d, rep)) return -1;
    attn_scatter(k, n_write, d, write, kpool, half);
    attn_scatter(v, n_write, d, write, vpool, half);
    return attn_decode_pooled(q, kpool, vpool, half, tables, tw, counts, rows, h, rep, d, bs,
                              shared, tiles, window, softcap, out, runner, threads, chunk);
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
