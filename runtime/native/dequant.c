/* Grouped dequantization on the host, in one pass: the stored codes of a weight read once and its
 * compute-dtype values written once into the destination, with no temporary of the weight.
 * runtime/formats/_grouped.py describes the formats that reduce to this and calls it through
 * ctypes; its torch path is the same arithmetic (and the reference the tests hold this to).
 *
 * Legend: R = rows, C = columns of the weight as stored, G = column groups per scale row.
 *
 * Element (r, c) is code c of row r (codes + r * row_bytes: byte c, or the low (c even) / high
 * (c odd) nibble of byte c / 2; AWQ: nibble AWQ_NIBBLE[c % 8] of 32-bit word c / 8; packed
 * along rows (GPTQ's qweight): bits (r % k) * b.. of word c of word row r / k, k = 32 / b),
 * decoded exactly to fp32 v by its kind; then, with the row's group
 * gr = gidx ? gidx[r] : (r + row0) / group_r and i = gr * srow + c / group_c,
 *     w = (v - zero[i]) * scale[i]          (w = v * scale[i] without a zero)
 * in fp32 (one rounding, the product's: the subtraction is of small integers, exact), and w is
 * stored in the output dtype rounded to nearest even, as torch's casts do. NaN codes stay NaN
 * (bf16 0xFFFF, as torch writes it). Rows are shared among threads through an atomic counter.
 * The AVX-512 path (16 columns at a time) runs when the CPU reports AVX-512F at run time; the
 * portable path is plain C. Both compute the same bits.
 *
 * No Python API: the runtime calls moecc_dequant_rows through ctypes (runtime/native). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <Python.h>

#include "cpu.h"

enum { K_INT8 = 0, K_UINT8 = 1, K_E4M3 = 2, K_E5M2 = 3, K_NIBBLE = 4, K_AWQ = 5, K_WROW4 = 6, K_WROW8 = 7 };
static const int AWQ_NIBBLE[8] = {0, 4, 1, 5, 2, 6, 3, 7};  /* column k of a word's 8 -> its nibble */
enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };

typedef struct {
    const uint8_t *codes; int64_t row_bytes; int kind;
    float lut[256];                              /* code -> fp32 value (nibbles: the first 16) */
    const float *scale, *zero; int64_t srow;     /* [*, srow] fp32; zero may be NULL */
    const int32_t *gidx;                         /* [R] row groups, or NULL */
    int64_t R, C, group_c, group_r, row0;
    void *out; int64_t out_stride; int out_dtype; /* out row r at out + r * out_stride elements */
    int64_t rows_per_item, items, next;
} Job;

static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* fp32 -> bf16, nearest even; NaN -> 0xFFFF (torch's) */
static uint16_t to_bf16(float f) {
    const uint32_t x = bits_of(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* fp32 -> fp16, nearest even, subnormals kept, overflow to inf; NaN quieted, payload's top bits
 * kept (as F16C's vcvtps2ph does). Integer arithmetic only. */
static uint16_t to_f16(float f) {
    const uint32_t x = bits_of(f), sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);       /* >= 65520: inf */
    if (a >= 0x38800000u) {                                         /* normal: >= 2^-14 */
        const uint32_t r = a - 0x38000000u;
        return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
    }
    if (a <= 0x33000000u) return (uint16_t)sign;                    /* <= 2^-25: zero (a tie goes to 0) */
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - (a >> 23);  /* 14 .. 24 */
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

/* float8 e4m3fn byte -> fp32 (exact; 0x7F / 0xFF NaN) */
static float e4m3(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80) << 24, e = (b >> 3) & 15u, m = b & 7u;
    if ((b & 0x7F) == 0x7F) return float_of(sign | 0x7FF00000u);
    const float mag = e ? ldexpf(1.0f + (float)m / 8.0f, (int)e - 7) : ldexpf((float)m, -9);
    return float_of(sign | bits_of(mag));
}

/* float8 e5m2 byte -> fp32: the top byte of an fp16, widened exactly (NaN quieted) */
static float e5m2(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80) << 24, e = (b >> 2) & 31u, m = b & 3u;
    if (e == 31) return float_of(sign | 0x7F800000u | (m ? 0x400000u | (m << 21) : 0));
    const float mag = e ? ldexpf(1.0f + (float)m / 4.0f, (int)e - 15) : ldexpf((float)m, -16);
    return float_of(sign | bits_of(mag));
}

static void store1(const Job *j, int64_t r, int64_t c, float w) {
    const int64_t at = r * j->out_stride + c;
    if (j->out_dtype == OUT_F32) ((float *)j->out)[at] = w;
    else if (j->out_dtype == OUT_BF16) ((uint16_t *)j->out)[at] = to_bf16(w);
    else ((uint16_t *)j->out)[at] = to_f16(w);
}

/* row r's codes: its bytes, or (packed along rows) its word row and the bit shift of its values */
static const uint8_t *row_codes(const Job *j, int64_t r, int *shift) {
    const int64_t k = j->kind == K_WROW4 ? 8 : 4;
    if (j->kind != K_WROW4 && j->kind != K_WROW8) { *shift = 0; return j->codes + r * j->row_bytes; }
    *shift = (int)(r % k) * (int)(32 / k);
    return j->codes + (r / k) * j->row_bytes;
}

static float code1(const Job *j, const uint8_t *p, int shift, int64_t c) {
    uint32_t w;
    switch (j->kind) {
    case K_NIBBLE: return j->lut[(p[c >> 1] >> ((c & 1) * 4)) & 15];
    case K_AWQ: { const int n = AWQ_NIBBLE[c & 7]; return j->lut[(p[(c >> 3) * 4 + (n >> 1)] >> ((n & 1) * 4)) & 15]; }
    case K_WROW4: case K_WROW8:
        memcpy(&w, p + 4 * c, 4);
        return (float)((w >> shift) & (j->kind == K_WROW4 ? 15u : 255u));
    default: return j->lut[p[c]];
    }
}

/* columns [c0, c1) of row r, all in one group (scale s, zero z) */
static void segment_base(const Job *j, int64_t r, const uint8_t *p, int sh, int64_t c0, int64_t c1, float s, float z) {
    for (int64_t c = c0; c < c1; c++) store1(j, r, c, (code1(j, p, sh, c) - z) * s);
}

/* columns [c0, c1) of row r, a scale (and zero) per column: s[c], z[c] */
static void percol_base(const Job *j, int64_t r, const uint8_t *p, int sh, int64_t c0, int64_t c1, const float *s,
                        const float *z) {
    for (int64_t c = c0; c < c1; c++) store1(j, r, c, (code1(j, p, sh, c) - (z ? z[c] : 0.0f)) * s[c]);
}

#ifdef HAVE_AVX2_CLONE
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))

static int use_avx512(void) {
    static int known = -1;
    if (known < 0) { __builtin_cpu_init(); known = __builtin_cpu_supports("avx512f"); }
    return known;
}

/* the 16 nibbles of the 8 bytes at p, low then high of each, through lut16 */
AVX512 static inline __m512 nibble16(const uint8_t *p, __m512 lut16) {
    const __m512i x = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)p));  /* [8] bytes */
    const __m512i nib = _mm512_set1_epi64(15);
    const __m512i idx = _mm512_or_si512(_mm512_and_si512(x, nib),
                                        _mm512_slli_epi64(_mm512_and_si512(_mm512_srli_epi64(x, 4), nib), 32));
    return _mm512_permutexvar_ps(idx, lut16);  /* lane 2k: byte k's low nibble, 2k+1: its high */
}

/* 16 codes from column c (even for nibbles, a multiple of 8 for AWQ) -> 16 fp32 values */
AVX512 static inline __m512 code16(const Job *j, const uint8_t *p, int sh, int64_t c, __m512 lut16) {
    if (j->kind == K_WROW4 || j->kind == K_WROW8) {
        const __m512i w = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(p + 4 * c)), (unsigned)sh);
        return _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(j->kind == K_WROW4 ? 15 : 255)));
    }
    if (j->kind == K_AWQ) {  /* the nibbles in word order, then each column's own */
        const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
        return _mm512_permutexvar_ps(order, nibble16(p + (c >> 1), lut16));
    }
    if (j->kind == K_NIBBLE) return nibble16(p + (c >> 1), lut16);
    const __m128i b = _mm_loadu_si128((const __m128i *)(p + c));
    if (j->kind == K_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m512i u = _mm512_cvtepu8_epi32(b);
    if (j->kind == K_UINT8) return _mm512_cvtepi32_ps(u);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 8);
    if (j->kind == K_E5M2) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(u, 8)));
    /* e4m3: the magnitude's 7 bits at fp16's bit 7 are the value times 2^-8, subnormals too */
    const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7F));
    const __m512i h = _mm512_or_si512(sign, _mm512_slli_epi32(mag, 7));
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
    const __m512i nanv = _mm512_or_si512(_mm512_slli_epi32(sign, 16), _mm512_set1_epi32(0x7FF00000));
    return _mm512_mask_blend_ps(nan, v, _mm512_castsi512_ps(nanv));
}

AVX512 static inline void store16(const Job *j, int64_t r, int64_t c, __m512 w) {
    const int64_t at = r * j->out_stride + c;
    if (j->out_dtype == OUT_F32) { _mm512_storeu_ps((float *)j->out + at, w); return; }
    __m256i h;
    if (j->out_dtype == OUT_F16) h = _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else {
        const __m512i x = _mm512_castps_si512(w);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
        __m512i y = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
        y = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q), y, _mm512_set1_epi32(0xFFFF));
        h = _mm512_cvtepi32_epi16(y);
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)j->out + at), h);
}

/* columns up to the first that code16 may start at (AWQ: a multiple of 8), from c */
static int64_t vector_start(const Job *j, int64_t c) {
    if (j->kind == K_AWQ) return (c + 7) & ~(int64_t)7;
    return j->kind == K_NIBBLE ? c + (c & 1) : c;
}

AVX512 static void segment_avx512(const Job *j, int64_t r, const uint8_t *p, int sh, int64_t c0, int64_t c1, float s,
                                  float z) {
    const __m512 lut16 = _mm512_loadu_ps(j->lut), sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
    int64_t c = vector_start(j, c0) < c1 ? vector_start(j, c0) : c1;
    segment_base(j, r, p, sh, c0, c, s, z);
    for (; c + 16 <= c1; c += 16) store16(j, r, c, _mm512_mul_ps(_mm512_sub_ps(code16(j, p, sh, c, lut16), zv), sv));
    segment_base(j, r, p, sh, c, c1, s, z);
}

AVX512 static void percol_avx512(const Job *j, int64_t r, const uint8_t *p, int sh, const float *s, const float *z) {
    const __m512 lut16 = _mm512_loadu_ps(j->lut);
    int64_t c = 0;
    for (; c + 16 <= j->C; c += 16) {
        const __m512 v = code16(j, p, sh, c, lut16);
        const __m512 d = z ? _mm512_sub_ps(v, _mm512_loadu_ps(z + c)) : _mm512_sub_ps(v, _mm512_setzero_ps());
        store16(j, r, c, _mm512_mul_ps(d, _mm512_loadu_ps(s + c)));
    }
    percol_base(j, r, p, sh, c, j->C, s, z);
}
#endif

static void one_row(const Job *j, int64_t r, int wide) {
    int sh;
    const uint8_t *p = row_codes(j, r, &sh);
    const int64_t si = (j->gidx ? (int64_t)j->gidx[r] : (r + j->row0) / j->group_r) * j->srow;
    (void)wide;
    if (j->group_c == 1) {  /* a scale per column (GPTQ, AWQ as stored: rows are input channels) */
        const float *s = j->scale + si, *z = j->zero ? j->zero + si : NULL;
#ifdef HAVE_AVX2_CLONE
        if (wide) { percol_avx512(j, r, p, sh, s, z); return; }
#endif
        percol_base(j, r, p, sh, 0, j->C, s, z);
        return;
    }
    for (int64_t c0 = 0, g = 0; c0 < j->C; c0 += j->group_c, g++) {
        const int64_t c1 = c0 + j->group_c < j->C ? c0 + j->group_c : j->C;
        const float s = j->scale[si + g], z = j->zero ? j->zero[si + g] : 0.0f;
#ifdef HAVE_AVX2_CLONE
        if (wide) { segment_avx512(j, r, p, sh, c0, c1, s, z); continue; }
#endif
        segment_base(j, r, p, sh, c0, c1, s, z);
    }
}

static void *worker(void *arg) {
    Job *j = (Job *)arg;
    int wide = 0;
#ifdef HAVE_AVX2_CLONE
    wide = use_avx512() && !getenv("MOECC_DEQUANT_PORTABLE");
#endif
    for (;;) {
        const int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= j->items) break;
        const int64_t r1 = (it + 1) * j->rows_per_item < j->R ? (it + 1) * j->rows_per_item : j->R;
        for (int64_t r = it * j->rows_per_item; r < r1; r++) one_row(j, r, wide);
    }
    return NULL;
}

static void fill_lut(Job *j, const float *lut16) {
    for (int b = 0; b < 256; b++) {
        switch (j->kind) {
        case K_INT8: j->lut[b] = (float)(int8_t)b; break;
        case K_UINT8: j->lut[b] = (float)b; break;
        case K_E4M3: j->lut[b] = e4m3((uint8_t)b); break;
        case K_E5M2: j->lut[b] = e5m2((uint8_t)b); break;
        default: j->lut[b] = b < 16 && lut16 ? lut16[b] : 0.0f;
        }
    }
}

#define MIN_ITEM_ELEMS 32768  /* a thread's work item: at least this many weights (whole rows) */

/* Returns 0, or 1 when the arguments are inconsistent (nothing written). */
int moecc_dequant_rows(const uint8_t *codes, int64_t row_bytes, int kind, const float *lut16, const float *scale,
                       const float *zero, int64_t srow, const int32_t *gidx, int64_t R, int64_t C, int64_t group_c,
                       int64_t group_r, int64_t row0, void *out, int64_t out_stride, int out_dtype, int nthreads) {
    const int64_t need = kind == K_NIBBLE ? (C + 1) / 2 : kind == K_AWQ ? (C + 7) / 8 * 4
                         : kind >= K_WROW4 ? 4 * C : C;  /* bytes a row's codes take */
    if (kind < K_INT8 || kind > K_WROW8 || out_dtype < OUT_F32 || out_dtype > OUT_F16 || group_c < 1 || group_r < 1
        || R < 0 || C < 0 || row0 < 0 || ((kind == K_NIBBLE || kind == K_AWQ) && !lut16) || row_bytes < need)
        return 1;
    static Job zero_job;
    Job j = zero_job;
    j.codes = codes; j.row_bytes = row_bytes; j.kind = kind;
    j.scale = scale; j.zero = zero; j.srow = srow; j.gidx = gidx;
    j.R = R; j.C = C; j.group_c = group_c; j.group_r = group_r; j.row0 = row0;
    j.out = out; j.out_stride = out_stride; j.out_dtype = out_dtype;
    fill_lut(&j, lut16);
    if (R == 0 || C == 0) return 0;
    j.rows_per_item = C >= MIN_ITEM_ELEMS ? 1 : (MIN_ITEM_ELEMS + C - 1) / C;
    j.items = (R + j.rows_per_item - 1) / j.rows_per_item;
    run_threads(worker, &j, nthreads, j.items);
    return 0;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dequant",
                                    "moecc's grouped dequantization on the host (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__dequant(void) { return PyModule_Create(&module); }
