/* The thread pool and the memory helpers. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kw_mem.h"
#include "kw_pool.h"
#include "kw_watch.h"

static void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

typedef struct tally {
    atomic_int calls, mask;
    int nth_seen;
} tally;

static void count(void *arg, int ith, int nth) {
    tally *t = arg;
    atomic_fetch_add(&t->calls, 1);
    atomic_fetch_or(&t->mask, 1 << ith);
    t->nth_seen = nth;
}

static void worker_writes(void *arg, int ith, int nth) {
    (void)nth;
    if (ith == 1) ((unsigned char *)arg)[1] ^= 0xff;
}

/* A worker's fault goes to the process's handler: a worker writing a page that
 * a watch made read-only once killed the process (the workers blocked every
 * signal, and the kernel then takes the default action for a fault's). */
Test(pool, a_worker_writing_a_watched_page_is_seen_and_goes_on) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    unsigned char *mem = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(mem, MAP_FAILED);
    kw_watch *w = kw_watch_new(mem, 2 * page);
    kw_pool *pool = kw_pool_create(2);
    cr_assert(w && pool);
    kw_pool_run(pool, worker_writes, mem);
    cr_expect_eq(kw_watch_changed(w), 1);
    cr_expect_eq(mem[1], 0xff);
    kw_pool_destroy(pool);
    kw_watch_free(w);
    munmap(mem, 2 * page);
}

Test(pool, every_thread_runs_once_per_run) {
    for (int n = 1; n <= 8; n *= 2) {
        kw_pool *pool = kw_pool_create(n);
        cr_assert_not_null(pool);
        cr_expect_eq(kw_pool_size(pool), n);
        for (int run = 0; run < 50; run++) {
            tally t = {0};
            kw_pool_run(pool, count, &t);
            cr_assert_eq(atomic_load(&t.calls), n, "run %d of %d threads", run, n);
            cr_assert_eq(atomic_load(&t.mask), (1 << n) - 1);
            cr_assert_eq(t.nth_seen, n);
        }
        kw_pool_destroy(pool);
    }
    cr_expect_null(kw_pool_create(0));
}

/* Every step, each thread writes the step into its slot; after a barrier every
 * thread must see every slot at that step, and after a second barrier the slots
 * may change again. A barrier that lets a thread through early breaks this. */
typedef struct lockstep {
    kw_pool *pool;
    int steps;
    atomic_int slot[16];
    atomic_int errors;
} lockstep;

static void lockstep_task(void *arg, int ith, int nth) {
    lockstep *l = arg;
    for (int s = 1; s <= l->steps; s++) {
        atomic_store_explicit(&l->slot[ith], s, memory_order_relaxed);
        kw_pool_barrier(l->pool);
        for (int j = 0; j < nth; j++)
            if (atomic_load_explicit(&l->slot[j], memory_order_relaxed) != s) atomic_fetch_add(&l->errors, 1);
        kw_pool_barrier(l->pool);
    }
}

static void run_lockstep(int n, int steps, int runs) {
    kw_pool *pool = kw_pool_create(n);
    cr_assert_not_null(pool);
    for (int run = 0; run < runs; run++) {
        lockstep l = {.pool = pool, .steps = steps};
        kw_pool_run(pool, lockstep_task, &l);
        cr_assert_eq(atomic_load(&l.errors), 0, "%d threads, run %d", n, run);
    }
    kw_pool_destroy(pool);
}

Test(pool, barrier_keeps_threads_in_lockstep) { run_lockstep(2, 5000, 4); }

/* More threads than cores: waiters must still get through (spin, then sleep). */
Test(pool, barrier_survives_oversubscription) { run_lockstep(6, 300, 2); }

/* A thread that arrives late (after the spin limit) finds the others asleep at
 * the barrier and must wake them; so must a run after the workers fell asleep. */
static void late_arrival(void *arg, int ith, int nth) {
    lockstep *l = arg;
    if (ith == nth - 1) sleep_us(3000);
    atomic_fetch_add(&l->slot[ith], 1);
    kw_pool_barrier(l->pool);
    for (int j = 0; j < nth; j++)
        if (atomic_load(&l->slot[j]) != 1) atomic_fetch_add(&l->errors, 1);
}

Test(pool, sleeping_waiters_wake_up) {
    kw_pool *pool = kw_pool_create(3);
    for (int run = 0; run < 4; run++) {
        lockstep l = {.pool = pool};
        kw_pool_run(pool, late_arrival, &l);
        cr_assert_eq(atomic_load(&l.errors), 0);
        sleep_us(2000); /* past the spin limit: workers sleep before the next run */
    }
    kw_pool_destroy(pool);
}

/* Two threads drive one pool at once: runs are serialised, none is lost. */
typedef struct driver {
    kw_pool *pool;
    int runs;
    atomic_int sum;
    int errors;
} driver;

static void add_ith(void *arg, int ith, int nth) {
    driver *d = arg;
    atomic_fetch_add(&d->sum, ith + 1);
    (void)nth;
}

static void *drive(void *arg) {
    driver *d = arg;
    for (int i = 0; i < d->runs; i++) {
        const int before = atomic_load(&d->sum);
        kw_pool_run(d->pool, add_ith, d);
        if (atomic_load(&d->sum) - before != 3) d->errors++; /* 1 + 2 for two threads */
        lockstep l = {.pool = d->pool, .steps = 3};
        kw_pool_run(d->pool, lockstep_task, &l);
        d->errors += atomic_load(&l.errors);
    }
    return NULL;
}

Test(pool, runs_from_two_threads_are_serialised) {
    kw_pool *pool = kw_pool_create(2);
    driver a = {.pool = pool, .runs = 3000}, b = {.pool = pool, .runs = 3000};
    pthread_t ta, tb;
    pthread_create(&ta, NULL, drive, &a);
    pthread_create(&tb, NULL, drive, &b);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    cr_expect_eq(a.errors, 0);
    cr_expect_eq(b.errors, 0);
    cr_expect_eq(atomic_load(&a.sum), 3 * 3000);
    cr_expect_eq(atomic_load(&b.sum), 3 * 3000);
    kw_pool_destroy(pool);
}

Test(mem, blocks_are_aligned_zeroed_and_writable) {
    static const size_t sizes[] = {0, 1, 63, 64, 1000, (2u << 20) - 1, 2u << 20, (5u << 20) + 3};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        unsigned char *p = kw_mem_alloc(sizes[i]);
        cr_assert_not_null(p, "%zu bytes", sizes[i]);
        cr_expect_eq((uintptr_t)p % 64, 0, "%zu bytes", sizes[i]);
        if (sizes[i] >= (2u << 20)) cr_expect_eq((uintptr_t)p % (2u << 20), 0, "huge blocks start on a 2 MiB page");
        for (size_t j = 0; j < sizes[i]; j += 4093) cr_expect_eq(p[j], 0);
        if (sizes[i]) p[sizes[i] - 1] = 1;
        kw_mem_free(p, sizes[i]);
    }
    kw_mem_free(NULL, 10);
}
