/* What the AMX kernels (expert_amx.c, prompt_amx.c) share: whether this compiler and CPU run
 * AMX's bf16 tiles with the AVX-512 parts their epilogues use, the tile configuration, and the
 * 16-lane bf16 conversions (torch's rounding). Include after cpu.h; defines HAVE_AMX and
 * AMX_TARGET where the compiler has the AMX target (Linux x86-64, GCC 11 / Clang 12 or newer:
 * the target attribute, arch_prctl's permission). Header-only. */
#ifndef MOECC_AMX_H
#define MOECC_AMX_H

#include <stdint.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512bf16")))

typedef struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileCfg;

/* Tiles 0-7 of 16 rows of 64 bytes, palette 1. A constant in memory, not built on the stack: GCC
 * 12 dropped part of a stack-built copy's stores (ldtilecfg reads 64 bytes it does not track) once
 * the function it was inlined into grew, and the first tile instruction then faulted. */
static const TileCfg AMX_TILES __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

AMX_TARGET static inline void tiles_on(void) { _tile_loadconfig(&AMX_TILES); }

/* The CPU has AMX's bf16 tiles (CPUID 7.0 EDX bits 22, 24) and the AVX-512 parts the epilogues
 * use (F, BW, DQ, BF16, the OS saving their registers: __builtin_cpu_supports), and the OS lets
 * this process use the tiles (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); asked once. */
static int amx_ready(void) {
    static int known = -1;
    if (known >= 0) return known;
    unsigned a = 7, b = 0, c = 0, d = 0;
    __asm__ volatile("cpuid" : "+a"(a), "=b"(b), "+c"(c), "=d"(d));
    __builtin_cpu_init();
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
    known = ((d >> 22) & 1u) && ((d >> 24) & 1u) && avx512 && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return known;
}

/* bf16.h's f2bf on 16 lanes: to nearest even, NaN to 0x7fc0. AVX512-BF16's conversion rounds
 * the same way but flushes subnormals and keeps a NaN's sign and payload, so it takes a vector
 * only when no lane is either (one fpclass test); otherwise integer ops, as torch rounds. */
AMX_TARGET static inline __m256i f2bf16_int(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
}

AMX_TARGET static inline __m256i f2bf16(__m512 x) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0x20 | 0x01 | 0x80) != 0, 0))  /* subnormal, QNaN, SNaN */
        return f2bf16_int(x);
    return (__m256i)_mm512_cvtneps_pbh(x);
}

AMX_TARGET static inline __m512 bf16x(__m256i h) {  /* 16 bf16 widened (exact) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#endif
