/* bf16 <-> fp32 for the runtime's native kernels (expert_rows.c, rope.c, rmsnorm.c, the attention
 * kernel's scalar loads and bf16 output): widening is exact; narrowing rounds to nearest even and
 * turns NaN into 0x7fc0, as torch's conversion does. Plain integer code, which the compiler
 * vectorizes in each build. And the dtype codes the runtime passes (native.DTYPE_CODES).
 * Header-only, all inline. */
#ifndef MOECC_BF16_H
#define MOECC_BF16_H

#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1 };  /* native.DTYPE_CODES */

static inline __attribute__((always_inline)) float bf2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline __attribute__((always_inline)) uint16_t f2bf(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)r;
}

/* x rounded to bf16 and widened again (a bf16 op's result, kept in fp32). */
static inline __attribute__((always_inline)) float bf_round(float x) { return bf2f(f2bf(x)); }

#endif
