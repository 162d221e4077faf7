/* A layer's routed experts' gated MLPs in fp32 on AVX-512 FMA, in one call:
 *
 *   h[r, j]         = silu(x[tok[r]] . G[j]) * (x[tok[r]] . U[j])     j < I   (gate and up, one pass)
 *   out[tok[r], c] += (h[r] . D[c]) * tw[r]                             c < H   (down, added in place)
 *
 * Legend: H hidden, I intermediate, r < n the rows routed to one expert (tok: their distinct
 * tokens, tw: their routing weights), G/U the gate and up halves of the stacked [2I, H] weight,
 * D the [H, I] down weight; every value fp32.
 *
 * The weights are read as oneDNN packed them for its own fp32 GEMM on an AVX-512 CPU
 * (packed_weights.PackedLinear: blocks of 64 outputs, inside a block [K inputs][64 outputs]),
 * so no second copy exists; expert_fp32.py checks that layout on a probe weight first. The rows
 * are read from x in place through tok (no gather pass).
 *
 * Arithmetic: each output an fp32 sum over its inputs in input order by fused multiply-adds (the
 * order oneDNN's kernel keeps where it does not split the inputs); silu(g) = g / (1 + exp(-g))
 * with exp to ~1 ulp (torch's exp is Sleef's: the two may differ in the last place); the down
 * row times tw, rounded, then added to out, rounded (kernels._run_experts' mul_ and index_add_,
 * in expert order). Built without contracting a multiply and an add outside the products.
 *
 * Work: experts one after another (slots sorted by expert_slots.h), each expert's rows in parts
 * of MAX_ROWS, each part two passes on torch's OpenMP team (cpu.h): gate/up by units of 64
 * outputs of each half (the gate's block, its sums kept in h, then the up's block, h = silu(gate)
 * * up), down by units of 64 outputs; each thread a contiguous run of units. A block runs its rows
 * MR at a time with MR x 4 accumulators in registers over all its inputs, its rows streamed
 * whole from L2 for each group of rows after the first (1.05-1.08x over reading gate's and up's
 * half blocks side by side), and asks for the next block's weights a few lines at each input
 * step; a down block's group asks for the next group's out lines before its products (out's rows
 * are the routed tokens', scattered: 1.00-1.04x a layer at 2,048-8,192 tokens). Linux/x86-64 with
 * GCC 7 / Clang 6 or newer (the AVX-512 target attribute); elsewhere, or on a CPU without AVX-512,
 * the call returns 2 and the caller runs torch's path.
 */
#include <stdint.h>
#include <Python.h>

#include "cpu.h"
#include "exp16.h"
#include "expert_slots.h"
#include "py_args.h"

#define MAX_ROWS 512  /* rows of an expert per part (h's scratch holds one part) */
#define MR 6          /* rows a register tile: 6 x 4 accumulators, 4 weight vectors, a broadcast */
#define NB 64         /* outputs of a packed weight block */

typedef struct {
    const float *x; int64_t ldx;          /* [T, H] */
    const int64_t *tok; const float *tw;  /* [n] each */
    int64_t n, H, I;
    const float *gu, *dn;                 /* [2I, H] and [H, I] packed: [N/64][K][64] */
    float *h;                             /* [n, I] */
    float *out; int64_t ldo;              /* [T, H] */
    int nth; int64_t next;                /* threads; the next thread index to hand out */
} Job;

#if defined(HAVE_AVX512_CLONE) && defined(__linux__)
#define HAVE_FP32_KERNEL 1
#include <immintrin.h>
#define FP32_TARGET __attribute__((target(AVX512_TARGET)))
#define FP32_INLINE FP32_TARGET __attribute__((always_inline)) static inline

/* The next run of a pass's `items` units for this thread (cpu.h's take_run over j->nth runs). */
static int next_run(Job *j, int64_t items, int64_t *lo, int64_t *hi) {
    return take_run(&j->next, j->nth, items, lo, hi);
}

/* The next block's weights (`lines` lines, contiguous), asked for while a block runs: each group
 * of rows asks for its share of them, `per` lines at each of its input steps. */
typedef struct { const char *p; int64_t lines, share; int per; } Pf;

/* The prefetch of block `next` (NULL: none, else K rows of 4 lines) while a block runs over its
 * K inputs in `groups` groups of rows. */
static Pf pf_block(const float *next, int64_t K, int64_t groups) {
    Pf f = {(const char *)next, next ? 4 * K : 0, 0, 0};
    f.share = (f.lines + groups - 1) / groups;
    f.per = (int)((f.share + K - 1) / K);
    return f;
}

/* silu(g) * u on 16 lanes: g / (1 + exp(-g)), rounded, times u, rounded. */
FP32_INLINE __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

/* acc[r] = a[r] . W over K inputs for rows r < mr, 64 outputs: W a packed block (its rows NB
 * floats apart, each 4 lines), its four vectors loaded once an input for all rows; this group's
 * share of the next block's lines asked for on the way (Pf). */
FP32_INLINE void block_rows(const float *const *a, const int mr, int64_t K, const float *W, const Pf *pf,
                            int64_t group, __m512 acc[MR][4]) {
    int64_t li = group * pf->share;
    const int64_t end = li + pf->share < pf->lines ? li + pf->share : pf->lines;
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        for (int q = 0; q < pf->per && li < end; q++, li++) _mm_prefetch(pf->p + li * 64, _MM_HINT_T1);
        const __m512 w0 = _mm512_loadu_ps(W + k * NB), w1 = _mm512_loadu_ps(W + k * NB + 16);
        const __m512 w2 = _mm512_loadu_ps(W + k * NB + 32), w3 = _mm512_loadu_ps(W + k * NB + 48);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m512 v = _mm512_set1_ps(a[r][k]);
            acc[r][0] = _mm512_fmadd_ps(v, w0, acc[r][0]), acc[r][1] = _mm512_fmadd_ps(v, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(v, w2, acc[r][2]), acc[r][3] = _mm512_fmadd_ps(v, w3, acc[r][3]);
        }
    }
}

/* Rows r0.. r0+mr of a gate or up block (outputs c0 .. c0+64 of its half): the gate's sums
 * stored into h, then the up's combined with them, h = silu(gate) * up. */
FP32_INLINE void gu_rows(const Job *j, int64_t r0, const int mr, const float *W, int64_t c0, int up, const Pf *pf) {
    const float *a[MR];
    __m512 acc[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) a[r] = j->x + j->tok[r0 + r] * j->ldx;
    block_rows(a, mr, j->H, W, pf, r0 / MR, acc);
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        float *hr = j->h + (r0 + r) * j->I + c0;
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            _mm512_storeu_ps(hr + 16 * v, up ? silu_mul16(_mm512_loadu_ps(hr + 16 * v), acc[r][v]) : acc[r][v]);
    }
}

/* Rows r0.. r0+mr of a down block: out[tok[r], c0 .. c0+64) += (h[r] . D) * tw[r]. */
FP32_INLINE void dn_rows(const Job *j, int64_t r0, const int mr, const float *D, int64_t c0, const Pf *pf) {
    const float *a[MR];
    __m512 acc[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) a[r] = j->h + (r0 + r) * j->I;
    for (int64_t r = r0 + MR; r < r0 + 2 * MR && r < j->n; r++)  /* the next group's out lines (scattered rows) */
        for (int v = 0; v < 4; v++) _mm_prefetch((const char *)(j->out + j->tok[r] * j->ldo + c0 + 16 * v), _MM_HINT_T0);
    block_rows(a, mr, j->I, D, pf, r0 / MR, acc);
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        const __m512 w = _mm512_set1_ps(j->tw[r0 + r]);
        float *o = j->out + j->tok[r0 + r] * j->ldo + c0;
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            _mm512_storeu_ps(o + 16 * v, _mm512_add_ps(_mm512_loadu_ps(o + 16 * v), _mm512_mul_ps(acc[r][v], w)));
    }
}

/* The unit's rows MR at a time, the last group's `n % MR` by its own (constant) count. */
#define ROW_GROUPS(CALL)                                                              \
    for (int64_t r0 = 0; r0 < j->n; r0 += MR) {                                       \
        switch (j->n - r0 < MR ? (int)(j->n - r0) : MR) {                             \
            case 1: CALL(1); break;                                                   \
            case 2: CALL(2); break;                                                   \
            case 3: CALL(3); break;                                                   \
            case 4: CALL(4); break;                                                   \
            case 5: CALL(5); break;                                                   \
            default: CALL(6); break;                                                  \
        }                                                                             \
    }

/* Gate and up by units of 64 outputs of each half: the gate block u (outputs 64u ..), then the
 * up block I/64 + u (outputs I + 64u ..), each asking for the next one's lines. */
FP32_TARGET static void *gate_up(void *arg) {
    Job *j = (Job *)arg;
    const int64_t H = j->H, half = j->I / NB, groups = (j->n + MR - 1) / MR;
    int64_t u0, u1;
    while (next_run(j, half, &u0, &u1))
        for (int64_t u = u0; u < u1; u++)
            for (int up = 0; up < 2; up++) {
                const float *W = j->gu + (up * half + u) * H * NB;
                const float *next = !up ? W + half * H * NB : u + 1 < u1 ? j->gu + (u + 1) * H * NB : NULL;
                const Pf pf = pf_block(next, H, groups);
#define GU(m) gu_rows(j, r0, m, W, NB * u, up, &pf)
                ROW_GROUPS(GU)
#undef GU
            }
    return NULL;
}

/* Down by units of 64 outputs (one packed block). */
FP32_TARGET static void *down(void *arg) {
    Job *j = (Job *)arg;
    const int64_t I = j->I, groups = (j->n + MR - 1) / MR;
    int64_t u0, u1;
    while (next_run(j, j->H / NB, &u0, &u1))
        for (int64_t u = u0; u < u1; u++) {
            const float *D = j->dn + u * I * NB;
            const Pf pf = pf_block(u + 1 < u1 ? D + I * NB : NULL, I, groups);
#define DN(m) dn_rows(j, r0, m, D, NB * u, &pf)
            ROW_GROUPS(DN)
#undef DN
        }
    return NULL;
}
#endif

/* 1: this build and CPU run the kernel; 0: they do not. */
int moecc_expert_fp32_ready(void) {
#ifdef HAVE_FP32_KERNEL
    return cpu_isa() >= ISA_AVX512;
#else
    return 0;
#endif
}

/* Every routed expert of a layer in one call: the T*k slots sorted by expert into tok/tw ([T*k]
 * scratch), then each expert in order, its rows in parts of MAX_ROWS, each part its two passes.
 * gu/dn [E]: each expert's packed weights (0 for one no slot names); h scratch for
 * min(most rows of an expert, MAX_ROWS) rows. Returns 0, 1 (arguments it does not take, nothing
 * written: an index outside [0, E), a named expert without weights, sizes) or 2 (not here). */
int moecc_expert_fp32_layer(const float *x, int64_t ldx, int64_t T, int64_t k, const int64_t *top_i,
                            const float *top_w, int64_t E, const int64_t *gu, const int64_t *dn, int64_t H, int64_t I,
                            int64_t *tok, float *tw, float *h, float *out, int64_t ldo, int nthreads) {
#ifdef HAVE_FP32_KERNEL
    if (!moecc_expert_fp32_ready()) return 2;
    if (T < 1 || k < 1 || E < 1 || E > MAX_EXPERTS || H % NB || I % NB || ldx < H || ldo < H) return 1;
    int64_t at[E];
    if (sort_slots(T, k, top_i, top_w, E, gu, dn, at, tok, tw, NULL)) return 1;
    const int nth = nthreads < 1 ? 1 : nthreads;
    for (int64_t e = 0, lo = 0; e < E; lo = at[e++])
        for (int64_t r = lo; r < at[e]; r += MAX_ROWS) {
            const int64_t n = at[e] - r < MAX_ROWS ? at[e] - r : MAX_ROWS;
            Job j = {x, ldx, tok + r, tw + r, n, H, I, (const float *)(intptr_t)gu[e], (const float *)(intptr_t)dn[e],
                     h, out, ldo, nth, 0};
            run_threads(gate_up, &j, nth, I / NB);
            j.next = 0;
            run_threads(down, &j, nth, H / NB);
        }
    return 0;
#else
    (void)x, (void)ldx, (void)T, (void)k, (void)top_i, (void)top_w, (void)E, (void)gu, (void)dn, (void)H, (void)I;
    (void)tok, (void)tw, (void)h, (void)out, (void)ldo, (void)nthreads;
    return 2;
#endif
}

/* Python entries (METH_FASTCALL, pointers as ints, the work without the GIL: py_args.h). */
static PyObject *py_layer(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[17];
    if (int_args(args, n, 17, "layer", 0, v)) return NULL;
    int rc;
#define P(i, type) ((type)(intptr_t)v[i])
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_expert_fp32_layer(P(0, const float *), v[1], v[2], v[3], P(4, const int64_t *), P(5, const float *),
                                 v[6], P(7, const int64_t *), P(8, const int64_t *), v[9], v[10], P(11, int64_t *),
                                 P(12, float *), P(13, float *), P(14, float *), v[15], (int)v[16]);
    Py_END_ALLOW_THREADS
#undef P
    return PyLong_FromLong(rc);
}

PY_READY(moecc_expert_fp32_ready)

static PyMethodDef methods[] = {
    {"layer", (PyCFunction)(void (*)(void))py_layer, METH_FASTCALL,
     "layer(x, ldx, T, k, top_i, top_w, E, gu[E], down[E], H, I, tok, tw, h, out, ldo, nthreads) -> 0, 1 or 2"},
    PY_READY_METHOD,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_expert_fp32",
                                    "moecc's routed experts of a layer in fp32 on AVX-512 over oneDNN-packed weights.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__expert_fp32(void) { return PyModule_Create(&module); }
