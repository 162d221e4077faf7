/* dequant.c's AVX-512 path, included once per build (the attend_isa.h pattern):
 *   WSFX      the build's suffix: every function here is NAME_WSFX
 *   WATTR     its target attribute (AVX-512 F, BW and DQ; plus BF16 in the bf16 build)
 *   WBF16     1 when fp32 -> bf16 rounding may use vcvtneps2bf16 (AVX512-BF16)
 * Every function computes the bits of its plain-C twin in dequant.c (segment_base, percol_base):
 * the same fp32 arithmetic and the same rounding to the output dtype.
 *
 * Legend: a "vector" is 16 fp32 lanes (one column each) or 32 16-bit lanes. */
#define WCAT2(a, b) a##_##b
#define WCAT(a, b) WCAT2(a, b)
#define W(name) WCAT(name, WSFX)

/* the 16 nibbles of the 8 bytes at p, low then high of each, through lut16 */
WATTR static inline __m512 W(nibble16)(const uint8_t *p, __m512 lut16) {
    const __m512i x = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)p));  /* [8] bytes */
    const __m512i nib = _mm512_set1_epi64(15);
    const __m512i idx = _mm512_or_si512(_mm512_and_si512(x, nib),
                                        _mm512_slli_epi64(_mm512_and_si512(_mm512_srli_epi64(x, 4), nib), 32));
    return _mm512_permutexvar_ps(idx, lut16);  /* lane 2k: byte k's low nibble, 2k+1: its high */
}

/* 16 codes from column c (even for nibbles, a multiple of 8 for AWQ) -> 16 fp32 values */
WATTR static inline __m512 W(code16)(const Job *j, const uint8_t *p, int sh, int64_t c, __m512 lut16) {
    if (j->kind == K_WROW4 || j->kind == K_WROW8) {
        const __m512i w = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(p + 4 * c)), (unsigned)sh);
        return _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(j->kind == K_WROW4 ? 15 : 255)));
    }
    if (j->kind == K_AWQ) {  /* the nibbles in word order, then each column's own */
        const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
        return _mm512_permutexvar_ps(order, W(nibble16)(p + (c >> 1), lut16));
    }
    if (j->kind == K_NIBBLE) return W(nibble16)(p + (c >> 1), lut16);
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

/* 16 fp32 values -> 16 bf16, nearest even, NaN -> 0xFFFF (to_bf16's bits). vcvtneps2bf16 treats
 * denormal inputs as zero and keeps a NaN's sign: vectors with either take the integer way. */
WATTR static inline __m256i W(bf16_16)(__m512 w) {
#if WBF16
    if (!_mm512_fpclass_ps_mask(w, 0x01 | 0x80 | 0x20))  /* no QNaN, SNaN or denormal lane */
        return (__m256i)_mm512_cvtneps_pbh(w);
#endif
    const __m512i x = _mm512_castps_si512(w);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i y = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    y = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q), y, _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(y);
}

/* 16 fp32 values -> the output dtype's 16 values, as store1 rounds them */
WATTR static inline __m256i W(half16)(const Job *j, __m512 w) {
    if (j->out_dtype == OUT_F16) return _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return W(bf16_16)(w);
}

WATTR static inline void W(store16)(const Job *j, int64_t r, int64_t c, __m512 w) {
    const int64_t at = r * j->out_stride + c;
    if (j->out_dtype == OUT_F32) { _mm512_storeu_ps((float *)j->out + at, w); return; }
    _mm256_storeu_si256((__m256i *)((uint16_t *)j->out + at), W(half16)(j, w));
}

/* 32 fp32 values (w0 then w1) stored from column c: in bf16 with one check and one vcvtne2ps2bf16
 * for both halves where the build has it (a denormal or NaN lane: store16's integer rounding) */
WATTR static inline void W(store32)(const Job *j, int64_t r, int64_t c, __m512 w0, __m512 w1) {
#if WBF16
    if (j->out_dtype == OUT_BF16
        && !(_mm512_fpclass_ps_mask(w0, 0x01 | 0x80 | 0x20) | _mm512_fpclass_ps_mask(w1, 0x01 | 0x80 | 0x20))) {
        _mm512_storeu_si512((void *)((uint16_t *)j->out + r * j->out_stride + c), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        return;
    }
#endif
    W(store16)(j, r, c, w0);
    W(store16)(j, r, c + 16, w1);
}

/* Nibble codes (K_NIBBLE) into a 16-bit dtype, columns [c, c1) from an even c: the group's 16
 * possible results made once (the same fp32 product and rounding as each element's), then 32
 * columns a time by table lookup (vpermw). Returns the first column not written. */
WATTR static int64_t W(nibble_table16)(const Job *j, int64_t r, const uint8_t *p, int64_t c, int64_t c1, __m512 tab_f) {
    const __m512i tab = _mm512_castsi256_si512(W(half16)(j, tab_f));  /* [16] results by nibble */
    uint16_t *o = (uint16_t *)j->out + r * j->out_stride;
    const __m512i nib = _mm512_set1_epi32(15);
    for (; c + 32 <= c1; c += 32) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + (c >> 1))));  /* [16] bytes */
        const __m512i idx = _mm512_or_si512(_mm512_and_si512(b, nib), _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16));
        _mm512_storeu_si512((void *)(o + c), _mm512_permutexvar_epi16(idx, tab));  /* lane 2k low, 2k+1 high */
    }
    return c;
}

/* columns [c0, c1) of row r, all in one group (scale s, zero z) */
WATTR static void W(segment)(const Job *j, int64_t r, const uint8_t *p, int sh, int64_t c0, int64_t c1, float s,
                             float z) {
    const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
    __m512 lut16 = _mm512_loadu_ps(j->lut);
    int64_t c = vector_start(j, c0) < c1 ? vector_start(j, c0) : c1;
    segment_base(j, r, p, sh, c0, c, s, z);
    if (j->kind == K_NIBBLE) {  /* a nibble's result is one of 16: look them up */
        const __m512 tab_f = _mm512_mul_ps(_mm512_sub_ps(lut16, zv), sv);  /* [16] fp32 results by nibble */
        if (j->out_dtype != OUT_F32) c = W(nibble_table16)(j, r, p, c, c1, tab_f);
        for (; c + 16 <= c1; c += 16) W(store16)(j, r, c, W(code16)(j, p, sh, c, tab_f));
    } else {
        for (; c + 32 <= c1; c += 32)
            W(store32)(j, r, c, _mm512_mul_ps(_mm512_sub_ps(W(code16)(j, p, sh, c, lut16), zv), sv),
                       _mm512_mul_ps(_mm512_sub_ps(W(code16)(j, p, sh, c + 16, lut16), zv), sv));
        for (; c + 16 <= c1; c += 16) W(store16)(j, r, c, _mm512_mul_ps(_mm512_sub_ps(W(code16)(j, p, sh, c, lut16), zv), sv));
    }
    _mm256_zeroupper();  /* before plain C runs again: SSE code after dirty upper halves stalls */
    segment_base(j, r, p, sh, c, c1, s, z);
}

/* row r, a scale (and zero) per column: s[c], z[c] (z NULL: zconst) */
WATTR static void W(percol)(const Job *j, int64_t r, const uint8_t *p, int sh, const float *s, const float *z) {
    const __m512 lut16 = _mm512_loadu_ps(j->lut), zc = _mm512_set1_ps(j->zconst);
    int64_t c = 0;
    for (; c + 32 <= j->C; c += 32)
        W(store32)(j, r, c, _mm512_mul_ps(_mm512_sub_ps(W(code16)(j, p, sh, c, lut16), z ? _mm512_loadu_ps(z + c) : zc),
                                          _mm512_loadu_ps(s + c)),
                   _mm512_mul_ps(_mm512_sub_ps(W(code16)(j, p, sh, c + 16, lut16), z ? _mm512_loadu_ps(z + c + 16) : zc),
                                 _mm512_loadu_ps(s + c + 16)));
    for (; c + 16 <= j->C; c += 16) {
        const __m512 v = W(code16)(j, p, sh, c, lut16);
        const __m512 d = _mm512_sub_ps(v, z ? _mm512_loadu_ps(z + c) : zc);
        W(store16)(j, r, c, _mm512_mul_ps(d, _mm512_loadu_ps(s + c)));
    }
    _mm256_zeroupper();
    percol_base(j, r, p, sh, c, j->C, s, z);
}

/* row r of a weight in groups of 16 columns (C a multiple of 16, codes 16 a vector from column 0) */
WATTR static void W(row_g16)(const Job *j, int64_t r, const uint8_t *p, int sh, int64_t si) {
    const __m512 lut16 = _mm512_loadu_ps(j->lut);
    for (int64_t c = 0, g = si; c < j->C; c += 16, g++) {
        const __m512 z = _mm512_set1_ps(j->zero ? j->zero[g] : j->zconst);
        W(store16)(j, r, c, _mm512_mul_ps(_mm512_sub_ps(W(code16)(j, p, sh, c, lut16), z), _mm512_set1_ps(scale_of(j, g))));
    }
    _mm256_zeroupper();
}

/* e4m3 codes into a 16-bit dtype, scale s finite, no zero point: tab [128] the results of the 128
 * magnitudes (E4M3[m] * s rounded, as each element's), a code's the table's with its sign bit
 * flipped by the code's (exact: (-m) * s = -(m * s), and rounding to nearest even is symmetric) */
WATTR static void W(e4m3_table)(const Job *j, float s, uint16_t *tab) {
    const __m512 sv = _mm512_set1_ps(s);
    for (int i = 0; i < 128; i += 16)
        _mm256_storeu_si256((__m256i *)(tab + i), W(half16)(j, _mm512_mul_ps(_mm512_loadu_ps(E4M3 + i), sv)));
}

/* columns [c0, c1) of row r by tab (e4m3_table's for this group), 32 a time by vpermi2w */
WATTR static void W(e4m3_segment)(const Job *j, int64_t r, const uint8_t *p, int64_t c0, int64_t c1, float s,
                                  const uint16_t *tab) {
    const __m512i t0 = _mm512_loadu_si512(tab), t1 = _mm512_loadu_si512(tab + 32);
    const __m512i t2 = _mm512_loadu_si512(tab + 64), t3 = _mm512_loadu_si512(tab + 96);
    const __m512i m7 = _mm512_set1_epi16(0x7F), b6 = _mm512_set1_epi16(0x40), b7 = _mm512_set1_epi16(0x80);
    uint16_t *o = (uint16_t *)j->out + r * j->out_stride;
    int64_t c = c0;
    for (; c + 32 <= c1; c += 32) {
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + c)));  /* [32] codes */
        const __m512i m = _mm512_and_si512(b, m7);                                                /* magnitudes */
        __m512i w = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(m, b6), _mm512_permutex2var_epi16(t0, m, t1),
                                            _mm512_permutex2var_epi16(t2, m, t3));
        w = _mm512_xor_si512(w, _mm512_slli_epi16(_mm512_and_si512(b, b7), 8));
        if (j->out_dtype == OUT_BF16)  /* the NaN code: 0xFFFF whatever its sign, as to_bf16 writes NaN */
            w = _mm512_mask_mov_epi16(w, _mm512_cmpeq_epi16_mask(m, m7), _mm512_set1_epi16(-1));
        _mm512_storeu_si512((void *)(o + c), w);
    }
    _mm256_zeroupper();
    segment_base(j, r, p, 0, c, c1, s, 0.0f);
}

#undef W
#undef WCAT
#undef WCAT2
