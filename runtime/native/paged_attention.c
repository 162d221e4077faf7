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

static inline __attribute__((always_inline)) float bf16_at(const uint16_t *p, int64_t i) {
    uint32_t bits = ((uint32_t)p[i]) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Convert n elements of a K or V vector to fp32 (bf16 widening is exact). */
static inline __attribute__((always_inline)) void load_vec(float *dst, const void *base, int64_t at, int n, int dtype) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + at, (size_t)n * 4);
    } else {
        const uint16_t *p = (const uint16_t *)base + at;
        for (int i = 0; i < n; i++) dst[i] = bf16_at(p, i);
    }
}

#include "cpu.h"
#include "vec8.h"

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

/* s[g * bs + i] = scale * q_g . k_i for g < G, i < n. Four queries at a time share each
 * load of k (four independent FMA chains); D % 8 elements finish in scalar. */
static inline __attribute__((always_inline)) void qk_block(float *s, int bs, const float *q, int64_t qs, int G, const float *k, int64_t ks,
                            int n, int D, float scale) {
    const int D8 = D & ~7;
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *q0 = q + g * qs, *q1 = q0 + qs, *q2 = q1 + qs, *q3 = q2 + qs;
        for (int i = 0; i < n; i++) {
            const float *ki = k + i * ks;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int d = 0; d < D8; d += 8) {
                const v8 kv = ld8(ki + d);
                a0 += ld8(q0 + d) * kv, a1 += ld8(q1 + d) * kv, a2 += ld8(q2 + d) * kv, a3 += ld8(q3 + d) * kv;
            }
            float r0 = hsum8(a0), r1 = hsum8(a1), r2 = hsum8(a2), r3 = hsum8(a3);
            for (int d = D8; d < D; d++) r0 += q0[d] * ki[d], r1 += q1[d] * ki[d], r2 += q2[d] * ki[d], r3 += q3[d] * ki[d];
            s[(g + 0) * bs + i] = r0 * scale, s[(g + 1) * bs + i] = r1 * scale;
            s[(g + 2) * bs + i] = r2 * scale, s[(g + 3) * bs + i] = r3 * scale;
        }
    }
    for (; g < G; g++) {
        const float *qg = q + g * qs;
        for (int i = 0; i < n; i++) {
            const float *ki = k + i * ks;
            v8 a0 = {0}, a1 = {0};
            int d = 0;
            for (; d + 16 <= D8; d += 16) a0 += ld8(qg + d) * ld8(ki + d), a1 += ld8(qg + d + 8) * ld8(ki + d + 8);
            for (; d < D8; d += 8) a0 += ld8(qg + d) * ld8(ki + d);
            float r = hsum8(a0 + a1);
            for (d = D8; d < D; d++) r += qg[d] * ki[d];
            s[g * bs + i] = r * scale;
        }
    }
}

/* acc[g] += sum_i p[g * bs + i] * v_i for g < G: per 8 lanes of Dv, four queries' sums in
 * registers while the block's values stream past. */
static inline __attribute__((always_inline)) void pv_block(float *acc, int Dv, const float *p, int bs, int G, const float *v, int64_t vs, int n) {
    const int D8 = Dv & ~7;
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *p0 = p + g * bs, *p1 = p0 + bs, *p2 = p1 + bs, *p3 = p2 + bs;
        float *c0 = acc + (int64_t)g * Dv, *c1 = c0 + Dv, *c2 = c1 + Dv, *c3 = c2 + Dv;
        for (int d = 0; d < D8; d += 8) {
            v8 a0 = ld8(c0 + d), a1 = ld8(c1 + d), a2 = ld8(c2 + d), a3 = ld8(c3 + d);
            for (int i = 0; i < n; i++) {
                const v8 x = ld8(v + i * vs + d);
                a0 += p0[i] * x, a1 += p1[i] * x, a2 += p2[i] * x, a3 += p3[i] * x;
            }
            st8(c0 + d, a0), st8(c1 + d, a1), st8(c2 + d, a2), st8(c3 + d, a3);
        }
        for (int d = D8; d < Dv; d++)
            for (int i = 0; i < n; i++) {
                const float x = v[i * vs + d];
                c0[d] += p0[i] * x, c1[d] += p1[i] * x, c2[d] += p2[i] * x, c3[d] += p3[i] * x;
            }
    }
    for (; g < G; g++) {
        const float *pg = p + g * bs;
        float *c = acc + (int64_t)g * Dv;
        for (int d = 0; d < D8; d += 8) {
            v8 a = ld8(c + d);
            for (int i = 0; i < n; i++) a += pg[i] * ld8(v + i * vs + d);
            st8(c + d, a);
        }
        for (int d = D8; d < Dv; d++)
            for (int i = 0; i < n; i++) c[d] += pg[i] * v[i * vs + d];
    }
}

#ifdef HAVE_AVX2_CLONE  /* cpu.h */
#include <immintrin.h>

/* Lane j of the result = the sum of v_j's eight lanes (a transpose-reduce: 6 hadds, 2 permutes). */
__attribute__((target("avx2,fma"))) static inline __m256 sum8x8(__m256 v0, __m256 v1, __m256 v2, __m256 v3,
                                                                 __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* qk_block for AVX2 + FMA: a register tile of 4 queries x 2 positions (8 accumulators, each
 * load of q or k feeding two or four FMAs), the 8 sums reduced together. */
__attribute__((target("avx2,fma"))) static void qk_avx2(float *s, int bs, const float *q, int64_t qs, int G,
                                                         const float *k, int64_t ks, int n, int D, float scale) {
    const int D8 = D & ~7;
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *q0 = q + g * qs, *q1 = q0 + qs, *q2 = q1 + qs, *q3 = q2 + qs;
        for (int i = 0; i < n; i += 2) {
            const float *k0 = k + i * ks, *k1 = i + 1 < n ? k0 + ks : k0;  /* odd n: the last position twice */
            __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00;
            __m256 a01 = a00, a11 = a00, a21 = a00, a31 = a00;
            for (int d = 0; d < D8; d += 8) {
                const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
                __m256 y = _mm256_loadu_ps(q0 + d);
                a00 = _mm256_fmadd_ps(y, x0, a00), a01 = _mm256_fmadd_ps(y, x1, a01);
                y = _mm256_loadu_ps(q1 + d);
                a10 = _mm256_fmadd_ps(y, x0, a10), a11 = _mm256_fmadd_ps(y, x1, a11);
                y = _mm256_loadu_ps(q2 + d);
                a20 = _mm256_fmadd_ps(y, x0, a20), a21 = _mm256_fmadd_ps(y, x1, a21);
                y = _mm256_loadu_ps(q3 + d);
                a30 = _mm256_fmadd_ps(y, x0, a30), a31 = _mm256_fmadd_ps(y, x1, a31);
            }
            float t[8];
            _mm256_storeu_ps(t, sum8x8(a00, a10, a20, a30, a01, a11, a21, a31));
            for (int d = D8; d < D; d++) {
                t[0] += q0[d] * k0[d], t[1] += q1[d] * k0[d], t[2] += q2[d] * k0[d], t[3] += q3[d] * k0[d];
                t[4] += q0[d] * k1[d], t[5] += q1[d] * k1[d], t[6] += q2[d] * k1[d], t[7] += q3[d] * k1[d];
            }
            for (int u = 0; u < 4; u++) s[(g + u) * bs + i] = t[u] * scale;
            if (i + 1 < n)
                for (int u = 0; u < 4; u++) s[(g + u) * bs + i + 1] = t[4 + u] * scale;
        }
    }
    if (g < G) qk_block(s + (int64_t)g * bs, bs, q + g * qs, qs, G - g, k, ks, n, D, scale);
}

/* pv_block for AVX2 + FMA: per 24 lanes of Dv, 4 queries' sums (12 accumulators) in
 * registers while the block's values stream past, each value load feeding four FMAs. */
__attribute__((target("avx2,fma"))) static void pv_avx2(float *acc, int Dv, const float *p, int bs, int G,
                                                         const float *v, int64_t vs, int n) {
    const int D24 = Dv - Dv % 24;
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *p0 = p + g * bs, *p1 = p0 + bs, *p2 = p1 + bs, *p3 = p2 + bs;
        float *c0 = acc + (int64_t)g * Dv, *c1 = c0 + Dv, *c2 = c1 + Dv, *c3 = c2 + Dv;
        for (int d = 0; d < D24; d += 24) {
            __m256 a00 = _mm256_loadu_ps(c0 + d), a01 = _mm256_loadu_ps(c0 + d + 8), a02 = _mm256_loadu_ps(c0 + d + 16);
            __m256 a10 = _mm256_loadu_ps(c1 + d), a11 = _mm256_loadu_ps(c1 + d + 8), a12 = _mm256_loadu_ps(c1 + d + 16);
            __m256 a20 = _mm256_loadu_ps(c2 + d), a21 = _mm256_loadu_ps(c2 + d + 8), a22 = _mm256_loadu_ps(c2 + d + 16);
            __m256 a30 = _mm256_loadu_ps(c3 + d), a31 = _mm256_loadu_ps(c3 + d + 8), a32 = _mm256_loadu_ps(c3 + d + 16);
            for (int i = 0; i < n; i++) {
                const float *vi = v + i * vs + d;
                const __m256 x0 = _mm256_loadu_ps(vi), x1 = _mm256_loadu_ps(vi + 8), x2 = _mm256_loadu_ps(vi + 16);
                __m256 b = _mm256_broadcast_ss(p0 + i);
                a00 = _mm256_fmadd_ps(b, x0, a00), a01 = _mm256_fmadd_ps(b, x1, a01), a02 = _mm256_fmadd_ps(b, x2, a02);
                b = _mm256_broadcast_ss(p1 + i);
                a10 = _mm256_fmadd_ps(b, x0, a10), a11 = _mm256_fmadd_ps(b, x1, a11), a12 = _mm256_fmadd_ps(b, x2, a12);
                b = _mm256_broadcast_ss(p2 + i);
                a20 = _mm256_fmadd_ps(b, x0, a20), a21 = _mm256_fmadd_ps(b, x1, a21), a22 = _mm256_fmadd_ps(b, x2, a22);
                b = _mm256_broadcast_ss(p3 + i);
                a30 = _mm256_fmadd_ps(b, x0, a30), a31 = _mm256_fmadd_ps(b, x1, a31), a32 = _mm256_fmadd_ps(b, x2, a32);
            }
            _mm256_storeu_ps(c0 + d, a00), _mm256_storeu_ps(c0 + d + 8, a01), _mm256_storeu_ps(c0 + d + 16, a02);
            _mm256_storeu_ps(c1 + d, a10), _mm256_storeu_ps(c1 + d + 8, a11), _mm256_storeu_ps(c1 + d + 16, a12);
            _mm256_storeu_ps(c2 + d, a20), _mm256_storeu_ps(c2 + d + 8, a21), _mm256_storeu_ps(c2 + d + 16, a22);
            _mm256_storeu_ps(c3 + d, a30), _mm256_storeu_ps(c3 + d + 8, a31), _mm256_storeu_ps(c3 + d + 16, a32);
        }
        if (D24 < Dv) {  /* the last Dv % 24 lanes */
            float *cs[4] = {c0, c1, c2, c3};
            const float *ps[4] = {p0, p1, p2, p3};
            for (int u = 0; u < 4; u++)
                for (int d = D24; d < Dv; d++)
                    for (int i = 0; i < n; i++) cs[u][d] += ps[u][i] * v[i * vs + d];
        }
    }
    if (g < G) pv_block(acc + (int64_t)g * Dv, Dv, p + g * bs, bs, G - g, v, vs, n);
}
#endif

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 3  /* how many blocks ahead of the one computing are asked for */
#endif

/* Ask for the K and V rows of pool block `blk` (head h) while the current block computes:
 * a block is a few KB at a random place in the pool, too short for the hardware prefetcher
 * to reach full speed on its own. */
static inline __attribute__((always_inline)) void prefetch_block(const Job *j, int h, int64_t blk) {
    const int esz = j->kv_dtype == 0 ? 4 : 2;
    const char *kp = (const char *)j->k + (h * j->k_head + blk * j->k_block) * esz;
    const char *vp = (const char *)j->v + (h * j->v_head + blk * j->v_block) * esz;
    const int64_t kbytes = (int64_t)j->bs * j->k_pos * esz, vbytes = (int64_t)j->bs * j->v_pos * esz;
    for (int64_t o = 0; o < kbytes; o += 64) __builtin_prefetch(kp + o, 0, 3);
    for (int64_t o = 0; o < vbytes; o += 64) __builtin_prefetch(vp + o, 0, 3);
}

/* One (row, KV head): scratch holds G*bs scores, bs*(D+Dv) converted K/V, G*Dv accumulators.
 * Per block: scores, the running max and sum per query (online softmax), rescaled sums. */
static inline __attribute__((always_inline)) void attend_item(const Job *j, int64_t r, int h, float *scratch,
                                                              int avx2) {
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
        const float *kb = kbuf, *vb = vbuf;  /* [n, D], [n, Dv]: in place when fp32 */
        int64_t ks = D, vs = Dv;
        if (j->kv_dtype == 0) {
            kb = (const float *)j->k + kat, ks = j->k_pos;
            vb = (const float *)j->v + vat, vs = j->v_pos;
        } else {
            for (int i = 0; i < n; i++) {
                load_vec(kbuf + (int64_t)i * D, j->k, kat + i * j->k_pos, D, j->kv_dtype);
                load_vec(vbuf + (int64_t)i * Dv, j->v, vat + i * j->v_pos, Dv, j->kv_dtype);
            }
        }
        if (p0 == lo) {  /* the item's next blocks */
            for (int a = 0; a < PREFETCH_BLOCKS - 1 && p0 + n + a * bs < c; a++) prefetch_block(j, h, table[(p0 + n) / bs + a]);
        }
        if (p0 + n + (PREFETCH_BLOCKS - 1) * bs < c) prefetch_block(j, h, table[(p0 + n) / bs + PREFETCH_BLOCKS - 1]);
#ifdef HAVE_AVX2_CLONE
        if (avx2) qk_avx2(scores, bs, q, j->q_head, G, kb, ks, n, D, j->scale);
        else
#endif
            qk_block(scores, bs, q, j->q_head, G, kb, ks, n, D, j->scale);
        for (int g = 0; g < G; g++) {
            float *s = scores + (int64_t)g * bs;
            float mx = m[g];
            for (int i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
            const float corr = expf(m[g] - mx);  /* 0 on the first block (m = -inf) */
            float sum = l[g] * corr;
            sum += exp_sub_sum(s, n, mx);
            if (corr != 1.f) {
                float *a = acc + (int64_t)g * Dv;
                for (int d = 0; d < Dv; d++) a[d] *= corr;
            }
            m[g] = mx;
            l[g] = sum;
        }
#ifdef HAVE_AVX2_CLONE
        if (avx2) pv_avx2(acc, Dv, scores, bs, G, vb, vs, n);
        else
#endif
            pv_block(acc, Dv, scores, bs, G, vb, vs, n);
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

/* The item loop twice: compiled for AVX2 + FMA, and for the baseline ISA; chosen once by
 * what the CPU reports (a dispatch of our own: GCC's arch= clones test the CPU model name,
 * which virtual machines often do not report). */
#ifdef HAVE_AVX2_CLONE
__attribute__((target("avx2,fma"))) static void run_items_avx2(Job *j, float *scratch) {
    const int64_t items = j->nrows * j->Hkv;
    for (;;) {
        const int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= items) break;
        attend_item(j, j->rows[it / j->Hkv], (int)(it % j->Hkv), scratch, 1);
    }
}
#endif

static void run_items_base(Job *j, float *scratch) {
    const int64_t items = j->nrows * j->Hkv;
    for (;;) {
        const int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= items) break;
        attend_item(j, j->rows[it / j->Hkv], (int)(it % j->Hkv), scratch, 0);
    }
}

static void *worker(void *arg) {
    Job *j = (Job *)arg;
    const size_t n = (size_t)j->G * j->bs + (size_t)j->bs * (j->D + j->Dv) + (size_t)j->G * j->Dv;
    float *scratch = (float *)malloc(n * sizeof(float));
    if (!scratch) { __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED); return NULL; }
#ifdef HAVE_AVX2_CLONE
    if (use_avx2()) run_items_avx2(j, scratch);
    else
#endif
        run_items_base(j, scratch);
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
    run_threads(worker, &j, nthreads, items);
    return j.failed;
}

/* An importable module, so setuptools builds and ships it like any extension. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_attention",
                                    "moecc's paged attention kernel (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__paged_attention(void) { return PyModule_Create(&module); }
