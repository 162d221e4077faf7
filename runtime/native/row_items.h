/* A job's R rows on n threads for the plain-loop kernels (expert_rows.c, rope.c): items of whole
 * rows (at least MIN_ITEM_ELEMS outputs each) taken from an atomic counter; each item runs the
 * kernel's AVX2+FMA clone where the CPU has it (cpu.h), else its baseline build. Include after
 * cpu.h. Header-only. */
#ifndef MOECC_ROW_ITEMS_H
#define MOECC_ROW_ITEMS_H

#include <stdint.h>

#define MIN_ITEM_ELEMS 16384

typedef void (*rows_fn)(const void *job, int64_t r0, int64_t r1);

typedef struct {
    const void *job;
    rows_fn avx2, base;  /* avx2: NULL where this compiler made no clone */
    int64_t R, per_item, items, next;
} RowItems;

static void *row_items_worker(void *arg) {
    RowItems *it = (RowItems *)arg;
    const rows_fn fn = it->avx2 && use_avx2() ? it->avx2 : it->base;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&it->next, 1, __ATOMIC_RELAXED);
        if (item >= it->items) break;
        const int64_t r0 = item * it->per_item, r1 = r0 + it->per_item < it->R ? r0 + it->per_item : it->R;
        fn(it->job, r0, r1);
    }
    return NULL;
}

/* The two builds run_row_items picks between, `static void rows_avx2 / rows_base(const void *job,
 * int64_t r0, int64_t r1)`, from one BODY that sees job, r0 and r1 (rows_avx2 a null rows_fn
 * where this compiler makes no AVX2 clone). */
#ifdef HAVE_AVX2_CLONE
#define ROW_ITEMS_BUILDS(BODY)                                                                                  \
    __attribute__((target("avx2,fma"))) static void rows_avx2(const void *job, int64_t r0, int64_t r1) { BODY } \
    static void rows_base(const void *job, int64_t r0, int64_t r1) { BODY }
#else
#define ROW_ITEMS_BUILDS(BODY)                                                                                  \
    static const rows_fn rows_avx2 = NULL;                                                                      \
    static void rows_base(const void *job, int64_t r0, int64_t r1) { BODY }
#endif

/* fn(job, r0, r1) over rows [0, R) of `row_elems` outputs each, on `nthreads` threads; returns
 * when all rows are done. */
static void run_row_items(const void *job, rows_fn avx2, rows_fn base, int64_t R, int64_t row_elems, int nthreads) {
    if (R <= 0 || row_elems <= 0) return;
    RowItems it = {job, avx2, base, R, 0, 0, 0};
    it.per_item = row_elems >= MIN_ITEM_ELEMS ? 1 : (MIN_ITEM_ELEMS + row_elems - 1) / row_elems;
    it.items = (R + it.per_item - 1) / it.per_item;
    run_threads(row_items_worker, &it, nthreads, it.items);
}

#endif
