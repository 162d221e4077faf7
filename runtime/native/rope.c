/* Rotary position embedding on the host in one pass (torch runs it as four products, a sum, a
 * difference and a concatenation, each a pass over a step's [T, heads, D] queries and keys):
 *
 *   out[t, h, j]     = x[t, h, j] * cos[t, j]     - x[t, h, j + D/2] * sin[t, j]
 *   out[t, h, j+D/2] = x[t, h, j+D/2] * cos[t, j+D/2] + x[t, h, j] * sin[t, j+D/2]     j < D/2
 *
 * Legend: T rows (tokens), heads the heads rotated (queries and keys side by side), D the head
 * size; x any row and head strides (its last dimension contiguous), cos and sin [T, D] with one
 * row stride (the rope table's halves), out [T, heads, D] contiguous.
 *
 * The bits are kernels.apply_rope's (transformers' x * cos + rotate_half(x) * sin): each product
 * rounded to the dtype, then their sum or difference. Built without contracting a product and a
 * sum into one fused multiply-add (setup.py). bf16 or fp32, x, the table and out alike.
 *
 * Rows run on `nthreads` threads (row_items.h; torch's OpenMP team where one was handed over:
 * cpu.h). Its builds (AVX-512 and AVX2+FMA clones, baseline) are the same
 * plain loops and compute the same bits. Where the CPU has AVX512-BF16, bf16 rows round 16 lanes
 * at once with its conversion (vcvtneps2bf16: to nearest even, as bf16.h's f2bf, but subnormal
 * inputs taken as zero and NaN's payload kept), so a block of 16 in which any value it rounds is
 * subnormal or NaN runs the plain loop instead: the same bits either way, the integer rounding
 * (~1.6 cycles an element a thread) skipped where it is not needed. No torch headers: the
 * runtime passes data pointers (runtime/native/rope.py).
 */
#include <stdint.h>
#include <string.h>
#include <Python.h>

#include "bf16.h"
#include "cpu.h"
#include "bf16_lanes.h"
#include "row_items.h"
#include "py_args.h"


typedef struct {
    const void *x; int64_t xs_t, xs_h;  /* x [T, heads, D]: row and head strides (elements) */
    const void *cos, *sin; int64_t ts;   /* [T, D] each, one row stride */
    void *out;                           /* [T, heads, D] contiguous */
    int64_t T, heads, D;
    int dtype;
} Job;

/* One head's lanes [c0, c1) of its first and second halves (x1/x2, o1/o2 at its halves; cs/sn the
 * row's table), rounded in integer code (locals and restrict: loops the compiler vectorizes). */
static inline __attribute__((always_inline)) void rope_lanes_bf16(const uint16_t *restrict x1, const uint16_t *restrict x2,
                                                                  const uint16_t *restrict cs, const uint16_t *restrict sn,
                                                                  uint16_t *restrict o1, uint16_t *restrict o2, int64_t h2,
                                                                  int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c++)
        o1[c] = f2bf(bf_round(bf2f(x1[c]) * bf2f(cs[c])) - bf_round(bf2f(x2[c]) * bf2f(sn[c])));
    for (int64_t c = c0; c < c1; c++)
        o2[c] = f2bf(bf_round(bf2f(x2[c]) * bf2f(cs[h2 + c])) + bf_round(bf2f(x1[c]) * bf2f(sn[h2 + c])));
}

/* Row t, each head's first halves then its second. */
static inline __attribute__((always_inline)) void rope_row_bf16(const Job *j, int64_t t) {
    const int64_t h2 = j->D / 2, heads = j->heads, D = j->D, xs_h = j->xs_h;
    const uint16_t *cs = (const uint16_t *)j->cos + t * j->ts, *sn = (const uint16_t *)j->sin + t * j->ts;
    const uint16_t *xt = (const uint16_t *)j->x + t * j->xs_t;
    uint16_t *ot = (uint16_t *)j->out + t * heads * D;
    for (int64_t hd = 0; hd < heads; hd++)
        rope_lanes_bf16(xt + hd * xs_h, xt + hd * xs_h + h2, cs, sn, ot + hd * D, ot + hd * D + h2, h2, 0, h2);
}

static inline __attribute__((always_inline)) void rope_row_f32(const Job *j, int64_t t) {
    const int64_t h2 = j->D / 2, heads = j->heads, D = j->D, xs_h = j->xs_h;
    const float *restrict cs = (const float *)j->cos + t * j->ts, *restrict sn = (const float *)j->sin + t * j->ts;
    const float *xt = (const float *)j->x + t * j->xs_t;
    float *ot = (float *)j->out + t * heads * D;
    for (int64_t hd = 0; hd < heads; hd++) {
        const float *restrict x1 = xt + hd * xs_h, *restrict x2 = x1 + h2;
        float *restrict o1 = ot + hd * D, *restrict o2 = o1 + h2;
        for (int64_t c = 0; c < h2; c++) o1[c] = x1[c] * cs[c] - x2[c] * sn[c];
        for (int64_t c = 0; c < h2; c++) o2[c] = x2[c] * cs[h2 + c] + x1[c] * sn[h2 + c];
    }
}

/* Rows [r0, r1) of the job (row_items.h runs them on the threads); each build compiles it. */
#define ROWS_BODY                                                   \
    const Job *j = (const Job *)job;                                \
    for (int64_t t = r0; t < r1; t++) {                             \
        if (j->dtype == DT_BF16) rope_row_bf16(j, t);               \
        else rope_row_f32(j, t);                                    \
    }

ROW_ITEMS_BUILDS(ROWS_BODY)

#ifdef HAVE_AVX512BF16_CLONE
/* Rows [r0, r1) of a bf16 job, 16 lanes of a head's halves at a time; a block with a subnormal or
 * NaN value to round, and the lanes past the last full block, through rope_lanes_bf16. */
static BF16_TARGET void rows_bf16_fast(const void *job, int64_t r0, int64_t r1) {
    const Job *j = (const Job *)job;
    const int64_t h2 = j->D / 2, heads = j->heads, D = j->D;
    for (int64_t t = r0; t < r1; t++) {
        const uint16_t *cs = (const uint16_t *)j->cos + t * j->ts, *sn = (const uint16_t *)j->sin + t * j->ts;
        for (int64_t hd = 0; hd < heads; hd++) {
            const uint16_t *x1 = (const uint16_t *)j->x + t * j->xs_t + hd * j->xs_h, *x2 = x1 + h2;
            uint16_t *o1 = (uint16_t *)j->out + (t * heads + hd) * D, *o2 = o1 + h2;
            int64_t c = 0;
            for (; c + 16 <= h2; c += 16) {
                const __m512 a = widen16(x1 + c), b = widen16(x2 + c);
                const __m512 p1 = _mm512_mul_ps(a, widen16(cs + c)), p2 = _mm512_mul_ps(b, widen16(sn + c));
                const __m512 p3 = _mm512_mul_ps(b, widen16(cs + h2 + c)), p4 = _mm512_mul_ps(a, widen16(sn + h2 + c));
                const __m512 d = _mm512_sub_ps(round16(p1), round16(p2)), e = _mm512_add_ps(round16(p3), round16(p4));
                const __mmask16 odd = odd16(p1) | odd16(p2) | odd16(p3) | odd16(p4) | odd16(d) | odd16(e);
                if (__builtin_expect(odd != 0, 0)) {
                    rope_lanes_bf16(x1, x2, cs, sn, o1, o2, h2, c, c + 16);
                    continue;
                }
                _mm256_storeu_si256((void *)(o1 + c), narrow16(d));
                _mm256_storeu_si256((void *)(o2 + c), narrow16(e));
            }
            rope_lanes_bf16(x1, x2, cs, sn, o1, o2, h2, c, h2);
        }
    }
}
#endif

/* Returns 0, or 1 when the arguments are inconsistent (nothing written). */
int moecc_rope(const void *x, int64_t xs_t, int64_t xs_h, int64_t T, int64_t heads, int64_t D, const void *cos,
               const void *sin, int64_t ts, void *out, int dtype, int nthreads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || T < 0 || heads < 0 || D < 0 || D % 2 || ts < D) return 1;
    if (T == 0 || heads == 0 || D == 0) return 0;
    Job j = {x, xs_t, xs_h, cos, sin, ts, out, T, heads, D, dtype};
#ifdef HAVE_AVX512BF16_CLONE
    if (dtype == DT_BF16 && cpu_isa() >= ISA_AVX512BF16) {
        run_row_items(&j, rows_bf16_fast, NULL, rows_base, T, heads * D, nthreads);
        return 0;
    }
#endif
    run_row_items(&j, ROW_FNS, T, heads * D, nthreads);
    return 0;
}

/* rope(x, x_row_stride, x_head_stride, T, heads, D, cos, sin, cos_sin_row_stride, out, dtype, nthreads)
 * from Python (METH_FASTCALL, pointers as ints, the work without the GIL). */
static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[12];
    if (int_args(args, n, 12, "rope", 0, v)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_rope((const void *)(intptr_t)v[0], v[1], v[2], v[3], v[4], v[5], (const void *)(intptr_t)v[6],
                    (const void *)(intptr_t)v[7], v[8], (void *)(intptr_t)v[9], (int)v[10], (int)v[11]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL,
     "rope(x, x_row_stride, x_head_stride, T, heads, D, cos, sin, cos_sin_row_stride, out, dtype, nthreads) -> 0 or 1"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rope", "moecc's rotary position embedding on the host.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__rope(void) { return PyModule_Create(&module); }
