/* Attention of query rows over a paged KV pool, read in place (no gather).
 *
 * Legend: t = query rows, Hq / Hkv = query / key-value heads, G = Hq / Hkv (queries sharing
 * one KV head), D / Dv = key / value head dim, bs = block size (positions per block).
 *
 * Each query row r attends positions lo[r] .. ctx[r]-1 of its sequence, whose position p
 * lives in pool block tables[table_off[r] + p / bs] at offset p % bs. One work item is one
 * KV head of a group of rows: a decoding row alone, or up to QUERIES_PER_ITEM / G consecutive
 * rows of one prompt chunk (row_groups: same table, one position more each, so the causal
 * mask is each row's own ctx). Its queries read each key and value once, CHUNK positions at a
 * time across blocks (all the chunk's scores, then one online-softmax step and one pass of
 * the values with the sums in registers; the next chunk's blocks prefetched), so the KV of a
 * decode step is streamed once from memory, a small block costs no more than a large one and
 * a prompt's rows share each load. Latent attention (MLA,
 * absorbed) is the case Hkv = 1, G = heads, values = the first Dv elements of each key
 * (pass the key pool as the value pool). gpt-oss's sinks add one logit per query head that
 * takes probability mass but has no value.
 *
 * K/V are fp32 or bf16 (kv_dtype 0 / 1), queries fp32 or bf16 (q_dtype 0 / 1, widened exactly
 * where a build computes in fp32), outputs fp32; all strides in elements.
 * Work items are shared among `nthreads` threads through an atomic counter.
 *
 * Builds: the inner loops (attend_isa.h) are compiled for the baseline ISA, AVX2 + FMA,
 * AVX-512 (F/BW/VL/DQ, 16 lanes) and AVX-512 with AVX512-BF16 (bf16 queries and keys: q . k by
 * vdpbf16ps, 32 elements a step) through function target attributes, so one compile serves
 * any x86-64 CPU; each call runs the build moecc_paged_attention_isa() names: the highest the
 * CPU's feature bits allow (cpu.h), or the one moecc_paged_attention_set_isa chose
 * (runtime/native/isa.py: MOECC_NATIVE_ISA). bf16 K/V are widened to fp32 (exactly) in
 * registers, or the values once per chunk into scratch (BF16_STAGE_V); fp32 accumulation.
 *
 * No Python API: the runtime calls moecc_paged_attention (and the _isa functions) through
 * ctypes (runtime/native).
 */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <Python.h>

typedef struct {
    const void *q; int64_t q_row, q_head; int q_dtype;  /* q [t, Hq, D]: fp32 (0) or bf16 (1) */
    const void *k, *v; int kv_dtype;                 /* pools of one layer: [Hkv, NB, bs, D|Dv] */
    int64_t k_head, k_block, k_pos, v_head, v_block, v_pos;
    int Hkv, G, D, Dv, bs;
    const int64_t *rows; int64_t nrows;              /* which rows to compute */
    const int64_t *group; int64_t ngroups; int qr;   /* rows[group[i] .. group[i+1]): item i's rows (row_groups) */
    const int64_t *tables, *table_off, *ctx, *lo;   /* per row (indexed by the row itself) */
    const float *sinks;                              /* [Hq] or NULL */
    float scale;
    void *out; int64_t o_row, o_head; int o_dtype;   /* out [t, Hq, Dv]: fp32 (0) or bf16 (1, rounded to nearest even) */
    int isa;                                         /* the build every thread runs */
    int64_t next;                                    /* the work counter */
    int failed;
} Job;

#include "bf16.h"

static inline __attribute__((always_inline)) float bf16_at(const uint16_t *p, int64_t i) { return bf2f(p[i]); }

/* Element `at` of a K or V pool as fp32 (bf: the pool holds bf16). */
static inline __attribute__((always_inline)) float kv_at(const void *base, int64_t at, int bf) {
    return bf ? bf16_at((const uint16_t *)base, at) : ((const float *)base)[at];
}

#include "cpu.h"
#include "vec8.h"
#include "vec16.h"

/* s[i] = exp(s[i] - mx) for i < n; returns their sum. */
static inline __attribute__((always_inline)) float exp_sub_sum(float *s, int n, float mx) {
    v8 acc = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 e = exp8(ld8(s + i) - mx);
        st8(s + i, e);
        acc += e;
    }
    float sum = hsum8(acc);
    if (i < n) {
        float t[8] = {0};
        for (int u = 0; u < n - i; u++) t[u] = s[i + u] - mx;
        for (int u = n - i; u < 8; u++) t[u] = -INFINITY;
        const v8 e = exp8(ld8(t));
        for (int u = 0; u < n - i; u++) { s[i + u] = e[u]; sum += e[u]; }
    }
    return sum;
}

#ifndef PREFETCH_HINT
#define PREFETCH_HINT 2  /* into L2: a chunk ahead overflows L1 (measured: 1.4x over L1 at 500 positions) */
#endif
#ifndef CHUNK
#define CHUNK 64  /* positions one item scores before one online-softmax step (and one pass over its sums) */
#endif

/* K and V rows are asked for ahead of their chunk (a block is a few KB at a random place in the
 * pool, too short for the hardware prefetcher to reach full speed on its own): the lines of the
 * next spans (an item's next chunk; during its first chunk, the next item's first) still to be
 * asked for: the loops over the current chunk ask for a few each step (pf_step), so the
 * asks spread over the chunk's compute instead of queueing at once in the core's few line fill
 * buffers (a burst of a chunk's ~400 asks stalled the core until most had landed). Regions: a
 * run of positions inside one block, its keys and its values. */
#define PF_REGIONS (4 * CHUNK + 4)  /* two spans of CHUNK positions, each at most CHUNK + 1 block runs of K and V */
typedef struct {
    const char *at[PF_REGIONS];
    int64_t len[PF_REGIONS];
    int n, i;
    int64_t off, lines;  /* lines: all the regions hold */
    int rate;            /* lines a step asks for (pf_pace) */
} PfCursor;

/* The K and V rows of positions from .. to-1 (head h, through the row's block table) added to
 * what pf still holds. */
static inline __attribute__((always_inline)) void pf_span(PfCursor *pf, const Job *j, int h, const int64_t *table,
                                                          int64_t from, int64_t to) {
    const int esz = j->kv_dtype == 0 ? 4 : 2;
    for (int64_t p = from; p < to && pf->n + 2 <= PF_REGIONS;) {
        const int64_t blk = table[p / j->bs], off = p % j->bs;
        const int64_t n = (to - p) < (j->bs - off) ? (to - p) : (j->bs - off);
        pf->at[pf->n] = (const char *)j->k + (h * j->k_head + blk * j->k_block + off * j->k_pos) * esz;
        pf->len[pf->n++] = ((n - 1) * j->k_pos + j->D) * esz;
        pf->at[pf->n] = (const char *)j->v + (h * j->v_head + blk * j->v_block + off * j->v_pos) * esz;
        pf->len[pf->n++] = ((n - 1) * j->v_pos + j->Dv) * esz;
        pf->lines += (pf->len[pf->n - 2] + 63) / 64 + (pf->len[pf->n - 1] + 63) / 64;
        p += n;
    }
}

/* pf emptied (nothing to ask for, a step asks for one line). */
static inline __attribute__((always_inline)) void pf_clear(PfCursor *pf) {
    pf->n = pf->i = 0, pf->off = pf->lines = 0, pf->rate = 1;
}

/* Spread what pf holds over `steps` loop steps (pf_step(pf, 1) each). */
static inline __attribute__((always_inline)) void pf_pace(PfCursor *pf, int64_t steps) {
    pf->rate = (int)(steps > 0 ? (pf->lines + steps - 1) / steps : 1);
    pf->rate = pf->rate < 1 ? 1 : pf->rate;
}

/* Ask for the next `steps` x rate lines pf holds (none once all are asked for). */
static inline __attribute__((always_inline)) void pf_step(PfCursor *pf, int64_t steps) {
    for (int64_t lines = steps * pf->rate; lines > 0 && pf->i < pf->n; lines--) {
        __builtin_prefetch(pf->at[pf->i] + pf->off, 0, PREFETCH_HINT);
        pf->off += 64;
        if (pf->off >= pf->len[pf->i]) pf->i++, pf->off = 0;
    }
}

/* The first chunk of work item `it` (its rows' positions lo .. lo + CHUNK, head) added to pf;
 * nothing when `it` is past the last item. */
static inline __attribute__((always_inline)) void pf_item(PfCursor *pf, const Job *j, int64_t it) {
    if (it >= j->ngroups * j->Hkv) return;
    const int64_t r = j->rows[j->group[it / j->Hkv]];
    const int64_t c = j->ctx[r], lo = j->lo[r];
    pf_span(pf, j, (int)(it % j->Hkv), j->tables + j->table_off[r], lo, c < lo + CHUNK ? c : lo + CHUNK);
}


/* out[r, h's queries] = acc / (sum and the sinks' mass): the end of one (row, KV head). */
static inline __attribute__((always_inline)) void finish_item(const Job *j, int64_t r, int h, const float *acc,
                                                              const float *m, const float *l) {
    const int G = j->G, Dv = j->Dv;
    for (int g = 0; g < G; g++) {
        float mx = m[g], sum = l[g], corr = 1.f;
        if (j->sinks) {
            const float sk = j->sinks[h * G + g];
            const float top = sk > mx ? sk : mx;
            corr = expf(mx - top);
            sum = sum * corr + expf(sk - top);
        }
        const int64_t at = r * j->o_row + (int64_t)(h * G + g) * j->o_head;
        const float *a = acc + (int64_t)g * Dv;
        const float f = sum > 0.f ? corr / sum : 0.f;
        if (j->o_dtype == 1) {  /* torch's fp32 -> bf16 of the fp32 result: the same bits */
            uint16_t *o = (uint16_t *)j->out + at;
            for (int d = 0; d < Dv; d++) o[d] = f2bf(a[d] * f);
        } else {
            float *o = (float *)j->out + at;
            for (int d = 0; d < Dv; d++) o[d] = a[d] * f;
        }
    }
}

/* The kernel's loops once per build (attend_isa.h), each chosen as a whole: run_items_NAME. */
#define ISA_NAME baseline
#define ISA_ATTR
#define VW 8
#define VF v8
#define VLD ld8
#define VST st8
#define VLDBF ldbf8
#define VSUM8 sum8x8_base
#define PV_NV 3
#define BF16_STAGE_V 1
#include "attend_isa.h"

#ifdef HAVE_AVX2_CLONE  /* cpu.h */
#define ISA_NAME avx2
#define ISA_ATTR __attribute__((target("avx2,fma")))
#define VW 8
#define VF v8
#define VLD ld8
#define VST st8
#define VLDBF ldbf8_avx2
#define VSUM8 sum8x8_avx2
#define VMAX(x, m) ((v8)_mm256_max_ps((__m256)(x), (__m256)(m)))
#define PV_NV 3
#define BF16_STAGE_V 1
#include "attend_isa.h"
#endif

#ifdef HAVE_AVX512_CLONE  /* cpu.h */
#define ISA_NAME avx512
#define ISA_ATTR __attribute__((target(AVX512_TARGET)))
#include "attend_lanes16.h"
#include "attend_isa.h"
#endif

#ifdef HAVE_AVX512BF16_CLONE  /* cpu.h: the AVX-512 build, bf16 q . k by vdpbf16ps */
#define ISA_NAME avx512bf16
#define ISA_ATTR __attribute__((target(AVX512BF16_TARGET)))
#include "attend_lanes16.h"
#define QK_BF16 1
#include "attend_isa.h"
#endif

/* The build calls use: the CPU's best (cpu.h, asked once) until moecc_paged_attention_set_isa. */
static int isa_now = -1;

/* The highest build this CPU runs (ISA_BASELINE ... ISA_AVX512BF16, cpu.h). */
int moecc_paged_attention_isa_max(void) { return cpu_isa(); }

/* The build calls use now. */
int moecc_paged_attention_isa(void) {
    const int now = __atomic_load_n(&isa_now, __ATOMIC_RELAXED);
    return now < 0 ? cpu_isa() : now;
}

/* Use build `isa` from the next call on; returns it, or -1 (nothing changed) when the CPU or
 * this compiler's build lacks it. */
int moecc_paged_attention_set_isa(int isa) {
    if (isa < ISA_BASELINE || isa > cpu_isa()) return -1;
    __atomic_store_n(&isa_now, isa, __ATOMIC_RELAXED);
    return isa;
}

static void *worker(void *arg) {
    Job *j = (Job *)arg;
    const size_t gq = (size_t)j->qr * j->G;  /* queries of one item, at most */
    const size_t n = gq * CHUNK + gq * j->Dv + (size_t)CHUNK * j->Dv + gq * j->D;  /* attend_item's */
    float *scratch = (float *)malloc(n * sizeof(float));
    if (!scratch) { __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED); return NULL; }
    switch (j->isa) {
#ifdef HAVE_AVX512BF16_CLONE
    case ISA_AVX512BF16: run_items_avx512bf16(j, scratch); break;
#endif
#ifdef HAVE_AVX512_CLONE
    case ISA_AVX512: run_items_avx512(j, scratch); break;
#endif
#ifdef HAVE_AVX2_CLONE
    case ISA_AVX2: run_items_avx2(j, scratch); break;
#endif
    default: run_items_baseline(j, scratch);
    }
    free(scratch);
    return NULL;
}

#ifndef QUERIES_PER_ITEM
#define QUERIES_PER_ITEM 16  /* a group's rows x G at most (one row alone when G is larger) */
#endif

/* Cut rows into work groups: consecutive rows r, r+1, ... of one prompt chunk (the same block
 * table and window start, one position more each) up to qr rows a group, every other row
 * alone. group[i] is where group i starts in rows, group[ngroups] = nrows; returns ngroups. */
static int64_t row_groups(const Job *j, int64_t *group) {
    int64_t n = 0;
    for (int64_t i = 0; i < j->nrows; i++) {
        const int64_t r = j->rows[i], p = i ? j->rows[i - 1] : -1;
        const int join = i > 0 && i - group[n - 1] < j->qr && r == p + 1 && j->table_off[r] == j->table_off[p] &&
                         j->lo[r] == j->lo[p] && j->ctx[r] == j->ctx[p] + 1;
        if (!join) group[n++] = i;
    }
    group[n] = j->nrows;
    return n;
}

/* Returns 0 on success, 1 when scratch memory or a thread could not be had. */
int moecc_paged_attention(
    const void *q, int64_t q_row, int64_t q_head, int q_dtype,
    const void *k, const void *v, int kv_dtype,
    int64_t k_head, int64_t k_block, int64_t k_pos, int64_t v_head, int64_t v_block, int64_t v_pos,
    int Hkv, int G, int D, int Dv, int bs,
    const int64_t *rows, int64_t nrows, const int64_t *tables, const int64_t *table_off,
    const int64_t *ctx, const int64_t *lo, const float *sinks, float scale,
    void *out, int64_t o_row, int64_t o_head, int o_dtype, int nthreads) {
    int64_t *group = (int64_t *)malloc((size_t)(nrows + 1) * sizeof(int64_t));
    if (!group) return 1;
    const int qr = G < QUERIES_PER_ITEM ? QUERIES_PER_ITEM / G : 1;
    Job j = {q, q_row, q_head, q_dtype, k, v, kv_dtype, k_head, k_block, k_pos, v_head, v_block, v_pos,
             Hkv, G, D, Dv, bs, rows, nrows, group, 0, qr, tables, table_off, ctx, lo, sinks, scale,
             out, o_row, o_head, o_dtype, moecc_paged_attention_isa(), 0, 0};
    j.ngroups = row_groups(&j, group);
    run_threads(worker, &j, nthreads, j.ngroups * Hkv);
    free(group);
    return j.failed;
}

/* An importable module, so setuptools builds and ships it like any extension. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_attention",
                                    "moecc's paged attention kernel (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__paged_attention(void) { return PyModule_Create(&module); }
