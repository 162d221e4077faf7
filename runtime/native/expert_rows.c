/* The element-wise passes around an expert's two GEMMs on the host, each one read of its inputs
 * and one write (torch runs each as two or three passes over memory, and an expert's rows
 * change every step, so the passes are many and small):
 *
 *   silu_mul:       h[r, j] = silu(gu[r, j]) * gu[r, I + j]             r < R, j < I  (bf16)
 *   scale_add_rows: out[rows[i], c] += w[i] * y[i, c]                  i < n, c < H  (fp32, bf16)
 *
 * Legend: R rows, I the intermediate size (gu is gate and up side by side, [R, 2I]), H hidden,
 * n rows routed to the expert, `rows` their tokens (distinct), w their routing weights (fp32).
 *
 * The results are torch's bits:
 *   silu_mul (bf16):  F.silu(g) * u, the silu rounded to bf16, then the product. A bf16 input
 *                     has 65,536 values, so the silu is a table the caller made with torch's own
 *                     F.silu (`lut`: each value's silu as fp32) and costs no exp.
 *   scale_add_rows:   y.mul_(w[:, None]) (the product in fp32, rounded to y's dtype), then
 *                     out.index_add_(0, rows, y) (the sum in fp32, rounded). Built without
 *                     contracting the two into a fused multiply-add (setup.py).
 * Rounding to bf16 is to nearest even; a NaN stays a NaN (its bits may differ from torch's).
 *
 * Rows run on `nthreads` threads (row_items.h; torch's OpenMP team where one was handed over:
 * cpu.h). Its builds (AVX-512 and AVX2+FMA clones, baseline) are
 * the same plain loops and compute the same bits. No torch headers: the runtime passes data
 * pointers (runtime/native/expert_rows.py).
 */
#include <stdint.h>
#include <string.h>
#include <Python.h>

#include "bf16.h"
#include "cpu.h"
#include "row_items.h"
#include "py_args.h"


typedef struct {
    int op;                          /* 0: silu_mul, 1: scale_add_rows */
    const void *a; int64_t lda;      /* silu_mul: gu [R, 2I]; scale_add_rows: y [n, H] (row strides) */
    void *out; int64_t ldo;          /* silu_mul: h [R, I]; scale_add_rows: out [*, H] */
    const int64_t *rows;             /* scale_add_rows: n distinct rows of out */
    const float *w;                  /* scale_add_rows: [n] */
    const float *lut;                /* silu_mul: [65536] silu of every bf16 value, rounded to bf16 */
    int64_t R, C;                    /* rows, columns (I or H) */
    int dtype;
} Job;

/* Row r of the job: plain loops the compiler vectorizes (gathers for the table on AVX2). */
static inline __attribute__((always_inline)) void silu_mul_row(const Job *j, int64_t r) {
    const uint16_t *g = (const uint16_t *)j->a + r * j->lda, *u = g + j->C;
    uint16_t *h = (uint16_t *)j->out + r * j->ldo;
    const float *lut = j->lut;
    for (int64_t c = 0; c < j->C; c++) h[c] = f2bf(lut[g[c]] * bf2f(u[c]));
}

static inline __attribute__((always_inline)) void scale_add_row(const Job *j, int64_t r) {
    const float wr = j->w[r];
    if (j->dtype == DT_BF16) {
        const uint16_t *y = (const uint16_t *)j->a + r * j->lda;
        uint16_t *o = (uint16_t *)j->out + j->rows[r] * j->ldo;
        for (int64_t c = 0; c < j->C; c++) o[c] = f2bf(bf2f(o[c]) + bf_round(bf2f(y[c]) * wr));
    } else {
        const float *y = (const float *)j->a + r * j->lda;
        float *o = (float *)j->out + j->rows[r] * j->ldo;
        for (int64_t c = 0; c < j->C; c++) o[c] = o[c] + y[c] * wr;  /* two roundings: built without contraction */
    }
}

/* Rows [r0, r1) of the job (row_items.h runs them on the threads); each build compiles it. */
#define ROWS_BODY                                                 \
    const Job *j = (const Job *)job;                              \
    for (int64_t r = r0; r < r1; r++) {                           \
        if (j->op == 0) silu_mul_row(j, r);                       \
        else scale_add_row(j, r);                                 \
    }

ROW_ITEMS_BUILDS(ROWS_BODY)

/* bf16 only. Returns 0, or 1 when the arguments are inconsistent (nothing written). */
int moecc_silu_mul(const void *gu, int64_t ldg, int64_t R, int64_t I, void *h, int64_t ldh, const float *lut,
                   int nthreads) {
    if (R < 0 || I < 0 || ldg < 2 * I || ldh < I || !lut) return 1;
    Job j = {0, gu, ldg, h, ldh, NULL, NULL, lut, R, I, DT_BF16};
    /* no AVX-512 clone here: its 16-lane table gathers ran slower than AVX2's 8 (38 against
     * 31 us at 128 x 1152 rows, Xeon with AVX-512) */
    run_row_items(&j, NULL, rows_avx2, rows_base, R, I, nthreads);
    return 0;
}

int moecc_scale_add_rows(void *out, int64_t ldo, const int64_t *rows, int64_t n, const void *y, int64_t ldy,
                         const float *w, int64_t H, int dtype, int nthreads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || n < 0 || H < 0 || ldy < H || ldo < H) return 1;
    Job j = {1, y, ldy, out, ldo, rows, w, NULL, n, H, dtype};
    run_row_items(&j, ROW_FNS, n, H, nthreads);
    return 0;
}

/* Python entries (METH_FASTCALL, pointers as ints, the work without the GIL: py_args.h): no
 * ctypes conversions, since a decode step makes two calls per expert. */
static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[8];
    if (int_args(args, n, 8, "silu_mul", 0, v)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_silu_mul((const void *)(intptr_t)v[0], v[1], v[2], v[3], (void *)(intptr_t)v[4], v[5],
                        (const float *)(intptr_t)v[6], (int)v[7]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_scale_add_rows(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[10];
    if (int_args(args, n, 10, "scale_add_rows", 0, v)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_scale_add_rows((void *)(intptr_t)v[0], v[1], (const int64_t *)(intptr_t)v[2], v[3],
                              (const void *)(intptr_t)v[4], v[5], (const float *)(intptr_t)v[6], v[7], (int)v[8],
                              (int)v[9]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL,
     "silu_mul(gu, gu_row_stride, R, I, h, h_row_stride, lut, nthreads) -> 0 or 1 (inconsistent arguments); bf16"},
    {"scale_add_rows", (PyCFunction)(void (*)(void))py_scale_add_rows, METH_FASTCALL,
     "scale_add_rows(out, out_row_stride, rows, n, y, y_row_stride, w, H, dtype, nthreads) -> 0 or 1"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_expert_rows",
                                    "moecc's fused element-wise passes around an expert's GEMMs on the host.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__expert_rows(void) { return PyModule_Create(&module); }
