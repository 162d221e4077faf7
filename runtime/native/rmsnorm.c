/* transformers' RMSNorm on the host in one pass over each row (torch runs it as six: widen,
 * square, mean, add eps and rsqrt, scale, narrow, times the weight), optionally after the
 * residual add that makes its input (moecc_add_rmsnorm: a decoder layer's `x + attn` or
 * `x + mlp` then the next norm, in one pass while the row is in L1):
 *
 *   x[t, c]  = round(a[t, c] + b[t, c]), kept in sum   (moecc_add_rmsnorm only; torch's add)
 *   r        = 1 / sqrt(sum(x[t, :]^2) / H + eps)          in fp32
 *   out[t,c] = w[c] * round(x[t, c] * r)                   round: to x's dtype; the product too
 *
 * Legend: R rows (tokens, or tokens x heads for a per-head norm), H the normalised width; x (or
 * a, b and sum) any row stride (rows contiguous), w [H], out [R, H] contiguous; fp32 or bf16,
 * all alike.
 *
 * The bits are kernels._rmsnorm's: the sum of squares adds the rounded squares in the order of
 * torch's own inner sum (its cascade sum) over `lanes`-wide vectors (the width of torch's sum
 * kernel, which the caller finds; 1 for rows narrower than it, torch's scalar path): four
 * interleaved accumulators, cascaded every 16 groups of four vectors, the vectors past the last
 * group into the first, the four added in order; then the lanes one after another onto the sum of
 * the elements past the last vector. The mean divides by H; eps is added in fp32; 1/sqrt is exact
 * IEEE. Built without contracting a product and a sum into one fused multiply-add (setup.py).
 *
 * Rows run on `nthreads` threads (row_items.h; torch's OpenMP team where one was handed over:
 * cpu.h); the AVX-512 and AVX2+FMA clones and the baseline compute the same bits. No torch headers: the runtime
 * passes data pointers (runtime/native/rmsnorm.py).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <Python.h>

#include "bf16.h"
#include "cpu.h"
#include "row_items.h"
#include "py_args.h"

enum { ILP = 4, LEVELS = 4, MAX_LANES = 16 };

typedef struct {
    const void *x; int64_t xs;  /* x [R, H], row stride xs (elements); the add's a when b is set */
    const void *w;               /* [H] */
    void *out;                   /* [R, H] contiguous */
    int64_t R, H;
    float eps;
    int dtype, lanes;
    const void *b; int64_t bs;   /* the add's b [R, H] (NULL: no add), row stride bs */
    void *sum; int64_t ss;       /* the add's result [R, H], row stride ss */
} Job;

/* ceil(log2(n)), at least 1 (torch's utils::CeilLog2). */
static inline int64_t ceil_log2(int64_t n) {
    if (n <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = (uint64_t)(n - 1); v; v >>= 1) b++;
    return b;
}

/* acc[k][l] += sq[(g * ILP + k) * lanes + l]: one group of ILP vectors of squares. */
static inline __attribute__((always_inline)) void add_group(float acc[ILP][MAX_LANES], const float *sq, int64_t g,
                                                            int lanes) {
    for (int k = 0; k < ILP; k++) {
        const float *v = sq + (g * ILP + k) * lanes;
        for (int l = 0; l < lanes; l++) acc[k][l] += v[l];
    }
}

/* The sum of sq[0, H) in torch's inner-sum order (see the header). */
static inline __attribute__((always_inline)) float sum_squares(const float *sq, int64_t H, int lanes) {
    float acc[LEVELS][ILP][MAX_LANES];
    memset(acc, 0, sizeof acc);
    const int64_t nvec = H / lanes, groups = nvec / ILP;
    int64_t power = ceil_log2(groups) / LEVELS;
    power = power < 4 ? 4 : power;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t g = 0;
    while (g + step <= groups) {
        for (int64_t s = 0; s < step; s++, g++) add_group(acc[0], sq, g, lanes);
        for (int lv = 1; lv < LEVELS; lv++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) acc[lv][k][l] += acc[lv - 1][k][l], acc[lv - 1][k][l] = 0.f;
            if (g & (mask << (lv * power))) break;
        }
    }
    for (; g < groups; g++) add_group(acc[0], sq, g, lanes);
    for (int lv = 1; lv < LEVELS; lv++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[lv][k][l];
    for (int64_t v = groups * ILP; v < nvec; v++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += sq[v * lanes + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.f;
    for (int64_t c = nvec * lanes; c < H; c++) total += sq[c];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* Row t; `sq` [H] fp32 scratch (the rounded squares), `wide` [H] fp32 scratch (a bf16 row widened;
 * an fp32 row is read in place). */
static inline __attribute__((always_inline)) void norm_row(const Job *j, int64_t t, float *restrict sq,
                                                           float *restrict wide) {
    const int64_t H = j->H;
    const float *restrict xf = (const float *)j->x + t * j->xs;
    if (j->b) {  /* x = round(a + b), kept in sum and widened */
        if (j->dtype == DT_BF16) {
            const uint16_t *restrict a = (const uint16_t *)j->x + t * j->xs;
            const uint16_t *restrict b = (const uint16_t *)j->b + t * j->bs;
            uint16_t *restrict s = (uint16_t *)j->sum + t * j->ss;
            for (int64_t c = 0; c < H; c++) s[c] = f2bf(bf2f(a[c]) + bf2f(b[c])), wide[c] = bf2f(s[c]);
        } else {
            const float *restrict a = (const float *)j->x + t * j->xs, *restrict b = (const float *)j->b + t * j->bs;
            float *restrict s = (float *)j->sum + t * j->ss;
            for (int64_t c = 0; c < H; c++) s[c] = wide[c] = a[c] + b[c];
        }
        xf = wide;
    } else if (j->dtype == DT_BF16) {
        const uint16_t *restrict x = (const uint16_t *)j->x + t * j->xs;
        for (int64_t c = 0; c < H; c++) wide[c] = bf2f(x[c]);
        xf = wide;
    }
    for (int64_t c = 0; c < H; c++) sq[c] = xf[c] * xf[c];
    /* the width as a constant in each call: the lane loops become vector adds */
    const float total = j->lanes == 8 ? sum_squares(sq, H, 8) : j->lanes == 16 ? sum_squares(sq, H, 16)
                                                                               : sum_squares(sq, H, 1);
    const float mean = total / (float)H;
    const float r = 1.f / sqrtf(mean + j->eps);
    if (j->dtype == DT_BF16) {
        const uint16_t *restrict w = (const uint16_t *)j->w;
        uint16_t *restrict o = (uint16_t *)j->out + t * H;
        for (int64_t c = 0; c < H; c++) o[c] = f2bf(bf2f(w[c]) * bf_round(xf[c] * r));
    } else {
        const float *restrict w = (const float *)j->w;
        float *restrict o = (float *)j->out + t * H;
        for (int64_t c = 0; c < H; c++) o[c] = w[c] * (xf[c] * r);
    }
}

#define SCRATCH_H 16384 /* the widest row taken (moecc_rmsnorm refuses wider) */

/* Rows [r0, r1) of the job (row_items.h runs them on the threads); each build compiles it. */
#define ROWS_BODY                                                              \
    const Job *j = (const Job *)job;                                           \
    float sq[SCRATCH_H], wide[SCRATCH_H];                                      \
    for (int64_t t = r0; t < r1; t++) norm_row(j, t, sq, wide);

ROW_ITEMS_BUILDS(ROWS_BODY)

/* The job's rows on the threads. Returns 0, or 1 when the arguments are inconsistent or out of
 * range (nothing written). */
static int run_norm(Job *j, int nthreads) {
    if ((j->dtype != DT_F32 && j->dtype != DT_BF16) || j->R < 0 || j->H < 0 || j->H > SCRATCH_H || j->xs < j->H ||
        (j->b && (j->bs < j->H || j->ss < j->H)) || (j->lanes != 1 && j->lanes != 8 && j->lanes != 16))
        return 1;
    if (j->R == 0 || j->H == 0) return 0;
    run_row_items(j, ROW_FNS, j->R, j->H, nthreads);
    return 0;
}

int moecc_rmsnorm(const void *x, int64_t xs, int64_t R, int64_t H, const void *w, float eps, void *out, int dtype,
                  int lanes, int nthreads) {
    Job j = {x, xs, w, out, R, H, eps, dtype, lanes, NULL, 0, NULL, 0};
    return run_norm(&j, nthreads);
}

/* sum = round(a + b) (torch's add, same bits), then out = the norm of sum, as moecc_rmsnorm:
 * both written in one pass over each row. `sum` overlaps neither a nor b. */
int moecc_add_rmsnorm(const void *a, int64_t as, const void *b, int64_t bs, void *sum, int64_t ss, int64_t R,
                      int64_t H, const void *w, float eps, void *out, int dtype, int lanes, int nthreads) {
    Job j = {a, as, w, out, R, H, eps, dtype, lanes, b, bs, sum, ss};
    return b == NULL ? 1 : run_norm(&j, nthreads);
}

/* rmsnorm(x, x_row_stride, R, H, w, eps, out, dtype, lanes, nthreads) from Python (METH_FASTCALL,
 * pointers as ints, eps a float, the work without the GIL). */
static PyObject *py_rmsnorm(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[10];
    if (int_args(args, n, 10, "rmsnorm", 1u << 5, v)) return NULL;
    const double eps = PyFloat_AsDouble(args[5]);  /* the one float */
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_rmsnorm((const void *)(intptr_t)v[0], v[1], v[2], v[3], (const void *)(intptr_t)v[4], (float)eps,
                       (void *)(intptr_t)v[6], (int)v[7], (int)v[8], (int)v[9]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* add_rmsnorm(a, a_stride, b, b_stride, sum, sum_stride, R, H, w, eps, out, dtype, lanes, nthreads) from
 * Python, as py_rmsnorm. */
static PyObject *py_add_rmsnorm(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[14];
    if (int_args(args, n, 14, "add_rmsnorm", 1u << 9, v)) return NULL;
    const double eps = PyFloat_AsDouble(args[9]);  /* the one float */
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_add_rmsnorm((const void *)(intptr_t)v[0], v[1], (const void *)(intptr_t)v[2], v[3],
                           (void *)(intptr_t)v[4], v[5], v[6], v[7], (const void *)(intptr_t)v[8], (float)eps,
                           (void *)(intptr_t)v[10], (int)v[11], (int)v[12], (int)v[13]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"rmsnorm", (PyCFunction)(void (*)(void))py_rmsnorm, METH_FASTCALL,
     "rmsnorm(x, x_row_stride, R, H, w, eps, out, dtype, lanes, nthreads) -> 0 or 1"},
    {"add_rmsnorm", (PyCFunction)(void (*)(void))py_add_rmsnorm, METH_FASTCALL,
     "add_rmsnorm(a, a_stride, b, b_stride, sum, sum_stride, R, H, w, eps, out, dtype, lanes, nthreads) -> 0 or 1"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rmsnorm", "moecc's RMSNorm on the host.", -1, methods};

PyMODINIT_FUNC PyInit__rmsnorm(void) { return PyModule_Create(&module); }
