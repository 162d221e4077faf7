/* One routed expert's gated MLP over its rows on a CPU with AMX (bf16 tiles), in one call:
 *
 *   a[r]      = x[tok[r]]                                    r < n       (gather)
 *   h[r, j]   = silu(a[r] . G[j]) * (a[r] . U[j])             j < I       (gate and up, one pass)
 *   out[tok[r], c] += tw[r] * (h[r] . D[c])                   c < H       (down, added in place)
 *
 * Legend: T tokens of the layer, H hidden, I intermediate, n rows routed to the expert (tok:
 * their distinct tokens, tw: their routing weights, fp32), G/U the gate and up halves of the
 * stacked [2I, H] weight, D the [H, I] down weight; Mp = n rounded up to 16 (tile rows).
 *
 * The weights are read as oneDNN packed them for its own GEMM (packed_weights.PackedLinear:
 * `_reorder_linear_weight`, layout AB16b{NB}a2b): blocks of NB output rows by 16 inputs, inside a
 * block [8 input pairs][NB outputs][2]. A bf16 tile of 16 outputs by 32 inputs (VNNI pairs) is
 * then 16 rows of 64 bytes at a stride of NB*4 bytes, so no second copy of the weights exists;
 * expert_amx.py checks the layout on probe weights before any call and passes NB.
 *
 * Rounding is torch's for the same ops (the unfused path, kernels.gated_mlp + scale_add_rows):
 * each GEMM accumulates in fp32 over the inputs in order, 32 at a time (AMX's dot product, the
 * order oneDNN's AMX kernel uses where it does not split the inputs between threads), rounded
 * to bf16; silu from the same table (expert_rows.py's, torch's F.silu of every bf16 value),
 * times up, rounded; the down row rounded, times tw (fp32), rounded, then added, rounded.
 *
 * `moecc_expert_amx_layer` runs a whole layer's experts in one call: the routed (token, expert)
 * slots sorted by expert (a counting sort), then each expert's rows as above, in expert order.
 *
 * Work: three parallel passes on torch's OpenMP team (cpu.h), on amx_gemm.h's tile machinery: the
 * gather by rows (row_items.h); gate/up by units of nb outputs of each half, down by units of nb
 * outputs, each thread a contiguous run of units, over the rows in blocks that stay in L2
 * (amx_gemm.h's block_tiles: one block up to 512 rows of 1,280 inputs; down's 3,584 inputs in
 * three). A unit's inputs run in blocks of KBLK steps over the block's row tiles (its weight tiles
 * for a step block are read once, from L1 for the other row tiles); gate/up takes 32 outputs of a half
 * at a time, both 64-byte halves of the packed 128-byte rows, so the weights stream as whole
 * lines in address order (not alternate halves of each line in two passes); the next unit's weight block
 * (a contiguous run per half) is asked for a few lines at each step, paced so the line fill buffers
 * never fill. A slice's epilogue (silu times up into h; the weighted down rows into out) waits for
 * the next slice and runs a few rows at each of its K steps, AVX-512 beside the tile products
 * (each thread keeps two C buffers for that); the down epilogue asks for the out line of the row
 * OUT_AHEAD rows on before it adds into one. Linux x86-64 with GCC 11 / Clang 12 or newer only (the
 * AMX target, arch_prctl's permission); elsewhere `moecc_expert_amx` returns 2 and the caller runs
 * torch's path.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <Python.h>

#include "amx.h"
#include "amx_gemm.h"
#include "bf16.h"
#include "cpu.h"
#include "py_args.h"
#include "expert_slots.h"
#include "row_items.h"

#define MAX_ROWS 512   /* rows per call (the caller chunks); 32 tiles of 16 */

typedef struct {
    const uint16_t *x; int64_t ldx;          /* [T, H] */
    const int64_t *tok; const float *tw;     /* [n] each */
    int64_t n, mp, H, I;
    const uint16_t *gu; int nb_gu;           /* [2I, H] packed, NB */
    const uint16_t *dn; int nb_dn;           /* [H, I] packed, NB */
    const float *lut;                        /* [65536] silu of each bf16, rounded to bf16 */
    uint16_t *a;                             /* [Mp/16, H/32, 16, 32] gathered rows as tiles, pad rows zero */
    uint16_t *h;                             /* [Mp/16, I/32, 16, 32] */
    uint16_t *out; int64_t ldo;              /* [T, H] */
    uint16_t *y;                             /* [n, H] each row's weighted down result, or NULL: added into out */
    int nth; int64_t next;                   /* threads; the next thread index to hand out */
} Job;

#ifdef HAVE_AMX
/* The next run of a pass's `items` units for this thread (cpu.h's take_run over j->nth runs). */
static int next_run(Job *j, int64_t items, int64_t *lo, int64_t *hi) {
    return take_run(&j->next, j->nth, items, lo, hi);
}

/* The gather: rows [r0, r1) of a (x's rows tok[r], then zero rows up to Mp), as tiles
 * (amx_gemm.h's pack_row), on row_items.h's threads. */
#define GATHER_BODY                                                                   \
    const Job *j = (const Job *)job;                                                  \
    for (int64_t r = r0; r < r1; r++)                                                 \
        pack_row(j->a, r, j->H, r < j->n ? j->x + j->tok[r] * j->ldx : NULL);

ROW_ITEMS_BUILDS(GATHER_BODY)

#ifndef OUT_AHEAD
#define OUT_AHEAD 16  /* rows the down epilogue asks for out's line ahead of adding into it (bf16 out of a
                       * prefill step, 12 MB at 8,192 tokens, misses cache: 1.04-1.11x a layer there) */
#endif

/* h row = silu(bf16(g)) * bf16(u), rounded: expert_rows.c's silu_mul on 16 columns. */
AMX_TARGET static inline void silu_mul16(uint16_t *h, const float *g, const float *u, const float *lut) {
    const __m512 sg = _mm512_i32gather_ps(_mm512_cvtepu16_epi32(f2bf16(_mm512_load_ps(g))), lut, 4);
    _mm256_storeu_si256((__m256i *)h, f2bf16(_mm512_mul_ps(sg, bf16x(f2bf16(_mm512_load_ps(u))))));
}

/* bf16(bf16(c) * w) on 16 columns: a row's weighted down result, rounded as expert_rows.c's
 * scale_add_rows rounds it. */
AMX_TARGET static inline __m256i weighted16(const float *c, __m512 w) {
    return f2bf16(_mm512_mul_ps(bf16x(f2bf16(_mm512_load_ps(c))), w));
}

/* o += y, rounded (bf16 both): the add of scale_add_rows on 16 columns. */
AMX_TARGET static inline void add16(uint16_t *o, __m256i y) {
    const __m512 sum = _mm512_add_ps(bf16x(_mm256_loadu_si256((const __m256i *)o)), bf16x(y));
    _mm256_storeu_si256((__m256i *)o, f2bf16(sum));
}

/* The epilogues' rows, Epi.rows: h's 32 columns of the slice for rows [r, upto) (silu of the
 * gate times up; every row of the Mp, pad rows included, so h's pad rows are written), or each
 * routed row's weighted down result added into out[tok[r]], or kept in y[r] where the job has y
 * (an expert dealt to one thread, whose rows' tokens another thread's expert may also add into;
 * add_slots adds them later, in expert order). */
AMX_TARGET static void silu_rows(Epi *e, int64_t upto) {
    const Job *j = (const Job *)e->j;
    for (; e->r < upto; e->r++) {
        const int64_t m = e->r / 16, r = e->r % 16;
        uint16_t *hr = j->h + packed_at(e->r, e->col, j->I);  /* 32 columns, one tile row */
        silu_mul16(hr, e->c0[m][0] + r * 16, e->c1[m][0] + r * 16, j->lut);
        silu_mul16(hr + 16, e->c0[m][1] + r * 16, e->c1[m][1] + r * 16, j->lut);
    }
}

AMX_TARGET static void down_rows(Epi *e, int64_t upto) {
    const Job *j = (const Job *)e->j;
    for (; e->r < upto; e->r++) {
        const int64_t m = e->r / 16, r = e->r % 16, ahead = e->r + OUT_AHEAD;
        const __m512 w = _mm512_set1_ps(j->tw[e->r]);
        const __m256i y0 = weighted16(e->c0[m][0] + r * 16, w), y1 = weighted16(e->c0[m][1] + r * 16, w);
        if (j->y) {
            uint16_t *o = j->y + e->r * j->H + e->col;
            _mm256_storeu_si256((__m256i *)o, y0), _mm256_storeu_si256((__m256i *)(o + 16), y1);
            continue;
        }
        if (ahead < e->n)  /* out's rows are the routed tokens' own, scattered: asked for ahead */
            _mm_prefetch((const char *)(j->out + j->tok[ahead] * j->ldo + e->col), _MM_HINT_T0);
        uint16_t *o = j->out + j->tok[e->r] * j->ldo + e->col;
        add16(o, y0), add16(o + 16, y1);
    }
}

/* Each thread's C buffers, two of each (a slice's, and the previous slice's while its epilogue
 * is pending): [buffer][row tile][column tile][16 x 16 fp32]. */
static __thread float c_gate[2][MAX_ROWS / 16][2][256] __attribute__((aligned(64)));
static __thread float c_up[2][MAX_ROWS / 16][2][256] __attribute__((aligned(64)));

/* Gate and up by units of nb outputs of each (one block of the gate half, the same block of
 * the up half); h's columns of the unit for every row. Each 32 outputs of a half run as one
 * slice_tiles pass (its two column tiles are the two 64-byte halves of the block's 128-byte rows
 * at nb 32), gate then up: each weight line is read whole, in order, once. A slice's epilogue
 * runs inside the next slice's passes (Epi), the thread's last one after them. */
AMX_TARGET static void *gate_up(void *arg) {
    Job *j = (Job *)arg;
    tiles_on();
    const int64_t K = j->H, KB = K / 32, MT = j->mp / 16, I = j->I;
    Epi e = {silu_rows, j, NULL, NULL, 0, 0, 0, (j->mp + 2 * ((MT + 1) / 2) * KB - 1) / (2 * ((MT + 1) / 2) * KB)};
    float (*c[2])[2][256] = {c_gate[0], c_gate[1]}, (*c2[2])[2][256] = {c_up[0], c_up[1]};
    int64_t u0, u1;
    int b = 0;
    while (next_run(j, I / j->nb_gu, &u0, &u1))  /* units of the gate half; the up half I / nb units on */
        units_tiles(j->a, MT, j->gu, K, j->nb_gu, I / j->nb_gu, u0, u1, j->mp, &e, c, c2, &b);
    epi_finish(&e);
    _tile_release();
    return NULL;
}

static __thread float c_down[2][MAX_ROWS / 16][2][256] __attribute__((aligned(64)));

/* Down by units of nb outputs (nb/32 slices of 32); each row's weighted result added into
 * out[tok[r]], a slice's inside the next slice's pass (Epi). */
AMX_TARGET static void *down(void *arg) {
    Job *j = (Job *)arg;
    tiles_on();
    const int64_t K = j->I, KB = K / 32, MT = j->mp / 16;
    const int64_t steps = ((MT + 1) / 2) * KB;  /* K steps of a slice: the epilogue's rows spread over them */
    Epi e = {down_rows, j, NULL, NULL, 0, 0, 0, (j->n + steps - 1) / steps};
    float (*c[2])[2][256] = {c_down[0], c_down[1]};
    int64_t u0, u1;
    int b = 0;
    while (next_run(j, j->H / j->nb_dn, &u0, &u1))
        units_tiles(j->h, MT, j->dn, K, j->nb_dn, 0, u0, u1, j->n, &e, c, NULL, &b);
    epi_finish(&e);
    _tile_release();
    return NULL;
}

#endif

/* 1: this build and CPU run the kernel; 0: they do not. */
int moecc_expert_amx_ready(void) {
#ifdef HAVE_AMX
    return amx_ready();
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
/* One job's three passes (rows j->n <= MAX_ROWS), each on the team: the gather, gate/up, down. */
static void run_expert(Job *j) {
    run_row_items(j, ROW_FNS, j->mp, j->H, j->nth);
    j->next = 0;
    run_threads(gate_up, j, j->nth, j->nth);
    j->next = 0;
    run_threads(down, j, j->nth, j->nth);
}

/* j narrowed to its rows [r0, r0 + n): tok, tw (and y) from r0, Mp rounded up to 16. */
static inline Job rows_of(const Job *j, int64_t r0, int64_t n) {
    Job p = *j;
    p.tok += r0, p.tw += r0, p.n = n, p.mp = (n + 15) / 16 * 16, p.next = 0;
    if (p.y) p.y += r0 * p.H;
    return p;
}

/* run_expert on this thread alone, in thread t's share of the scratch (`rows` rows of a and of h:
 * split_rows' and deal_experts' own scratch a thread). */
static void run_alone(Job *j, int64_t t, int64_t rows) {
    j->a += t * rows * j->H, j->h += t * rows * j->I, j->nth = 1;
    run_expert(j);
}

/* An expert's rows split between the threads (more rows than MAX_ROWS: amx_gemm.h's chunk_rows),
 * each chunk run whole by one thread (gather, gate/up, down, run_expert on that thread alone) in
 * its own scratch (thread t: a and h from row t * MAX_ROWS), so a chunk's rows and h stay in its
 * core's L2 and the threads meet once an expert instead of three times a chunk. An expert's rows
 * are distinct tokens: no two chunks add into one row of out, and each row's bits are those of a
 * run of MAX_ROWS (rows do not meet in the sums). */
typedef struct { Job base; int64_t rows, next, taken; } Split;

static void *split_rows(void *arg) {
    Split *s = (Split *)arg;
    const int64_t t = __atomic_fetch_add(&s->taken, 1, __ATOMIC_RELAXED);  /* this thread's scratch */
    int64_t r0, n;
    while (take_chunk(&s->next, s->rows, s->base.n, &r0, &n)) {
        Job j = rows_of(&s->base, r0, n);
        run_alone(&j, t, MAX_ROWS);
    }
    return NULL;
}

/* Expert rows [0, j->n) of any count: split between the threads past MAX_ROWS (Split), else
 * one run. */
static void run_expert_rows(Job *j) {
    if (j->n <= MAX_ROWS || j->nth < 2) {
        for (int64_t r = 0; r < j->n; r += MAX_ROWS) {
            Job part = rows_of(j, r, j->n - r < MAX_ROWS ? j->n - r : MAX_ROWS);
            run_expert(&part);
        }
        return;
    }
    Split s = {*j, chunk_rows(j->n, j->nth, MAX_ROWS), 0, 0};
    run_threads(split_rows, &s, j->nth, j->nth);
}

/* A layer's experts dealt whole to the threads (expert_amx.py's `layer` asks for it where no
 * expert has more than MAX_ROWS rows and there are several experts a thread): each thread runs
 * whole experts alone (run_expert on that thread: gather, gate/up, down) in its own scratch
 * (thread t: a and h from row t * mp, mp the most rows of an expert rounded up to 16), the
 * experts of most rows first, each taken by whichever thread asks. An expert's weighted down rows
 * go to y (a row per sorted slot) and add_slots then adds them into out, each token's in expert
 * order: the bits of the experts run one after another. The threads meet twice a layer instead
 * of three times an expert, and an expert's rows and h stay in one core's L2. */
typedef struct {
    Job base;                                /* tok, tw, y: the layer's sorted slots */
    const int64_t *at, *gu, *dn, *order;     /* at[e]: expert e's end among the slots; order: experts to run */
    int64_t experts, mp, next, taken;
} Deal;

static void *deal_experts(void *arg) {
    Deal *d = (Deal *)arg;
    const int64_t t = __atomic_fetch_add(&d->taken, 1, __ATOMIC_RELAXED);  /* this thread's scratch */
    for (int64_t i; (i = __atomic_fetch_add(&d->next, 1, __ATOMIC_RELAXED)) < d->experts;) {
        const int64_t e = d->order[i], lo = slot_start(d->at, e);
        Job j = rows_of(&d->base, lo, d->at[e] - lo);
        j.gu = (const uint16_t *)(intptr_t)d->gu[e], j.dn = (const uint16_t *)(intptr_t)d->dn[e];
        run_alone(&j, t, d->mp);
    }
    return NULL;
}

/* out[t] += y[p], rounded, for each of token t's slots p (pos[t * k + i]) in expert order: the
 * sorted slots' order, p ascending. Tokens in runs, one a thread. */
typedef struct { const int64_t *pos; const uint16_t *y; uint16_t *out; int64_t T, k, H, ldo, next; int nth; } Slots;

AMX_TARGET static void *add_slots(void *arg) {
    Slots *s = (Slots *)arg;
    int64_t t0, t1;
    while (take_run(&s->next, s->nth, s->T, &t0, &t1))
        for (int64_t t = t0; t < t1; t++) {
            int64_t p[s->k];
            for (int64_t i = 0; i < s->k; i++) {  /* insertion sort: k is a handful */
                int64_t v = s->pos[t * s->k + i], at = i;
                for (; at > 0 && p[at - 1] > v; at--) p[at] = p[at - 1];
                p[at] = v;
            }
            uint16_t *o = s->out + t * s->ldo;
            for (int64_t i = 0; i < s->k; i++)
                for (int64_t c = 0; c < s->H; c += 16)
                    add16(o + c, _mm256_loadu_si256((const __m256i *)(s->y + p[i] * s->H + c)));
        }
    return NULL;
}

/* The layer's experts with rows dealt (Deal), then their rows added (add_slots). */
static void deal_layer(const Job *base, const int64_t *at, int64_t E, const int64_t *gu, const int64_t *dn,
                       const int64_t *pos, int64_t T, int64_t k) {
    int64_t order[E], experts = 0, most = 0;
    for (int64_t e = 0; e < E; e++) {  /* non-empty experts, most rows first (insertion: stable) */
        const int64_t n = at[e] - slot_start(at, e);
        if (n == 0) continue;
        int64_t i = experts++;
        for (; i > 0 && at[order[i - 1]] - slot_start(at, order[i - 1]) < n; i--) order[i] = order[i - 1];
        order[i] = e, most = n > most ? n : most;
    }
    Deal d = {*base, at, gu, dn, order, experts, (most + 15) / 16 * 16, 0, 0};
    run_threads(deal_experts, &d, base->nth, experts);
    Slots s = {pos, base->y, base->out, T, k, base->H, base->ldo, 0, base->nth};
    run_threads(add_slots, &s, base->nth, base->nth);
}

/* 1: the sizes and layouts the kernel takes (shared by both entries). */
static int takes(int64_t H, int64_t I, int nb_gu, int nb_dn, int64_t ldx, int64_t ldo) {
    return !(H % 32 || I % 32 || I % nb_gu || H % nb_dn || nb_gu % 32 || nb_dn % 32 || ldx < H || ldo < H);
}
#endif

/* Returns 0 (done), 1 (arguments it does not take: nothing written) or 2 (no AMX here). `a`
 * [Mp, H] and `h` [Mp, I] are the caller's scratch. */
int moecc_expert_amx(const uint16_t *x, int64_t ldx, const int64_t *tok, const float *tw, int64_t n, int64_t H,
                     int64_t I, const uint16_t *gu, int nb_gu, const uint16_t *dn, int nb_dn, const float *lut,
                     uint16_t *a, uint16_t *h, uint16_t *out, int64_t ldo, int nthreads) {
#ifdef HAVE_AMX
    if (!amx_ready()) return 2;
    if (n < 1 || n > MAX_ROWS || !takes(H, I, nb_gu, nb_dn, ldx, ldo)) return 1;
    Job j = {x, ldx, tok, tw, n, (n + 15) / 16 * 16, H, I, gu, nb_gu, dn, nb_dn, lut, a, h, out, ldo, NULL, 1, 0};
    j.nth = nthreads < 1 ? 1 : nthreads;
    run_expert(&j);
    return 0;
#else
    (void)x, (void)ldx, (void)tok, (void)tw, (void)n, (void)H, (void)I, (void)gu, (void)nb_gu, (void)dn;
    (void)nb_dn, (void)lut, (void)a, (void)h, (void)out, (void)ldo, (void)nthreads;
    return 2;
#endif
}

/* Every routed expert of a layer in one call: the T*k slots (top_i/top_w [T, k], int64 / fp32)
 * sorted by expert into tok/tw ([T*k] scratch; a counting sort, slots in order within an expert,
 * as a stable argsort orders them: expert_slots.h), then each expert in order, its rows in runs of
 * MAX_ROWS as moecc_expert_amx runs them, or past MAX_ROWS split between the threads
 * (run_expert_rows); or, given `y` ([T*k, H] scratch) and `pos` ([T*k] scratch), no expert of
 * more than MAX_ROWS rows, whole experts dealt to the threads (deal_layer). The same bits as one
 * call per run. gu/dn [E]: each expert's packed weights (0 for one no slot names); `a`/`h` scratch
 * for min(most rows of an expert, MAX_ROWS) rows rounded up to 16, nthreads times that when
 * dealt, or nthreads * MAX_ROWS rows where an expert has more than MAX_ROWS (expert_amx.py's
 * `layer`). Returns 0, 1 (arguments it does not take, nothing written: an index outside [0, E), a
 * named expert without weights, sizes, y with an expert past MAX_ROWS) or 2 (no AMX here). */
int moecc_expert_amx_layer(const uint16_t *x, int64_t ldx, int64_t T, int64_t k, const int64_t *top_i,
                           const float *top_w, int64_t E, const int64_t *gu, const int64_t *dn, int64_t H, int64_t I,
                           int nb_gu, int nb_dn, const float *lut, int64_t *tok, float *tw, uint16_t *a, uint16_t *h,
                           uint16_t *out, int64_t ldo, uint16_t *y, int64_t *pos, int nthreads) {
#ifdef HAVE_AMX
    if (!amx_ready()) return 2;
    if (T < 1 || k < 1 || E < 1 || E > MAX_EXPERTS || !takes(H, I, nb_gu, nb_dn, ldx, ldo) || (y && !pos)) return 1;
    int64_t at[E];  /* at[e]: expert e's end among the sorted slots */
    if (sort_slots(T, k, top_i, top_w, E, gu, dn, at, tok, tw, pos)) return 1;
    const int nth = nthreads < 1 ? 1 : nthreads;
    if (y) {
        for (int64_t e = 0; e < E; e++)
            if (at[e] - slot_start(at, e) > MAX_ROWS) return 1;
        const Job base = {x, ldx, tok, tw, 0, 0, H, I, NULL, nb_gu, NULL, nb_dn, lut, a, h, out, ldo, y, nth, 0};
        deal_layer(&base, at, E, gu, dn, pos, T, k);
        return 0;
    }
    for (int64_t e = 0, lo = 0; e < E; lo = at[e++]) {
        Job j = {x, ldx, tok + lo, tw + lo, at[e] - lo, 0, H, I, (const uint16_t *)(intptr_t)gu[e], nb_gu,
                 (const uint16_t *)(intptr_t)dn[e], nb_dn, lut, a, h, out, ldo, NULL, nth, 0};
        run_expert_rows(&j);
    }
    return 0;
#else
    (void)x, (void)ldx, (void)T, (void)k, (void)top_i, (void)top_w, (void)E, (void)gu, (void)dn, (void)H, (void)I;
    (void)nb_gu, (void)nb_dn, (void)lut, (void)tok, (void)tw, (void)a, (void)h, (void)out, (void)ldo, (void)y;
    (void)pos, (void)nthreads;
    return 2;
#endif
}

/* Python entries (METH_FASTCALL, pointers as ints, the work without the GIL: py_args.h). */
static PyObject *py_expert(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[17];
    if (int_args(args, n, 17, "expert", 0, v)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_expert_amx((const uint16_t *)(intptr_t)v[0], v[1], (const int64_t *)(intptr_t)v[2],
                          (const float *)(intptr_t)v[3], v[4], v[5], v[6], (const uint16_t *)(intptr_t)v[7], (int)v[8],
                          (const uint16_t *)(intptr_t)v[9], (int)v[10], (const float *)(intptr_t)v[11],
                          (uint16_t *)(intptr_t)v[12], (uint16_t *)(intptr_t)v[13], (uint16_t *)(intptr_t)v[14], v[15],
                          (int)v[16]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_layer(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[23];
    if (int_args(args, n, 23, "layer", 0, v)) return NULL;
    int rc;
#define P(i, type) ((type)(intptr_t)v[i])
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_expert_amx_layer(P(0, const uint16_t *), v[1], v[2], v[3], P(4, const int64_t *), P(5, const float *), v[6],
                                P(7, const int64_t *), P(8, const int64_t *), v[9], v[10], (int)v[11], (int)v[12],
                                P(13, const float *), P(14, int64_t *), P(15, float *), P(16, uint16_t *),
                                P(17, uint16_t *), P(18, uint16_t *), v[19], P(20, uint16_t *), P(21, int64_t *),
                                (int)v[22]);
    Py_END_ALLOW_THREADS
#undef P
    return PyLong_FromLong(rc);
}

PY_READY(moecc_expert_amx_ready)

static PyMethodDef methods[] = {
    {"expert", (PyCFunction)(void (*)(void))py_expert, METH_FASTCALL,
     "expert(x, ldx, tok, tw, n, H, I, gu, nb_gu, down, nb_down, lut, a, h, out, ldo, nthreads) -> 0, 1 or 2"},
    {"layer", (PyCFunction)(void (*)(void))py_layer, METH_FASTCALL,
     "layer(x, ldx, T, k, top_i, top_w, E, gu[E], down[E], H, I, nb_gu, nb_down, lut, tok, tw, a, h, out, ldo, "
     "y, pos, nthreads) -> 0, 1 or 2"},
    PY_READY_METHOD,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_expert_amx",
                                    "moecc's fused routed expert on AMX tiles over oneDNN-packed weights.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__expert_amx(void) { return PyModule_Create(&module); }
