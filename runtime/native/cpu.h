/* What the runtime's native kernels (paged_attention.c, sample_rows.c) share about the CPU:
 * whether their AVX2+FMA clone may run (the CPU's own feature bits, asked once: GCC's arch=
 * clones test the model name, which virtual machines often do not report), and running a job
 * on n threads that take work items from it themselves. Header-only. */
#ifndef MOECC_CPU_H
#define MOECC_CPU_H

#include <pthread.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_CLONE 1
#endif

static int use_avx2(void) {
#ifdef HAVE_AVX2_CLONE
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return known;
#else
    return 0;
#endif
}

/* fn(job) on `nthreads` threads (at most `items`, at least 1), this one among them; returns
 * when all have. The CPU is probed before any thread reads the answer. */
static void run_threads(void *(*fn)(void *), void *job, int nthreads, int64_t items) {
    (void)use_avx2();
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
    pthread_t th[nthreads > 1 ? nthreads - 1 : 1];
    int started = 0;
    for (int i = 0; i < nthreads - 1; i++) {
        if (pthread_create(&th[i], NULL, fn, job) != 0) break;
        started++;
    }
    fn(job);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
}

#endif
