/* 16 lanes of fp32 for the host-attention kernel's AVX-512 build (paged_attention.c,
 * attend_isa.h): a GCC/Clang vector type the compiler lowers to zmm registers inside
 * functions with AVX512_TARGET, loads, bf16 widening, and the 8-way reduce of 16-lane sums.
 * Needs cpu.h and vec8.h first; empty without HAVE_AVX512_CLONE. Header-only, all inline. */
#ifndef MOECC_VEC16_H
#define MOECC_VEC16_H

#ifdef HAVE_AVX512_CLONE  /* cpu.h */
#include <immintrin.h>

typedef float v16 __attribute__((vector_size(64)));

#define AVX512_INLINE __attribute__((target(AVX512_TARGET), always_inline)) static inline

AVX512_INLINE v16 ld16(const float *p) { return (v16)_mm512_loadu_ps(p); }
AVX512_INLINE void st16(float *p, v16 x) { _mm512_storeu_ps(p, (__m512)x); }

/* 16 bf16 values widened to fp32 (exact): zero-extend each to 32 bits, shift into the top half. */
AVX512_INLINE v16 ldbf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Lane j of the result = the sum of a[j]'s sixteen lanes: halves added, then sum8x8_avx2. */
AVX512_INLINE v8 sum8x16(const v16 a[8]) {
    v8 h[8];
    for (int j = 0; j < 8; j++)
        h[j] = (v8)_mm256_add_ps(_mm512_castps512_ps256((__m512)a[j]), _mm512_extractf32x8_ps((__m512)a[j], 1));
    return sum8x8_avx2(h);
}
#endif

#endif
