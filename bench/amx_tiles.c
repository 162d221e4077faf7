/* The AMX tile loop's ceilings on this CPU, one core (bench/amx_tiles.py builds and runs it): ns a
 * tile product (TDPBF16PS, 16x16x32 bf16) for the 2x2 blocking runtime/native/expert_amx.c uses
 * (C in tiles 0-3, A in 4-5, B in 6-7), with the operands and the C traffic varied one at a time:
 *
 *   peak     no loads, no stores: the products alone
 *   l1       A and B loaded each step from 8 KB rings (L1)
 *   stream   A streamed through `a_kb` KB (L2 at 768), B from a 16 KB ring
 *   store P  stream, and C stored (and zeroed) every P steps (4P products)
 *   kernel   expert_amx.c's slice_tiles pattern: MT row tiles, KB input steps in blocks of KBLK,
 *            C stored after each block and loaded back for the next, B read at a stride of
 *            nb*4 bytes (oneDNN's AB16b{nb}a2b), one unit of nb outputs
 *
 * usage: amx_tiles MODE [args]   prints one line: "<ns a product>"
 *   peak | l1 | stream A_KB | store A_KB P | kernel MT KB KBLK NB
 * Linux x86-64, GCC 11+; exits 2 where the CPU or OS has no AMX. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileCfg;
static const TileCfg CFG __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
static float C[32][2][256] __attribute__((aligned(64)));  /* spilled C: 32 row tiles x 2 column tiles */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t *ones(size_t n) {  /* n bf16 1.0s, 64-byte aligned */
    uint16_t *p = aligned_alloc(64, (n * 2 + 63) / 64 * 64);
    for (size_t i = 0; i < n; i++) p[i] = 0x3f80;
    return p;
}

/* `steps` steps of four products; A tile pair i from `a` (na tiles in a ring, the pair's two tiles
 * `a2` tiles apart), B from a 16-tile ring; C stored and zeroed every `every` steps (0: never). */
__attribute__((target("amx-tile,amx-bf16"))) static double run_steps(long steps, const uint16_t *a, long na, long a2,
                                                                      const uint16_t *b, int loads, long every) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const double t = now();
    for (long i = 0; i < steps; i++) {
        if (loads) {
            const long ia = i % (na - a2), ib = (2 * i) % 16;
            _tile_loadd(4, a + ia * 512, 64);
            _tile_loadd(6, b + ib * 512, 64);
            _tile_loadd(7, b + (ib + 1) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a + (ia + a2) * 512, 64);
        } else {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (every && i % every == every - 1) {
            _tile_stored(0, C[0][0], 64); _tile_stored(1, C[0][1], 64);
            _tile_stored(2, C[1][0], 64); _tile_stored(3, C[1][1], 64);
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        }
    }
    _tile_stored(0, C[0][0], 64);
    return (now() - t) / (4.0 * steps) * 1e9;
}

/* expert_amx.c's slice_tiles over one unit of nb outputs (nb/32 slices), `reps` times. */
__attribute__((target("amx-tile,amx-bf16"))) static double run_kernel(long MT, long KB, long kblk, long nb,
                                                                       long reps) {
    const uint16_t *a = ones(MT * KB * 512), *w = ones(KB * 32 * nb);
    long products = 0;
    const double t = now();
    for (long r = 0; r < reps; r++)
        for (long s = 0; s < nb / 32; s++) {
            const uint16_t *b0 = w + s * 64, *b1 = b0 + 32;
            for (long k0 = 0; k0 < KB; k0 += kblk) {
                const long k1 = k0 + kblk < KB ? k0 + kblk : KB;
                for (long m = 0; m < MT; m += 2) {
                    if (k0 == 0) {
                        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    } else {
                        _tile_loadd(0, C[m][0], 64); _tile_loadd(1, C[m][1], 64);
                        _tile_loadd(2, C[m + 1][0], 64); _tile_loadd(3, C[m + 1][1], 64);
                    }
                    const uint16_t *a0 = a + m * KB * 512;
                    for (long kb = k0; kb < k1; kb++) {
                        _tile_loadd(4, a0 + kb * 512, 64);
                        _tile_loadd(6, b0 + kb * 32 * nb, nb * 4);
                        _tile_loadd(7, b1 + kb * 32 * nb, nb * 4);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(5, a0 + (KB + kb) * 512, 64);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, C[m][0], 64); _tile_stored(1, C[m][1], 64);
                    _tile_stored(2, C[m + 1][0], 64); _tile_stored(3, C[m + 1][1], 64);
                }
            }
            products += MT * KB * 2;
        }
    return (now() - t) / products * 1e9;
}

__attribute__((target("amx-tile"))) static void tiles_on(void) { _tile_loadconfig(&CFG); }

int main(int argc, char **argv) {
    unsigned ea = 7, eb = 0, ec = 0, ed = 0;
    __asm__ volatile("cpuid" : "+a"(ea), "=b"(eb), "+c"(ec), "=d"(ed));
    if (argc < 2 || !((ed >> 22) & 1u) || !((ed >> 24) & 1u) || syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;
    tiles_on();
    const char *mode = argv[1];
    const long steps = 2000000;
    double ns = -1;
    if (!strcmp(mode, "peak") || !strcmp(mode, "l1")) {
        const uint16_t *a = ones(8 * 512), *b = ones(17 * 512);
        ns = run_steps(steps, a, 8, 1, b, !strcmp(mode, "l1"), 0);
    } else if ((!strcmp(mode, "stream") && argc == 3) || (!strcmp(mode, "store") && argc == 4)) {
        const long na = atol(argv[2]);  /* KB: one tile each */
        const uint16_t *a = ones(na * 512), *b = ones(17 * 512);
        ns = run_steps(steps, a, na, na / 2, b, 1, argc == 4 ? atol(argv[3]) : 0);
    } else if (!strcmp(mode, "kernel") && argc == 6) {
        const long MT = atol(argv[2]), KB = atol(argv[3]), kblk = atol(argv[4]), nb = atol(argv[5]);
        if (MT < 2 || MT > 32 || MT % 2 || KB < 1 || kblk < 1 || nb % 32) return 1;
        ns = run_kernel(MT, KB, kblk, nb, steps / (MT * KB));
    } else {
        return 1;
    }
    printf("%.3f\n", ns);
    return 0;
}
