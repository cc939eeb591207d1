/* The parallel regions of every kernel of this library: rs_parallel runs fn(ctx, tid, nth)
 * on nth threads, the caller as thread 0, either on a persistent worker pool (the default)
 * or in an OpenMP parallel region (rs_set_pool(0): the A/B of bench/cpu_pool.py).
 *
 * Why a pool of our own: a decode step makes ~150 parallel regions from Python, each
 * streaming 0.3-1.8 MB of weights. The scheduler runs libgomp with OMP_WAIT_POLICY=PASSIVE
 * (its four processes share the cores), so every region paid a futex wake-up of a sleeping
 * worker and ended before the stream reached the copy bandwidth. The pool's workers instead
 * spin a bounded time after each region (POOL_SPIN_NS), which covers the gap between two
 * kernels of a step, and sleep on a futex past it: between steps and when idle they use no
 * CPU, and on a small shared machine a worker never holds a core longer than the bound. A
 * spin that lost its core (the clock jumped between two looks) turns spinning off for the
 * next 100 ms: on cores shared with other busy processes a spinning thread only delays them
 * and then waits for a preempted peer (measured: at load 4-5 on 2 cores a 50 us spin made
 * batch-1 int8 linears 1.5-10x slower than sleeping at once; with this rule they matched).
 *
 * The protocol: the caller publishes (fn, ctx, nth) and increments the generation `gen`;
 * workers wait for a generation other than the one they last ran; each worker (all of
 * them, those with tid >= nth only report back) decrements `pending`, and the last one
 * increments `done`, which the caller waits on. Every wait is wait_while_eq: spin, then
 * sleep on the word; every publish is publish: increment, then wake if anyone sleeps
 * (both sequentially consistent, so a waiter that registered itself as a sleeper is seen).
 *
 * The split of work is the caller's (each kernel splits by tid / nth, as its comments say),
 * so a region computes the same thing on the pool, in OpenMP or on one thread: every kernel
 * computes each output on one thread in a fixed order, so results do not depend on nth.
 * nth is the calling thread's OpenMP thread count (omp_get_max_threads: torch's
 * set_num_threads sets it), so torch and these kernels use the same count.
 *
 * One region runs at a time: a second thread calling while a region runs (or a kernel
 * called from inside a region) runs its work on itself alone (same results, see above).
 * After fork() the child has no workers (pthread_atfork resets the pool).
 */
#define _GNU_SOURCE
#include "common.h"

#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

/* How long a worker (or a caller waiting for workers) spins before it sleeps: 50 us. A
 * step's kernels come from Python ~10-30 us apart (a ctypes call, an output allocation, the
 * attention call between two linears), so a worker spinning this long is already awake for
 * the next region, while a futex wake-up costs 5-10 us on an idle core and up to a
 * scheduler tick on a busy one. Longer spins stopped paying on a 2-core machine shared with
 * the ring's front services: libgomp's spinning workers (GOMP_SPINCOUNT 10,000 and up)
 * waited on preempted peers there and steps took 2-40x longer (bench/RESULTS.md). */
#define POOL_SPIN_NS 50000
/* 16 pauses take ~1-2 us; a gap of 20 us between two looks at the clock means the spinning
 * thread was descheduled. Then every wait sleeps at once for 100 ms (a few scheduler periods). */
#define POOL_PREEMPTED_NS 20000
#define POOL_QUIET_NS 100000000
#define POOL_MAX_THREADS 256

typedef struct {
    _Alignas(64) _Atomic uint32_t word;
    _Atomic int sleepers;
} signal_t;

static struct {
    pthread_mutex_t lock;  /* one region at a time */
    int nworkers;
    uint32_t seen0[POOL_MAX_THREADS];  /* the generation each new worker starts from */
    rs_task fn;
    void *ctx;
    int nth;
    signal_t gen, done, bar;
    _Alignas(64) _Atomic int pending;
    _Alignas(64) _Atomic int bar_count;
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Atomic int use_pool = 1;
static _Thread_local int in_region;  /* this thread is a worker, or runs a region now */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void futex(_Atomic uint32_t *w, int op, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)w, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

/* Until when (now_ns) waits skip spinning: a spin that lost its core (POOL_PREEMPTED_NS between
 * two looks at the clock) says other threads want these cores, and spinning then only delays
 * them and, through the scheduler's fairness, this process's own next region. */
static _Atomic uint64_t quiet_after;

/* Return once s->word != v: spin up to POOL_SPIN_NS (none while the cores are contended), then
 * sleep until a publish. */
static void wait_while_eq(signal_t *s, uint32_t v) {
    uint64_t t0 = now_ns(), last = t0;
    const uint64_t limit = t0 < atomic_load_explicit(&quiet_after, memory_order_relaxed)
                               ? 0 : POOL_SPIN_NS;
    for (unsigned i = 1; atomic_load_explicit(&s->word, memory_order_acquire) == v; i++) {
        CPU_RELAX();
        if ((i & 15) != 0 && limit) continue;
        const uint64_t t = now_ns();
        const int preempted = t - last > POOL_PREEMPTED_NS;
        if (preempted) atomic_store_explicit(&quiet_after, t + POOL_QUIET_NS, memory_order_relaxed);
        last = t;
        if (t - t0 >= limit || preempted) {
            atomic_fetch_add(&s->sleepers, 1);
            while (atomic_load(&s->word) == v) futex(&s->word, FUTEX_WAIT, v);
            atomic_fetch_sub(&s->sleepers, 1);
            return;
        }
    }
}

static void publish(signal_t *s) {
    atomic_fetch_add(&s->word, 1);
    if (atomic_load(&s->sleepers)) futex(&s->word, FUTEX_WAKE, INT_MAX);
}

static void *worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    uint32_t seen = P.seen0[tid];
    in_region = 1;
    for (;;) {
        wait_while_eq(&P.gen, seen);
        seen = atomic_load(&P.gen.word);
        if (tid < P.nth) P.fn(P.ctx, tid, P.nth);
        if (atomic_fetch_sub(&P.pending, 1) == 1) publish(&P.done);
    }
    return NULL;
}

static void reset_after_fork(void) {  /* the child of a fork has the caller's thread only */
    pthread_mutex_init(&P.lock, NULL);
    P.nworkers = 0;
    atomic_store(&P.gen.sleepers, 0);
    atomic_store(&P.done.sleepers, 0);
    atomic_store(&P.bar.sleepers, 0);
    atomic_store(&P.bar_count, 0);
    in_region = 0;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

/* Start workers 1 .. n-1 (those missing); returns how many threads the pool has now. */
static int grow(int n) {
    pthread_once(&atfork_once, register_atfork);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  /* signals stay with the interpreter's threads */
    while (P.nworkers + 1 < n) {
        const int tid = P.nworkers + 1;
        P.seen0[tid] = atomic_load(&P.gen.word);
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int err = pthread_create(&th, &attr, worker, (void *)(intptr_t)tid);
        pthread_attr_destroy(&attr);
        if (err) break;
        P.nworkers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return P.nworkers + 1;
}

int rs_set_pool(int on) { return atomic_exchange(&use_pool, on ? 1 : 0); }

int rs_pool_threads(void) { return P.nworkers + 1; }

void rs_parallel(rs_task fn, void *ctx, int parallel) {
    int nth = parallel && !in_region ? omp_get_max_threads() : 1;
    nth = nth < POOL_MAX_THREADS ? nth : POOL_MAX_THREADS;
    if (nth <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    if (!atomic_load(&use_pool)) {
#pragma omp parallel num_threads(nth)
        fn(ctx, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
    if (pthread_mutex_trylock(&P.lock) != 0) {  /* another thread's region runs */
        fn(ctx, 0, 1);
        return;
    }
    const int have = grow(nth);
    nth = nth < have ? nth : have;
    P.fn = fn;
    P.ctx = ctx;
    P.nth = nth;
    atomic_store(&P.pending, P.nworkers);
    const uint32_t done = atomic_load(&P.done.word);
    in_region = 1;
    if (P.nworkers) publish(&P.gen);
    fn(ctx, 0, nth);
    if (P.nworkers) wait_while_eq(&P.done, done);
    in_region = 0;
    pthread_mutex_unlock(&P.lock);
}

void rs_barrier(int nth) {
    if (nth <= 1) return;
    if (omp_in_parallel()) {  /* the region is OpenMP's (rs_set_pool(0)) */
#pragma omp barrier
        return;
    }
    const uint32_t g = atomic_load(&P.bar.word);
    if (atomic_fetch_add(&P.bar_count, 1) == nth - 1) {
        atomic_store(&P.bar_count, 0);
        publish(&P.bar);
    } else {
        wait_while_eq(&P.bar, g);
    }
}
