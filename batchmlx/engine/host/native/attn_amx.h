/* attn.c's attention for a prompt's queries (Job.tiles) through AMX-BF16 tiles, where
 * attn_amx_init found them (paged_attention.amx(): q8's AMX check first).
 *
 * Why prompt rows alone: a prompt chunk's queries all see the same keys (their sequence's),
 * and a step's chunks behind one system prompt share its blocks too, so each step of 32 keys
 * is converted once and scored for 16 query vectors a tile product: 64 chunks of 30 tokens
 * behind a 930-token prefix, one layer on 2 threads, 38 ms on the vector path, 18 here. A
 * decode row alone fills 3 of a tile's 16 columns and pays the conversion for itself (2.6x
 * the vector path, measured), and whether its keys are shared depends on the batch; so
 * decode rows always take the vector path and prompt tokens always this one (a generated
 * token is a decode row even when replayed after a preemption: replay_decodes). A token's
 * bits then still depend on its own keys alone, and a prefix-cache hit gives the bits its
 * prompt would have computed.
 *
 * The arithmetic, per query vector, whatever shares its tiles or its claim:
 * - every value split in two bf16 halves, x = hi + lo (hi: x's upper 16 bits, lo: those of
 *   x - hi): a float16 key or value exactly, a float32 one to 16 bits; the query (each half
 *   rounded to nearest) likewise;
 * - per 32 positions (from position 0, whatever the chunk), scores C[key][vector] += Khi.Qhi,
 *   Khi.Qlo, Klo.Qhi per 32 dimensions in order (TDPBF16PS: each C element from its own A row
 *   and B column, so the other vectors of a tile change nothing; lo.lo, ~2^-16 of a product,
 *   left out);
 * - the online-softmax step in lanes (one per vector) on its valid scores (its keys, its
 *   window): the step's max, exp16, the sum over keys paired n with n + 16 then halved, p
 *   split in halves;
 * - O = P V per 16 dimensions (Phi.Vhi, Plo.Vhi, Phi.Vlo), acc = fma(acc, alpha, O).
 * Positions past a step's last written key are zeros in the tiles (a vector's p there is 0, so
 * no stale value of the pool reaches a sum). Against a float64 reference the outputs are
 * within ~1e-4 (the vector path: ~2e-6); below float16's resolution of the keys themselves. */
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMXA __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx512dq")))
#define STEP 32 /* positions a tile step covers */

static int amx_granted = 0; /* Linux gave this process the tile state */
static int amx_on = 0;      /* decode_units takes this path for tile rows (Job.tiles) */

/* Asks Linux for the tile state; 0 (and the path on) when granted. */
int attn_amx_init(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1;
    amx_granted = amx_on = 1;
    return 0;
}

/* Turns the path off, or on again where granted (tests). Returns whether it is on. */
int attn_set_amx(int on) {
    amx_on = on && amx_granted;
    return amx_on;
}

static int amx_takes(const Shape *sh) { return amx_on && sh->d % 32 == 0 && sh->rep <= 16; }

struct attn_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Every tile 16 rows of 64 bytes. Scores: 0, 1 C (keys 0-15, 16-31 x vectors), 2, 3 B (Q^T
 * hi, lo: dimension pairs x vectors), 4-7 A (K hi, lo of keys 0-15, then of 16-31: keys x 32
 * dimensions). Values: 0-3 C (vectors x 16 dimensions), 4, 5 A (P hi, lo: vectors x 32
 * keys), 6, 7 B (V hi, lo: key pairs x 16 dimensions). */
AMXA static void attn_tiles(void) {
    struct attn_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* 32 floats (a, b: 16 each) -> their bf16 halves as 16 dword pairs: pair n = (a[n], b[n]);
 * hi = each one's upper word, lo = the upper word of x - hi. (A key's dimensions, and a score
 * row's keys, are paired n with n + 16 this way; the query's and the values' pairs follow.) */
AMXA static inline void pair_halves(__m512 a, __m512 b, __m512i *hi, __m512i *lo) {
    const __m512i upper = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i ai = _mm512_castps_si512(a), bi = _mm512_castps_si512(b);
    const __m512 ra = _mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_and_si512(ai, upper)));
    const __m512 rb = _mm512_sub_ps(b, _mm512_castsi512_ps(_mm512_and_si512(bi, upper)));
    *hi = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(ai, 16), bi);
    *lo = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(_mm512_castps_si512(ra), 16),
                                  _mm512_castps_si512(rb));
}

/* 16 rows of 16 dwords, transposed in place (unpacks, then 128-bit lane shuffles) */
AMXA static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int g = 0; g < 2; g++)
        for (int i = 0; i < 4; i++) {
            t[8 * g + i] = _mm512_shuffle_i32x4(r[8 * g + i], r[8 * g + 4 + i], 0x88);
            t[8 * g + 4 + i] = _mm512_shuffle_i32x4(r[8 * g + i], r[8 * g + 4 + i], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    }
}


/* This thread's scratch of at least `bytes`, kept between calls (a claim's, up to a few MB at
 * a long prompt's step, is not mapped and cleared afresh every call); its size is bounded by
 * the largest claim, so by the step's token budget */
static char *scratch(size_t bytes) {
    static __thread char *mem;
    static __thread size_t size;
    if (bytes > size) {
        free(mem);
        size = bytes + bytes / 4;
        mem = malloc(size);
        if (!mem) size = 0;
    }
    return mem;
}

/* A claim's scratch. Slots: its units by head, then row (`order`); groups of 16 / rep slots
 * of one head share tiles (slot k: group gid[k], vectors from column col[k]). qt: each
 * group's Q^T halves as B tiles [group][d / 32][2][16 pairs][16 vectors]; state per slot: m
 * [rep], l [rep], acc [rep][d]; a step's tiles: kr [2][32 keys][d] bf16 (A), vt [d / 16][2]
 * [16 pairs][16] dwords (B); a tile job's s [32][16] and o [4][16][16] floats, P [2][16][32]
 * bf16, alpha [16]. */
typedef struct {
    const Job *j;
    int *order, *gid, *col;
    uint32_t *qt, *vt;
    float *state, *s, *o;
    uint16_t *kr, *p;
    float alpha[16];
} Claim;

/* The keys and values of positions [STEP t, STEP t + real) of a row's table (the rest zeros)
 * for KV head `head`, as the step's tiles: kr's rows a key's dimension pairs (n, n + 16) of
 * each 32, vt's the pairs of keys (n, n + 16). */
AMXA static void step_tiles(Claim *c, const int32_t *table, int head, int t, int real) {
    const Shape *sh = &c->j->sh;
    const int d = sh->d, bs = sh->bs;
    size_t at[STEP];
    int b = STEP * t / bs, off = STEP * t % bs;
    for (int i = 0; i < STEP; i++) {
        at[i] = i < real ? (((size_t)table[b] * sh->h + head) * bs + off) * d : 0;
        if (++off == bs) off = 0, b++;
    }
    for (int i = 0; i < STEP; i++) {
        uint16_t *hi = c->kr + (size_t)i * d, *lo = c->kr + (size_t)(STEP + i) * d;
        for (int x = 0; x < d; x += 32) {
            __m512i h = _mm512_setzero_si512(), l = h;
            if (i < real)
                pair_halves(load16(sh->kpool, at[i] + x, sh->half),
                            load16(sh->kpool, at[i] + x + 16, sh->half), &h, &l);
            _mm512_storeu_si512(hi + x, h);
            _mm512_storeu_si512(lo + x, l);
        }
    }
    for (int pr = 0; pr < STEP / 2; pr++)
        for (int x = 0; x < d; x += 16) {
            const int a = pr, b2 = pr + 16;
            const __m512 va = a < real ? load16(sh->vpool, at[a] + x, sh->half) : _mm512_setzero_ps();
            const __m512 vb = b2 < real ? load16(sh->vpool, at[b2] + x, sh->half) : _mm512_setzero_ps();
            __m512i h, l;
            pair_halves(va, vb, &h, &l);
            uint32_t *o = c->vt + (size_t)(x / 16) * 512 + (size_t)pr * 16;
            _mm512_storeu_si512(o, h);
            _mm512_storeu_si512(o + 256, l);
        }
}

/* key_span of step t (positions STEP t ..) */
static inline void step_span(const Shape *sh, int t, int count, int *lo, int *hi) {
    key_span(sh, STEP * t, STEP, count, lo, hi);
}

/* A tile job: slots [k0, k1) of group g against step t, whose tiles the claim holds. Its
 * scores (tile products) and each vector's softmax step (in lanes): P in c->p and alpha.
 * Returns the vectors (a bit each, by column) that saw a key of the step. */
AMXA static __mmask16 job_scores(Claim *c, int g, int k0, int k1, int t) {
    const Job *j = c->j;
    const Shape *sh = &j->sh;
    const int rep = sh->rep, d = sh->d;
    const size_t per = (size_t)rep * (d + 2);
    const uint32_t *qt = c->qt + (size_t)g * d * 16;
    const uint16_t *kr = c->kr;
    _tile_zero(0);
    _tile_zero(1);
    for (int x = 0; x < d / 32; x++) {
        _tile_loadd(2, qt + (size_t)x * 512, 64);
        _tile_loadd(3, qt + (size_t)x * 512 + 256, 64);
        _tile_loadd(4, kr + 32 * x, d * 2);
        _tile_loadd(5, kr + (size_t)STEP * d + 32 * x, d * 2);
        _tile_loadd(6, kr + (size_t)16 * d + 32 * x, d * 2);
        _tile_loadd(7, kr + (size_t)(STEP + 16) * d + 32 * x, d * 2);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 6, 2);
        _tile_dpbf16ps(0, 4, 3);
        _tile_dpbf16ps(1, 6, 3);
        _tile_dpbf16ps(0, 5, 2);
        _tile_dpbf16ps(1, 7, 2);
    }
    _tile_stored(0, c->s, 64);
    _tile_stored(1, c->s + 256, 64);
    /* the softmax step with the job's vectors in lanes (C's columns): per lane its state and
     * the keys [lo, hi) of the step its row sees; other lanes keep theirs */
    float m0[16], l0[16];
    int32_t lo_[16], hi_[16];
    for (int v = 0; v < 16; v++) m0[v] = -INFINITY, l0[v] = 0.0f, lo_[v] = hi_[v] = 0;
    for (int k = k0; k < k1; k++) {
        int lo, hi;
        step_span(sh, t, j->counts[c->order[k] / sh->h], &lo, &hi);
        for (int r = 0; r < rep; r++) {
            const int v = c->col[k] + r;
            const float *st = c->state + (size_t)k * per;
            m0[v] = st[r], l0[v] = st[rep + r], lo_[v] = lo, hi_[v] = hi;
        }
    }
    const __m512i lov = _mm512_loadu_si512(lo_), hiv = _mm512_loadu_si512(hi_);
    const __mmask16 act = _mm512_cmplt_epi32_mask(lov, hiv);
    if (!act) return act;
    const __m512 m = _mm512_loadu_ps(m0), l = _mm512_loadu_ps(l0), ninf = _mm512_set1_ps(-INFINITY);
    __mmask16 valid[STEP];
    __m512 top = ninf;
    float *sc = c->s; /* [key][vector] */
    for (int i = 0; i < STEP; i++) {
        const __m512i key = _mm512_set1_epi32(i);
        valid[i] = _mm512_cmple_epi32_mask(lov, key) & _mm512_cmplt_epi32_mask(key, hiv);
        __m512 x = _mm512_loadu_ps(sc + 16 * i);
        if (sh->softcap > 0.0f) x = softcap16(x, sh->softcap);
        x = _mm512_mask_blend_ps(valid[i], ninf, x);
        _mm512_storeu_ps(sc + 16 * i, x);
        top = _mm512_max_ps(top, x);
    }
    const __m512 mnew = _mm512_max_ps(m, top);
    /* alpha: 0 where the state was empty (m = -inf), exp(m - mnew) else */
    const __mmask16 had = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ) & act;
    const __m512 alpha = _mm512_maskz_mov_ps(had, exp16(_mm512_mask_sub_ps(m, had, m, mnew)));
    __m512 p[STEP];
    for (int i = 0; i < STEP; i++)
        p[i] = _mm512_maskz_mov_ps(valid[i], exp16(_mm512_mask_sub_ps(mnew, valid[i], _mm512_loadu_ps(sc + 16 * i), mnew)));
    /* the step's sum: keys paired n with n + 16, then halves, in one fixed tree */
    __m512 sum[16];
    for (int i = 0; i < 16; i++) sum[i] = _mm512_add_ps(p[i], p[i + 16]);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) sum[i] = _mm512_add_ps(sum[i], sum[i + w]);
    const __m512 lnew = _mm512_fmadd_ps(l, alpha, sum[0]);
    _mm512_storeu_ps(m0, _mm512_mask_blend_ps(act, m, mnew));
    _mm512_storeu_ps(l0, _mm512_mask_blend_ps(act, l, lnew));
    _mm512_storeu_ps(c->alpha, alpha);
    for (int k = k0; k < k1; k++)
        for (int r = 0; r < rep; r++) {
            float *st = c->state + (size_t)k * per;
            st[r] = m0[c->col[k] + r], st[rep + r] = l0[c->col[k] + r];
        }
    /* P's halves: rows of key pairs (n, n + 16) x vectors, transposed to a vector a row */
    __m512i ph[16], pl[16];
    for (int n = 0; n < 16; n++) pair_halves(p[n], p[n + 16], &ph[n], &pl[n]);
    transpose16(ph);
    transpose16(pl);
    for (int v = 0; v < 16; v++) {
        _mm512_storeu_si512(c->p + 32 * v, ph[v]);
        _mm512_storeu_si512(c->p + 512 + 32 * v, pl[v]);
    }
    return act;
}

/* The job's O = P V (tile products), merged into the acc of each vector in `act` (those that
 * saw keys: job_scores). */
AMXA static void job_values(Claim *c, int k0, int k1, __mmask16 act) {
    const Job *j = c->j;
    const int rep = j->sh.rep, d = j->sh.d;
    const size_t per = (size_t)rep * (d + 2);
    const uint32_t *vt = c->vt;
    const float *alpha = c->alpha;
    _tile_loadd(4, c->p, 64);
    _tile_loadd(5, c->p + 512, 64);
    for (int x0 = 0; x0 < d / 16; x0 += 4) {
        const int w = d / 16 - x0 < 4 ? d / 16 - x0 : 4;
#define PV(T)                                                          \
        if (T < w) {                                                   \
            _tile_zero(T);                                             \
            _tile_loadd(6, vt + (size_t)(x0 + T) * 512, 64);           \
            _tile_loadd(7, vt + (size_t)(x0 + T) * 512 + 256, 64);     \
            _tile_dpbf16ps(T, 4, 6);                                   \
            _tile_dpbf16ps(T, 5, 6);                                   \
            _tile_dpbf16ps(T, 4, 7);                                   \
        }
        PV(0) PV(1) PV(2) PV(3)
#undef PV
        if (w > 0) _tile_stored(0, c->o, 64);
        if (w > 1) _tile_stored(1, c->o + 256, 64);
        if (w > 2) _tile_stored(2, c->o + 512, 64);
        if (w > 3) _tile_stored(3, c->o + 768, 64);
        for (int k = k0; k < k1; k++)
            for (int r = 0; r < rep; r++) {
                const int v = c->col[k] + r;
                if (!((act >> v) & 1)) continue;
                float *acc = c->state + (size_t)k * per + 2 * rep + (size_t)r * d + 16 * x0;
                for (int y = 0; y < w; y++)
                    _mm512_storeu_ps(acc + 16 * y,
                                     _mm512_fmadd_ps(_mm512_loadu_ps(acc + 16 * y), _mm512_set1_ps(alpha[v]),
                                                     _mm512_loadu_ps(c->o + 256 * y + 16 * v)));
            }
    }
}

AMXA static void tile_job(Claim *c, int g, int k0, int k1, int t) {
    const __mmask16 act = job_scores(c, g, k0, k1, t);
    if (act) job_values(c, k0, k1, act);
}

/* Group g's Q^T tiles from its slots' query halves (each rounded to nearest; columns past its
 * vectors zeros), dimensions paired (n, n + 16) of each 32 as the keys'. */
AMXA static void group_tiles(Claim *c, int g, int k0, int k1) {
    const Job *j = c->j;
    const int rep = j->sh.rep, d = j->sh.d;
    for (int x = 0; x < d; x += 32) {
        __m512i hi[16], lo[16];
        for (int v = 0; v < 16; v++) hi[v] = lo[v] = _mm512_setzero_si512();
        for (int k = k0; k < k1; k++)
            for (int r = 0; r < rep; r++) {
                const float *q = j->q + ((size_t)c->order[k] * rep + r) * d + x;
                const int v = c->col[k] + r;
                __m512i wh[2], wl[2];
                for (int e = 0; e < 2; e++) {
                    const __m512 a = _mm512_loadu_ps(q + 16 * e);
                    const __m256i h = (__m256i)_mm512_cvtneps_pbh(a);
                    wh[e] = _mm512_cvtepu16_epi32(h);
                    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(wh[e], 16));
                    wl[e] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(a, w)));
                }
                hi[v] = _mm512_or_si512(wh[0], _mm512_slli_epi32(wh[1], 16));
                lo[v] = _mm512_or_si512(wl[0], _mm512_slli_epi32(wl[1], 16));
            }
        transpose16(hi);
        transpose16(lo);
        uint32_t *o = c->qt + (size_t)g * d * 16 + (size_t)(x / 32) * 512;
        for (int pr = 0; pr < 16; pr++) {
            _mm512_storeu_si512(o + 16 * pr, hi[pr]);
            _mm512_storeu_si512(o + 256 + 16 * pr, lo[pr]);
        }
    }
}

/* The claim's slots by KV head, then row, in groups of 16 / rep; their states empty; each
 * group's Q^T tiles. Returns 0, or -1 for no memory. */
AMXA static int claim_open(Claim *c, Job *j, int u0, int u1) {
    const Shape *sh = &j->sh;
    const int rep = sh->rep, d = sh->d, h = sh->h, n = u1 - u0, group = 16 / rep;
    const size_t per = (size_t)rep * (d + 2), tiles = (size_t)2 * STEP * d * 2 + (size_t)d * 32 * 4;
    const int most = n / group + h; /* groups at most (one part-full a head) */
    const size_t bytes = (size_t)most * d * 64 + (size_t)n * per * 4 + tiles + (512 + 1024) * 4 +
                         1024 * 2 + (size_t)3 * n * 4;
    char *at = scratch(bytes);
    if (!at) return -1;
    c->j = j;
    c->qt = (uint32_t *)at, at += (size_t)most * d * 64; /* [groups][d * 16] dwords */
    c->state = (float *)at, at += (size_t)n * per * 4;
    c->vt = (uint32_t *)at, at += (size_t)d * 32 * 4;
    c->kr = (uint16_t *)at, at += (size_t)2 * STEP * d * 2;
    c->s = (float *)at, at += 512 * 4;
    c->o = (float *)at, at += 1024 * 4;
    c->p = (uint16_t *)at, at += 1024 * 2;
    c->order = (int *)at;
    c->gid = c->order + n;
    c->col = c->gid + n;
    int k = 0, groups = 0;
    for (int hd = 0; hd < h; hd++) {
        const int first = k;
        for (int x = u0; x < u1; x++) {
            const int u = j->head_major ? (x % j->rows) * h + x / j->rows : x; /* row-major */
            if (u % h != hd) continue;
            if ((k - first) % group == 0) groups++;
            c->order[k] = u, c->gid[k] = groups - 1, c->col[k] = (k - first) % group * rep;
            k++;
        }
    }
    for (k = 0; k < n; k++) {
        float *st = c->state + (size_t)k * per;
        for (int r = 0; r < rep; r++) st[r] = -INFINITY;
        memset(st + rep, 0, (per - rep) * sizeof(float));
    }
    for (int k0 = 0, k1; k0 < n; k0 = k1) {
        for (k1 = k0; k1 < n && c->gid[k1] == c->gid[k0]; k1++) {}
        group_tiles(c, c->gid[k0], k0, k1);
    }
    return 0;
}

/* Step t for slots [k0, k1) (one KV head; `table`, the keys every one of them reads): its
 * tiles made once, then a tile job for each group's part of them. */
AMXA static void run_step(Claim *c, const int32_t *table, int k0, int k1, int t) {
    const Shape *sh = &c->j->sh;
    int ext = 0, lo, hi;
    for (int k = k0; k < k1; k++) {
        step_span(sh, t, c->j->counts[c->order[k] / sh->h], &lo, &hi);
        if (lo < hi && hi > ext) ext = hi;
    }
    if (ext == 0) return;
    step_tiles(c, table, c->order[k0] % sh->h, t, ext);
    for (int g0 = k0, g1; g0 < k1; g0 = g1) {
        for (g1 = g0; g1 < k1 && c->gid[g1] == c->gid[g0]; g1++) {}
        tile_job(c, c->gid[g0], g0, g1, t);
    }
}

/* decode_units through tiles: the steps inside every row's shared blocks, step-major for each
 * KV head's slots; then the steps past them for each run of slots of one KV head and one
 * table (a prompt chunk's queries); steps in position order for every slot. */
AMXA static void decode_units_amx(const void *arg, int u0, int u1) {
    Job *j = (Job *)arg;
    const Shape *sh = &j->sh;
    const int rep = sh->rep, d = sh->d, h = sh->h, n = u1 - u0;
    const size_t per = (size_t)rep * (d + 2);
    Claim c;
    if (claim_open(&c, j, u0, u1)) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    attn_tiles();
    const int shared_steps = j->shared * sh->bs / STEP;
    for (int t = 0; t < shared_steps; t++)
        for (int k0 = 0, k1; k0 < n; k0 = k1) {
            for (k1 = k0; k1 < n && c.order[k1] % h == c.order[k0] % h; k1++) {}
            run_step(&c, j->tables + (size_t)(c.order[k0] / h) * j->tw, k0, k1, t);
        }
    for (int k0 = 0, k1; k0 < n; k0 = k1) {
        const int row0 = c.order[k0] / h;
        const int32_t *table = j->tables + (size_t)row0 * j->tw;
        int steps = 0;
        for (k1 = k0; k1 < n && c.order[k1] % h == c.order[k0] % h; k1++) {
            const int row = c.order[k1] / h;
            if (row != row0 && memcmp(table, j->tables + (size_t)row * j->tw, (size_t)j->tw * 4)) break;
            if ((j->counts[row] + STEP - 1) / STEP > steps) steps = (j->counts[row] + STEP - 1) / STEP;
        }
        for (int t = shared_steps; t < steps; t++) run_step(&c, table, k0, k1, t);
    }
    _tile_release();
    for (int k = 0; k < n; k++)
        for (int r = 0; r < rep; r++) {
            const float *st = c.state + (size_t)k * per;
            float *o = j->out + ((size_t)c.order[k] * rep + r) * d;
            const __m512 inv = _mm512_set1_ps(st[rep + r]);
            for (int x = 0; x < d; x += 16)
                _mm512_storeu_ps(o + x, _mm512_div_ps(_mm512_loadu_ps(st + 2 * rep + (size_t)r * d + x), inv));
        }
}
