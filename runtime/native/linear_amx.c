/* A dense bf16 projection on a CPU with AMX (bf16 tiles), over the weight oneDNN packed for its
 * own GEMM (packed_weights.PackedLinear, read in place as expert_amx.c reads an expert's):
 *
 *   y[r, o] = bf16(x[r] . W[o])                                    r < M, o < N
 *
 * Legend: M rows, K inputs, N outputs; W [N, K] packed AB16b{nb}a2b (amx_gemm.h's tile_at); a
 * chunk: up to MAX_ROWS rows, copied as tiles (packed_at) into a scratch, Mp rows rounded up to 16.
 *
 * Rounding: each sum in fp32 over the inputs in order, 32 at a time (AMX's dot product), rounded
 * once to bf16: the bits of oneDNN's AMX GEMM where it does not split the inputs between threads
 * (where it does, as close to the exact product: tests/runtime/worker/test_linear_amx.py).
 *
 * Work, on torch's OpenMP team (cpu.h):
 * - up to MAX_ROWS rows (a decode step): one chunk, copied on row_items.h's threads, then its
 *   outputs split between the threads, each a contiguous run of the weight's nb-output units;
 * - more rows (a prefill step): the rows in chunks (amx_gemm.h's chunk_rows); each thread copies
 *   its own chunks into its own scratch and runs every output of each, so a chunk's tiles stay in
 *   its core's L2 and the threads meet once.
 * The next unit's weights are asked for a few lines at each step (amx_gemm.h's Pf); a slice's
 * 32 outputs of every row are stored while the next slice's tiles run (Epi), with streaming
 * stores where y is aligned for them: the output is read by the next op, not by this one, and
 * written without first reading its lines in (the lm_head's 8 MB at 512 rows: 2.4 ms in a job
 * against 5.9 with plain stores). Linux x86-64 with GCC 11 / Clang 12 or newer only; elsewhere
 * `moecc_linear_amx` returns 2 and the caller runs oneDNN's GEMM.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <Python.h>

#include "amx.h"
#include "amx_gemm.h"
#include "bf16.h"
#include "cpu.h"
#include "py_args.h"
#include "row_items.h"

#define MAX_ROWS 512  /* rows per chunk; 32 tiles of 16 */

typedef struct {
    const uint16_t *x; int64_t ldx;  /* [M, K] */
    int64_t M, K, N, rows;           /* rows: a chunk's (the last may have fewer) */
    const uint16_t *w; int nb;       /* [N, K] packed, NB */
    uint16_t *a;                     /* [nth or 1][MAX_ROWS/16, K/32, 16, 32] chunks as tiles, pad rows zero */
    uint16_t *y; int64_t ldy;        /* [M, N] */
    int nth, stream;                 /* threads; 1: streaming stores into y */
    int64_t next, taken;             /* the next run (or chunk) to hand out; threads started */
} Job;

/* A chunk in flight: rows [r0, r0 + n) of the job, as tiles in a ([mp, K]), its slice's rows
 * stored by store_rows. */
typedef struct { Job *j; uint16_t *a; int64_t r0, n, mp; } Chunk;

#ifdef HAVE_AMX
/* The chunk's rows [r0, r1) (of its Mp) as tiles in c->a, zero rows from n on. */
static inline void pack_chunk(const Chunk *c, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        pack_row(c->a, r, c->j->K, r < c->n ? c->j->x + (c->r0 + r) * c->j->ldx : NULL);
}

#define PACK_BODY pack_chunk((const Chunk *)job, r0, r1);

ROW_ITEMS_BUILDS(PACK_BODY)

/* Epi.rows: rows [r, upto) of the slice's 32 outputs, rounded to bf16, into y. */
AMX_TARGET static void store_rows(Epi *e, int64_t upto) {
    const Chunk *c = (const Chunk *)e->j;
    const Job *j = c->j;
    for (; e->r < upto; e->r++) {
        const int64_t m = e->r / 16, r = e->r % 16;
        __m256i *o = (__m256i *)(j->y + (c->r0 + e->r) * j->ldy + e->col);
        const __m256i lo = f2bf16(_mm512_load_ps(e->c0[m][0] + r * 16));
        const __m256i hi = f2bf16(_mm512_load_ps(e->c0[m][1] + r * 16));
        if (j->stream) _mm256_stream_si256(o, lo), _mm256_stream_si256(o + 1, hi);
        else _mm256_storeu_si256(o, lo), _mm256_storeu_si256(o + 1, hi);
    }
}

/* Each thread's C buffers: a slice's, and the previous slice's while its rows are stored. */
static __thread float c_out[2][MAX_ROWS / 16][2][256] __attribute__((aligned(64)));

/* The chunk's outputs of units [u0, u1) (nb outputs each, nb/32 slices of 32), every row. */
AMX_TARGET static void chunk_units(const Chunk *c, int64_t u0, int64_t u1) {
    const Job *j = c->j;
    const int64_t KB = j->K / 32, MT = c->mp / 16, pairs = (MT + 1) / 2;
    Epi e = {store_rows, c, NULL, NULL, 0, 0, 0, (c->n + pairs * KB - 1) / (pairs * KB)};
    float (*bufs[2])[2][256] = {c_out[0], c_out[1]};
    int b = 0;
    units_tiles(c->a, MT, j->w, j->K, j->nb, 0, u0, u1, c->n, &e, bufs, NULL, &b);
    epi_finish(&e);
}

/* One chunk (all the rows), its outputs split: each thread a contiguous run of units. */
AMX_TARGET static void *split_outputs(void *arg) {
    const Chunk *c = (const Chunk *)arg;
    Job *j = c->j;
    tiles_on();
    int64_t u0, u1;
    while (take_run(&j->next, j->nth, j->N / j->nb, &u0, &u1)) chunk_units(c, u0, u1);
    if (j->stream) _mm_sfence();
    _tile_release();
    return NULL;
}

/* The rows split: each thread takes whole chunks, copies each into its own scratch, and runs
 * every output of it. */
AMX_TARGET static void *split_rows(void *arg) {
    Job *j = (Job *)arg;
    tiles_on();
    const int64_t t = __atomic_fetch_add(&j->taken, 1, __ATOMIC_RELAXED);
    uint16_t *a = j->a + t * MAX_ROWS * j->K;  /* this thread's scratch */
    int64_t r0, n;
    while (take_chunk(&j->next, j->rows, j->M, &r0, &n)) {
        const Chunk c = {j, a, r0, n, (n + 15) / 16 * 16};
        pack_chunk(&c, 0, c.mp);
        chunk_units(&c, 0, j->N / j->nb);
    }
    if (j->stream) _mm_sfence();
    _tile_release();
    return NULL;
}
#endif

/* 1: this build and CPU run the kernel; 0: they do not. */
int moecc_linear_amx_ready(void) {
#ifdef HAVE_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* y = x . W^T for M rows: returns 0 (done), 1 (arguments it does not take: nothing written) or 2
 * (no AMX here). `a`: the caller's scratch of amx_gemm.py's `scratch_rows(M, nthreads)` rows of K. */
int moecc_linear_amx(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int64_t N, const uint16_t *w, int nb,
                     uint16_t *a, uint16_t *y, int64_t ldy, int nthreads) {
#ifdef HAVE_AMX
    if (!amx_ready()) return 2;
    if (M < 1 || K < 32 || K % 32 || nb % 32 || N < nb || N % nb || ldx < K || ldy < N) return 1;
    const int nth = nthreads < 1 ? 1 : nthreads;
    Job j = {x, ldx, M, K, N, M, w, nb, a, y, ldy, nth, (uintptr_t)y % 32 == 0 && ldy % 16 == 0, 0, 0};
    if (M <= MAX_ROWS || nth == 1) {  /* one chunk at a time, its outputs split */
        for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
            const int64_t n = M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS;
            const Chunk c = {&j, a, r0, n, (n + 15) / 16 * 16};
            j.next = 0;
            run_row_items(&c, ROW_FNS, c.mp, K, nth);
            run_threads(split_outputs, (void *)&c, nth, nth);
        }
        return 0;
    }
    j.rows = chunk_rows(M, nth, MAX_ROWS);
    run_threads(split_rows, &j, nth, nth);
    return 0;
#else
    (void)x, (void)ldx, (void)M, (void)K, (void)N, (void)w, (void)nb, (void)a, (void)y, (void)ldy, (void)nthreads;
    return 2;
#endif
}

/* Python entry (METH_FASTCALL, pointers as ints, the work without the GIL: py_args.h). */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[11];
    if (int_args(args, n, 11, "linear", 0, v)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_linear_amx((const uint16_t *)(intptr_t)v[0], v[1], v[2], v[3], v[4], (const uint16_t *)(intptr_t)v[5],
                          (int)v[6], (uint16_t *)(intptr_t)v[7], (uint16_t *)(intptr_t)v[8], v[9], (int)v[10]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

PY_READY(moecc_linear_amx_ready)

static PyMethodDef methods[] = {
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL,
     "linear(x, ldx, M, K, N, w, nb, a, y, ldy, nthreads) -> 0, 1 or 2"},
    PY_READY_METHOD,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_linear_amx",
                                    "moecc's dense bf16 projection on AMX tiles over oneDNN-packed weights.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__linear_amx(void) { return PyModule_Create(&module); }
