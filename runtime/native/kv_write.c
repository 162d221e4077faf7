/* A step's new K or V rows scattered into the paged KV pool in place:
 *
 *   pool[h, blocks[i], offsets[i], :] = src[i, h, :]      i < n, h < Hkv
 *
 * Legend: n positions written this step, Hkv KV heads, `row` the bytes of one head's row (D
 * elements of the pool's dtype; src has the same dtype: a copy of bytes, no rounding). Strides
 * are in bytes. Replaces torch's advanced-index assignment (`pool[:, blocks, offsets] = src`),
 * whose index machinery costs ~0.25 ms a layer at 512 decode rows for ~200 KB of copies.
 * Nothing is written unless every block and offset lies inside the pool. The copies are
 * latency-bound (each row a cold line of the pool), so they run on torch's threads (row_items.h),
 * each asking for its rows' lines a few positions ahead.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <Python.h>

#include "cpu.h"
#include "py_args.h"
#include "row_items.h"

#define AHEAD 8  /* positions between a row's prefetch and its copy: the pool's lines are cold */

typedef struct {
    char *pool; int64_t head_stride, block_stride, pos_stride;
    const int64_t *blocks, *offsets;
    const char *src; int64_t src_row, src_head;
    int64_t Hkv, row;
} Job;

/* Positions [r0, r1) of the job (row_items.h runs them on the threads): each head's row copied,
 * the destination lines of the position AHEAD on asked for first. */
static void copy_rows(const void *job, int64_t r0, int64_t r1) {
    const Job *j = (const Job *)job;
    for (int64_t i = r0; i < r1; i++) {
        if (i + AHEAD < r1) {
            const char *next = j->pool + j->blocks[i + AHEAD] * j->block_stride + j->offsets[i + AHEAD] * j->pos_stride;
            for (int64_t h = 0; h < j->Hkv; h++)
                for (int64_t b = 0; b < j->row; b += 64) __builtin_prefetch(next + h * j->head_stride + b, 1);
        }
        char *dst = j->pool + j->blocks[i] * j->block_stride + j->offsets[i] * j->pos_stride;
        const char *s = j->src + i * j->src_row;
        for (int64_t h = 0; h < j->Hkv; h++) memcpy(dst + h * j->head_stride, s + h * j->src_head, (size_t)j->row);
    }
}

/* Returns 0, or 1 (a block or offset outside [0, nblocks) x [0, bs), or sizes out of range:
 * nothing written). */
int moecc_kv_write(char *pool, int64_t head_stride, int64_t block_stride, int64_t pos_stride, int64_t nblocks,
                   int64_t bs, const int64_t *blocks, const int64_t *offsets, const char *src, int64_t src_row,
                   int64_t src_head, int64_t n, int64_t Hkv, int64_t row, int nthreads) {
    if (n < 0 || Hkv < 0 || row < 0) return 1;
    for (int64_t i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= nblocks || offsets[i] < 0 || offsets[i] >= bs) return 1;
    Job j = {pool, head_stride, block_stride, pos_stride, blocks, offsets, src, src_row, src_head, Hkv, row};
    run_row_items(&j, NULL, NULL, copy_rows, n, Hkv * row / 2, nthreads);  /* a row's size in 2-byte units: the grain */
    return 0;
}

/* kv_write(pool, head_stride, block_stride, pos_stride, nblocks, bs, blocks, offsets, src, src_row_stride,
 * src_head_stride, n, Hkv, row_bytes, nthreads) from Python (METH_FASTCALL, pointers as ints, without the GIL). */
static PyObject *py_kv_write(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[15];
    if (int_args(args, n, 15, "kv_write", 0, v)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_kv_write((char *)(intptr_t)v[0], v[1], v[2], v[3], v[4], v[5], (const int64_t *)(intptr_t)v[6],
                        (const int64_t *)(intptr_t)v[7], (const char *)(intptr_t)v[8], v[9], v[10], v[11], v[12],
                        v[13], (int)v[14]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"kv_write", (PyCFunction)(void (*)(void))py_kv_write, METH_FASTCALL,
     "kv_write(pool, head_stride, block_stride, pos_stride, nblocks, bs, blocks, offsets, src, src_row_stride, "
     "src_head_stride, n, Hkv, row_bytes, nthreads) -> 0 or 1"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kv_write",
                                    "moecc's scatter of a step's K/V rows into the paged pool on the host.", -1, methods};

PyMODINIT_FUNC PyInit__kv_write(void) { return PyModule_Create(&module); }
