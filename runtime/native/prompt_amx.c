/* Causal attention of fresh prompts on AMX tiles, bf16 in and out. A fresh prompt's rows are
 * its whole context (positions 0..n-1); for prompt row p, query head g and its KV head
 * h = g / (Hq / Hkv):
 *
 *   out[p, g] = sum_{j <= p} softmax_j(scale * q[p, g] . k[j, h]) v[j, h]
 *
 * Legend: n a prompt's rows, D / Dv the key / value head dim (multiples of 16; the tiles pad them
 * with zeros to Dp / Dvp, multiples of 32), nk = keys a row block sees rounded up to 32, Hq / Hkv
 * query / KV heads; a tile is 16 rows of 64 bytes.
 *
 * Numerics, as torch's flash attention computes bf16 on the CPU: q . k in fp32 over bf16 inputs,
 * scaled in fp32; exp(s - max) and its sum in fp32; the weights rounded to bf16 for P . V (fp32
 * sums); each output times 1 / its row's sum, rounded once. A row block sees all its keys in
 * one pass (no online rescaling between key blocks) and the exp is this file's, so the bits differ
 * from SDPA's by rounding; prompt_amx.py says where the runtime takes it.
 *
 * Work: items (prompt, a KV head's query heads: all of them, or a share where prompts are too few
 * to keep the threads busy), the longest prompts first, taken from an atomic counter by torch's
 * threads (cpu.h). A thread lays out the item's KV head's K and V as the tiles the products read
 * (VNNI pairs, keys past n zero) into its own scratch, unless its last item had them, then for each
 * query head and each block of 32 rows: S = Q K^T over the keys the block sees (2 x 2 tiles a
 * step), each row's softmax into P, O = P V (2 x 2 tiles).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <Python.h>

#include "amx.h"
#include "bf16.h"
#include "cpu.h"
#include "prompt_items.h"
#include "py_args.h"

typedef struct {
    const uint16_t *q, *k, *v; int64_t t, ldq, ldk, ldv;  /* [t, Hq, D], [t, Hkv, D], [t, Hkv, Dv] */
    const int64_t *spans; int64_t ns;                  /* [ns, 2]: rows [lo, hi) of each prompt */
    int64_t Hq, Hkv, D, Dv, Dp, Dvp; float scale;      /* Dp, Dvp: D, Dv rounded up to 32 (zeros) */
    const int64_t *items; int64_t nitems, per;         /* [ns * Hq / per]: s * (Hq / per) + c, the longest */
                                                       /* prompts first; item c: query heads c * per .. + per */
    uint16_t *out; int64_t ldo;                        /* [t, Hq, Dv] */
    int64_t next;                                      /* the next item to hand out */
} Job;

#define SPAN_N(j, s) SPAN_N_RAW((j)->spans, s)
#define ROUND32(x) (((x) + 31) / 32 * 32)

#ifdef HAVE_AMX
/* K's tiles of keys [16 kb, 16 kb + 16) (those past n zero): row i % 16 of tile (kb, i / 16) holds
 * the dim pair (2i, 2i + 1) of each key, one 32-bit lane a key (a gather down the keys' rows);
 * dims D..Dp zero. */
AMX_TARGET static void lay_out_k(const uint16_t *k0, int64_t ldk, int64_t kb, int64_t n, int64_t D, int64_t Dp,
                                 uint16_t *kt) {
    const int64_t left = n - 16 * kb;
    const __mmask16 valid = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(ldk / 2)));  /* a key's row, in pairs */
    const int *base = (const int *)(k0 + 16 * kb * ldk);
    uint16_t *dst = kt + kb * (Dp / 32) * 512;
    for (int64_t i = 0; i < Dp / 2; i++)
        _mm512_storeu_si512(dst + (i / 16) * 512 + (i % 16) * 32,
                            i < D / 2 ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, rows, base + i, 4)
                                      : _mm512_setzero_si512());
}

/* V's tiles of keys 2i, 2i + 1 (a, b: NULL past n, zeros): row i % 16 of tile (i / 16, d / 16)
 * interleaves the two keys' dims d..d+15; dims Dv..Dvp zero. */
AMX_TARGET static void lay_out_v(const uint16_t *a, const uint16_t *b, int64_t i, int64_t Dv, int64_t Dvp,
                                 uint16_t *vt) {
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    uint16_t *dst = vt + (i / 16) * (Dvp / 16) * 512 + (i % 16) * 32;
    for (int64_t d = 0; d < Dvp; d += 16) {
        const __m256i x = a && d < Dv ? _mm256_loadu_si256((const __m256i *)(a + d)) : _mm256_setzero_si256();
        const __m256i y = b && d < Dv ? _mm256_loadu_si256((const __m256i *)(b + d)) : _mm256_setzero_si256();
        _mm512_storeu_si512(dst + (d / 16) * 512,
                            _mm512_permutexvar_epi16(mix, _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1)));
    }
}

/* Prompt s, KV head h: K's tiles (16 keys x 32 dims: row i = dims 2i, 2i+1 of each key) into kt,
 * then V's (32 keys x 16 dims: row i = keys 2i, 2i+1 of each dim) after them, ROUND32(n) keys
 * with zeros past n. */
AMX_TARGET static void lay_out(const Job *j, int64_t s, int64_t h, uint16_t *kt) {
    const int64_t lo = j->spans[2 * s], n = SPAN_N(j, s), nk = ROUND32(n), D = j->D, Dv = j->Dv;
    uint16_t *vt = kt + nk * j->Dp;
    for (int64_t kb = 0; kb < nk / 16; kb++) lay_out_k(j->k + lo * j->ldk + h * D, j->ldk, kb, n, D, j->Dp, kt);
    for (int64_t i = 0; i < nk / 2; i++) {
        const uint16_t *a = 2 * i < n ? j->v + (lo + 2 * i) * j->ldv + h * Dv : NULL;
        const uint16_t *b = 2 * i + 1 < n ? j->v + (lo + 2 * i + 1) * j->ldv + h * Dv : NULL;
        lay_out_v(a, b, i, Dv, j->Dvp, vt);
    }
}

/* 2^x for x <= 0 (a row's scaled scores less its max, in log2 units): 2^i * 2^f, i = round(x),
 * |f| <= 1/2, 2^f = 1 + f P(f) with Cephes' exp2f polynomial (relative error ~1e-7, far under
 * bf16's 4e-3 step); scalef makes 0 of anything below 2^-149. */
AMX_TARGET static inline __m512 exp2_neg(__m512 x) {
    const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, i);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, i);
}

/* A thread's scratch for prompts of up to nk keys: the K/V tiles of (s, h) (laid out when an item
 * needs another), a block's queries, scores, weights, outputs and row sums. */
typedef struct { uint16_t *kv, *q, *p; float *s, *o, *sum; int64_t s_at, h_at; } Scratch;

/* S[32, nk] (rows nk apart) = Q's 32 rows (qt: bf16, Dp dims, rows ldq elements apart) . K^T for
 * the block's nk keys. */
AMX_TARGET static void scores(const uint16_t *qt, int64_t ldq, const uint16_t *kt, int64_t Dp, int64_t nk, float *S) {
    const int64_t DS = Dp / 32;
    for (int64_t kp = 0; kp < nk / 32; kp++) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t ds = 0; ds < DS; ds++) {
            _tile_loadd(4, qt + ds * 32, ldq * 2);
            _tile_loadd(5, qt + 16 * ldq + ds * 32, ldq * 2);
            _tile_loadd(6, kt + ((2 * kp) * DS + ds) * 512, 64);
            _tile_loadd(7, kt + ((2 * kp + 1) * DS + ds) * 512, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, S + kp * 32, nk * 4); _tile_stored(1, S + kp * 32 + 16, nk * 4);
        _tile_stored(2, S + 16 * nk + kp * 32, nk * 4); _tile_stored(3, S + 16 * nk + kp * 32 + 16, nk * 4);
    }
}

/* Row r of the block (position p, keys 0..p visible): P[r] = bf16(e^(scale S - max)) over the
 * visible keys (as 2^(scale log2(e) S - max)), 0 past them up to nk; sum[r] their fp32 sum (1 for
 * a row past the prompt). */
AMX_TARGET static void softmax_row(const float *S, uint16_t *P, int64_t nk, int64_t visible, float scale, float *sum) {
    if (visible <= 0) {
        memset(P, 0, (size_t)nk * 2);
        *sum = 1.0f;
        return;
    }
    const __m512 sc = _mm512_set1_ps(scale * 1.44269504088896341f);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < visible; c += 16) {
        const __mmask16 m = visible - c >= 16 ? 0xffff : (__mmask16)((1u << (visible - c)) - 1);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(S + c));
    }
    const __m512 top = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mx)), sc);  /* scale > 0 */
    __m512 acc = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c < visible; c += 16) {
        const int64_t left = visible - c;
        const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 e = _mm512_maskz_mov_ps(m, exp2_neg(_mm512_fmsub_ps(_mm512_loadu_ps(S + c), sc, top)));
        acc = _mm512_add_ps(acc, e);
        _mm256_storeu_si256((__m256i *)(P + c), f2bf16(e));
    }
    if (c < nk) memset(P + c, 0, (size_t)(nk - c) * 2);
    *sum = _mm512_reduce_add_ps(acc);
}

/* O[32, Dv] (fp32, Dv a multiple of 32 here: Dvp) = P[32, nk] (bf16) . V for the block's nk keys. */
AMX_TARGET static void weighted(const uint16_t *P, const uint16_t *vt, int64_t Dv, int64_t nk, float *O) {
    const int64_t DB = Dv / 16;
    for (int64_t dp = 0; dp < Dv / 32; dp++) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t ks = 0; ks < nk / 32; ks++) {
            _tile_loadd(4, P + ks * 32, nk * 2);
            _tile_loadd(5, P + 16 * nk + ks * 32, nk * 2);
            _tile_loadd(6, vt + (ks * DB + 2 * dp) * 512, 64);
            _tile_loadd(7, vt + (ks * DB + 2 * dp + 1) * 512, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, O + dp * 32, Dv * 4); _tile_stored(1, O + dp * 32 + 16, Dv * 4);
        _tile_stored(2, O + 16 * Dv + dp * 32, Dv * 4); _tile_stored(3, O + 16 * Dv + dp * 32 + 16, Dv * 4);
    }
}

/* Rows [32 b, 32 b + 32) of prompt s, query head g, over w's K/V tiles (kt, vt). */
AMX_TARGET static void block(const Job *j, int64_t s, int64_t g, int64_t b, Scratch *w, const uint16_t *kt,
                             const uint16_t *vt) {
    const int64_t lo = j->spans[2 * s], n = SPAN_N(j, s), r0 = 32 * b, D = j->D, Dv = j->Dv, Dp = j->Dp, Dvp = j->Dvp;
    const int64_t rows = n - r0 < 32 ? n - r0 : 32, nk = ROUND32(r0 + rows);
    const uint16_t *qt = j->q + (lo + r0) * j->ldq + g * D;  /* read in place (rows past the prompt: */
    int64_t ldq = j->ldq;                                    /* another's, their scores unused) */
    if (lo + r0 + 32 > j->t || D != Dp) {  /* but not past q's end, nor past a head: copied, zeros after */
        memset(w->q, 0, (size_t)(32 * Dp * 2));
        for (int64_t r = 0; r < rows; r++) memcpy(w->q + r * Dp, qt + r * ldq, (size_t)D * 2);
        qt = w->q, ldq = Dp;
    }
    scores(qt, ldq, kt, Dp, nk, w->s);
    for (int64_t r = 0; r < 32; r++)
        softmax_row(w->s + r * nk, w->p + r * nk, nk, r < rows ? r0 + r + 1 : 0, j->scale, w->sum + r);
    weighted(w->p, vt, Dvp, nk, w->o);
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = j->out + (lo + r0 + r) * j->ldo + g * Dv;
        const __m512 inv = _mm512_set1_ps(1.0f / w->sum[r]);  /* as torch's flash attention: times 1 / sum */
        for (int64_t d = 0; d < Dv; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d), f2bf16(_mm512_mul_ps(_mm512_loadu_ps(w->o + r * Dvp + d), inv)));
    }
}

/* One item: every row block of prompt s for query heads g0 .. g0 + per - 1 (one KV head's: its
 * tiles laid out first unless this thread's last item had them). */
AMX_TARGET static void item(const Job *j, int64_t s, int64_t g0, Scratch *w) {
    const int64_t h = g0 / (j->Hq / j->Hkv), n = SPAN_N(j, s);
    if (w->s_at != s || w->h_at != h) {
        lay_out(j, s, h, w->kv);
        w->s_at = s, w->h_at = h;
    }
    for (int64_t g = g0; g < g0 + j->per; g++)
        for (int64_t b = 0; b < (n + 31) / 32; b++) block(j, s, g, b, w, w->kv, w->kv + ROUND32(n) * j->Dp);
}

/* Sizes of a Scratch's parts for prompts of up to nk keys, in bytes (each a multiple of 64). */
#define SCRATCH_PARTS(j, nk) {(nk) * ((j)->Dp + (j)->Dvp) * 2, 32 * (j)->Dp * 2, 32 * (nk) * 2, 32 * (nk) * 4, \
                              32 * (j)->Dvp * 4, 32 * 4}

AMX_TARGET static void *attend_items(void *arg) {
    Job *j = (Job *)arg;
    int64_t nk = 32;
    for (int64_t s = 0; s < j->ns; s++) nk = ROUND32(SPAN_N(j, s)) > nk ? ROUND32(SPAN_N(j, s)) : nk;
    const int64_t part[6] = SCRATCH_PARTS(j, nk);
    char *mem = aligned_alloc(64, (size_t)(part[0] + part[1] + part[2] + part[3] + part[4] + part[5]));
    if (!mem) return NULL;  /* moecc_prompt_amx checks every item was taken */
    Scratch w = {(uint16_t *)mem, (uint16_t *)(mem + part[0]), (uint16_t *)(mem + part[0] + part[1]),
                 (float *)(mem + part[0] + part[1] + part[2]), (float *)(mem + part[0] + part[1] + part[2] + part[3]),
                 (float *)(mem + part[0] + part[1] + part[2] + part[3] + part[4]), -1, -1};
    tiles_on();
    for (;;) {
        const int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= j->nitems) break;
        const int64_t per_s = j->Hq / j->per;  /* items a prompt */
        item(j, j->items[it] / per_s, j->items[it] % per_s * j->per, &w);
    }
    _tile_release();
    free(mem);
    return NULL;
}

#endif

/* 1: this build and CPU run the kernel; 0: they do not. */
int moecc_prompt_amx_ready(void) {
#ifdef HAVE_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* Returns 0 (done), 1 (arguments it does not take: nothing written), 2 (no AMX here) or 3 (out of
 * memory). q/k/v/out: t rows, ldq/ldk/ldv/ldo elements apart, heads contiguous in a row. */
int moecc_prompt_amx(const uint16_t *q, int64_t t, int64_t ldq, const uint16_t *k, int64_t ldk, const uint16_t *v, int64_t ldv,
                     const int64_t *spans, int64_t ns, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float scale,
                     uint16_t *out, int64_t ldo, int nthreads) {
#ifdef HAVE_AMX
    if (!amx_ready()) return 2;
    int64_t maxn;  /* unused here: the tiles' scratch is per block */
    if (!prompt_args_ok(spans, ns, t, Hq, Hkv, D, Dv, ldq, ldk, ldv, ldo, &maxn)) return 1;
    const int nth = nthreads < 1 ? 1 : nthreads;
    int64_t per = Hq / Hkv;  /* a KV head's query heads an item (one lay-out of its tiles); while too few */
    while (per > 1 && ns * Hq / per < 4 * nth) {  /* items to share among the threads, the next divisor down */
        int64_t d = per - 1;
        while ((Hq / Hkv) % d) d--;
        per = d;
    }
    const int64_t nitems = ns * Hq / per;
    int64_t *items = longest_first(spans, ns, Hq / per);
    if (!items) return 3;
    Job j = {q, k, v, t, ldq, ldk, ldv, spans, ns, Hq, Hkv, D, Dv, ROUND32(D), ROUND32(Dv), scale, items, nitems, per,
             out, ldo, 0};
    run_threads(attend_items, &j, nth, nitems);
    free(items);
    return j.next >= nitems ? 0 : 3;  /* no thread had scratch: nothing taken */
#else
    (void)q, (void)ldq, (void)k, (void)ldk, (void)v, (void)ldv, (void)spans, (void)ns, (void)Hq, (void)Hkv, (void)D;
    (void)t, (void)Dv, (void)scale, (void)out, (void)ldo, (void)nthreads;
    return 2;
#endif
}

/* Python entries (METH_FASTCALL, pointers as ints, the work without the GIL: py_args.h). */
static PyObject *py_attend(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    long long v[17];
    if (int_args(args, n, 17, "attend", 1u << 13, v)) return NULL;
    const double scale = PyFloat_AsDouble(args[13]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_prompt_amx((const uint16_t *)(intptr_t)v[0], v[1], v[2], (const uint16_t *)(intptr_t)v[3], v[4],
                          (const uint16_t *)(intptr_t)v[5], v[6], (const int64_t *)(intptr_t)v[7], v[8], v[9], v[10],
                          v[11], v[12], (float)scale, (uint16_t *)(intptr_t)v[14], v[15], (int)v[16]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

PY_READY(moecc_prompt_amx_ready)

static PyMethodDef methods[] = {
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_FASTCALL,
     "attend(q, t, ldq, k, ldk, v, ldv, spans, ns, Hq, Hkv, D, Dv, scale, out, ldo, nthreads) -> 0, 1, 2 or 3"},
    PY_READY_METHOD,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prompt_amx",
                                    "moecc's causal attention of fresh prompts on AMX tiles.", -1, methods};

PyMODINIT_FUNC PyInit__prompt_amx(void) { return PyModule_Create(&module); }
