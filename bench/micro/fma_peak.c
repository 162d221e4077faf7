/* The FMA units' ceiling: each of THREADS threads runs AVX-512 fused multiply-adds on registers
 * only (12 independent accumulators, so the FMA latency is hidden), for SECONDS; prints the total
 * GFLOP/s (32 FLOPs an instruction: 16 fp32 lanes, a multiply and an add) and the clock each
 * thread's FMAs imply at 2 FMA units a core. The arithmetic ceiling bench/bounds.py prices fp32
 * work at; no load or store in the loop.
 *
 *   gcc -O2 -mavx512f -o /tmp/fma_peak bench/micro/fma_peak.c -lpthread && /tmp/fma_peak 2 1.0
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ACC 12      /* independent accumulators (FMA12 and INIT below name them): 4-cycle latency x 2 units */
#define INNER 4096  /* loop trips between clock reads */

static double seconds_limit;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define FMA(i) acc##i = _mm512_fmadd_ps(acc##i, a, b)
#define FMA12 FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5); FMA(6); FMA(7); FMA(8); FMA(9); FMA(10); FMA(11)

/* FMAs done by one thread in seconds_limit, a second, to sink[0]; the accumulators' sum to sink[1]
 * so nothing is optimised away. The accumulators are named variables (registers at -O2). */
static void *run(void *sink) {
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
#define INIT(i) acc##i = _mm512_set1_ps(1.0f + (float)(i) / 64)  /* distinct: no two chains merge */
    __m512 INIT(0), INIT(1), INIT(2), INIT(3), INIT(4), INIT(5), INIT(6), INIT(7), INIT(8), INIT(9), INIT(10), INIT(11);
    double t0 = now(), fmas = 0;
    do {
        for (int n = 0; n < INNER; n++) {
            FMA12;
        }
        fmas += (double)INNER * ACC;
    } while (now() - t0 < seconds_limit);
    const double dt = now() - t0;
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)),
                             _mm512_add_ps(_mm512_add_ps(acc4, acc5), _mm512_add_ps(acc6, acc7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(acc8, acc9), _mm512_add_ps(acc10, acc11)));
    ((double *)sink)[0] = fmas / dt;
    ((double *)sink)[1] = _mm512_reduce_add_ps(s);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: fma_peak THREADS SECONDS\n");
        return 2;
    }
    int threads = atoi(argv[1]);
    seconds_limit = atof(argv[2]);
    if (threads < 1 || threads > 256 || seconds_limit <= 0) {
        fprintf(stderr, "fma_peak: THREADS 1-256, SECONDS > 0\n");
        return 2;
    }
    pthread_t th[256];
    double out[256][2];
    for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, run, out[t]);
    double total = 0, slowest = 1e30;
    for (int t = 0; t < threads; t++) {
        pthread_join(th[t], NULL);
        total += out[t][0];
        if (out[t][0] < slowest) slowest = out[t][0];
    }
    printf("gflops %.1f clock_ghz %.2f threads %d\n", total * 32 / 1e9, slowest / 2 / 1e9, threads);
    return 0;
}
