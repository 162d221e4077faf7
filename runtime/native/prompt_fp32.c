/* Causal attention of fresh prompts in fp32 on AVX-512, in one call. A fresh prompt's rows are its
 * whole context (positions 0..n-1); for prompt row p, query head g and its KV head h = g / (Hq / Hkv):
 *
 *   out[p, g] = sum_{j <= p} softmax_j(scale * q[p, g] . k[j, h]) v[j, h]
 *
 * Legend: n a prompt's rows, D / Dv the key / value head dim (multiples of 16), Hq / Hkv query / KV
 * heads, a block = RB (48) consecutive rows of one prompt and query head, kend = the keys a block
 * sees (its last row's position + 1, at most n).
 *
 * A block's scores are kept transposed, S[j][r] (key j, row r of the block), so every step below
 * runs down the 16 rows of a vector and nothing is summed across lanes:
 *   1. Q^T [D][RB]: the block's queries transposed (rows past the prompt zero);
 *   2. S[j][r] = q_r . k_j for j < kend: tiles of 8 keys x 3 vectors of rows (24 accumulators), a
 *      key's dim broadcast from K in place, Q^T's three vectors loaded once a dim;
 *   3. each vector of rows: its max over the keys each row sees, then S = exp(scale (s - max)) in
 *      place (0 where a key is past the row), and the sums;
 *   4. out[r] = (sum_j S[j][r] v_j) / sum_r: tiles of 6 rows x 4 vectors of Dv (4 x 6 where Dv is
 *      96 or a multiple of 96), a weight broadcast from S, V's rows read in place, a tile's keys
 *      only up to its last row's position.
 * Numerics: fp32 sums in dim / key order by FMAs, exp by exp16.h (~1 ulp), each row's max over all
 * its keys in one pass (no online rescaling between key blocks), the output times 1 / its sum at
 * the end, as torch's flash attention does. The bits differ from SDPA's by rounding.
 *
 * Work: items (prompt, query head), the longest prompts first, taken from an atomic counter by
 * torch's threads (cpu.h); each thread's scratch holds a block's Q^T and scores for the longest
 * prompt.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <Python.h>

#include "cpu.h"
#include "exp16.h"
#include "prompt_items.h"
#include "py_args.h"

#define RB 48  /* rows a block (3 vectors; 6- and 4-row tiles divide it) */
#define KT 8   /* keys a score tile */

typedef struct {
    const float *q, *k, *v; int64_t t, ldq, ldk, ldv;  /* [t, Hq, D], [t, Hkv, D], [t, Hkv, Dv] */
    const int64_t *spans; int64_t ns;               /* [ns, 2]: rows [lo, hi) of each prompt */
    int64_t Hq, Hkv, D, Dv; float scale;
    const int64_t *items; int64_t nitems;           /* [ns * Hq]: s * Hq + g, the longest prompts first */
    float *out; int64_t ldo;                        /* [t, Hq, Dv] */
    int64_t maxn;                                   /* the longest prompt's rows */
    int64_t next;                                   /* the next item to hand out */
} Job;

#if defined(HAVE_AVX512_CLONE) && defined(__linux__)
#define HAVE_PROMPT_FP32 1
#define P32_TARGET __attribute__((target(AVX512_TARGET)))
#define P32_INLINE P32_TARGET __attribute__((always_inline)) static inline

/* Lanes of rows vector c (rows 16c .. 16c+15 of a block starting at position r0) that see key j. */
P32_INLINE __mmask16 sees(int64_t j, int64_t r0, int c) {
    const int64_t first = j - r0 - 16 * c;  /* the first lane whose row is at position >= j */
    return first <= 0 ? (__mmask16)0xffff : first >= 16 ? (__mmask16)0 : (__mmask16)(0xffffu << first);
}

/* 1. qt[d][r] = q[r0 + r, g, d] for the block's rows (zero past the prompt's `rows`: a prompt's
 * last block only). */
P32_INLINE void transpose_q(const float *q, int64_t ldq, int64_t rows, int64_t D, float *qt) {
    if (rows < RB) memset(qt, 0, (size_t)(D * RB) * sizeof(float));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < D; d++) qt[d * RB + r] = q[r * ldq + d];
}

/* 2. S[j][0..RB) = q_r . k_j for keys [j0, j0 + KT) (those past kend: the last key again, masked
 * in 3), K's rows ldk apart in place. */
P32_INLINE void score_tile(const float *qt, const float *k, int64_t ldk, int64_t j0, int64_t kend, int64_t D,
                           float *S) {
    const float *kr[KT];
    for (int i = 0; i < KT; i++) kr[i] = k + (j0 + i < kend ? j0 + i : kend - 1) * ldk;
    __m512 a[KT][3];
#pragma GCC unroll 8
    for (int i = 0; i < KT; i++) a[i][0] = a[i][1] = a[i][2] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 q0 = _mm512_loadu_ps(qt + d * RB), q1 = _mm512_loadu_ps(qt + d * RB + 16);
        const __m512 q2 = _mm512_loadu_ps(qt + d * RB + 32);
#pragma GCC unroll 8
        for (int i = 0; i < KT; i++) {
            const __m512 x = _mm512_set1_ps(kr[i][d]);
            a[i][0] = _mm512_fmadd_ps(x, q0, a[i][0]), a[i][1] = _mm512_fmadd_ps(x, q1, a[i][1]);
            a[i][2] = _mm512_fmadd_ps(x, q2, a[i][2]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < KT; i++) {
        float *s = S + (j0 + i) * RB;
        _mm512_storeu_ps(s, a[i][0]), _mm512_storeu_ps(s + 16, a[i][1]), _mm512_storeu_ps(s + 32, a[i][2]);
    }
}

/* 3. Rows vector c of the block: S[j][16c..] = exp(scale (s - max)) for the keys each row sees,
 * 0 for the others (j < kend); sum[16c..] their sums. */
P32_INLINE void softmax_rows(float *S, int64_t kend, int64_t r0, int c, float scale, float *sum) {
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    for (int64_t j = 0; j < kend; j++)
        mx = _mm512_mask_max_ps(mx, sees(j, r0, c), mx, _mm512_loadu_ps(S + j * RB + 16 * c));
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512 top = _mm512_mul_ps(mx, sc);  /* every row sees key 0: finite */
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < kend; j++) {
        float *s = S + j * RB + 16 * c;
        const __m512 e = _mm512_maskz_mov_ps(sees(j, r0, c), exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s), sc, top)));
        acc = _mm512_add_ps(acc, e);
        _mm512_storeu_ps(s, e);
    }
    _mm512_storeu_ps(sum + 16 * c, acc);
}

/* 4. out rows r .. r + mr of the block, Dv's vectors [d0 / 16, d0 / 16 + nv): the weighted sum of
 * V's rows over keys [0, keys), times 1 / the row's sum (mr <= 6, nv <= 6, mr * nv <= 24). */
P32_INLINE void pv_tile(const float *S, int r, const int mr, const float *v, int64_t ldv, int64_t d0, const int nv,
                        int64_t keys, const float *sum, float *out, int64_t ldo) {
    __m512 a[6][6];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 6
        for (int w = 0; w < nv; w++) a[i][w] = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j++) {
        __m512 x[6];
#pragma GCC unroll 6
        for (int w = 0; w < nv; w++) x[w] = _mm512_loadu_ps(v + j * ldv + d0 + 16 * w);
        const float *p = S + j * RB + r;
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            const __m512 e = _mm512_set1_ps(p[i]);
#pragma GCC unroll 6
            for (int w = 0; w < nv; w++) a[i][w] = _mm512_fmadd_ps(e, x[w], a[i][w]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[r + i]);
#pragma GCC unroll 6
        for (int w = 0; w < nv; w++) _mm512_storeu_ps(out + i * ldo + d0 + 16 * w, _mm512_mul_ps(a[i][w], inv));
    }
}

/* pv_tile with mr and nv as constants (their registers named at compile time). */
#define PV_CASE(MR, NV) pv_tile(S, r, MR, v, ldv, d0, NV, keys, sum, dst, ldo)
P32_INLINE void pv_rows(const float *S, int r, int mr, const float *v, int64_t ldv, int64_t d0, int nv,
                        int64_t keys, const float *sum, float *dst, int64_t ldo) {
    switch (nv * 8 + mr) {
#define PV_MR(NV) case NV * 8 + 1: PV_CASE(1, NV); break; case NV * 8 + 2: PV_CASE(2, NV); break; \
                  case NV * 8 + 3: PV_CASE(3, NV); break; case NV * 8 + 4: PV_CASE(4, NV); break;
        PV_MR(1) PV_MR(2) PV_MR(3) PV_MR(4) PV_MR(5) PV_MR(6)
#undef PV_MR
        case 1 * 8 + 5: PV_CASE(5, 1); break; case 1 * 8 + 6: PV_CASE(6, 1); break;
        case 2 * 8 + 5: PV_CASE(5, 2); break; case 2 * 8 + 6: PV_CASE(6, 2); break;
        case 3 * 8 + 5: PV_CASE(5, 3); break; case 3 * 8 + 6: PV_CASE(6, 3); break;
        case 4 * 8 + 5: PV_CASE(5, 4); break; case 4 * 8 + 6: PV_CASE(6, 4); break;
        default: break;  /* mr * nv > 24: never asked (block's choice below) */
    }
}
#undef PV_CASE

/* The rows [r0, r0 + rows) of prompt s (starting at row lo), query head g; w: RB * D floats of
 * Q^T, then S for the block's keys. */
P32_TARGET static void block(const Job *j, int64_t lo, int64_t n, int64_t g, int64_t r0, float *w) {
    const int64_t h = g / (j->Hq / j->Hkv), D = j->D, Dv = j->Dv, rows = n - r0 < RB ? n - r0 : RB;
    const int64_t kend = r0 + rows;  /* keys the block sees: its last row's position + 1 */
    float *qt = w, *S = w + D * RB, sum[RB];
    transpose_q(j->q + (lo + r0) * j->ldq + g * D, j->ldq, rows, D, qt);
    const float *k = j->k + lo * j->ldk + h * D, *v = j->v + lo * j->ldv + h * Dv;
    for (int64_t j0 = 0; j0 < kend; j0 += KT) score_tile(qt, k, j->ldk, j0, kend, D, S);
    for (int c = 0; c < 3; c++) softmax_rows(S, kend, r0, c, j->scale, sum);
    const int nvt = (int)(Dv / 16), wide = nvt % 6 == 0 ? 6 : 4, mr = wide == 6 ? 4 : 6;
    for (int r = 0; r < rows; r += mr) {
        const int m = rows - r < mr ? (int)(rows - r) : mr;
        const int64_t keys = r0 + r + m;  /* the tile's last row sees keys 0 .. r0 + r + m - 1 */
        float *dst = j->out + (lo + r0 + r) * j->ldo + g * Dv;
        for (int vv = 0; vv < nvt; vv += wide)
            pv_rows(S, r, m, v, j->ldv, 16 * vv, nvt - vv < wide ? nvt - vv : wide, keys, sum, dst, j->ldo);
    }
}

P32_TARGET static void *attend_items(void *arg) {
    Job *j = (Job *)arg;
    float *w = aligned_alloc(64, (size_t)((j->D + j->maxn + KT) * RB) * sizeof(float));
    if (!w) return NULL;  /* moecc_prompt_fp32 checks every item was taken */
    for (;;) {
        const int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= j->nitems) break;
        const int64_t s = j->items[it] / j->Hq, g = j->items[it] % j->Hq;
        const int64_t lo = j->spans[2 * s], n = SPAN_N_RAW(j->spans, s);
        for (int64_t r0 = 0; r0 < n; r0 += RB) block(j, lo, n, g, r0, w);
    }
    free(w);
    return NULL;
}

#endif

/* 1: this build and CPU run the kernel; 0: they do not. */
int moecc_prompt_fp32_ready(void) {
#ifdef HAVE_PROMPT_FP32
    return cpu_isa() >= ISA_AVX512;
#else
    return 0;
#endif
}

/* Returns 0 (done), 1 (arguments it does not take: nothing written), 2 (not here) or 3 (out of
 * memory). q/k/v/out: t rows, ldq/ldk/ldv/ldo elements apart, heads contiguous in a row. */
int moecc_prompt_fp32(const float *q, int64_t t, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                      const int64_t *spans, int64_t ns, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float scale,
                      float *out, int64_t ldo, int nthreads) {
#ifdef HAVE_PROMPT_FP32
    if (!moecc_prompt_fp32_ready()) return 2;
    int64_t maxn;
    if (!(scale > 0.0f) || !prompt_args_ok(spans, ns, t, Hq, Hkv, D, Dv, ldq, ldk, ldv, ldo, &maxn)) return 1;
    const int64_t nitems = ns * Hq;
    int64_t *items = longest_first(spans, ns, Hq);
    if (!items) return 3;
    Job j = {q, k, v, t, ldq, ldk, ldv, spans, ns, Hq, Hkv, D, Dv, scale, items, nitems, out, ldo, maxn, 0};
    run_threads(attend_items, &j, nthreads < 1 ? 1 : nthreads, nitems);
    free(items);
    return j.next >= nitems ? 0 : 3;  /* no thread had scratch: nothing taken */
#else
    (void)q, (void)ldq, (void)k, (void)ldk, (void)v, (void)ldv, (void)spans, (void)ns, (void)Hq, (void)Hkv, (void)D;
    (void)t, (void)Dv, (void)scale, (void)out, (void)ldo, (void)nthreads;
    return 2;
#endif
}

/* Python entries (METH_FASTCALL, pointers as ints, the work without the GIL: py_args.h). */
static PyObject *py_attend(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[17];
    if (int_args(args, n, 17, "attend", 1u << 13, v)) return NULL;
    const double scale = PyFloat_AsDouble(args[13]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    int rc;
#define P(i, type) ((type)(intptr_t)v[i])
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_prompt_fp32(P(0, const float *), v[1], v[2], P(3, const float *), v[4], P(5, const float *), v[6],
                           P(7, const int64_t *), v[8], v[9], v[10], v[11], v[12], (float)scale, P(14, float *), v[15],
                           (int)v[16]);
    Py_END_ALLOW_THREADS
#undef P
    return PyLong_FromLong(rc);
}

PY_READY(moecc_prompt_fp32_ready)

static PyMethodDef methods[] = {
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_FASTCALL,
     "attend(q, t, ldq, k, ldk, v, ldv, spans, ns, Hq, Hkv, D, Dv, scale, out, ldo, nthreads) -> 0, 1, 2 or 3"},
    PY_READY_METHOD,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prompt_fp32",
                                    "moecc's causal attention of fresh prompts in fp32 on AVX-512.", -1, methods};

PyMODINIT_FUNC PyInit__prompt_fp32(void) { return PyModule_Create(&module); }
