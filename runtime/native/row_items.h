/* A job's R rows on n threads for the plain-loop kernels (expert_rows.c, rope.c, rmsnorm.c,
 * sample_rows.c, expert_amx.c's gather): items of whole rows (at least MIN_ITEM_ELEMS outputs
 * each) taken from an atomic counter; each item runs the kernel's AVX-512 clone where the CPU
 * has it (cpu.h's cpu_isa), else its AVX2+FMA clone, else its baseline build. The clones are the
 * same C compiled for wider vectors: each element's operations and each sum's order are the
 * source's, so all three compute the same bits (the fused-multiply-add contraction, where a
 * file allows it, is the same for both FMA targets). Include after cpu.h. Header-only. */
#ifndef MOECC_ROW_ITEMS_H
#define MOECC_ROW_ITEMS_H

#include <stdint.h>

#define MIN_ITEM_ELEMS 16384

typedef void (*rows_fn)(const void *job, int64_t r0, int64_t r1);

typedef struct {
    const void *job;
    rows_fn avx512, avx2, base;  /* avx512, avx2: NULL where this compiler made no such clone */
    int64_t R, per_item, items, next;
} RowItems;

static void *row_items_worker(void *arg) {
    RowItems *it = (RowItems *)arg;
    const rows_fn fn = it->avx512 && cpu_isa() >= ISA_AVX512 ? it->avx512 : it->avx2 && use_avx2() ? it->avx2 : it->base;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&it->next, 1, __ATOMIC_RELAXED);
        if (item >= it->items) break;
        const int64_t r0 = item * it->per_item, r1 = r0 + it->per_item < it->R ? r0 + it->per_item : it->R;
        fn(it->job, r0, r1);
    }
    return NULL;
}

/* The builds run_row_items picks among, `static void rows_avx512 / rows_avx2 / rows_base(const
 * void *job, int64_t r0, int64_t r1)`, from one BODY that sees job, r0 and r1 (ROW_FNS names
 * them in run_row_items' order; a clone this compiler cannot make is a null rows_fn). */
#ifdef HAVE_AVX512_CLONE
#define ROW_ITEMS_AVX512(...) \
    __attribute__((target(AVX512_TARGET))) static void rows_avx512(const void *job, int64_t r0, int64_t r1) { __VA_ARGS__ }
#else
#define ROW_ITEMS_AVX512(...) static const rows_fn rows_avx512 = NULL;
#endif
#ifdef HAVE_AVX2_CLONE
#define ROW_ITEMS_BUILDS(BODY)                                                                                  \
    ROW_ITEMS_AVX512(BODY)                                                                                      \
    __attribute__((target("avx2,fma"))) static void rows_avx2(const void *job, int64_t r0, int64_t r1) { BODY } \
    static void rows_base(const void *job, int64_t r0, int64_t r1) { BODY }
#else
#define ROW_ITEMS_BUILDS(BODY)                                                                                  \
    static const rows_fn rows_avx512 = NULL;                                                                    \
    static const rows_fn rows_avx2 = NULL;                                                                      \
    static void rows_base(const void *job, int64_t r0, int64_t r1) { BODY }
#endif
#define ROW_FNS rows_avx512, rows_avx2, rows_base

/* fn(job, r0, r1) over rows [0, R) of `row_elems` outputs each, on `nthreads` threads; returns
 * when all rows are done. */
static void run_row_items(const void *job, rows_fn avx512, rows_fn avx2, rows_fn base, int64_t R, int64_t row_elems,
                          int nthreads) {
    if (R <= 0 || row_elems <= 0) return;
    RowItems it = {job, avx512, avx2, base, R, 0, 0, 0};
    it.per_item = row_elems >= MIN_ITEM_ELEMS ? 1 : (MIN_ITEM_ELEMS + row_elems - 1) / row_elems;
    it.items = (R + it.per_item - 1) / it.per_item;
    run_threads(row_items_worker, &it, nthreads, it.items);
}

#endif
