/* The host-attention kernel's inner loops, written once over a vector abstraction and
 * compiled once per ISA: paged_attention.c includes this file per build after defining
 *   ISA_NAME  the build's suffix (baseline, avx2, avx512): every function here is NAME_ISA
 *   ISA_ATTR  its function attribute (target("...") or nothing)
 *   VW, VF    lanes per vector and the vector type (8: v8 from vec8.h, 16: v16 from vec16.h)
 *   VLD, VST, VLDBF, VSUM8  fp32 load and store, bf16 load widened to fp32, the 8-way
 *             reduce to a v8
 *   PV_NV     vectors of Dv per query that pv keeps in registers
 *   BF16_STAGE_V  1: a bf16 chunk's values are widened once into scratch before pv (faster
 *             for 8 lanes, whose pv passes over the chunk several times), 0: in registers
 *   QK_BF16   (optional, 16 lanes with AVX512-BF16 only) 1: bf16 queries over bf16 keys score
 *             by qk_bf16 (vdpbf16ps); every other build widens bf16 queries and runs qk
 * and this file undefines them again. It needs paged_attention.c's Job, kv_at, exp_sub_sum,
 * CHUNK, PfCursor, pf_span, pf_item, pf_step and finish_item. K/V are fp32 or bf16 (`bf`, a constant in each
 * specialization: bf16 lanes are widened in registers, exactly), accumulation always fp32. */

#define ISA_CAT2(a, b) a##_##b
#define ISA_CAT(a, b) ISA_CAT2(a, b)
#define ISA_FN(name) ISA_CAT(name, ISA_NAME)
#define ISA_INLINE ISA_ATTR __attribute__((always_inline)) static inline
_Static_assert(PV_NV >= 1 && PV_NV <= 6, "attend_isa.h: PV_NV must be 1..6 (pv_rest's cases)");
#ifndef QK_BF16
#define QK_BF16 0
#endif
#ifndef VMAX  /* lane-wise x > m ? x : m (what vmaxps computes, NaN and signed zeros alike) */
#define VMAX(x, m) ISA_FN(vmax_lanes)(x, m)
ISA_INLINE VF ISA_FN(vmax_lanes)(VF x, VF m) {
    for (int u = 0; u < VW; u++) m[u] = x[u] > m[u] ? x[u] : m[u];
    return m;
}
#endif

/* VW lanes of a K or V pool from element `at` (fp32, or bf16 widened). */
ISA_INLINE VF ISA_FN(kv_ld)(const void *base, int64_t at, int bf) {
    return bf ? VLDBF((const uint16_t *)base + at) : VLD((const float *)base + at);
}

ISA_INLINE float ISA_FN(hsum)(VF x) {
    float r = 0.f;
    for (int l = 0; l < VW; l++) r += x[l];
    return r;
}

/* s[g * ss + i] = scale * q_g . k_i for g < G, i < n, key i at pool element kat[i]: register
 * tiles of 4 queries x 2 positions (8 accumulators, each load of q or k feeding two or four
 * FMAs), and for the G % 4 queries left 1 query x 8 positions, each tile reduced together by
 * VSUM8; D % VW elements in scalar. */
ISA_INLINE void ISA_FN(qk)(float *s, int ss, const float *q, int64_t qs, int G, const void *k, const int64_t *kat,
                           int n, int D, float scale, int bf, PfCursor *pf) {
    const int DV = D - D % VW;
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *qg[4] = {q + g * qs, q + (g + 1) * qs, q + (g + 2) * qs, q + (g + 3) * qs};
        for (int i = 0; i < n; i += 2) {
            const int64_t k0 = kat[i], k1 = i + 1 < n ? kat[i + 1] : k0;  /* odd n: the last twice */
            pf_step(pf, 1);
            VF a[8] = {0};  /* a[u]: query u . k0, a[4 + u]: query u . k1 */
            for (int d = 0; d < DV; d += VW) {
                const VF x0 = ISA_FN(kv_ld)(k, k0 + d, bf), x1 = ISA_FN(kv_ld)(k, k1 + d, bf);
                for (int u = 0; u < 4; u++) {
                    const VF y = VLD(qg[u] + d);
                    a[u] += y * x0, a[4 + u] += y * x1;
                }
            }
            float t[8];
            st8(t, VSUM8(a));
            for (int d = DV; d < D; d++) {
                const float x0 = kv_at(k, k0 + d, bf), x1 = kv_at(k, k1 + d, bf);
                for (int u = 0; u < 4; u++) t[u] += qg[u][d] * x0, t[4 + u] += qg[u][d] * x1;
            }
            for (int u = 0; u < 4; u++) s[(g + u) * ss + i] = t[u] * scale;
            if (i + 1 < n)
                for (int u = 0; u < 4; u++) s[(g + u) * ss + i + 1] = t[4 + u] * scale;
        }
    }
    for (; g < G; g++) {
        const float *qg = q + g * qs;
        for (int i = 0; i < n; i += 8) {
            int64_t ki[8];
            for (int u = 0; u < 8; u++) ki[u] = kat[i + u < n ? i + u : n - 1];  /* past n: the last again */
            pf_step(pf, 4);
            VF a[8] = {0};  /* a[u]: the query . k_{i+u} */
            for (int d = 0; d < DV; d += VW) {
                const VF y = VLD(qg + d);
                for (int u = 0; u < 8; u++) a[u] += y * ISA_FN(kv_ld)(k, ki[u] + d, bf);
            }
            float t[8];
            st8(t, VSUM8(a));
            for (int d = DV; d < D; d++)
                for (int u = 0; u < 8; u++) t[u] += qg[d] * kv_at(k, ki[u] + d, bf);
            for (int u = 0; u < 8 && i + u < n; u++) s[g * ss + i + u] = t[u] * scale;
        }
    }
}

#if QK_BF16
/* qk for bf16 queries and keys, q and k as they are: each vdpbf16ps adds the exact products of
 * 32 (q, k) element pairs into 16 fp32 lanes, so a step covers 32 elements of D with half qk's
 * instructions and no widening. The same tiles and the same reduce as qk (a row's bits still do
 * not depend on its group), the D % 32 elements left in scalar fp32; only the order of the sums
 * differs from qk's. */
ISA_INLINE void ISA_FN(qk_bf16)(float *s, int ss, const uint16_t *q, int64_t qs, int G, const uint16_t *k,
                                const int64_t *kat, int n, int D, float scale, PfCursor *pf) {
    const int DV = D - D % 32;
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        const uint16_t *qg[4] = {q + g * qs, q + (g + 1) * qs, q + (g + 2) * qs, q + (g + 3) * qs};
        for (int i = 0; i < n; i += 2) {
            const int64_t k0 = kat[i], k1 = i + 1 < n ? kat[i + 1] : k0;  /* odd n: the last twice */
            pf_step(pf, 1);
            __m512 a[8];  /* a[u]: query u . k0, a[4 + u]: query u . k1 */
            for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
            for (int d = 0; d < DV; d += 32) {
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512(k + k0 + d);
                const __m512bh x1 = (__m512bh)_mm512_loadu_si512(k + k1 + d);
                for (int u = 0; u < 4; u++) {
                    const __m512bh y = (__m512bh)_mm512_loadu_si512(qg[u] + d);
                    a[u] = _mm512_dpbf16_ps(a[u], y, x0), a[4 + u] = _mm512_dpbf16_ps(a[4 + u], y, x1);
                }
            }
            VF av[8];
            for (int u = 0; u < 8; u++) av[u] = (VF)a[u];
            float t[8];
            st8(t, VSUM8(av));
            for (int d = DV; d < D; d++) {
                const float x0 = bf16_at(k, k0 + d), x1 = bf16_at(k, k1 + d);
                for (int u = 0; u < 4; u++) t[u] += bf16_at(qg[u], d) * x0, t[4 + u] += bf16_at(qg[u], d) * x1;
            }
            for (int u = 0; u < 4; u++) s[(g + u) * ss + i] = t[u] * scale;
            if (i + 1 < n)
                for (int u = 0; u < 4; u++) s[(g + u) * ss + i + 1] = t[4 + u] * scale;
        }
    }
    for (; g < G; g++) {
        const uint16_t *qg = q + g * qs;
        for (int i = 0; i < n; i += 8) {
            int64_t ki[8];
            for (int u = 0; u < 8; u++) ki[u] = kat[i + u < n ? i + u : n - 1];  /* past n: the last again */
            pf_step(pf, 4);
            __m512 a[8];  /* a[u]: the query . k_{i+u} */
            for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
            for (int d = 0; d < DV; d += 32) {
                const __m512bh y = (__m512bh)_mm512_loadu_si512(qg + d);
                for (int u = 0; u < 8; u++) a[u] = _mm512_dpbf16_ps(a[u], y, (__m512bh)_mm512_loadu_si512(k + ki[u] + d));
            }
            VF av[8];
            for (int u = 0; u < 8; u++) av[u] = (VF)a[u];
            float t[8];
            st8(t, VSUM8(av));
            for (int d = DV; d < D; d++)
                for (int u = 0; u < 8; u++) t[u] += bf16_at(qg, d) * bf16_at(k, ki[u] + d);
            for (int u = 0; u < 8 && i + u < n; u++) s[g * ss + i + u] = t[u] * scale;
        }
    }
}
#endif

/* acc[g, d0 .. d0 + NV * VW) += sum_i p[g * ss + i] * v_i for `nq` (1..4) queries from g0,
 * value i at element vat[i]: their sums in registers while the chunk's values stream past,
 * each load feeding nq FMAs. */
ISA_INLINE void ISA_FN(pv_tile)(float *acc, int Dv, const float *p, int ss, int g0, int nq, const void *v,
                                const int64_t *vat, int n, int d0, int NV, int bf, PfCursor *pf) {
    VF a[4][PV_NV];
    float *c[4];
    const float *pg[4];
    for (int u = 0; u < nq; u++) {
        c[u] = acc + (int64_t)(g0 + u) * Dv + d0, pg[u] = p + (int64_t)(g0 + u) * ss;
        for (int w = 0; w < NV; w++) a[u][w] = VLD(c[u] + w * VW);
    }
    for (int i = 0; i < n; i++) {
        VF x[PV_NV];
        for (int w = 0; w < NV; w++) x[w] = ISA_FN(kv_ld)(v, vat[i] + d0 + w * VW, bf);
        pf_step(pf, 1);
        for (int u = 0; u < nq; u++)
            for (int w = 0; w < NV; w++) a[u][w] += pg[u][i] * x[w];
    }
    for (int u = 0; u < nq; u++)
        for (int w = 0; w < NV; w++) VST(c[u] + w * VW, a[u][w]);
}

/* pv_tile for 4 queries and the last `nv` (< PV_NV, at most 5) vectors of Dv from d0, each
 * width its own constant (so its sums stay in registers). */
ISA_INLINE void ISA_FN(pv_rest)(float *acc, int Dv, const float *p, int ss, int g0, const void *v,
                                const int64_t *vat, int n, int d0, int nv, int bf, PfCursor *pf) {
    switch (nv) {
    case 1: ISA_FN(pv_tile)(acc, Dv, p, ss, g0, 4, v, vat, n, d0, 1, bf, pf); break;
    case 2: ISA_FN(pv_tile)(acc, Dv, p, ss, g0, 4, v, vat, n, d0, 2 < PV_NV ? 2 : 1, bf, pf); break;
    case 3: ISA_FN(pv_tile)(acc, Dv, p, ss, g0, 4, v, vat, n, d0, 3 < PV_NV ? 3 : 1, bf, pf); break;
    case 4: ISA_FN(pv_tile)(acc, Dv, p, ss, g0, 4, v, vat, n, d0, 4 < PV_NV ? 4 : 1, bf, pf); break;
    case 5: ISA_FN(pv_tile)(acc, Dv, p, ss, g0, 4, v, vat, n, d0, 5 < PV_NV ? 5 : 1, bf, pf); break;
    default: break;
    }
}

/* acc[g] += sum_i p[g * ss + i] * v_i for g < G, value i at element vat[i]: tiles of 4
 * queries x PV_NV vectors, then one tile of the vectors left, then Dv % VW lanes in scalar. */
ISA_INLINE void ISA_FN(pv)(float *acc, int Dv, const float *p, int ss, int G, const void *v, const int64_t *vat,
                           int n, int bf, PfCursor *pf) {
    const int DV = Dv - Dv % VW, DT = DV - DV % (PV_NV * VW);
    for (int g = 0; g < G; g += 4) {
        const int nq = G - g < 4 ? G - g : 4;
        if (nq == 4) {
            for (int d = 0; d < DT; d += PV_NV * VW) ISA_FN(pv_tile)(acc, Dv, p, ss, g, 4, v, vat, n, d, PV_NV, bf, pf);
            if (DT < DV) ISA_FN(pv_rest)(acc, Dv, p, ss, g, v, vat, n, DT, (DV - DT) / VW, bf, pf);
        } else {
            for (int d = 0; d < DV; d += VW) ISA_FN(pv_tile)(acc, Dv, p, ss, g, nq, v, vat, n, d, 1, bf, pf);
        }
        for (int u = 0; u < nq; u++) {
            float *c = acc + (int64_t)(g + u) * Dv;
            const float *pg = p + (g + u) * ss;
            for (int d = DV; d < Dv; d++)
                for (int i = 0; i < n; i++) c[d] += pg[i] * kv_at(v, vat[i] + d, bf);
        }
    }
}

/* dst[i, :m] = the bf16 pool row at element at[i] widened (exactly), for i < n. */
ISA_INLINE void ISA_FN(widen_rows)(float *dst, const void *base, const int64_t *at, int n, int m, PfCursor *pf) {
    const int MV = m - m % VW;
    for (int i = 0; i < n; i++) {
        const uint16_t *src = (const uint16_t *)base + at[i];
        float *o = dst + (int64_t)i * m;
        for (int d = 0; d < MV; d += VW) VST(o + d, VLDBF(src + d));
        for (int d = MV; d < m; d++) o[d] = bf16_at(src, d);
        pf_step(pf, 1);
    }
}

/* The online softmax over one chunk, per query g over its first nv[g] scores (a group's row
 * sees only the positions before its ctx): scores [g, :nv[g]] become exp(s - the new max) and
 * [g, nv[g]:n] zero, the running max m[g] and sum l[g] move on, the sums acc [g, :Dv] are
 * rescaled. The bits of a query's row alone, whose chunk ends at nv[g]. */
ISA_INLINE void ISA_FN(softmax_chunk)(float *scores, int ss, int n, const int *nv, int G, float *m, float *l,
                                      float *acc, int Dv) {
    for (int g = 0; g < G; g++) {
        float *s = scores + (int64_t)g * ss;
        const int ng = nv[g], NV = ng - ng % VW;
        for (int i = ng; i < n; i++) s[i] = 0.f;
        if (!ng) continue;
        float mx = m[g];
        if (NV) {
            VF vm = VLD(s);
            for (int i = VW; i < NV; i += VW) vm = VMAX(VLD(s + i), vm);
            for (int u = 0; u < VW; u++) mx = vm[u] > mx ? vm[u] : mx;
        }
        for (int i = NV; i < ng; i++) mx = s[i] > mx ? s[i] : mx;
        const float corr = expf(m[g] - mx);  /* 0 on the first chunk (m = -inf) */
        const float sum = l[g] * corr + exp_sub_sum(s, ng, mx);
        if (corr != 1.f)
            for (int d = 0; d < Dv; d++) acc[(int64_t)g * Dv + d] *= corr;
        m[g] = mx, l[g] = sum;
    }
}

/* One KV head of a group of `nr` rows (row_groups) with this build's loops, CHUNK positions at
 * a time up to the last row's ctx: the chunk's pool offsets, its scores, the running max and
 * sum per query over the positions before its row's ctx (online softmax), rescaled sums, the
 * values' contributions; the next chunk's blocks are asked for before this one computes (the
 * first chunk's by run_items, an item ahead). scratch: worker's floats. */
ISA_INLINE void ISA_FN(attend_item)(const Job *j, const int64_t *rows, int nr, int h, float *scratch, int bf,
                                    int64_t next_item) {
    const int G = j->G, GQ = nr * G, D = j->D, Dv = j->Dv, bs = j->bs;
    float *scores = scratch;                    /* [GQ, CHUNK] */
    float *acc = scores + (int64_t)GQ * CHUNK;  /* [GQ, Dv] */
    float *vbuf = acc + (int64_t)GQ * Dv;       /* [CHUNK, Dv] (BF16_STAGE_V) */
    float *qbuf = vbuf + (int64_t)CHUNK * Dv;   /* [GQ, D]: the group's queries, packed (fp32, or bf16 for qk_bf16) */
    int64_t kat[CHUNK], vat[CHUNK], vrow[CHUNK];
    float m[GQ], l[GQ];
    int nv[GQ];  /* per query: the chunk's positions before its row's ctx */
    for (int g = 0; g < GQ; g++) m[g] = -INFINITY, l[g] = 0.f;
    memset(acc, 0, sizeof(float) * (size_t)GQ * Dv);
    const int qbf = QK_BF16 && bf && j->q_dtype == 1;  /* bf16 q over bf16 K: qk_bf16, q packed as it is */
    PfCursor none, pf;  /* pf: the next spans' lines, asked for a few at a time by the loops */
    pf_clear(&none);
    /* the loop steps of a full chunk that ask (pf_step(pf, 1) each): qk's position pairs (or
     * eighths), pv's positions per tile of values, the widened values' rows */
    const int64_t pv_tiles = Dv >= VW ? (Dv / VW + PV_NV - 1) / PV_NV : 0, qk_steps = G % 4 ? CHUNK / 8 * 4 : CHUNK / 2;
    const int64_t pf_steps = (int64_t)((GQ + 3) / 4) * (qk_steps + CHUNK * pv_tiles) + (bf && BF16_STAGE_V ? CHUNK : 0);
    for (int u = 0; u < nr; u++)
        for (int g = 0; g < G; g++) {
            const int64_t at = rows[u] * j->q_row + (int64_t)(h * G + g) * j->q_head, to = (int64_t)(u * G + g) * D;
            if (qbf) memcpy((uint16_t *)qbuf + to, (const uint16_t *)j->q + at, sizeof(uint16_t) * (size_t)D);
            else if (j->q_dtype == 1)
                ISA_FN(widen_rows)(qbuf + to, j->q, &at, 1, D, &none);  /* exact */
            else memcpy(qbuf + to, (const float *)j->q + at, sizeof(float) * (size_t)D);
        }
    const int64_t c = j->ctx[rows[nr - 1]], lo = j->lo[rows[0]];
    const int64_t *table = j->tables + j->table_off[rows[0]];
    for (int64_t p0 = lo; p0 < c; p0 += CHUNK) {
        const int n = (int)(c - p0 < CHUNK ? c - p0 : CHUNK);
        pf_clear(&pf);  /* this item's next chunk, then (during its first) the next item's first */
        if (p0 + n < c) pf_span(&pf, j, h, table, p0 + n, c < p0 + n + CHUNK ? c : p0 + n + CHUNK);
        if (p0 == lo) pf_item(&pf, j, next_item);
        pf_pace(&pf, pf_steps);
        for (int64_t i = 0, b = p0 / bs, off = p0 % bs; i < n; i++) {  /* position p0 + i: block b, offset off */
            kat[i] = h * j->k_head + table[b] * j->k_block + off * j->k_pos;
            vat[i] = h * j->v_head + table[b] * j->v_block + off * j->v_pos;
            if (++off == bs) off = 0, b++;
        }
        const void *vb = j->v;  /* the chunk's values: in the pool, or widened into vbuf */
        const int64_t *va = vat;
        int vbf = bf;
        if (bf && BF16_STAGE_V) {
            ISA_FN(widen_rows)(vbuf, j->v, vat, n, Dv, &pf);
            for (int i = 0; i < n; i++) vrow[i] = (int64_t)i * Dv;
            vb = vbuf, va = vrow, vbf = 0;
        }
#if QK_BF16
        if (qbf) ISA_FN(qk_bf16)(scores, CHUNK, (const uint16_t *)qbuf, D, GQ, (const uint16_t *)j->k, kat, n, D, j->scale, &pf);
        else
#endif
        ISA_FN(qk)(scores, CHUNK, qbuf, D, GQ, j->k, kat, n, D, j->scale, bf, &pf);
        for (int u = 0; u < nr; u++) {
            const int64_t cu = j->ctx[rows[u]] - p0;
            for (int g = 0; g < G; g++) nv[u * G + g] = (int)(cu < 0 ? 0 : cu < n ? cu : n);
        }
        ISA_FN(softmax_chunk)(scores, CHUNK, n, nv, GQ, m, l, acc, Dv);
        ISA_FN(pv)(acc, Dv, scores, CHUNK, GQ, vb, va, n, vbf, &pf);
        pf_step(&pf, INT_MAX);  /* what the loops left unasked (a short chunk) */
    }
    for (int u = 0; u < nr; u++)
        finish_item(j, rows[u], h, acc + (int64_t)u * G * Dv, m + u * G, l + u * G);
}

/* Take work items (group, KV head) from the job's counter until none is left, each claimed
 * one item ahead so that its first chunk is asked for while the one before computes. */
ISA_ATTR static void ISA_FN(run_items)(Job *j, float *scratch) {
    const int64_t items = j->ngroups * j->Hkv;
    const int bf = j->kv_dtype == 1;
    int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    if (it < items) {  /* the first item's first chunk at once: nothing computes before it */
        PfCursor first;
        pf_clear(&first);
        pf_item(&first, j, it);
        pf_step(&first, INT_MAX);
    }
    while (it < items) {
        const int64_t after = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);  /* asked for by it's last chunk */
        const int64_t gi = it / j->Hkv;
        const int64_t *rows = j->rows + j->group[gi];
        const int nr = (int)(j->group[gi + 1] - j->group[gi]);
        const int h = (int)(it % j->Hkv);
        if (bf) ISA_FN(attend_item)(j, rows, nr, h, scratch, 1, after);
        else ISA_FN(attend_item)(j, rows, nr, h, scratch, 0, after);
        it = after;
    }
}

#undef ISA_INLINE
#undef ISA_FN
#undef ISA_CAT
#undef ISA_CAT2
#undef ISA_NAME
#undef ISA_ATTR
#undef VW
#undef VF
#undef VLD
#undef VST
#undef VLDBF
#undef VSUM8
#undef VMAX
#undef PV_NV
#undef BF16_STAGE_V
#undef QK_BF16
