/* exp(x) on 16 fp32 lanes for the AVX-512 kernels (expert_fp32.c's silu, prompt_fp32.c's
 * softmax). Header-only; include after cpu.h, where HAVE_AVX512_CLONE is defined. */
#ifndef MOECC_EXP16_H
#define MOECC_EXP16_H

#ifdef HAVE_AVX512_CLONE
#include <immintrin.h>

/* exp(x) on 16 lanes to ~1 ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' expf polynomial,
 * times 2^n by vscalefps (x clamped to [-104, 89] first, NaN kept: inf past fp32's range, 0 below). */
__attribute__((target(AVX512_TARGET), always_inline)) static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));  /* a NaN x stays */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), 0);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
#endif
