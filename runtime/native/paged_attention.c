/* Attention of query rows over a paged KV pool, read in place (no gather).
 *
 * Legend: t = query rows, Hq / Hkv = query / key-value heads, G = Hq / Hkv (queries sharing
 * one KV head), D / Dv = key / value head dim, bs = block size (positions per block).
 *
 * Each query row r attends positions lo[r] .. ctx[r]-1 of its sequence, whose position p
 * lives in pool block tables[table_off[r] + p / bs] at offset p % bs. One work item is one
 * (row, KV head): its G queries read each key and value once (online softmax, one block at
 * a time), so the KV of a decode step is streamed once from memory. Latent attention (MLA,
 * absorbed) is the case Hkv = 1, G = heads, values = the first Dv elements of each key
 * (pass the key pool as the value pool). gpt-oss's sinks add one logit per query head that
 * takes probability mass but has no value.
 *
 * K/V are fp32 or bf16 (kv_dtype 0 / 1), queries and outputs fp32; all strides in elements.
 * Work items are shared among `nthreads` threads through an atomic counter.
 *
 * No Python API: the runtime calls moecc_paged_attention through ctypes (runtime/native).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <Python.h>

typedef struct {
    const float *q; int64_t q_row, q_head;          /* q [t, Hq, D] */
    const void *k, *v; int kv_dtype;                 /* pools of one layer: [Hkv, NB, bs, D|Dv] */
    int64_t k_head, k_block, k_pos, v_head, v_block, v_pos;
    int Hkv, G, D, Dv, bs;
    const int64_t *rows; int64_t nrows;              /* which rows to compute */
    const int64_t *tables, *table_off, *ctx, *lo;   /* per row (indexed by the row itself) */
    const float *sinks;                              /* [Hq] or NULL */
    float scale;
    float *out; int64_t o_row, o_head;               /* out [t, Hq, Dv] */
    int64_t next;                                    /* the work counter */
    int failed;
} Job;

static inline float bf16_at(const uint16_t *p, int64_t i) {
    uint32_t bits = ((uint32_t)p[i]) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Convert n elements of a K or V vector to fp32 (bf16 widening is exact). */
static inline void load_vec(float *dst, const void *base, int64_t at, int n, int dtype) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + at, (size_t)n * 4);
    } else {
        const uint16_t *p = (const uint16_t *)base + at;
        for (int i = 0; i < n; i++) dst[i] = bf16_at(p, i);
    }
}

/* 8 independent partial sums: vectorizes without reassociating one sum. */
static inline float dot(const float *a, const float *b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* One (row, KV head): scratch holds G*bs scores, bs*(D+Dv) converted K/V, G*Dv accumulators. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=haswell", "default")))
#endif
static void attend_item(const Job *j, int64_t r, int h, float *scratch) {
    const int G = j->G, D = j->D, Dv = j->Dv, bs = j->bs;
    float *scores = scratch;                       /* [G, bs] */
    float *kbuf = scores + (int64_t)G * bs;        /* [bs, D] */
    float *vbuf = kbuf + (int64_t)bs * D;          /* [bs, Dv] */
    float *acc = vbuf + (int64_t)bs * Dv;          /* [G, Dv] */
    float m[G], l[G];
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }
    memset(acc, 0, sizeof(float) * (size_t)G * Dv);
    const int64_t c = j->ctx[r], lo = j->lo[r];
    const int64_t *table = j->tables + j->table_off[r];
    const float *q = j->q + r * j->q_row + (int64_t)h * G * j->q_head;
    for (int64_t p0 = lo; p0 < c;) {
        const int64_t blk = table[p0 / bs];
        const int off = (int)(p0 % bs);
        const int n = (int)((c - p0) < (bs - off) ? (c - p0) : (bs - off));
        const int64_t kat = h * j->k_head + blk * j->k_block + off * j->k_pos;
        const int64_t vat = h * j->v_head + blk * j->v_block + off * j->v_pos;
        const float *kb = kbuf, *vb = vbuf;  /* [n, D], [n, Dv]: in place when fp32 rows are dense */
        int64_t ks = D, vs = Dv;
        if (j->kv_dtype == 0 && j->k_pos >= D && j->v_pos >= Dv) {
            kb = (const float *)j->k + kat, ks = j->k_pos;
            vb = (const float *)j->v + vat, vs = j->v_pos;
        } else {
            for (int i = 0; i < n; i++) {
                load_vec(kbuf + (int64_t)i * D, j->k, kat + i * j->k_pos, D, j->kv_dtype);
                load_vec(vbuf + (int64_t)i * Dv, j->v, vat + i * j->v_pos, Dv, j->kv_dtype);
            }
        }
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * j->q_head;
            float *s = scores + (int64_t)g * bs;
            float mx = m[g];
            for (int i = 0; i < n; i++) {
                s[i] = dot(qg, kb + i * ks, D) * j->scale;
                if (s[i] > mx) mx = s[i];
            }
            const float corr = expf(m[g] - mx);  /* 0 on the first block (m = -inf) */
            float *a = acc + (int64_t)g * Dv;
            if (corr != 1.f) {
                for (int d = 0; d < Dv; d++) a[d] *= corr;
            }
            float sum = l[g] * corr;
            for (int i = 0; i < n; i++) {
                const float e = expf(s[i] - mx);
                sum += e;
                axpy(a, e, vb + i * vs, Dv);
            }
            m[g] = mx;
            l[g] = sum;
        }
        p0 += n;
    }
    for (int g = 0; g < G; g++) {
        float mx = m[g], sum = l[g], corr = 1.f;
        if (j->sinks) {
            const float sk = j->sinks[h * G + g];
            const float top = sk > mx ? sk : mx;
            corr = expf(mx - top);
            sum = sum * corr + expf(sk - top);
        }
        float *o = j->out + r * j->o_row + (int64_t)(h * G + g) * j->o_head;
        const float *a = acc + (int64_t)g * Dv;
        const float f = sum > 0.f ? corr / sum : 0.f;
        for (int d = 0; d < Dv; d++) o[d] = a[d] * f;
    }
}

static void *worker(void *arg) {
    Job *j = (Job *)arg;
    const int64_t items = j->nrows * j->Hkv;
    const size_t n = (size_t)j->G * j->bs + (size_t)j->bs * (j->D + j->Dv) + (size_t)j->G * j->Dv;
    float *scratch = (float *)malloc(n * sizeof(float));
    if (!scratch) { __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED); return NULL; }
    for (;;) {
        const int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= items) break;
        attend_item(j, j->rows[it / j->Hkv], (int)(it % j->Hkv), scratch);
    }
    free(scratch);
    return NULL;
}

/* Returns 0 on success, 1 when scratch memory or a thread could not be had. */
int moecc_paged_attention(
    const float *q, int64_t q_row, int64_t q_head,
    const void *k, const void *v, int kv_dtype,
    int64_t k_head, int64_t k_block, int64_t k_pos, int64_t v_head, int64_t v_block, int64_t v_pos,
    int Hkv, int G, int D, int Dv, int bs,
    const int64_t *rows, int64_t nrows, const int64_t *tables, const int64_t *table_off,
    const int64_t *ctx, const int64_t *lo, const float *sinks, float scale,
    float *out, int64_t o_row, int64_t o_head, int nthreads) {
    Job j = {q, q_row, q_head, k, v, kv_dtype, k_head, k_block, k_pos, v_head, v_block, v_pos,
             Hkv, G, D, Dv, bs, rows, nrows, tables, table_off, ctx, lo, sinks, scale,
             out, o_row, o_head, 0, 0};
    const int64_t items = nrows * Hkv;
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
    pthread_t th[nthreads > 1 ? nthreads - 1 : 1];
    int started = 0;
    for (int i = 0; i < nthreads - 1; i++) {
        if (pthread_create(&th[i], NULL, worker, &j) != 0) break;
        started++;
    }
    worker(&j);  /* this thread works too */
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    return j.failed;
}

/* An importable module, so setuptools builds and ships it like any extension. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_attention",
                                    "moecc's paged attention kernel (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__paged_attention(void) { return PyModule_Create(&module); }
