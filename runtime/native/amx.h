/* What the AMX kernels (expert_amx.c, prompt_amx.c) share: whether this compiler and CPU run
 * AMX's bf16 tiles with the AVX-512 parts their epilogues use (cpu.h's AVX512-BF16 build), the
 * tile configuration, and the 16-lane bf16 rounding as torch rounds (over bf16_lanes.h). Defines
 * HAVE_AMX and AMX_TARGET where the compiler has the AMX target (Linux x86-64, GCC 11 / Clang 12
 * or newer: the target attribute, arch_prctl's permission). Header-only. */
#ifndef MOECC_AMX_H
#define MOECC_AMX_H

#include <stdint.h>
#include <unistd.h>

#include "cpu.h"
#include "bf16_lanes.h"

#if defined(__x86_64__) && defined(__linux__) && defined(HAVE_AVX512BF16_CLONE) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16," AVX512BF16_TARGET)))

typedef struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileCfg;

/* Tiles 0-7 of 16 rows of 64 bytes, palette 1. A constant in memory, not built on the stack: GCC
 * 12 dropped part of a stack-built copy's stores (ldtilecfg reads 64 bytes it does not track) once
 * the function it was inlined into grew, and the first tile instruction then faulted. */
static const TileCfg AMX_TILES __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

AMX_TARGET static inline void tiles_on(void) { _tile_loadconfig(&AMX_TILES); }

/* The CPU has AMX's bf16 tiles (CPUID 7.0 EDX bits 22, 24) and runs the AVX512-BF16 build the
 * epilogues use (cpu.h's cpu_isa: its feature bits, the OS saving their registers), and the OS
 * lets this process use the tiles (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); asked once. */
static int amx_ready(void) {
    static int known = -1;
    if (known >= 0) return known;
    unsigned a = 7, b = 0, c = 0, d = 0;
    __asm__ volatile("cpuid" : "+a"(a), "=b"(b), "+c"(c), "=d"(d));
    known = ((d >> 22) & 1u) && ((d >> 24) & 1u) && cpu_isa() >= ISA_AVX512BF16 &&
            syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return known;
}

/* bf16.h's f2bf on 16 lanes: to nearest even, NaN to 0x7fc0. AVX512-BF16's conversion
 * (bf16_lanes.h's narrow16) rounds the same way but flushes subnormals and keeps a NaN's sign and
 * payload, so it takes a vector only when no lane is either (odd16); otherwise integer ops. */
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
    if (__builtin_expect(odd16(x) != 0, 0))  /* a subnormal or NaN lane (bf16_lanes.h) */
        return f2bf16_int(x);
    return narrow16(x);
}
#endif

#endif
