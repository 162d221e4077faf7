/* What the fresh-prompt kernels (prompt_amx.c, prompt_fp32.c) share about their prompts and work
 * items: spans [lo, hi) of rows, [ns, 2] int64, each a prompt's whole context; items s * m + c
 * (prompt s, its part c < m), the longest prompts first. Header-only; needs _GNU_SOURCE (qsort_r)
 * before the first system include. */
#ifndef MOECC_PROMPT_ITEMS_H
#define MOECC_PROMPT_ITEMS_H

#include <stdint.h>
#include <stdlib.h>

#define SPAN_N_RAW(sp, s) ((sp)[2 * (s) + 1] - (sp)[2 * (s)])

/* 1 when every span is rows [lo, hi) with 0 <= lo < hi <= t (*maxn: the most rows), else 0. */
static inline int spans_ok(const int64_t *spans, int64_t ns, int64_t t, int64_t *maxn) {
    *maxn = 0;
    for (int64_t s = 0; s < ns; s++) {
        if (SPAN_N_RAW(spans, s) < 1 || spans[2 * s] < 0 || spans[2 * s + 1] > t) return 0;
        *maxn = SPAN_N_RAW(spans, s) > *maxn ? SPAN_N_RAW(spans, s) : *maxn;
    }
    return 1;
}

/* 1 when both prompt kernels take these sizes and spans: ns >= 1 prompts, Hq a multiple of Hkv,
 * head dims multiples of 16, rows at least as wide as their heads, spans as spans_ok (*maxn: the
 * most rows); else 0 (the caller returns 1, nothing written). */
static inline int prompt_args_ok(const int64_t *spans, int64_t ns, int64_t t, int64_t Hq, int64_t Hkv, int64_t D,
                                 int64_t Dv, int64_t ldq, int64_t ldk, int64_t ldv, int64_t ldo, int64_t *maxn) {
    if (ns < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv || D % 16 || Dv % 16 || D < 16 || Dv < 16 || ldq < Hq * D ||
        ldk < Hkv * D || ldv < Hkv * Dv || ldo < Hq * Dv)
        return 0;
    return spans_ok(spans, ns, t, maxn);
}

/* qsort_r's order of items s * m + c (arg: an Order): longer prompts first, then by s and c, so a
 * thread's consecutive items share a prompt and the last items are the shortest. */
typedef struct { const int64_t *spans; int64_t m; } Order;

static inline int longer_first(const void *a, const void *b, void *arg) {
    const Order *o = (const Order *)arg;
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    const int64_t nx = SPAN_N_RAW(o->spans, x / o->m), ny = SPAN_N_RAW(o->spans, y / o->m);
    return nx != ny ? (nx > ny ? -1 : 1) : (x < y ? -1 : x > y);
}

/* The ns * m items in that order (malloc'd: the caller frees), or NULL (out of memory). */
static inline int64_t *longest_first(const int64_t *spans, int64_t ns, int64_t m) {
    int64_t *items = malloc((size_t)(ns * m) * sizeof *items);
    if (!items) return NULL;
    for (int64_t i = 0; i < ns * m; i++) items[i] = i;
    Order order = {spans, m};
    qsort_r(items, (size_t)(ns * m), sizeof *items, longer_first, &order);
    return items;
}

#endif
