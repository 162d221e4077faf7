/* What the runtime's native kernels (paged_attention.c, sample_rows.c) share about the CPU:
 * whether their AVX2+FMA and AVX-512 clones may run (the CPU's own feature bits, asked once: GCC's arch=
 * clones test the model name, which virtual machines often do not report), and running a job
 * on n threads that take work items from it themselves (torch's OpenMP team where it was
 * handed over). Header-only. */
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

/* The host-attention kernel's builds, lowest first (runtime/native/isa.py names them). */
enum { ISA_BASELINE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3 };

/* An AVX-512 clone needs a compiler that knows the target attribute for it (GCC 7, Clang 6). */
#if defined(HAVE_AVX2_CLONE) && ((defined(__clang__) && __clang_major__ >= 6) || \
                                 (!defined(__clang__) && __GNUC__ >= 7))
#define HAVE_AVX512_CLONE 1
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
#endif

/* The AVX-512 clone with AVX512-BF16's dot product (vdpbf16ps) needs GCC 10 or Clang 9. */
#if defined(HAVE_AVX512_CLONE) && ((defined(__clang__) && __clang_major__ >= 9) || \
                                   (!defined(__clang__) && __GNUC__ >= 10))
#define HAVE_AVX512BF16_CLONE 1
#define AVX512BF16_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"
#endif

/* The highest build the CPU runs (its feature bits, asked once; the OS saving the wide
 * registers included, as __builtin_cpu_supports checks) among those this compiler made. */
static int cpu_isa(void) {
    static int known = -1;
    if (known >= 0) return known;
    int isa = use_avx2() ? ISA_AVX2 : ISA_BASELINE;
#ifdef HAVE_AVX512_CLONE
    if (isa == ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        isa = ISA_AVX512;
#endif
#ifdef HAVE_AVX512BF16_CLONE
    if (isa == ISA_AVX512 && __builtin_cpu_supports("avx512bf16")) isa = ISA_AVX512BF16;
#endif
    known = isa;
    return known;
}

/* The thread team of the OpenMP runtime torch runs its own ops on: its GOMP_parallel, the entry
 * point `#pragma omp parallel` compiles to (libgomp, LLVM's libomp and Intel's libiomp5 all
 * export it), handed over once by moecc_native_set_team (runtime/native/threads.py); NULL:
 * threads of our own. It matters: after every torch op its threads spin a while waiting for
 * the next, and a thread of ours on a core with a spinning one runs at about half speed
 * (measured: attention 1.3x slower right after a GEMM), while the team's own threads take the
 * work at once. */
typedef void (*team_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static team_parallel_fn team_parallel = NULL;

/* Run kernels on the team whose GOMP_parallel is `fn` (NULL: on threads of our own). */
int moecc_native_set_team(void *fn) {
    team_parallel = (team_parallel_fn)fn;
    return 0;
}

typedef struct { void *(*fn)(void *); void *job; } TeamCall;
static void team_body(void *arg) { const TeamCall *t = (const TeamCall *)arg; t->fn(t->job); }

/* fn(job) on `nthreads` threads (at most `items`, at least 1), this one among them: the
 * OpenMP team's where one was set, else threads started here; returns when all have. The CPU
 * is probed before any thread reads the answer. */
static void run_threads(void *(*fn)(void *), void *job, int nthreads, int64_t items) {
    (void)use_avx2(), (void)cpu_isa();
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 1 && team_parallel) {
        TeamCall t = {fn, job};
        team_parallel(team_body, &t, (unsigned)nthreads, 0);
        return;
    }
    pthread_t th[nthreads > 1 ? nthreads - 1 : 1];
    int started = 0;
    for (int i = 0; i < nthreads - 1; i++) {
        if (pthread_create(&th[i], NULL, fn, job) != 0) break;
        started++;
    }
    fn(job);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
}

/* The next of `parts` contiguous runs [*lo, *hi) of `items` (run t: [items t / parts,
 * items (t + 1) / parts)), counted by *next and taken by whichever thread asks first; 0 when all
 * are taken. A thread asks until none is left, so every run is taken however many threads
 * run_threads started. */
static inline int take_run(int64_t *next, int parts, int64_t items, int64_t *lo, int64_t *hi) {
    const int64_t t = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    if (t >= parts) return 0;
    *lo = items * t / parts;
    *hi = items * (t + 1) / parts;
    return 1;
}

#endif
