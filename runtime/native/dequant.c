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
 * The AVX-512 path (dequant_wide.h: 16 columns at a time; AVX-512 F, BW and DQ) runs when the CPU
 * reports them at run time, built twice: with AVX512-BF16's vcvtneps2bf16 for the bf16 rounding
 * (vectors holding a denormal or NaN take the integer rounding) and without. Nibble codes into a
 * 16-bit dtype are looked up 32 at a time in their group's 16 results, made once per group with the
 * same product and rounding. The portable path is plain C. All compute the same bits.
 *
 * Python calls it as _dequant.dequant_rows (METH_FASTCALL, below: a few hundred ns a call against
 * ctypes' microseconds); moecc_dequant_rows is also exported for ctypes. */
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
    const float *scale, *zero; int64_t srow;     /* [*, srow] fp32; zero may be NULL (then zconst) */
    const uint8_t *scale8; float scale_mul;      /* or the scales as e4m3 codes, each times scale_mul */
    float zconst;
    const uint8_t *zcodes; int64_t zrow_bytes; int zkind; float zadd;  /* or zeros as codes (per column only):
                                                   row i's column c is code c of zcodes + i * zrow_bytes, plus zadd */
    const int32_t *gidx;                         /* [R] row groups, or NULL */
    int64_t R, C, group_c, group_r, row0;
    void *out; int64_t out_stride; int out_dtype; /* out row r at out + r * out_stride elements */
    int64_t rows_per_item, items, next; int failed;
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

static float E4M3[256];  /* e4m3(b) for every byte (fp8 codes, NVFP4's scale grids), made once */
static pthread_once_t e4m3_once = PTHREAD_ONCE_INIT;
static void fill_e4m3(void) { for (int b = 0; b < 256; b++) E4M3[b] = e4m3((uint8_t)b); }

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
    for (int64_t c = c0; c < c1; c++) store1(j, r, c, (code1(j, p, sh, c) - (z ? z[c] : j->zconst)) * s[c]);
}

/* columns up to the first that code16 may start at (AWQ: a multiple of 8), from c */
static int64_t vector_start(const Job *j, int64_t c) {
    if (j->kind == K_AWQ) return (c + 7) & ~(int64_t)7;
    return j->kind == K_NIBBLE ? c + (c & 1) : c;
}

/* scale i of the grid: fp32 as given, or an e4m3 code's value times scale_mul (one fp32 product) */
static float scale_of(const Job *j, int64_t i) {
    return j->scale8 ? E4M3[j->scale8[i]] * j->scale_mul : j->scale[i];
}

#ifdef HAVE_AVX2_CLONE
#include <immintrin.h>
enum { WIDE_NONE = 0, WIDE_AVX512 = 1, WIDE_AVX512_BF16 = 2 };

/* the widest path this CPU runs: AVX-512 F+BW+DQ, and with AVX512-BF16 (its own feature bits,
 * asked once; MOECC_DEQUANT_PORTABLE: none, MOECC_DEQUANT_NO_BF16: not the bf16 one) */
static int wide_level(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                && __builtin_cpu_supports("avx512dq") ? WIDE_AVX512 : WIDE_NONE;
        if (known && __builtin_cpu_supports("avx512bf16")) known = WIDE_AVX512_BF16;
    }
    if (getenv("MOECC_DEQUANT_PORTABLE")) return WIDE_NONE;
    return known == WIDE_AVX512_BF16 && getenv("MOECC_DEQUANT_NO_BF16") ? WIDE_AVX512 : known;
}

#define E4M3_TABLE_MIN_GROUP 64  /* e4m3 by tables for groups of this many columns or more */

#define WSFX w512
#define WATTR __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define WBF16 0
#include "dequant_wide.h"
#undef WSFX
#undef WATTR
#undef WBF16
#define WSFX bf16
#define WATTR __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define WBF16 1
#include "dequant_wide.h"
#undef WSFX
#undef WATTR
#undef WBF16
#endif

/* zero code c of a zero row zp (K_NIBBLE: GPTQ's qzeros, K_AWQ: AutoAWQ's, K_UINT8: bytes), exact */
static float zero_code(int kind, const uint8_t *zp, int64_t c) {
    if (kind == K_NIBBLE) return (float)((zp[c >> 1] >> ((c & 1) * 4)) & 15);
    if (kind == K_AWQ) { const int n = AWQ_NIBBLE[c & 7]; return (float)((zp[(c >> 3) * 4 + (n >> 1)] >> ((n & 1) * 4)) & 15); }
    return (float)zp[c];
}

/* A worker's scratch: its decoded zero row (zeros given as codes: zbuf [C] holds zero row `row`)
 * and, for e4m3 codes into a 16-bit dtype, each column group's table of the 128 magnitudes'
 * results (tabs [G][128], made for scale index tab_key[g]) */
typedef struct { float *zbuf; int64_t row; uint16_t *tabs; int64_t *tab_key; } RowScratch;

static const float *zero_row(const Job *j, RowScratch *zr, int64_t i) {
    if (zr->row != i) {
        const uint8_t *zp = j->zcodes + i * j->zrow_bytes;
        for (int64_t c = 0; c < j->C; c++) zr->zbuf[c] = zero_code(j->zkind, zp, c) + j->zadd;
        zr->row = i;
    }
    return zr->zbuf;
}

static void one_row(const Job *j, int64_t r, int wide, RowScratch *zr) {
    int sh;
    const uint8_t *p = row_codes(j, r, &sh);
    const int64_t si = (j->gidx ? (int64_t)j->gidx[r] : (r + j->row0) / j->group_r) * j->srow;
    (void)wide;
    if (j->group_c == 1) {  /* a scale per column (GPTQ, AWQ as stored: rows are input channels) */
        const float *s = j->scale + si;
        const float *z = j->zcodes ? zero_row(j, zr, si / j->srow) : j->zero ? j->zero + si : NULL;
#ifdef HAVE_AVX2_CLONE
        if (wide == WIDE_AVX512_BF16) { percol_bf16(j, r, p, sh, s, z); return; }
        if (wide == WIDE_AVX512) { percol_w512(j, r, p, sh, s, z); return; }
#endif
        percol_base(j, r, p, sh, 0, j->C, s, z);
        return;
    }
#ifdef HAVE_AVX2_CLONE
    if (j->group_c == 16 && j->C % 16 == 0 && j->kind != K_AWQ) {  /* NVFP4's blocks: one loop, no calls */
        if (wide == WIDE_AVX512_BF16) { row_g16_bf16(j, r, p, sh, si); return; }
        if (wide == WIDE_AVX512) { row_g16_w512(j, r, p, sh, si); return; }
    }
#endif
    for (int64_t c0 = 0, g = 0; c0 < j->C; c0 += j->group_c, g++) {
        const int64_t c1 = c0 + j->group_c < j->C ? c0 + j->group_c : j->C;
        const float s = scale_of(j, si + g), z = j->zero ? j->zero[si + g] : j->zconst;
#ifdef HAVE_AVX2_CLONE
        if (zr->tabs && z == 0.0f && isfinite(s) && wide) {  /* e4m3 by its block's table */
            uint16_t *tab = zr->tabs + g * 128;
            if (zr->tab_key[g] != si + g) {
                if (wide == WIDE_AVX512_BF16) e4m3_table_bf16(j, s, tab); else e4m3_table_w512(j, s, tab);
                zr->tab_key[g] = si + g;
            }
            if (wide == WIDE_AVX512_BF16) e4m3_segment_bf16(j, r, p, c0, c1, s, tab);
            else e4m3_segment_w512(j, r, p, c0, c1, s, tab);
            continue;
        }
        if (wide == WIDE_AVX512_BF16) { segment_bf16(j, r, p, sh, c0, c1, s, z); continue; }
        if (wide == WIDE_AVX512) { segment_w512(j, r, p, sh, c0, c1, s, z); continue; }
#endif
        segment_base(j, r, p, sh, c0, c1, s, z);
    }
}

static void *worker(void *arg) {
    Job *j = (Job *)arg;
    int wide = 0;
#ifdef HAVE_AVX2_CLONE
    wide = wide_level();
#endif
    RowScratch zr = {NULL, -1, NULL, NULL};
    const int64_t G = (j->C + j->group_c - 1) / j->group_c;
    int ok = !j->zcodes || (zr.zbuf = malloc(sizeof(float) * (size_t)j->C));
    if (ok && wide && j->kind == K_E4M3 && j->out_dtype != OUT_F32 && j->group_c >= E4M3_TABLE_MIN_GROUP) {
        zr.tabs = malloc(sizeof(uint16_t) * 128 * (size_t)G);
        zr.tab_key = malloc(sizeof(int64_t) * (size_t)G);
        if (!zr.tabs || !zr.tab_key) ok = 0;
        else for (int64_t g = 0; g < G; g++) zr.tab_key[g] = -1;
    }
    if (!ok) {
        free(zr.zbuf); free(zr.tabs); free(zr.tab_key);
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    for (;;) {
        const int64_t it = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (it >= j->items) break;
        const int64_t r1 = (it + 1) * j->rows_per_item < j->R ? (it + 1) * j->rows_per_item : j->R;
        for (int64_t r = it * j->rows_per_item; r < r1; r++) one_row(j, r, wide, &zr);
    }
    free(zr.zbuf); free(zr.tabs); free(zr.tab_key);
    return NULL;
}

static void fill_lut(Job *j, const float *lut16) {
    for (int b = 0; b < 256; b++) {
        switch (j->kind) {
        case K_INT8: j->lut[b] = (float)(int8_t)b; break;
        case K_UINT8: j->lut[b] = (float)b; break;
        case K_E4M3: j->lut[b] = E4M3[b]; break;  /* made once (fill_e4m3), not per call */
        case K_E5M2: j->lut[b] = e5m2((uint8_t)b); break;
        default: j->lut[b] = b < 16 && lut16 ? lut16[b] : 0.0f;
        }
    }
}

#define MIN_ITEM_ELEMS 32768  /* a thread's work item: at least this many weights (whole rows) */

/* Returns 0, 1 when the arguments are inconsistent (nothing written), or 2 when memory ran out. */
int moecc_dequant_rows(const uint8_t *codes, int64_t row_bytes, int kind, const float *lut16, const float *scale,
                       const float *zero, int64_t srow, const int32_t *gidx, int64_t R, int64_t C, int64_t group_c,
                       int64_t group_r, int64_t row0, void *out, int64_t out_stride, int out_dtype, int nthreads,
                       int scale_e4m3, float scale_mul, float zconst, const uint8_t *zcodes, int64_t zrow_bytes,
                       int zkind, float zadd) {
    const int64_t need = kind == K_NIBBLE ? (C + 1) / 2 : kind == K_AWQ ? (C + 7) / 8 * 4
                         : kind >= K_WROW4 ? 4 * C : C;  /* bytes a row's codes take */
    if (kind < K_INT8 || kind > K_WROW8 || out_dtype < OUT_F32 || out_dtype > OUT_F16 || group_c < 1 || group_r < 1
        || R < 0 || C < 0 || row0 < 0 || ((kind == K_NIBBLE || kind == K_AWQ) && !lut16) || row_bytes < need
        || (scale_e4m3 && group_c == 1)  /* e4m3 scales: groups of columns only */
        || (zcodes && (group_c != 1 || zero || (zkind != K_NIBBLE && zkind != K_AWQ && zkind != K_UINT8)
                       || zrow_bytes < (zkind == K_UINT8 ? C : zkind == K_AWQ ? (C + 7) / 8 * 4 : (C + 1) / 2))))
        return 1;
    static Job zero_job;
    Job j = zero_job;
    j.codes = codes; j.row_bytes = row_bytes; j.kind = kind;
    j.scale = scale_e4m3 ? NULL : scale; j.scale8 = scale_e4m3 ? (const uint8_t *)scale : NULL;
    j.scale_mul = scale_mul; j.zconst = zconst; j.zero = zero; j.srow = srow; j.gidx = gidx;
    j.zcodes = zcodes; j.zrow_bytes = zrow_bytes; j.zkind = zkind; j.zadd = zadd;
    j.R = R; j.C = C; j.group_c = group_c; j.group_r = group_r; j.row0 = row0;
    j.out = out; j.out_stride = out_stride; j.out_dtype = out_dtype;
    pthread_once(&e4m3_once, fill_e4m3);
    fill_lut(&j, lut16);
    if (R == 0 || C == 0) return 0;
    j.rows_per_item = C >= MIN_ITEM_ELEMS ? 1 : (MIN_ITEM_ELEMS + C - 1) / C;
    j.items = (R + j.rows_per_item - 1) / j.rows_per_item;
    run_threads(worker, &j, nthreads, j.items);
    return j.failed ? 2 : 0;
}

/* dequant_rows(<moecc_dequant_rows's 24 arguments, the 3 floats last>) -> its return code: the same call from Python
 * without ctypes' per-argument conversions (a decode step makes a hundred of them). Pointers are
 * ints (data_ptr()) or None; the work runs without the GIL, as a ctypes call's does. */
static PyObject *py_dequant_rows(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 24) return PyErr_Format(PyExc_TypeError, "dequant_rows takes 24 arguments (%zd given)", n);
    long long v[21];
    for (int i = 0; i < 21; i++) {
        v[i] = args[i] == Py_None ? 0 : PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    const double scale_mul = PyFloat_AsDouble(args[21]), zconst = PyFloat_AsDouble(args[22]),
                 zadd = PyFloat_AsDouble(args[23]);
    if (PyErr_Occurred()) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moecc_dequant_rows((const uint8_t *)(intptr_t)v[0], v[1], (int)v[2], (const float *)(intptr_t)v[3],
                            (const float *)(intptr_t)v[4], (const float *)(intptr_t)v[5], v[6],
                            (const int32_t *)(intptr_t)v[7], v[8], v[9], v[10], v[11], v[12], (void *)(intptr_t)v[13],
                            v[14], (int)v[15], (int)v[16], (int)v[17], (float)scale_mul, (float)zconst,
                            (const uint8_t *)(intptr_t)v[18], v[19], (int)v[20], (float)zadd);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"dequant_rows", (PyCFunction)(void (*)(void))py_dequant_rows, METH_FASTCALL,
     "moecc_dequant_rows(...) from Python: (codes, row_bytes, kind, lut16, scale, zero, srow, gidx, R, C, "
     "group_c, group_r, row0, out, out_stride, out_dtype, nthreads, scale_e4m3, zcodes, zrow_bytes, zkind, "
     "scale_mul, zconst, zadd) -> 0, 1 (inconsistent arguments) or 2 (out of memory)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dequant",
                                    "moecc's grouped dequantization on the host (dequant_rows, or moecc_dequant_rows "
                                    "through ctypes).", -1, methods};

PyMODINIT_FUNC PyInit__dequant(void) { return PyModule_Create(&module); }
