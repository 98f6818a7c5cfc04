// The host step's elementwise passes (engine/host/ops.py): gated MLP activations of a fused
// gate-up GEMM's rows, RMSNorm (with the residual add before it), RoPE; AVX-512F.
//
// Each replaces several numpy passes over an array by one pass over each row while it is in
// cache, and one ctypes call for a dozen numpy calls at a decode step's width. Every row is
// computed alone, its elements in a fixed order (a norm's sum of squares: 4 vector
// accumulators, then their fixed reduction), so a row's result is the same whatever the batch
// and whichever thread takes it (docs/engine.md, batch invariance). The products and sums are
// the numpy forms' (ops.py), in their order; the exponential is our own (exp512: within ~2
// ulp of libm's), and a norm's sum of squares is in another order than numpy's, so the two
// forms agree closely, not bit for bit.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "runner.h"

#ifndef OPS_SOURCE_SHA
#define OPS_SOURCE_SHA "unknown"
#endif

const char* ops_source_sha(void) { return OPS_SOURCE_SHA; }

static inline __mmask16 tail(int left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

// e^x, Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 polynomial, times 2^n
// by scalef (which overflows to infinity and underflows to 0 as e^x does). x is clamped first
// to where e^x is already infinite or 0 (the reduction is exact there); NaN stays NaN.
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), _mm512_min_ps(_mm512_set1_ps(89.f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

// silu(g) * u = g / (1 + e^-g) * u, as the numpy form's passes
static inline __m512 swiglu16(__m512 g, __m512 u) {
    __m512 s = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    s = _mm512_add_ps(s, _mm512_set1_ps(1.f));
    s = _mm512_div_ps(g, s);
    return _mm512_mul_ps(s, u);
}

// 1 + tanh(y) = 2 / (1 + e^-2y): no cancellation where tanh(y) nears -1 (the numpy form's
// 1 + tanh loses the digits of a very negative gate there; both are within ~1e-7 of 1 + tanh)
static inline __m512 one_plus_tanh(__m512 y) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_add_ps(y, y)));
    return _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f)));
}

// gelu_approx(g) * u = 0.5 g (1 + tanh(c (g + k g^3))) * u, nn.gelu_approx's order
static inline __m512 geglu16(__m512 g, __m512 u) {
    __m512 s = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    s = _mm512_mul_ps(s, _mm512_set1_ps(0.044715f));
    s = _mm512_add_ps(s, g);
    s = _mm512_mul_ps(s, _mm512_set1_ps(0.7978845608028654f));
    s = one_plus_tanh(s);
    s = _mm512_mul_ps(_mm512_mul_ps(s, g), _mm512_set1_ps(0.5f));
    return _mm512_mul_ps(s, u);
}

// out[m, :I] = act(gu[m, :I]) * gu[m, I:2I] for rows lo..hi (gu's rows `ldg` apart, out's
// `ldo`); act: 0 silu, 1 gelu's tanh approximation
void ops_gated(int lo, int hi, int I, const float* gu, int64_t ldg, float* out, int64_t ldo,
               int act) {
    for (int m = lo; m < hi; m++) {
        const float* g = gu + (size_t)m * ldg;
        const float* u = g + I;
        float* o = out + (size_t)m * ldo;
        for (int j = 0; j < I; j += 16) {
            __mmask16 k = tail(I - j);
            __m512 gv = _mm512_maskz_loadu_ps(k, g + j), uv = _mm512_maskz_loadu_ps(k, u + j);
            _mm512_mask_storeu_ps(o + j, k, act ? geglu16(gv, uv) : swiglu16(gv, uv));
        }
    }
}

// x[m] (+= r[m] first when r is given) then out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, for
// M rows of N (x's rows `ldx` apart, r's `ldr`, out's `ldo`; out may be x)
void ops_rms_norm(int M, int N, float* x, int64_t ldx, const float* r, int64_t ldr,
                  const float* w, float eps, float* out, int64_t ldo) {
    for (int m = 0; m < M; m++) {
        float* xr = x + (size_t)m * ldx;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int j = 0, v = 0; j < N; j += 16, v = (v + 1) & 3) {
            __mmask16 k = tail(N - j);
            __m512 a = _mm512_maskz_loadu_ps(k, xr + j);
            if (r) {
                a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(k, r + (size_t)m * ldr + j));
                _mm512_mask_storeu_ps(xr + j, k, a);
            }
            acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(a, a));
        }
        __m512 s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        float ms = _mm512_reduce_add_ps(s) / (float)N;
        __m512 inv = _mm512_set1_ps(1.f / sqrtf(ms + eps));
        float* o = out + (size_t)m * ldo;
        for (int j = 0; j < N; j += 16) {
            __mmask16 k = tail(N - j);
            __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, xr + j), inv);
            _mm512_mask_storeu_ps(o + j, k, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, w + j)));
        }
    }
}

// RoPE of T rows of H heads of D (x's rows `ldx` apart, heads adjacent) into out [T, H, D]
// (contiguous): the first `dims` of each head rotated by its row's angles (cos, sin: [T,
// dims / 2], any factor folded in), pairs (i, i + dims / 2), or (2i, 2i + 1) when
// `traditional`: x1 cos - x2 sin, x2 cos + x1 sin (nn.RoPE's); the other dims as they are.
// The first `scaled` heads (the queries) are then multiplied by `scale`.
void ops_rope(int T, int H, int D, int dims, int traditional, const float* x, int64_t ldx,
              const float* cos, const float* sin, float* out, int scaled, float scale) {
    int half = dims / 2;
    __m512 sc = _mm512_set1_ps(scale);
    for (int t = 0; t < T; t++) {
        const float* c = cos + (size_t)t * half;
        const float* s = sin + (size_t)t * half;
        for (int h = 0; h < H; h++) {
            const float* a = x + (size_t)t * ldx + (size_t)h * D;
            float* o = out + ((size_t)t * H + h) * D;
            if (!traditional && half % 16 == 0) {
                for (int i = 0; i < half; i += 16) {
                    __m512 x1 = _mm512_loadu_ps(a + i), x2 = _mm512_loadu_ps(a + half + i);
                    __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
                    __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
                    __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
                    _mm512_storeu_ps(o + i, o1);
                    _mm512_storeu_ps(o + half + i, o2);
                }
            } else {
                for (int i = 0; i < half; i++) {
                    int p = traditional ? 2 * i : i, q = traditional ? 2 * i + 1 : i + half;
                    float x1 = a[p], x2 = a[q];
                    o[p] = x1 * c[i] - x2 * s[i];
                    o[q] = x2 * c[i] + x1 * s[i];
                }
            }
            for (int j = dims; j < D; j++) o[j] = a[j];
            if (h < scaled) {
                for (int j = 0; j < D; j += 16) {
                    __mmask16 k = tail(D - j);
                    _mm512_mask_storeu_ps(o + j, k,
                                          _mm512_mul_ps(_mm512_maskz_loadu_ps(k, o + j), sc));
                }
            }
        }
    }
}

// ---- The passes by rows over a lent pool's workers (runner.h: the GEMMs' spinning workers, a
// hand-off of a microsecond or two): each row is still one thread's, with the same
// instructions, so the same bits.

static int chunk_of(int M, int threads) {  // ~2 claims a thread
    int c = M / (2 * threads);
    return c < 1 ? 1 : c;
}

struct gated_job {
    int I, act;
    const float* gu;
    int64_t ldg, ldo;
    float* out;
};

static void gated_rows(const void* a, int r0, int r1) {
    const struct gated_job* j = a;
    ops_gated(r0, r1, j->I, j->gu, j->ldg, j->out, j->ldo, j->act);
}

void ops_gated_pooled(int M, int I, const float* gu, int64_t ldg, float* out, int64_t ldo,
                      int act, pool_runner runner, int threads) {
    struct gated_job j = {I, act, gu, ldg, ldo, out};
    runner(gated_rows, &j, M, chunk_of(M, threads), threads);
}

struct norm_job {
    int N;
    float* x;
    int64_t ldx, ldr, ldo;
    const float *r, *w;
    float eps;
    float* out;
};

static void norm_rows(const void* a, int r0, int r1) {
    const struct norm_job* j = a;
    ops_rms_norm(r1 - r0, j->N, j->x + (size_t)r0 * j->ldx, j->ldx,
                 j->r ? j->r + (size_t)r0 * j->ldr : 0, j->ldr, j->w, j->eps,
                 j->out + (size_t)r0 * j->ldo, j->ldo);
}

void ops_rms_norm_pooled(int M, int N, float* x, int64_t ldx, const float* r, int64_t ldr,
                         const float* w, float eps, float* out, int64_t ldo, pool_runner runner,
                         int threads) {
    struct norm_job j = {N, x, ldx, ldr, ldo, r, w, eps, out};
    runner(norm_rows, &j, M, chunk_of(M, threads), threads);
}

struct rope_job {
    int H, D, dims, traditional, scaled;
    const float* x;
    int64_t ldx;
    const float *cos, *sin;
    float* out;
    float scale;
};

static void rope_rows(const void* a, int r0, int r1) {
    const struct rope_job* j = a;
    size_t half = (size_t)(j->dims / 2);
    ops_rope(r1 - r0, j->H, j->D, j->dims, j->traditional, j->x + (size_t)r0 * j->ldx, j->ldx,
             j->cos + r0 * half, j->sin + r0 * half, j->out + (size_t)r0 * j->H * j->D,
             j->scaled, j->scale);
}

void ops_rope_pooled(int T, int H, int D, int dims, int traditional, const float* x,
                     int64_t ldx, const float* cos, const float* sin, float* out, int scaled,
                     float scale, pool_runner runner, int threads) {
    struct rope_job j = {H, D, dims, traditional, scaled, x, ldx, cos, sin, out, scale};
    runner(rope_rows, &j, T, chunk_of(T, threads), threads);
}
