/* engramflow's C kernels: the one discipline they share (native_kernels.c, block_scaled.c,
 * native_io.c all include this header).
 *
 * Dispatch (the llama.cpp ggml-cpu pattern). A compute library is several compiles of its one
 * source: a portable reference (`generic`, no -m flags) and SIMD variants (e.g. avx2, avx512),
 * each with -DEK_VARIANT=<name> and that variant's -m flags, its kernels exported hidden as
 * <name>_<variant> (EK_NAME); plus one compile with -DEK_DISPATCH (generic flags) holding the
 * exported entry points, the thread pool, and the choice of variant: the best one the CPU and
 * OS support (cpuid + xgetbv), made once when the library loads; <lib>_set_variant overrides it
 * (tests, benchmarks). SIMD code is selected by the compiler's own macros (__AVX2__,
 * __AVX512F__, ...), never by target attributes. engramflow/kernels/native_build.py builds
 * and loads every library this way.
 *
 * Floating point: every library is compiled with -ffp-contract=off, and never -ffast-math.
 * The exact kernels' bits depend on which multiply-adds are fused: block_scaled.c needs
 * (p * sa) * sw and the add after it as separate roundings, native_kernels.c's GEMVs fuse
 * their products into FMAs. With contraction off, the compiler fuses nothing on its own, so
 * each fused multiply-add is written out (an FMA intrinsic or ek_fma8) and is the same in
 * every compiler, flag set and variant. (-ffast-math would also flush subnormals, which the
 * E4M3 bit tricks rely on, and assume there are no NaNs.)
 */
#ifndef ENGRAMFLOW_KERNEL_COMMON_H
#define ENGRAMFLOW_KERNEL_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define EK_X86 1
#else
#define EK_X86 0
#endif

/* ---- variants ----------------------------------------------------------------------------- */
#define EK_CAT2(a, b) a##_##b
#define EK_CAT(a, b) EK_CAT2(a, b)
#ifdef EK_VARIANT
#define EK_NAME(name) EK_CAT(name, EK_VARIANT)
#define EK_KERNEL __attribute__((visibility("hidden")))
#else /* a single-object build (cc -shared <lib>.c by hand): the kernels keep their plain names */
#define EK_NAME(name) name
#define EK_KERNEL
#endif

/* ---- bits ---------------------------------------------------------------------------------- */
static inline float ek_bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t ek_float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* float32 -> bfloat16 bits, exactly torch's `tensor.to(torch.bfloat16)` on the CPU: round to
 * nearest, ties to even (infinities stay, a value rounding past the largest bf16 becomes inf,
 * subnormals round like any other value), and every NaN, of either sign and any payload,
 * becomes 0xFFFF, as ATen's vectorized conversion (cvtfp32_bf16) makes it for contiguous
 * tensors, which is what the references (quant_linear_reference's `.to(out_dtype)`) run. (c10's
 * scalar round_to_nearest_even, used for 0-d and strided tensors, gives 0x7FC0 instead; a
 * kernel whose contract is a canonical NaN, as the MXFP8 gathers', writes that itself.)
 * tests/test_kernel_common.py checks this against torch bit for bit. */
static inline uint16_t ek_float_to_bf16(float f) {
    uint32_t u = ek_float_to_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- the thread pool (defined in the dispatcher object only: one pool per library) -------- */

/* task(ctx, i) for i = 0..n-1, each index exactly once: 0 on the calling thread, the others on
 * pool workers, running together; returns when every index has finished. */
typedef void (*ek_task_fn)(void *ctx, int index);

#ifdef EK_DISPATCH
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#include <time.h>

/* One persistent pool per library (per process), grown on demand to the largest n - 1 a call
 * asked for (callers size n from the CPUs the process may use, or OMP_NUM_THREADS), at most
 * EK_POOL_MAX - 1 workers. Starting threads per call cost ~20 us+ a call; a pool worker is
 * woken instead: it spins EK_SPIN_NS after its last task (a decode step's next call finds it
 * awake), then sleeps on a condition variable; the caller likewise spins EK_SPIN_NS for the
 * workers to finish. (T = 1, 64 x 256 weight, 2 threads, busy 2-vCPU box, same run: 0.2-0.7x the
 * time of starting threads per call; 200 us spins were worse there, 0-50 us alike.)
 * - Several Python threads (ctypes drops the GIL): one call at a time uses the pool; a call
 *   that finds it busy runs all its indices on its own thread (same results: every task's
 *   result depends on the index it computes, never on the thread), so no caller waits on
 *   another's pool work and nothing deadlocks.
 * - fork: the child has no workers; pthread_atfork resets the pool there, and the child's
 *   first parallel call starts its own.
 * - CPU pinning: workers take the calling thread's CPU affinity whenever it differs from the
 *   one they run with (actors pin the process after the pool may already exist). */
#define EK_POOL_MAX 64
#ifndef EK_SPIN_NS
#define EK_SPIN_NS 20000
#endif

typedef struct {
    pthread_mutex_t busy;            /* held by the call using the pool */
    pthread_mutex_t m;               /* guards sleeping and waking */
    pthread_cond_t wake, done;
    int workers;                     /* started: worker w runs index w (1..workers) */
    uint64_t gen;                    /* bumped per call (atomic) */
    int n;                           /* indices of the current call */
    ek_task_fn task;
    void *ctx;
    int pending;                     /* workers yet to acknowledge the current call (atomic) */
    pthread_t tid[EK_POOL_MAX];
    uint64_t born[EK_POOL_MAX];      /* gen when worker w started: it waits for the next one */
    cpu_set_t affinity;              /* the workers' affinity */
    int have_affinity;
} ek_pool_t;

static ek_pool_t ek_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                            PTHREAD_COND_INITIALIZER};
static pthread_once_t ek_pool_once = PTHREAD_ONCE_INIT;

static inline uint64_t ek_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void ek_pause(void) {
#if EK_X86
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void ek_pool_after_fork_child(void) {
    /* the workers did not survive the fork; whatever the parent's threads held is void */
    ek_pool_t fresh = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                       PTHREAD_COND_INITIALIZER};
    ek_pool = fresh;
}

static void ek_pool_init(void) { pthread_atfork(NULL, NULL, ek_pool_after_fork_child); }

static void *ek_worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    uint64_t seen = ek_pool.born[me];
    for (;;) {
        uint64_t g = __atomic_load_n(&ek_pool.gen, __ATOMIC_ACQUIRE);
        if (g == seen) {
            const uint64_t until = ek_now_ns() + EK_SPIN_NS;
            for (int i = 0; g == seen; i++) {
                ek_pause();
                g = __atomic_load_n(&ek_pool.gen, __ATOMIC_ACQUIRE);
                if ((i & 255) == 255 && ek_now_ns() > until) break;
            }
        }
        if (g == seen) {
            pthread_mutex_lock(&ek_pool.m);
            while ((g = __atomic_load_n(&ek_pool.gen, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&ek_pool.wake, &ek_pool.m);
            pthread_mutex_unlock(&ek_pool.m);
        }
        seen = g;
        if (me < ek_pool.n) ek_pool.task(ek_pool.ctx, me);
        /* every worker acknowledges every call, needed or not: the caller returns (and the next
         * call rewrites n, task, ctx) only once none is still reading them */
        if (__atomic_sub_fetch(&ek_pool.pending, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&ek_pool.m);
            pthread_cond_signal(&ek_pool.done);
            pthread_mutex_unlock(&ek_pool.m);
        }
    }
    return NULL;
}

static void ek_parallel(int n, ek_task_fn task, void *ctx) {
    if (n > EK_POOL_MAX) n = EK_POOL_MAX;
    if (n <= 1 || pthread_mutex_trylock(&ek_pool.busy) != 0) { /* one index, or the pool is busy */
        for (int i = 0; i < (n < 1 ? 1 : n); i++) task(ctx, i);
        return;
    }
    pthread_once(&ek_pool_once, ek_pool_init);
    cpu_set_t mine;
    int pinned = sched_getaffinity(0, sizeof mine, &mine) == 0;
    if (pinned && ek_pool.have_affinity && !CPU_EQUAL(&mine, &ek_pool.affinity))
        for (int w = 1; w <= ek_pool.workers; w++) pthread_setaffinity_np(ek_pool.tid[w], sizeof mine, &mine);
    if (pinned) { ek_pool.affinity = mine; ek_pool.have_affinity = 1; }
    /* the call's indices: workers 1..use-1 (started now if missing), the caller 0 and any left */
    ek_pool.task = task;
    ek_pool.ctx = ctx;
    int use = n;
    __atomic_store_n(&ek_pool.pending, 0, __ATOMIC_RELAXED);
    while (ek_pool.workers < use - 1) { /* a new worker inherits this thread's affinity */
        int w = ek_pool.workers + 1;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        ek_pool.born[w] = ek_pool.gen; /* a worker started now takes part from the bump below on */
        int rc = pthread_create(&ek_pool.tid[w], &attr, ek_worker, (void *)(intptr_t)w);
        pthread_attr_destroy(&attr);
        if (rc != 0) { use = w; break; } /* no more threads to be had: the caller runs the rest */
        ek_pool.workers = w;
    }
    ek_pool.n = use;
    __atomic_store_n(&ek_pool.pending, ek_pool.workers, __ATOMIC_RELAXED); /* all of them, see ek_worker */
    pthread_mutex_lock(&ek_pool.m);
    __atomic_add_fetch(&ek_pool.gen, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&ek_pool.wake);
    pthread_mutex_unlock(&ek_pool.m);
    task(ctx, 0);
    for (int i = use; i < n; i++) task(ctx, i);
    if (__atomic_load_n(&ek_pool.pending, __ATOMIC_ACQUIRE)) { /* the workers' shares: spin a little, then sleep */
        const uint64_t until = ek_now_ns() + EK_SPIN_NS;
        for (int i = 1; __atomic_load_n(&ek_pool.pending, __ATOMIC_ACQUIRE); i++) {
            ek_pause();
            if ((i & 255) == 0 && ek_now_ns() > until) break;
        }
    }
    if (__atomic_load_n(&ek_pool.pending, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&ek_pool.m);
        while (__atomic_load_n(&ek_pool.pending, __ATOMIC_ACQUIRE)) pthread_cond_wait(&ek_pool.done, &ek_pool.m);
        pthread_mutex_unlock(&ek_pool.m);
    }
    pthread_mutex_unlock(&ek_pool.busy);
}

/* ---- what the CPU (and the OS) supports ---------------------------------------------------- */
static inline int ek_always(void) { return 1; }
#if EK_X86
#include <cpuid.h>
static inline uint64_t ek_xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
/* AVX2 + FMA + F16C, and the OS saves the YMM state */
static inline int ek_cpu_avx2(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned need1 = (1u << 12) | (1u << 27) | (1u << 28) | (1u << 29); /* FMA OSXSAVE AVX F16C */
    if ((c & need1) != need1 || (ek_xcr0() & 0x6) != 0x6) return 0;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 5) & 1; /* AVX2 */
}
/* the above + AVX-512 F, DQ, BW, VL, and the OS saves the opmask and ZMM state */
static inline int ek_cpu_avx512(void) {
    if (!ek_cpu_avx2() || (ek_xcr0() & 0xE6) != 0xE6) return 0;
    unsigned a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned need7 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31); /* F DQ BW VL */
    return (b & need7) == need7;
}
/* an AMD CPU (cpuid vendor "AuthenticAMD") */
static inline int ek_cpu_amd(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    return b == 0x68747541u && d == 0x69746E65u && c == 0x444D4163u;
}
/* AVX512_BF16 (on top of ek_cpu_avx512) */
static inline int ek_cpu_avx512bf16(void) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (a < 1) return 0; /* no subleaf 1 */
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 5) & 1;
}
#endif

/* The dispatcher's half of a library with variants, the same in every library: given its table
 * `variants` (best first, each with .name and .supported(); the last one, generic, always runs)
 * of type T, this defines the active variant (the best the CPU runs, picked at load), `kernels()`
 * for the exported wrappers, and the exports PREFIX_variant, PREFIX_variants (the variants built,
 * best first, comma-separated) and PREFIX_set_variant (0: now in use; 1: not built into this
 * library; 2: this CPU lacks its instructions; switch only while no kernel runs). */
#define EK_DISPATCHER(PREFIX, T)                                                                  \
    enum { N_VARIANTS = (int)(sizeof(variants) / sizeof(variants[0])) };                         \
    static const T *active;                                                                      \
    static const T *best(void) {                                                                 \
        for (int i = 0; i < N_VARIANTS; i++)                                                     \
            if (variants[i].supported()) return &variants[i];                                    \
        return &variants[N_VARIANTS - 1];                                                        \
    }                                                                                            \
    __attribute__((constructor)) static void pick_variant(void) { active = best(); }             \
    static inline const T *kernels(void) {                                                       \
        const T *k = __atomic_load_n(&active, __ATOMIC_ACQUIRE);                                 \
        return k ? k : best();                                                                   \
    }                                                                                            \
    const char *PREFIX##_variant(void) { return kernels()->name; }                               \
    const char *PREFIX##_variants(void) {                                                        \
        static char names[64];                                                                   \
        if (!names[0]) {                                                                         \
            char buf[64] = "";                                                                   \
            for (int i = 0; i < N_VARIANTS; i++) {                                               \
                if (i) strcat(buf, ",");                                                         \
                strcat(buf, variants[i].name);                                                   \
            }                                                                                    \
            memcpy(names, buf, sizeof(buf));                                                     \
        }                                                                                        \
        return names;                                                                            \
    }                                                                                            \
    int PREFIX##_set_variant(const char *name) {                                                 \
        for (int i = 0; i < N_VARIANTS; i++) {                                                   \
            if (strcmp(variants[i].name, name)) continue;                                        \
            if (!variants[i].supported()) return 2;                                              \
            __atomic_store_n(&active, &variants[i], __ATOMIC_RELEASE);                           \
            return 0;                                                                            \
        }                                                                                        \
        return 1;                                                                                \
    }
#endif /* EK_DISPATCH */

#endif /* ENGRAMFLOW_KERNEL_COMMON_H */
