/* The sampler's draw on the host: for each drawn row, in one read of the row from memory (a
 * second from cache), its softmax at a per-row temperature, its K most likely tokens, and its
 * token by inverse CDF of its uniform u when those K settle it (draw_rows.py's first tiers).
 *
 * Legend: R = drawn rows, V = vocabulary, K = candidates per row.
 *
 * Drawn row r is row rows[r] of x (row stride xs, fp32): m = max_i x_i; w_i = exp((x_i - m) *
 * inv_t[r]); z = sum_i w_i; the K largest w_i / z, best first (of equal weights the lower id
 * first, so a row's candidates depend on the row alone), their ids into out_i[r, :K]; out_tok[r]
 * the token (top-k, top-p, min-p applied as draw_rows.py does; an untruncated row whose u lies
 * past the K's mass drawn in the rest of the vocabulary) or -1 when they cannot settle it (a
 * truncated row whose kept tokens may reach past the K).
 * The weights are made once (kept in a scratch row, in cache), 64 to a block whose largest is
 * noted; the K-th largest block maximum bounds the K-th largest weight from below, so only the
 * blocks reaching it are looked at again, weight by weight, and what they hold at or above it
 * is sorted. Almost every weight costs its exp, an add and a max. Rows are shared among `nthreads` threads
 * through an atomic counter. NaN in a row is not propagated (the caller has already marked
 * such rows as failed); -inf logits get weight 0.
 *
 * No Python API: the runtime calls moecc_draw_rows through ctypes (runtime/native).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <Python.h>

#include "bf16.h"
#include "cpu.h"
#include "row_items.h"
#include "vec8.h"

typedef struct {
    const float *x; int64_t V, xs;                  /* logits [*, V], row stride xs */
    const int64_t *rows; int64_t R;                  /* the rows of x to draw */
    const float *inv_t, *top_p, *min_p, *u;          /* per drawn row */
    const int64_t *top_k;                            /* per drawn row, 0: off */
    int K;
    int64_t *out_tok, *out_i;                        /* [R] token or -1; [R, K] candidate ids */
    int64_t next;
    int failed;
} Job;

#define BLOCK 64  /* weights per block (8 where 64 would give fewer than 2K blocks): each block's largest is kept */

typedef struct { float w; int64_t i; } Cand;

/* a before b in the candidates' order: larger weight, then lower id */
static int cand_order(const void *pa, const void *pb) {
    const Cand *a = (const Cand *)pa, *b = (const Cand *)pb;
    if (a->w != b->w) return a->w > b->w ? -1 : 1;
    return a->i < b->i ? -1 : (a->i > b->i);
}

/* The k-th largest (k >= 1) of v[0..n-1] (reordered): quickselect. */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float pivot = v[lo + (hi - lo) / 2];
        int64_t a = lo, b = hi;
        while (a <= b) {
            while (v[a] > pivot) a++;
            while (v[b] < pivot) b--;
            if (a <= b) { float t = v[a]; v[a] = v[b]; v[b] = t; a++; b--; }
        }
        if (want <= b) hi = b;
        else if (want >= a) lo = a;
        else return v[want];
    }
    return v[want];
}

static inline __attribute__((always_inline)) v8 vmax(v8 a, v8 b) {
    const i8 gt = a > b;
    return as_v8((as_i8(a) & gt) | (as_i8(b) & ~gt));
}

static inline __attribute__((always_inline)) float row_max(const float *x, int64_t V) {
    v8 mx = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) mx = vmax(ld8(x + i), mx);
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = mx[l] > m ? mx[l] : m;
    for (; i < V; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* The row's weights into w [V], each block of `bs` (64 or 8) weights' largest into bmax;
 * returns their sum z. */
static inline __attribute__((always_inline)) float row_weights(const float *x, int64_t V, float m, float it,
                                                                int bs, float *w, float *bmax) {
    v8 acc = {0};
    const v8 mv = {m, m, m, m, m, m, m, m}, itv = {it, it, it, it, it, it, it, it};
    int64_t i = 0, b = 0;
    for (; i + bs <= V; i += bs, b++) {
        v8 bm = {0};
        for (int q = 0; q < bs / 8; q++) {
            const v8 e = exp8((ld8(x + i + 8 * q) - mv) * itv);
            acc += e;
            bm = vmax(bm, e);
            st8(w + i + 8 * q, e);
        }
        float top = bm[0];
        for (int l = 1; l < 8; l++) top = bm[l] > top ? bm[l] : top;
        bmax[b] = top;
    }
    float z = hsum8(acc);
    if (i < V) {
        float top = 0.0f;
        for (; i < V; i += 8) {
            float t[8];
            for (int l = 0; l < 8; l++) t[l] = i + l < V ? (x[i + l] - m) * it : -INFINITY;
            const v8 e = exp8(ld8(t));
            for (int l = 0; l < 8 && i + l < V; l++) { w[i + l] = e[l]; z += e[l]; top = e[l] > top ? e[l] : top; }
        }
        bmax[b] = top;
    }
    return z;
}

/* One row: its K best (of equal weights the lower id first) as probabilities, and their ids.
 * The K-th largest block maximum is a lower bound of the K-th largest weight, so every weight
 * at least that large is collected (from the blocks whose maximum reaches it), sorted, cut. */
static inline __attribute__((always_inline)) int64_t settle(const Job *j, int64_t r, const Cand *c, int64_t n, float z,
                                                            float *w);

/* One row: its K best (of equal weights the lower id first) into cand, their ids into out_i,
 * and its token when they settle it. The K-th largest block maximum is a lower bound of the
 * K-th largest weight, so every weight at least that large is collected (from the blocks
 * whose maximum reaches it), sorted, cut. */
static inline __attribute__((always_inline)) void one_row(Job *j, int64_t r, float *w, float *bmax, float *sel,
                                                           Cand *cand) {
    const int64_t V = j->V;
    const int bs = (V + BLOCK - 1) / BLOCK > 2 * (int64_t)j->K ? BLOCK : 8;
    const int64_t nb = (V + bs - 1) / bs;
    const float *x = j->x + j->rows[r] * j->xs;
    const float z = row_weights(x, V, row_max(x, V), j->inv_t[r], bs, w, bmax);
    float theta = 0.0f;
    if (nb > j->K) {
        memcpy(sel, bmax, (size_t)nb * sizeof(float));
        theta = kth_largest(sel, nb, j->K);
    }
    int64_t n = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (bmax[b] < theta) continue;
        const int64_t hi = (b + 1) * bs < V ? (b + 1) * bs : V;
        for (int64_t i = b * bs; i < hi; i++)
            if (w[i] >= theta) { cand[n].w = w[i]; cand[n].i = i; n++; }
    }
    qsort(cand, (size_t)n, sizeof(Cand), cand_order);
    if (n > j->K) n = j->K;
    int64_t *oi = j->out_i + r * j->K;
    for (int64_t k = 0; k < j->K; k++) oi[k] = k < n ? cand[k].i : 0;
    j->out_tok[r] = settle(j, r, cand, n, z, w);
}

/* An untruncated row whose u lies past its n best's mass `cum`: the token at u's place in the
 * rest of the vocabulary, index order (the candidates' weights in w zeroed: left out). */
static inline __attribute__((always_inline)) int64_t tail(const Job *j, const Cand *c, int64_t n, float z, float cum,
                                                          float u, float *w) {
    for (int64_t k = 0; k < n; k++) w[c[k].i] = 0.0f;
    const float target = (u - cum) * z;  /* the weight left past the candidates */
    float acc = 0.0f;
    int64_t last = c[n - 1].i;
    for (int64_t i = 0; i < j->V; i++) {
        if (w[i] <= 0.0f) continue;
        acc += w[i];
        last = i;
        if (acc > target) return i;
    }
    return last;
}

/* The row's token from its n best (weights over z, best first), or -1 when they cannot settle
 * it: a truncated row (top-k, top-p, min-p) whose kept prefix may reach past them. An
 * untruncated row whose u lies past their mass draws in the rest (`tail`). As
 * runtime/sampling/draw_rows.py _settle and _tail. */
static inline __attribute__((always_inline)) int64_t settle(const Job *j, int64_t r, const Cand *c, int64_t n, float z,
                                                            float *w) {
    const int64_t tk = j->top_k[r];
    const float tp = j->top_p[r], mp = j->min_p[r], u = j->u[r];
    const int trunc = tk > 0 || tp < 1.0f || mp > 0.0f, all = n >= j->V;
    const float p0 = c[0].w / z;
    float cum = 0.0f, kept = 0.0f;
    int64_t L = 0;  /* the kept prefix */
    for (int64_t k = 0; k < n; k++) {
        const float pk = c[k].w / z;
        const int keep = k == 0 || ((tk == 0 || k < tk) && (tp >= 1.0f || cum < tp) && pk >= mp * p0);
        cum += pk;
        if (keep && L == k) { L = k + 1; kept = cum; }
    }
    const float plast = c[n - 1].w / z;
    const int closed = (tk > 0 && tk <= j->K) || (tp < 1.0f && cum >= tp) || (mp > 0.0f && plast < mp * p0) || all;
    if (trunc && !closed) return -1;
    if (!trunc && !all && !(u < cum)) return tail(j, c, n, z, cum, u, w);
    const float target = trunc ? u * kept : u;
    const int64_t last = trunc ? L : n;
    float acc = 0.0f;
    for (int64_t k = 0; k < last; k++) {
        acc += c[k].w / z;
        if (acc > target) return c[k].i;
    }
    return c[last - 1].i;
}

#ifdef HAVE_AVX2_CLONE  /* cpu.h */
__attribute__((target("avx2,fma"))) static void run_rows_avx2(Job *j, float *w, float *bmax, float *sel, Cand *c) {
    for (;;) {
        const int64_t r = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (r >= j->R) break;
        one_row(j, r, w, bmax, sel, c);
    }
}
#endif

static void run_rows_base(Job *j, float *w, float *bmax, float *sel, Cand *c) {
    for (;;) {
        const int64_t r = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (r >= j->R) break;
        one_row(j, r, w, bmax, sel, c);
    }
}

static void *worker(void *arg) {
    Job *j = (Job *)arg;
    const size_t nb = (size_t)((j->V + 7) / 8);  /* blocks of 8 at the most */
    float *w = (float *)malloc((size_t)j->V * sizeof(float) + 2 * nb * sizeof(float));
    Cand *c = (Cand *)malloc((size_t)j->V * sizeof(Cand));
    if (!w || !c) { free(w); free(c); __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED); return NULL; }
    float *bmax = w + j->V, *sel = bmax + nb;
#ifdef HAVE_AVX2_CLONE
    if (use_avx2()) run_rows_avx2(j, w, bmax, sel, c);
    else
#endif
        run_rows_base(j, w, bmax, sel, c);
    free(w);
    free(c);
    return NULL;
}

/* Returns 0 on success, 1 when scratch memory could not be had. */
int moecc_draw_rows(const float *x, int64_t V, int64_t xs, const int64_t *rows, int64_t R, const float *inv_t,
                    const int64_t *top_k, const float *top_p, const float *min_p, const float *u, int K,
                    int64_t *out_tok, int64_t *out_i, int nthreads) {
    Job j = {x, V, xs, rows, R, inv_t, top_p, min_p, u, top_k, K, out_tok, out_i, 0, 0};
    run_threads(worker, &j, nthreads, R);
    return j.failed;
}

/* Greedy rows: out[r] = the first index of row r's largest logit, or -1 where the row is not
 * finite (a NaN, a largest +inf, or nothing above -inf), as torch's max over the row and its
 * isfinite check give, for fp32 or bf16 logits (bf16 widened exactly). Per row: the largest of each
 * block of 64 (one vectorized pass), then the first block holding the row's largest, then the
 * first index in it. */
typedef struct { const void *x; int dtype; int64_t V, xs; int64_t *out; } Greedy;

/* The largest of 8 lanes a and b, lane by lane, with `nan` marking lanes where b is NaN (a NaN
 * never wins: the row's NaN flag reports it). */
#define GREEDY_MAX8(a, b, nan)                          \
    do {                                                \
        const i8 gt_ = (b) > (a);                       \
        (nan) |= (b) != (b);                            \
        (a) = as_v8((as_i8(b) & gt_) | (as_i8(a) & ~gt_)); \
    } while (0)

/* Row r's greedy token into j->out[r]; LOAD8(i) the 8 logits from index i widened to fp32,
 * LOAD1(i) one. */
#define GREEDY_ROW(LOAD8, LOAD1)                                                               \
    do {                                                                                       \
        float m = -INFINITY, bm[(j->V + 63) / 64];                                             \
        i8 nan8 = {0};                                                                         \
        int nan = 0;                                                                           \
        for (int64_t b = 0; b < j->V; b += 64) {                                               \
            const int64_t e = b + 64 < j->V ? b + 64 : j->V;                                   \
            float x = -INFINITY;                                                               \
            int64_t i = b;                                                                     \
            if (e - b == 64) {                                                                 \
                v8 x8 = LOAD8(b);                                                              \
                nan8 |= x8 != x8;                                                              \
                for (i = b + 8; i < e; i += 8) {                                               \
                    const v8 v_ = LOAD8(i);                                                    \
                    GREEDY_MAX8(x8, v_, nan8);                                                 \
                }                                                                              \
                for (int l = 0; l < 8; l++) x = x8[l] > x ? x8[l] : x;                         \
            }                                                                                  \
            for (; i < e; i++) {                                                               \
                const float v = LOAD1(i);                                                      \
                x = v > x ? v : x;                                                             \
                nan |= v != v;                                                                 \
            }                                                                                  \
            bm[b / 64] = x;                                                                    \
            m = x > m ? x : m;                                                                 \
        }                                                                                      \
        for (int l = 0; l < 8; l++) nan |= nan8[l] != 0;                                       \
        int64_t at = -1;                                                                       \
        if (!nan && m > -INFINITY && m < INFINITY)                                             \
            for (int64_t b = 0; at < 0; b += 64)                                               \
                if (bm[b / 64] == m)                                                           \
                    for (int64_t i = b; at < 0; i++) at = LOAD1(i) == m ? i : -1;              \
        j->out[r] = at;                                                                        \
    } while (0)

#define GREEDY_F32_8(i) ld8(xf + (i))
#define GREEDY_F32_1(i) (xf[i])
#define GREEDY_BF16_8(i) ldbf8(xh + (i))
#define GREEDY_BF16_1(i) bf2f(xh[i])
#define GREEDY_BODY                                                                            \
    const Greedy *j = (const Greedy *)job;                                                     \
    for (int64_t r = r0; r < r1; r++) {                                                        \
        if (j->dtype == DT_F32) {                                                              \
            const float *xf = (const float *)j->x + r * j->xs;                                 \
            GREEDY_ROW(GREEDY_F32_8, GREEDY_F32_1);                                            \
        } else {                                                                               \
            const uint16_t *xh = (const uint16_t *)j->x + r * j->xs;                           \
            GREEDY_ROW(GREEDY_BF16_8, GREEDY_BF16_1);                                          \
        }                                                                                      \
    }

ROW_ITEMS_BUILDS(GREEDY_BODY)

/* out [R] <- each row's greedy token or -1 (Greedy); x [R, V] rows xs elements apart, dtype
 * DT_F32 or DT_BF16 (bf16.h). */
int moecc_greedy_rows(const void *x, int dtype, int64_t R, int64_t V, int64_t xs, int64_t *out, int nthreads) {
    if (R < 0 || V < 1 || xs < V || (dtype != DT_F32 && dtype != DT_BF16)) return 1;
    Greedy j = {x, dtype, V, xs, out};
    run_row_items(&j, ROW_FNS, R, V, nthreads);
    return 0;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sample_rows",
                                    "moecc's sampler pass over a step's logits (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__sample_rows(void) { return PyModule_Create(&module); }
