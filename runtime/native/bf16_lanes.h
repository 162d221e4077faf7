/* bf16 in 16 lanes on AVX512-BF16 for the plain-loop kernels (rope.c) and the AMX kernels' epilogues
 * (amx.h's f2bf16): widening 16
 * values, and rounding 16 with the conversion instruction (vcvtneps2bf16). That conversion rounds
 * to nearest even as bf16.h's f2bf does, but takes subnormal inputs as zero and keeps a NaN's
 * payload, so a caller checks the values it rounds with `odd16` and rounds a block holding any
 * subnormal or NaN with f2bf instead: the same bits as bf16.h everywhere. Include after cpu.h;
 * everything here exists where HAVE_AVX512BF16_CLONE does. Header-only. */
#ifndef MOECC_BF16_LANES_H
#define MOECC_BF16_LANES_H

#ifdef HAVE_AVX512BF16_CLONE
#include <immintrin.h>
#include <stdint.h>

#define BF16_TARGET __attribute__((target(AVX512BF16_TARGET)))

/* 16 bf16 (in a register) widened to fp32 (exact). */
static inline BF16_TARGET __m512 bf16x(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 bf16 at p widened to fp32 (exact). */
static inline BF16_TARGET __m512 widen16(const uint16_t *p) { return bf16x(_mm256_loadu_si256((const void *)p)); }

/* x rounded to bf16 (f2bf's bits where odd16(x) is clear). */
static inline BF16_TARGET __m256i narrow16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

/* x rounded to bf16 and widened again (bf_round's value where odd16(x) is clear). */
static inline BF16_TARGET __m512 round16(__m512 x) { return bf16x(narrow16(x)); }

/* The lanes of x that the conversion rounds apart from f2bf: subnormal or NaN (vfpclassps
 * 0xA1: quiet NaN, subnormal, signalling NaN). */
static inline BF16_TARGET __mmask16 odd16(__m512 x) { return _mm512_fpclass_ps_mask(x, 0xA1); }
#endif

#endif
