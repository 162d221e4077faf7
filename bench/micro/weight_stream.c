/* How fast one core streams weights from memory while it computes on them: the measurements
 * behind bench/results/README.md's "eighteenth pass" (not part of moecc; no test runs it).
 *
 *   gcc -O2 -o /tmp/weight_stream bench/micro/weight_stream.c -lpthread
 *   /tmp/weight_stream read STREAMS WORK PF_BYTES THREADS [MB]
 *       plain 64-byte loads over MB (default 512) MB read as STREAMS sequential streams taken in
 *       turn, WORK groups of two FMAs after each load, a prefetch (T1) PF_BYTES ahead (0: none)
 *   /tmp/weight_stream amx-one ROW_TILES PF_BYTES THREADS [MB]
 *       the fused expert's tile loop (runtime/native/amx_gemm.h): two row tiles x one 32-output
 *       slice a pass, blocks of 8 input steps, the slice's weights one sequential stream
 *   /tmp/weight_stream amx-two ROW_TILES PF_BYTES THREADS [MB]
 *       one row tile x two slices from opposite halves of the weights a pass: two streams
 * Weights: MB (default 176) MB, K = 1,024 inputs (32 steps); MB = 1 keeps them in L2. Prints
 * GB/s of weights (or bytes) a thread; the sums are not checked (timing only). Linux x86-64,
 * GCC 11+ (it builds on runtime/native/amx.h), a CPU with AMX for the amx modes. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../runtime/native/amx.h"  /* the runtime's tile configuration (tiles_on) and amx_ready */
#ifndef HAVE_AMX
#error "weight_stream needs a compiler with the AMX target (GCC 11 / Clang 12 or newer, Linux x86-64)"
#endif

enum { KB = 32, KBLK = 8 };
static long MB, A1, A2, A3;  /* the mode's numbers, in the order of the usage above */
static int MODE;             /* 0 read, 1 amx-one, 2 amx-two */
static volatile float sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

__attribute__((target("avx512f,fma"))) static double read_streams(char *b, long size) {
    const int ns = (int)A1, work = (int)A2;
    const long per = size / ns, pf = A3;
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_set1_ps(1.0f);
    const __m512 m = _mm512_set1_ps(0.999f);
    const double t0 = now();
    for (long i = 0; i < per; i += 64)
        for (int s = 0; s < ns; s++) {
            const char *p = b + s * per + i;
            if (pf) _mm_prefetch(p + pf, _MM_HINT_T1);
            const __m512 x = _mm512_load_ps((const float *)p);
            acc[0] = _mm512_add_ps(acc[0], x);
            for (int w = 0; w < work; w++) {
                acc[1 + (w & 3)] = _mm512_fmadd_ps(acc[1 + (w & 3)], m, x);
                acc[5 + w % 3] = _mm512_fmadd_ps(acc[5 + w % 3], m, acc[1 + (w & 3)]);
            }
        }
    const double dt = now() - t0;
    float r = 0.f;
    for (int i = 0; i < 8; i++) r += _mm512_reduce_add_ps(acc[i]);
    sink = r;  /* the sums are used: the loop is not optimised away */
    return dt;
}

static __thread float cb[32][4][256] __attribute__((aligned(64)));

/* The tile loop over `size` bytes of weights, slices of 32 outputs x K (64 KB each). */
AMX_TARGET static double tiles(char *b, long size, const uint16_t *a) {
    const long MT = A1, pf = A2, slice = KB * 2048, nsl = size / slice / 2 * 2;
    tiles_on();
    const double t0 = now();
    for (long s = 0; s < (MODE == 1 ? nsl : nsl / 2); s++) {
        const uint16_t *b0 = (const uint16_t *)(b + s * slice), *c0 = (const uint16_t *)(b + (nsl / 2 + s) * slice);
        for (long k0 = 0; k0 < KB; k0 += KBLK)
            for (long m = 0; m < MT; m += MODE == 1 ? 2 : 1) {
                if (k0 == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
                else { _tile_loadd(0, cb[m][0], 64); _tile_loadd(1, cb[m][1], 64); _tile_loadd(2, cb[m][2], 64); _tile_loadd(3, cb[m][3], 64); }
                const uint16_t *a0 = a + m * KB * 512;
                for (long kb = k0; kb < k0 + KBLK; kb++) {
                    if (pf && m == 0)
                        for (int l = 0; l < 32; l++) {
                            _mm_prefetch((const char *)(b0 + kb * 1024) + pf + 64 * l, _MM_HINT_T1);
                            if (MODE == 2) _mm_prefetch((const char *)(c0 + kb * 1024) + pf + 64 * l, _MM_HINT_T1);
                        }
                    _tile_loadd(4, a0 + kb * 512, 64);
                    if (MODE == 1) {  /* two row tiles x the slice's two column tiles */
                        _tile_loadd(6, b0 + kb * 1024, 128); _tile_loadd(7, b0 + kb * 1024 + 32, 128);
                        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(5, a0 + (KB + kb) * 512, 64);
                        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                    } else {  /* one row tile x two slices' column tiles (tile 5 reused) */
                        _tile_loadd(5, b0 + kb * 1024, 128); _tile_dpbf16ps(0, 4, 5);
                        _tile_loadd(6, b0 + kb * 1024 + 32, 128); _tile_dpbf16ps(1, 4, 6);
                        _tile_loadd(7, c0 + kb * 1024, 128); _tile_dpbf16ps(2, 4, 7);
                        _tile_loadd(5, c0 + kb * 1024 + 32, 128); _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, cb[m][0], 64); _tile_stored(1, cb[m][1], 64); _tile_stored(2, cb[m][2], 64); _tile_stored(3, cb[m][3], 64);
            }
    }
    const double dt = now() - t0;
    _tile_release();
    return dt * size / (double)(nsl * slice);
}

static void *run(void *arg) {
    (void)arg;
    const long size = MB << 20;
    char *b = aligned_alloc(2 << 20, size);
    memset(b, 1, size);
    uint16_t *a = aligned_alloc(4096, 32 * KB * 1024);
    memset(a, 1, 32 * KB * 1024);
    double best = 1e9;
    for (int rep = 0; rep < 4; rep++) {
        const double dt = MODE == 0 ? read_streams(b, size) : tiles(b, size, a);
        best = dt < best ? dt : best;
    }
    if (MODE == 0) printf("read: %ld streams, work %ld, prefetch %ld B, %ld MB: %.1f GB/s a thread\n", A1, A2, A3, MB,
                          size / best / 1e9);
    else printf("%s: %ld row tiles, prefetch %ld B, %ld MB: %.1f GB/s a thread\n", MODE == 1 ? "amx-one" : "amx-two", A1,
                A2, MB, size / best / 1e9);
    free(a);
    free(b);
    return NULL;
}

int main(int argc, char **argv) {
    const int nargs = argc > 1 && !strcmp(argv[1], "read") ? 5 : 4;  /* the mode and its required numbers */
    if (argc < nargs + 1 || (strcmp(argv[1], "read") && strcmp(argv[1], "amx-one") && strcmp(argv[1], "amx-two"))) {
        fprintf(stderr, "usage: see the header of bench/micro/weight_stream.c\n");
        return 2;
    }
    MODE = !strcmp(argv[1], "read") ? 0 : !strcmp(argv[1], "amx-one") ? 1 : 2;
    A1 = atol(argv[2]), A2 = atol(argv[3]);
    int th;
    if (MODE == 0) A3 = atol(argv[4]), th = atoi(argv[5]), MB = argc > 6 ? atol(argv[6]) : 512;
    else th = atoi(argv[4]), MB = argc > 5 ? atol(argv[5]) : 176;
    if (A1 < 1 || A1 > 32 || th < 1 || th > 16 || MB < 1) {
        fprintf(stderr, "weight_stream: streams / row tiles 1-32, threads 1-16, MB >= 1\n");
        return 2;
    }
    if (MODE && !amx_ready()) {
        fprintf(stderr, "weight_stream: no AMX here\n");
        return 2;
    }
    pthread_t t[16];
    for (int i = 0; i < th; i++) pthread_create(&t[i], NULL, run, NULL);
    for (int i = 0; i < th; i++) pthread_join(t[i], NULL);
    return 0;
}
