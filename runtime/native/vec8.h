/* 8 lanes of fp32 arithmetic shared by the runtime's native kernels (paged_attention.c,
 * sample_rows.c): GCC/Clang vector extensions, so each kernel compiles them to AVX on its
 * AVX2 clone and to SSE pairs otherwise; bf16 widening and an 8-way reduce for the attention
 * kernel's builds (vec16.h is the AVX-512 build's 16 lanes). Include after cpu.h.
 * Header-only, all inline. */
#ifndef MOECC_VEC8_H
#define MOECC_VEC8_H

#include <stdint.h>
#include <string.h>

/* 8 lanes of fp32 (GCC/Clang vector extension: AVX on the haswell clone, SSE pairs otherwise). */
typedef float v8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8 ld8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline __attribute__((always_inline)) void st8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
static inline __attribute__((always_inline)) float hsum8(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* 8 bf16 values widened to fp32 (exact: the bf16 bits become the top half of each lane). */
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) v8 ldbf8(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    v8 x;
    memcpy(&x, &w, sizeof x);
    return x;
}

/* Lane j of the result = the sum of a[j]'s eight lanes (hsum8 each: the baseline build). */
static inline __attribute__((always_inline)) v8 sum8x8_base(const v8 a[8]) {
    v8 r;
    for (int j = 0; j < 8; j++) r[j] = hsum8(a[j]);
    return r;
}

#ifdef HAVE_AVX2_CLONE  /* cpu.h */
#include <immintrin.h>
/* ldbf8 in two instructions (GCC splits the generic widening into halves). */
__attribute__((target("avx2,fma"), always_inline)) static inline v8 ldbf8_avx2(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* sum8x8_base as a transpose-reduce: 6 hadds, 2 permutes (AVX2 and AVX-512 builds). */
__attribute__((target("avx2,fma"), always_inline)) static inline v8 sum8x8_avx2(const v8 a[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[0], (__m256)a[1]), _mm256_hadd_ps((__m256)a[2], (__m256)a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[4], (__m256)a[5]), _mm256_hadd_ps((__m256)a[6], (__m256)a[7]));
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* exp of 8 lanes: 2^k * p(r) with x = k ln2 + r, |r| <= ln2/2, p Cephes' degree-6 polynomial
 * (relative error about 2e-7, like expf's); x below -87.3 gives 0 (the masked / first-block
 * case), above 88.7 is clamped. */
typedef int32_t i8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8 as_v8(i8 x) { v8 y; memcpy(&y, &x, sizeof y); return y; }
static inline __attribute__((always_inline)) i8 as_i8(v8 x) { i8 y; memcpy(&y, &x, sizeof y); return y; }

static inline __attribute__((always_inline)) v8 exp8(v8 x) {
    const v8 hi = {88.72f, 88.72f, 88.72f, 88.72f, 88.72f, 88.72f, 88.72f, 88.72f};
    const i8 big = x > hi;  /* all ones where x is above the clamp */
    x = as_v8((as_i8(x) & ~big) | (as_i8(hi) & big));
    const i8 under = x < -87.33f;  /* all ones where the result underflows */
    const v8 k = x * 1.44269504088896341f + 0.5f;
    i8 ki = __builtin_convertvector(k, i8);  /* truncation */
    ki = ki + (i8)(__builtin_convertvector(ki, v8) > k);  /* floor: -1 where truncation rounded up */
    const v8 kf = __builtin_convertvector(ki, v8);
    v8 r = x - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v8 out = p * as_v8((ki + 127) << 23);
    return as_v8(as_i8(out) & ~under);
}

#endif
