/* Write watches: read-only pages, a SIGSEGV handler that re-opens them, and
 * snapshots of the partial pages at the ends (see kw_watch.h).
 *
 * The handler reads a fixed table of protected ranges without a lock (it may
 * run on any thread, at any time); writers change the table under table_lock.
 * An entry is free (never used), active (its pages are protected or were
 * re-opened by a fault), or retired (its watch is gone but its range is kept
 * for RETIRED_CLAIM_NS, so that a fault that raced with the unprotecting still
 * finds it and retries instead of being taken for a crash). New watches take
 * free entries first, and entries retired for longer than that.
 *
 * A fault is claimed only where the retry can succeed: an active range's
 * faulting page is made writable (another mapping that took the place of a
 * freed weight, a file opened read-only, cannot be: the fault is passed on, as
 * it would be without kwker, instead of faulting again forever); a retired
 * range's pages were made writable before it retired, and are not touched
 * again (read-only memory mapped there later stays read-only: its fault is
 * retried until the range stops being claimed, then passed on). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kw_watch.h"

#define KW__WATCH_MAX 16384

/* How long a retired range still claims faults: a fault taken before its pages
 * were made writable reaches the handler as soon as its thread runs again, far
 * sooner than this unless the machine stalls it; a write to read-only memory
 * mapped there since spins this long before it ends the program. */
#define RETIRED_CLAIM_NS 2000000000LL

enum { ENTRY_FREE, ENTRY_ACTIVE, ENTRY_RETIRED };

typedef struct kw__region {
    _Atomic uintptr_t lo, hi; /* page-aligned: [lo, hi) */
    atomic_int state;
    atomic_int changed;   /* a write faulted since the last arm */
    atomic_int protected; /* the pages are read-only right now */
    _Atomic int64_t retired_at; /* CLOCK_MONOTONIC ns, when state became ENTRY_RETIRED */
} kw__region;

static kw__region regions[KW__WATCH_MAX];
static atomic_int n_used; /* entries [0, n_used) have been taken at least once */
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

/* The disposition found when the handler was installed, double-buffered so that
 * the handler never reads a half-written one. */
static struct sigaction previous[2];
static atomic_int previous_index;

struct kw_watch {
    const unsigned char *data;
    size_t bytes;
    int entry;         /* index into regions, -1 when no whole page lies inside */
    size_t head, tail; /* bytes before the first protected page, after the last */
    unsigned char *snapshot; /* head bytes, then tail bytes */
    atomic_int invalid;      /* kw_watch_invalidate, until the next arming */
    unsigned generation;     /* `generation` when armed */
};

/* kw_watch_invalidate_all's count: a watch armed before the last call reports changed. */
static atomic_uint generation;

static uintptr_t page_size(void) {
    static uintptr_t size;
    if (!size) size = (uintptr_t)sysconf(_SC_PAGESIZE);
    return size;
}

static int64_t now_ns(void) { /* clock_gettime is async-signal-safe */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* A retired entry whose range no fault can still be racing for. */
static int retired_long_ago(const kw__region *r, int64_t now) {
    return atomic_load(&r->state) == ENTRY_RETIRED && now - atomic_load(&r->retired_at) >= RETIRED_CLAIM_NS;
}

/* ---- the handler ------------------------------------------------------------------- */

/* Makes entry i's pages writable; any other entry whose pages overlap them was
 * re-opened too, so it is marked changed as well. 0, or -1 where mprotect
 * failed (part of the range no longer mapped, or mapped read-only from a file). */
static int reopen(int i) {
    kw__region *r = &regions[i];
    const uintptr_t lo = atomic_load(&r->lo), hi = atomic_load(&r->hi);
    const int rc = mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE);
    atomic_store(&r->protected, 0);
    atomic_store(&r->changed, 1);
    const int n = atomic_load(&n_used);
    for (int j = 0; j < n; j++)
        if (j != i && atomic_load(&regions[j].state) == ENTRY_ACTIVE && atomic_load(&regions[j].lo) < hi &&
            atomic_load(&regions[j].hi) > lo)
            atomic_store(&regions[j].changed, 1);
    return rc;
}

static int holds(const kw__region *r, uintptr_t a) {
    return a >= atomic_load(&r->lo) && a < atomic_load(&r->hi);
}

/* A write fault at a: 1 when a watched range holds it and it is now writable
 * (its page, or the whole range: a huge page cannot be opened a 4 KiB piece at
 * a time), or a range retired in the last RETIRED_CLAIM_NS holds it. */
static int claim(uintptr_t a) {
    int watched = 0, retired = 0;
    const int n = atomic_load(&n_used);
    for (int i = 0; i < n; i++) {
        const kw__region *r = &regions[i];
        const int state = atomic_load(&r->state);
        if (state == ENTRY_ACTIVE && holds(r, a))
            watched = 1;
        else if (state == ENTRY_RETIRED && holds(r, a) && !retired_long_ago(r, now_ns()))
            retired = 1;
    }
    if (!watched) return retired;
    /* The page before the ranges: each reopen marks its range changed after
     * opening it, so nothing the handler opens comes after the last mark. Opened
     * after, it could undo a kw_watch_rearm made in between, unseen. */
    const uintptr_t page = a / page_size() * page_size();
    int open = mprotect((void *)page, page_size(), PROT_READ | PROT_WRITE) == 0;
    for (int i = 0; i < n; i++)
        if (atomic_load(&regions[i].state) == ENTRY_ACTIVE && holds(&regions[i], a)) open |= reopen(i) == 0;
    return open || retired;
}

/* A SIGSEGV that no fault sent: re-opens every protected range; 1 if there was one. */
static int reopen_all(void) {
    int any = 0;
    const int n = atomic_load(&n_used);
    for (int i = 0; i < n; i++)
        if (atomic_load(&regions[i].state) == ENTRY_ACTIVE && atomic_load(&regions[i].protected)) {
            reopen(i);
            any = 1;
        }
    return any;
}

static void on_segv(int sig, siginfo_t *si, void *uc);

static void pass_on(int sig, siginfo_t *si, void *uc) {
    const struct sigaction *prev = &previous[atomic_load(&previous_index)];
    if ((prev->sa_flags & SA_SIGINFO) && prev->sa_sigaction && prev->sa_sigaction != on_segv) {
        prev->sa_sigaction(sig, si, uc);
        return;
    }
    if (!(prev->sa_flags & SA_SIGINFO) && prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
        return;
    }
    if (si->si_code <= 0 && !(prev->sa_flags & SA_SIGINFO) && prev->sa_handler == SIG_IGN) return;
    /* The default action: a fault re-runs its instruction and gets it; a sent
     * signal is sent again. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (si->si_code <= 0) raise(sig);
}

static void on_segv(int sig, siginfo_t *si, void *uc) {
    const int saved = errno;
    int handled;
    if (si->si_code > 0) /* sent by a fault */
        handled = si->si_code == SEGV_ACCERR && claim((uintptr_t)si->si_addr);
    else /* sent by kill/raise: perhaps a handler in front of ours re-raising our fault */
        handled = reopen_all();
    if (!handled) pass_on(sig, si, uc);
    errno = saved;
}

/* Called with table_lock held. */
static int install(void) {
    page_size(); /* read here, not first in the handler */
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, NULL, &old)) return -1;
    if ((old.sa_flags & SA_SIGINFO) && old.sa_sigaction == on_segv) return 0;
    const int next = !atomic_load(&previous_index);
    previous[next] = old;
    atomic_store(&previous_index, next);
    return sigaction(SIGSEGV, &sa, NULL);
}

int kw_watch_handler_check(void) {
    struct sigaction cur;
    if (sigaction(SIGSEGV, NULL, &cur)) return -1;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_segv) return 0;
    pthread_mutex_lock(&table_lock);
    const int rc = install();
    pthread_mutex_unlock(&table_lock);
    return rc;
}

/* ---- watches ------------------------------------------------------------------------ */

/* Called with table_lock held: a free entry or one retired long ago, else a
 * new one, else one retired lately, else -1. */
static int take_entry(uintptr_t lo, uintptr_t hi) {
    int found = -1;
    const int n = atomic_load(&n_used);
    const int64_t now = now_ns();
    for (int i = 0; i < n && found < 0; i++)
        if (atomic_load(&regions[i].state) == ENTRY_FREE || retired_long_ago(&regions[i], now)) found = i;
    if (found < 0 && n < KW__WATCH_MAX) {
        found = n;
        atomic_store(&n_used, n + 1);
    }
    for (int i = 0; i < n && found < 0; i++)
        if (atomic_load(&regions[i].state) == ENTRY_RETIRED) found = i;
    if (found < 0) return -1;
    kw__region *r = &regions[found];
    atomic_store(&r->state, ENTRY_FREE); /* not claimable while its range changes */
    atomic_store(&r->lo, lo);
    atomic_store(&r->hi, hi);
    atomic_store(&r->changed, 0);
    atomic_store(&r->protected, 0);
    atomic_store(&r->state, ENTRY_ACTIVE);
    return found;
}

static void take_snapshot(kw_watch *w) {
    memcpy(w->snapshot, w->data, w->head);
    memcpy(w->snapshot + w->head, w->data + w->bytes - w->tail, w->tail);
}

/* Clear the flag first, then protect: a write in between is not lost, because
 * the caller reads the memory only afterwards. */
static int protect(kw_watch *w) {
    if (w->entry < 0) return 0;
    kw__region *r = &regions[w->entry];
    atomic_store(&r->changed, 0);
    const uintptr_t lo = atomic_load(&r->lo), hi = atomic_load(&r->hi);
    if (mprotect((void *)lo, hi - lo, PROT_READ)) {
        atomic_store(&r->changed, 1);
        return -1;
    }
    atomic_store(&r->protected, 1);
    return 0;
}

kw_watch *kw_watch_new(const void *p, size_t bytes) {
    if (!p || !bytes) {
        errno = EINVAL;
        return NULL;
    }
    const uintptr_t start = (uintptr_t)p, end = start + bytes, page = page_size();
    const uintptr_t lo = (start + page - 1) / page * page, hi = end / page * page;
    kw_watch *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->data = p;
    w->bytes = bytes;
    w->entry = -1;
    if (hi > lo) {
        w->head = lo - start;
        w->tail = end - hi;
    } else {
        w->head = bytes; /* no whole page: every byte is compared */
    }
    w->snapshot = malloc(w->head + w->tail + 1);
    if (!w->snapshot) {
        free(w);
        return NULL;
    }
    if (hi > lo) {
        pthread_mutex_lock(&table_lock);
        const int rc = install();
        w->entry = rc ? -1 : take_entry(lo, hi);
        pthread_mutex_unlock(&table_lock);
        if (w->entry < 0 || protect(w)) {
            const int err = rc ? errno : w->entry < 0 ? ENOSPC : errno;
            kw_watch_free(w);
            errno = err;
            return NULL;
        }
    }
    take_snapshot(w);
    w->generation = atomic_load(&generation);
    return w;
}

/* Called with table_lock held: the watches still protecting pages of [lo, hi)
 * protect them again (freeing one watch must not open another's pages). */
static void protect_others(int self, uintptr_t lo, uintptr_t hi) {
    const int n = atomic_load(&n_used);
    for (int j = 0; j < n; j++) {
        kw__region *o = &regions[j];
        if (j == self || atomic_load(&o->state) != ENTRY_ACTIVE || !atomic_load(&o->protected)) continue;
        const uintptr_t olo = atomic_load(&o->lo), ohi = atomic_load(&o->hi);
        const uintptr_t a = olo > lo ? olo : lo, b = ohi < hi ? ohi : hi;
        if (a < b) mprotect((void *)a, b - a, PROT_READ);
    }
}

void kw_watch_free(kw_watch *w) {
    if (!w) return;
    if (w->entry >= 0) {
        kw__region *r = &regions[w->entry];
        pthread_mutex_lock(&table_lock);
        const uintptr_t lo = atomic_load(&r->lo), hi = atomic_load(&r->hi);
        mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE);
        atomic_store(&r->protected, 0);
        atomic_store(&r->retired_at, now_ns());
        atomic_store(&r->state, ENTRY_RETIRED);
        protect_others(w->entry, lo, hi);
        pthread_mutex_unlock(&table_lock);
    }
    free(w->snapshot);
    free(w);
}

int kw_watch_changed(const kw_watch *w) {
    if (atomic_load(&w->invalid) || w->generation != atomic_load_explicit(&generation, memory_order_relaxed)) return 1;
    if (w->entry >= 0 && atomic_load(&regions[w->entry].changed)) return 1;
    return memcmp(w->snapshot, w->data, w->head) != 0 ||
           memcmp(w->snapshot + w->head, w->data + w->bytes - w->tail, w->tail) != 0;
}

void kw_watch_prefetch(const kw_watch *w) {
    if (w->entry >= 0) __builtin_prefetch(&regions[w->entry].changed);
    __builtin_prefetch(w->snapshot);
    __builtin_prefetch(w->data);
    if (w->tail) {
        __builtin_prefetch(w->snapshot + w->head);
        __builtin_prefetch(w->data + w->bytes - w->tail);
    }
}

int kw_watch_rearm(kw_watch *w) {
    atomic_store(&w->invalid, 0);
    w->generation = atomic_load(&generation);
    const int rc = protect(w);
    take_snapshot(w);
    return rc;
}

void kw_watch_invalidate(kw_watch *w) { atomic_store(&w->invalid, 1); }

void kw_watch_invalidate_all(void) { atomic_fetch_add(&generation, 1); }

const void *kw_watch_data(const kw_watch *w) { return w->data; }
size_t kw_watch_bytes(const kw_watch *w) { return w->bytes; }
size_t kw_watch_protected_bytes(const kw_watch *w) { return w->bytes - w->head - w->tail; }
