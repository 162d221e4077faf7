/* The host-attention kernel's inner loops, written once over a vector abstraction and
 * compiled once per ISA: paged_attention.c includes this file per build after defining
 *   ISA_NAME  the build's suffix (baseline, avx2, avx512): every function here is NAME_ISA
 *   ISA_ATTR  its function attribute (target("...") or nothing)
 *   VW, VF    lanes per vector and the vector type (8: v8 from vec8.h, 16: v16 from vec16.h)
 *   VLD, VST, VLDBF, VSUM8  fp32 load and store, bf16 load widened to fp32, the 8-way
 *             reduce to a v8
 *   PV_NV     vectors of Dv per query that pv keeps in registers
 *   BF16_STAGE_V  1: a bf16 block's values are widened once into scratch before pv (faster
 *             for 8 lanes, whose pv passes over the block several times), 0: in registers
 * and this file undefines them again. It needs paged_attention.c's Job, kv_at, exp_sub_sum,
 * prefetch_block and finish_item. K/V are fp32 or bf16 (`bf`, a constant in each
 * specialization: bf16 lanes are widened in registers, exactly), accumulation always fp32. */

#define ISA_CAT2(a, b) a##_##b
#define ISA_CAT(a, b) ISA_CAT2(a, b)
#define ISA_FN(name) ISA_CAT(name, ISA_NAME)
#define ISA_INLINE ISA_ATTR __attribute__((always_inline)) static inline
_Static_assert(PV_NV >= 1 && PV_NV <= 6, "attend_isa.h: PV_NV must be 1..6 (pv_rest's cases)");

/* VW lanes of a K or V pool from element `at` (fp32, or bf16 widened). */
ISA_INLINE VF ISA_FN(kv_ld)(const void *base, int64_t at, int bf) {
    return bf ? VLDBF((const uint16_t *)base + at) : VLD((const float *)base + at);
}

ISA_INLINE float ISA_FN(hsum)(VF x) {
    float r = 0.f;
    for (int l = 0; l < VW; l++) r += x[l];
    return r;
}

/* s[g * bs + i] = scale * q_g . k_i for g < G, i < n, k_i at pool element kat + i * ks: a
 * register tile of 4 queries x 2 positions (8 accumulators, each load of q or k feeding two
 * or four FMAs) reduced together by VSUM8; D % VW elements in scalar, G % 4 queries alone. */
ISA_INLINE void ISA_FN(qk)(float *s, int bs, const float *q, int64_t qs, int G, const void *k, int64_t kat,
                           int64_t ks, int n, int D, float scale, int bf) {
    const int DV = D - D % VW;
    int g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *qg[4] = {q + g * qs, q + (g + 1) * qs, q + (g + 2) * qs, q + (g + 3) * qs};
        for (int i = 0; i < n; i += 2) {
            const int64_t k0 = kat + i * ks, k1 = i + 1 < n ? k0 + ks : k0;  /* odd n: the last twice */
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
            for (int u = 0; u < 4; u++) s[(g + u) * bs + i] = t[u] * scale;
            if (i + 1 < n)
                for (int u = 0; u < 4; u++) s[(g + u) * bs + i + 1] = t[4 + u] * scale;
        }
    }
    for (; g < G; g++) {
        const float *qg = q + g * qs;
        for (int i = 0; i < n; i++) {
            const int64_t ki = kat + i * ks;
            VF a = {0};
            for (int d = 0; d < DV; d += VW) a += VLD(qg + d) * ISA_FN(kv_ld)(k, ki + d, bf);
            float r = ISA_FN(hsum)(a);
            for (int d = DV; d < D; d++) r += qg[d] * kv_at(k, ki + d, bf);
            s[g * bs + i] = r * scale;
        }
    }
}

/* acc[g, d0 .. d0 + NV * VW) += sum_i p[g * bs + i] * v_i for `nq` (1..4) queries from g0:
 * their sums in registers while the block's values stream past, each load feeding nq FMAs. */
ISA_INLINE void ISA_FN(pv_tile)(float *acc, int Dv, const float *p, int bs, int g0, int nq, const void *v,
                                int64_t vat, int64_t vs, int n, int d0, int NV, int bf) {
    VF a[4][PV_NV];
    float *c[4];
    const float *pg[4];
    for (int u = 0; u < nq; u++) {
        c[u] = acc + (int64_t)(g0 + u) * Dv + d0, pg[u] = p + (int64_t)(g0 + u) * bs;
        for (int w = 0; w < NV; w++) a[u][w] = VLD(c[u] + w * VW);
    }
    for (int i = 0; i < n; i++) {
        VF x[PV_NV];
        for (int w = 0; w < NV; w++) x[w] = ISA_FN(kv_ld)(v, vat + i * vs + d0 + w * VW, bf);
        for (int u = 0; u < nq; u++)
            for (int w = 0; w < NV; w++) a[u][w] += pg[u][i] * x[w];
    }
    for (int u = 0; u < nq; u++)
        for (int w = 0; w < NV; w++) VST(c[u] + w * VW, a[u][w]);
}

/* pv_tile for 4 queries and the last `nv` (< PV_NV, at most 5) vectors of Dv from d0, each
 * width its own constant (so its sums stay in registers). */
ISA_INLINE void ISA_FN(pv_rest)(float *acc, int Dv, const float *p, int bs, int g0, const void *v, int64_t vat,
                                int64_t vs, int n, int d0, int nv, int bf) {
    switch (nv) {
    case 1: ISA_FN(pv_tile)(acc, Dv, p, bs, g0, 4, v, vat, vs, n, d0, 1, bf); break;
    case 2: ISA_FN(pv_tile)(acc, Dv, p, bs, g0, 4, v, vat, vs, n, d0, 2 < PV_NV ? 2 : 1, bf); break;
    case 3: ISA_FN(pv_tile)(acc, Dv, p, bs, g0, 4, v, vat, vs, n, d0, 3 < PV_NV ? 3 : 1, bf); break;
    case 4: ISA_FN(pv_tile)(acc, Dv, p, bs, g0, 4, v, vat, vs, n, d0, 4 < PV_NV ? 4 : 1, bf); break;
    case 5: ISA_FN(pv_tile)(acc, Dv, p, bs, g0, 4, v, vat, vs, n, d0, 5 < PV_NV ? 5 : 1, bf); break;
    default: break;
    }
}

/* acc[g] += sum_i p[g * bs + i] * v_i for g < G, v_i at pool element vat + i * vs: tiles of
 * 4 queries x PV_NV vectors, then one tile of the vectors left, then Dv % VW lanes in scalar. */
ISA_INLINE void ISA_FN(pv)(float *acc, int Dv, const float *p, int bs, int G, const void *v, int64_t vat,
                           int64_t vs, int n, int bf) {
    const int DV = Dv - Dv % VW, DT = DV - DV % (PV_NV * VW);
    for (int g = 0; g < G; g += 4) {
        const int nq = G - g < 4 ? G - g : 4;
        if (nq == 4) {
            for (int d = 0; d < DT; d += PV_NV * VW) ISA_FN(pv_tile)(acc, Dv, p, bs, g, 4, v, vat, vs, n, d, PV_NV, bf);
            if (DT < DV) ISA_FN(pv_rest)(acc, Dv, p, bs, g, v, vat, vs, n, DT, (DV - DT) / VW, bf);
        } else {
            for (int d = 0; d < DV; d += VW) ISA_FN(pv_tile)(acc, Dv, p, bs, g, nq, v, vat, vs, n, d, 1, bf);
        }
        for (int u = 0; u < nq; u++) {
            float *c = acc + (int64_t)(g + u) * Dv;
            const float *pg = p + (g + u) * bs;
            for (int d = DV; d < Dv; d++)
                for (int i = 0; i < n; i++) c[d] += pg[i] * kv_at(v, vat + i * vs + d, bf);
        }
    }
}

/* dst[i, :m] = the bf16 pool row at element at + i * stride widened (exactly), for i < n. */
ISA_INLINE void ISA_FN(widen_block)(float *dst, const void *base, int64_t at, int64_t stride, int n, int m) {
    const int MV = m - m % VW;
    for (int i = 0; i < n; i++) {
        const uint16_t *src = (const uint16_t *)base + at + i * stride;
        float *o = dst + (int64_t)i * m;
        for (int d = 0; d < MV; d += VW) VST(o + d, VLDBF(src + d));
        for (int d = MV; d < m; d++) o[d] = bf16_at(src, d);
    }
}

/* One block of the online softmax, per query g: scores [g, :n] become exp(s - the new max),
 * the running max m[g] and sum l[g] move on, the sums acc [g, :Dv] are rescaled. */
ISA_INLINE void ISA_FN(softmax_block)(float *scores, int bs, int n, int G, float *m, float *l, float *acc, int Dv) {
    for (int g = 0; g < G; g++) {
        float *s = scores + (int64_t)g * bs;
        float mx = m[g];
        for (int i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
        const float corr = expf(m[g] - mx);  /* 0 on the first block (m = -inf) */
        const float sum = l[g] * corr + exp_sub_sum(s, n, mx);
        if (corr != 1.f)
            for (int d = 0; d < Dv; d++) acc[(int64_t)g * Dv + d] *= corr;
        m[g] = mx, l[g] = sum;
    }
}

/* One (row, KV head) with this build's loops: per block, scores, the running max and sum per
 * query (online softmax), rescaled sums; scratch holds G * bs scores, G * Dv sums and
 * bs * Dv widened values. */
ISA_INLINE void ISA_FN(attend_item)(const Job *j, int64_t r, int h, float *scratch, int bf) {
    const int G = j->G, D = j->D, Dv = j->Dv, bs = j->bs;
    float *scores = scratch;                  /* [G, bs] */
    float *acc = scores + (int64_t)G * bs;    /* [G, Dv] */
    float *vbuf = acc + (int64_t)G * Dv;      /* [bs, Dv] (BF16_STAGE_V) */
    float m[G], l[G];
    for (int g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.f;
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
        if (p0 == lo)  /* the item's next blocks */
            for (int a = 0; a < PREFETCH_BLOCKS - 1 && p0 + n + a * bs < c; a++) prefetch_block(j, h, table[(p0 + n) / bs + a]);
        if (p0 + n + (PREFETCH_BLOCKS - 1) * bs < c) prefetch_block(j, h, table[(p0 + n) / bs + PREFETCH_BLOCKS - 1]);
        const void *vb = j->v;  /* the block's values: in the pool, or widened into vbuf */
        int64_t va = vat, vs = j->v_pos;
        int vbf = bf;
        if (bf && BF16_STAGE_V) {
            ISA_FN(widen_block)(vbuf, j->v, vat, vs, n, Dv);
            vb = vbuf, va = 0, vs = Dv, vbf = 0;
        }
        ISA_FN(qk)(scores, bs, q, j->q_head, G, j->k, kat, j->k_pos, n, D, j->scale, bf);
        ISA_FN(softmax_block)(scores, bs, n, G, m, l, acc, Dv);
        ISA_FN(pv)(acc, Dv, scores, bs, G, vb, va, vs, n, vbf);
        p0 += n;
    }
    finish_item(j, r, h, acc, m, l);
}

/* Take (row, KV head) items from the job's counter until none is left. */
ISA_ATTR static void ISA_FN(run_items)(Job *j, float *scratch) {
    const int64_t items = j->nrows * j->Hkv;
    const int bf = j->kv_dtype == 1;
    for (;;) {
        const int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= items) break;
        const int64_t r = j->rows[it / j->Hkv];
        const int h = (int)(it % j->Hkv);
        if (bf) ISA_FN(attend_item)(j, r, h, scratch, 1);
        else ISA_FN(attend_item)(j, r, h, scratch, 0);
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
#undef PV_NV
#undef BF16_STAGE_V
