/* kwker's thread pool: persistent pthreads, one wake-up per kw_pool_run, a
 * two-counter barrier (ggml's) between dependent steps.
 *
 * Waiting (for the next run, or at a barrier) spins for a bounded time and then
 * sleeps on a futex, so a decode loop keeps its workers hot while PyTorch code
 * between calls does not lose a core to them. A sleeper announces itself in a
 * counter before re-checking the word it waits on; the waker changes the word
 * before reading the counter. Both sides are seq_cst, so either the sleeper sees
 * the change or the waker sees the sleeper (and FUTEX_WAIT itself re-checks). */
#define _GNU_SOURCE
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kw_pool.h"

/* How long a waiter spins before it sleeps. Long enough to cover the gap between
 * two decode steps' Python overhead; short enough not to matter to PyTorch.
 *
 * After a short plain spin the waiter yields its core between polls, so that a
 * thread it waits for that shares its core (a busy machine, PyTorch's OpenMP
 * threads still spinning, more threads than cores) runs at once. How long the
 * plain spin lasts adapts per thread: a yield that took long means another
 * thread did run on this core, so the next waits yield at once; a yield that
 * returned at once means the core is ours, and the plain spin grows back to
 * KW__YIELD_NS. With another process busy on the same two cores a barrier
 * measured 3.8 µs with a fixed 2 µs spin and 1.8 µs adapting; on idle cores the
 * waits never get as far as a yield. */
#define KW__SPIN_NS 200000
#define KW__YIELD_NS 2000
#define KW__YIELD_SLOW_NS 2000 /* a yield this long gave the core to someone */

static _Thread_local int64_t kw__plain_spin_ns = KW__YIELD_NS;

/* Each counter other threads poll gets its own cache line. */
typedef struct kw__line {
    alignas(64) atomic_int v;
} kw__line;

struct kw_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t run_lock; /* serialises kw_pool_run */

    kw__line generation;  /* bumped once per run (and once to stop) */
    kw__line run_sleepers; /* workers asleep waiting for a run */
    kw__line n_barrier;    /* threads arrived at the current barrier */
    kw__line n_passed;     /* barriers completed */
    kw__line bar_sleepers; /* threads asleep at a barrier */

    /* Written before generation is bumped; read after it is seen. */
    kw_task_fn fn;
    void *arg;
    int stop;
};

typedef struct kw__worker {
    kw_pool *pool;
    int ith;
} kw__worker;

static void futex_wait(atomic_int *addr, int expected) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(atomic_int *addr) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void yield_and_adapt(void) {
    const int64_t t0 = now_ns();
    sched_yield();
    if (now_ns() - t0 > KW__YIELD_SLOW_NS)
        kw__plain_spin_ns = 0;
    else if (kw__plain_spin_ns < KW__YIELD_NS)
        kw__plain_spin_ns = 2 * kw__plain_spin_ns + 250;
}

/* Returns once *word != old: spins, then spins yielding, then sleeps. */
static void wait_change(atomic_int *word, int old, atomic_int *sleepers) {
    int64_t start = 0;
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) != old) return;
        _mm_pause();
        if ((i & 15) == 0) {
            const int64_t t = now_ns();
            if (!start) start = t;
            if (t - start > KW__SPIN_NS) break;
            if (t - start >= kw__plain_spin_ns) yield_and_adapt();
        }
    }
    atomic_fetch_add(sleepers, 1);
    while (atomic_load(word) == old) futex_wait(word, old);
    atomic_fetch_sub(sleepers, 1);
}

static void wake(atomic_int *word, atomic_int *sleepers) {
    if (atomic_load(sleepers) > 0) futex_wake_all(word);
}

void kw_pool_barrier(kw_pool *pool) {
    if (pool->n_threads == 1) return;
    const int passed = atomic_load_explicit(&pool->n_passed.v, memory_order_relaxed);
    if (atomic_fetch_add(&pool->n_barrier.v, 1) == pool->n_threads - 1) {
        atomic_store_explicit(&pool->n_barrier.v, 0, memory_order_relaxed);
        atomic_fetch_add(&pool->n_passed.v, 1);
        wake(&pool->n_passed.v, &pool->bar_sleepers.v);
        return;
    }
    wait_change(&pool->n_passed.v, passed, &pool->bar_sleepers.v);
}

static void *worker_main(void *p) {
    kw__worker *self = p;
    kw_pool *pool = self->pool;
    const int ith = self->ith;
    int seen = 0;
    free(self);
    for (;;) {
        wait_change(&pool->generation.v, seen, &pool->run_sleepers.v);
        seen = atomic_load_explicit(&pool->generation.v, memory_order_acquire);
        if (pool->stop) return NULL;
        pool->fn(pool->arg, ith, pool->n_threads);
        kw_pool_barrier(pool); /* the run's end: the caller returns after it */
    }
}

kw_pool *kw_pool_create(int n_threads) {
    if (n_threads < 1) return NULL;
    kw_pool *pool = aligned_alloc(64, (sizeof(kw_pool) + 63) / 64 * 64);
    if (!pool) return NULL;
    *pool = (kw_pool){.n_threads = 1}; /* grows as workers start: destroy joins those */
    pthread_mutex_init(&pool->run_lock, NULL);
    pool->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!pool->threads) goto fail;
    /* Workers inherit a mask that blocks every signal, so signals (Ctrl-C in
     * Python) keep going to the threads that expect them; but not the signals of
     * a fault, which the kernel delivers to the faulting thread: one blocked there
     * kills the process instead of running its handler (a worker writing a page
     * kwker's write watches made read-only, whose handler re-opens it). */
    sigset_t all, old;
    sigfillset(&all);
    for (const int *s = (const int[]){SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, 0}; *s; s++) sigdelset(&all, *s);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int i = 1; i < n_threads; i++) {
        kw__worker *w = malloc(sizeof *w);
        if (!w) goto fail_threads;
        *w = (kw__worker){pool, i};
        if (pthread_create(&pool->threads[i], NULL, worker_main, w) != 0) {
            free(w);
            goto fail_threads;
        }
        pool->n_threads = i + 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pool->n_threads = n_threads;
    return pool;

fail_threads:
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    kw_pool_destroy(pool);
    return NULL;
fail:
    pthread_mutex_destroy(&pool->run_lock);
    free(pool);
    return NULL;
}

void kw_pool_destroy(kw_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->run_lock);
    pool->stop = 1;
    atomic_fetch_add(&pool->generation.v, 1);
    futex_wake_all(&pool->generation.v);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->threads[i], NULL);
    pthread_mutex_unlock(&pool->run_lock);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->threads);
    free(pool);
}

int kw_pool_size(const kw_pool *pool) { return pool->n_threads; }

void kw_pool_run(kw_pool *pool, kw_task_fn fn, void *arg) {
    pthread_mutex_lock(&pool->run_lock);
    pool->fn = fn;
    pool->arg = arg;
    if (pool->n_threads > 1) {
        atomic_fetch_add(&pool->generation.v, 1);
        wake(&pool->generation.v, &pool->run_sleepers.v);
    }
    fn(arg, 0, pool->n_threads);
    kw_pool_barrier(pool);
    pthread_mutex_unlock(&pool->run_lock);
}
