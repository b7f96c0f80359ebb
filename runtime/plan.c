/* The replay loop: every thread of the pool walks the same flat step array. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kw_mem.h"
#include "kw_ops.h"
#include "kw_plan_impl.h"

_Alignas(KW__ALIGN) char kw__empty[KW__ALIGN];

const char *kw_buffer_kind_name(kw_buffer_kind kind) {
    switch (kind) {
    case KW_BUFFER_INPUT: return "input";
    case KW_BUFFER_OUTPUT: return "output";
    case KW_BUFFER_CONSTANT: return "constant";
    case KW_BUFFER_ARENA: return "arena";
    default: return "?";
    }
}

void kw_plan_destroy(kw_plan *p) {
    if (!p) return;
    for (int i = 0; p->steps && p->info && i < p->n_steps; i++) {
        const kw_op_info *op = p->info[i].op >= 0 ? kw_op_get((kw_op_id)p->info[i].op) : NULL;
        if (op && op->release && p->steps[i].call && p->steps[i].call->prep) op->release((void *)p->steps[i].call->prep);
    }
    kw_mem_free(p->prep_mem, p->prep_bytes);
    if (p->arena) kw_mem_free(p->arena, p->alloc_bytes);
    kw_mem_free(p->shares, p->share_bytes);
    for (int i = 0; i < p->n_fallbacks; i++) free(p->fallbacks[i].views);
    for (int i = 0; i < p->n_buffers; i++) free(p->buffers[i].name);
    for (int i = 0; i < p->n_steps; i++) {
        free(p->info[i].label);
        free(p->info[i].views);
        free(p->info[i].access);
    }
    free(p->steps);
    free(p->calls);
    free(p->fallbacks);
    free(p->slots);
    free(p->patches);
    free(p->buffers);
    free(p->views);
    free(p->info);
    free(p->profile_ns);
    free(p);
}

/* One replay in flight: what every thread of the pool reads. */
typedef struct kw__run {
    kw_plan *plan;
    kw_pool *pool;
    atomic_int rc;
    atomic_int stop_at; /* the barrier (counted from 1) the replay stops at; 0: none yet */
} kw__run;

/* A barrier at which every thread decides alike whether the replay stops: once
 * a kernel has reported an index out of range (kw_fault), no step after the
 * next barrier runs, so that nothing computed past a skipped row (an embedding
 * of a bad token id) is written into the call's inputs (the KV cache): PyTorch
 * raises before writing anything. Each thread votes with what it saw before
 * the barrier, and a vote counts only at the barrier it was cast for or a
 * later one: a fast thread may report and vote for the next barrier while a
 * slower one is still reading this one's verdict. at: this barrier's count. */
static int barrier_stops(kw__run *r, int at) {
    int none = 0;
    if (atomic_load_explicit(&r->plan->fault.reported, memory_order_relaxed))
        atomic_compare_exchange_strong(&r->stop_at, &none, at);
    kw_pool_barrier(r->pool);
    const int stop = atomic_load(&r->stop_at);
    return stop && stop <= at;
}

/* Thread 0 runs the host step while the others go straight to the barrier;
 * a failure is a vote to stop at that barrier, as a kernel's fault is. The
 * verdict must be the barrier's own: a thread that read a shared flag after it
 * could see a later host step's failure, which thread 0, already past, had
 * reported, and leave while thread 0 waited for it at the barrier after that
 * step (the process hung). at: the barrier's count. */
static int run_fallback(kw__run *r, const kw__fallback *f, int ith, int at) {
    if (ith == 0 && f->fn(f->user, f->views, f->n) != 0) {
        int none = 0;
        atomic_store_explicit(&r->rc, KW_ECALLBACK, memory_order_relaxed);
        atomic_compare_exchange_strong(&r->stop_at, &none, at);
    }
    return barrier_stops(r, at);
}

static void run_steps(void *arg, int ith, int nth) {
    kw__run *r = arg;
    const kw__fallback *fallbacks = r->plan->fallbacks;
    const kw__step *s = r->plan->steps, *end = s + r->plan->n_steps;
    for (int barriers = 0; s < end; s++) {
        if (s->barrier && barrier_stops(r, ++barriers)) return;
        if (s->fn)
            s->fn(s->call, ith, nth);
        else if (run_fallback(r, &fallbacks[s->fallback], ith, ++barriers))
            return;
    }
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The same walk with a barrier after every step, so that thread 0's clock spans
 * the slowest thread's share. */
static void run_steps_profiled(void *arg, int ith, int nth) {
    kw__run *r = arg;
    kw_plan *p = r->plan;
    for (int i = 0, barriers = 0; i < p->n_steps; i++) {
        const kw__step *s = &p->steps[i];
        const uint64_t t0 = ith == 0 ? now_ns() : 0;
        if (s->fn) {
            s->fn(s->call, ith, nth);
            if (barrier_stops(r, ++barriers)) return;
        } else if (run_fallback(r, &p->fallbacks[s->fallback], ith, ++barriers)) {
            return;
        }
        if (ith == 0) p->profile_ns[i] += now_ns() - t0;
    }
}

/* Points every view on a per-call buffer at this call's memory. */
static int bind_slots(kw_plan *p, void *const *ptrs) {
    for (int i = 0; i < p->n_slots; i++) {
        const kw__slot *s = &p->slots[i];
        char *base = ptrs[i];
        if (!base) {
            if (p->buffers[s->buffer].nbytes) return KW_EINVAL;
            base = kw__empty; /* zero bytes: every view on it is empty and at offset 0 */
        }
        for (int k = 0; k < s->n_patches; k++) s->patches[k].t->data = base + s->patches[k].offset;
    }
    return 0;
}

int kw_plan_replay(kw_plan *p, kw_pool *pool, void *const *slots) {
    if (!p || !pool || (p->n_slots && !slots) || kw_pool_size(pool) > p->n_threads) return KW_EINVAL;
    if (atomic_exchange_explicit(&p->busy, 1, memory_order_acquire)) return KW_EBUSY;
    kw__run r = {.plan = p, .pool = pool};
    int rc = bind_slots(p, slots);
    if (p->shares) memset(p->shares, 0, p->share_bytes);
    atomic_store(&p->fault.reported, 0);
    if (rc == 0) {
        kw_pool_run(pool, p->profiling ? run_steps_profiled : run_steps, &r);
        rc = atomic_load_explicit(&r.rc, memory_order_relaxed);
        if (rc == 0 && atomic_load(&p->fault.reported)) rc = KW_EINDEX;
        if (p->profiling && rc == 0) p->profile_runs++;
    }
    atomic_store_explicit(&p->busy, 0, memory_order_release);
    return rc;
}

void kw_plan_forget_replay(kw_plan *p) { atomic_store_explicit(&p->busy, 0, memory_order_release); }

int kw_plan_fault(const kw_plan *p, int *step, int64_t *index, int64_t *size) {
    if (!atomic_load(&p->fault.reported)) return 0;
    for (int i = 0; i < p->n_steps; i++)
        if (p->steps[i].call == p->fault.call) *step = i;
    *index = p->fault.index;
    *size = p->fault.size;
    return 1;
}

int kw_plan_n_slots(const kw_plan *p) { return p->n_slots; }

int64_t kw_plan_slot_bytes(const kw_plan *p, int slot) {
    if (slot < 0 || slot >= p->n_slots) return -1;
    return (int64_t)p->buffers[p->slots[slot].buffer].nbytes;
}

int kw_plan_buffer(const kw_plan *p, int buffer, kw_buffer_kind *kind, int *slot) {
    if (buffer < 0 || buffer >= p->n_buffers) return KW_EINVAL;
    *kind = p->buffers[buffer].kind;
    *slot = p->buffers[buffer].slot;
    return 0;
}

int kw_plan_view(const kw_plan *p, int view, int *buffer, size_t *offset, kw_tensor *layout) {
    if (view < 0 || view >= p->n_views) return KW_EINVAL;
    const kw__view *v = &p->views[view];
    *buffer = v->buffer;
    *offset = v->offset;
    *layout = v->t;
    layout->data = NULL;
    return 0;
}

int kw_plan_n_views(const kw_plan *p) { return p->n_views; }

void *kw_plan_buffer_address(const kw_plan *p, int buffer) {
    if (buffer < 0 || buffer >= p->n_buffers) return NULL;
    const kw__buffer *b = &p->buffers[buffer];
    return b->kind == KW_BUFFER_INPUT || b->kind == KW_BUFFER_OUTPUT ? NULL : b->base;
}

int kw_plan_n_steps(const kw_plan *p) { return p->n_steps; }
int kw_plan_n_barriers(const kw_plan *p) { return p->n_barriers; }
int kw_plan_n_threads(const kw_plan *p) { return p->n_threads; }
void *kw_plan_arena(const kw_plan *p) { return p->arena; }
size_t kw_plan_arena_bytes(const kw_plan *p) { return p->alloc_bytes; }

void kw_plan_set_profiling(kw_plan *p, int on) {
    p->profiling = on && p->profile_ns;
    if (!p->profile_ns) return;
    for (int i = 0; i < p->n_steps; i++) p->profile_ns[i] = 0;
    p->profile_runs = 0;
}

int kw_plan_profiling(const kw_plan *p) { return p->profiling; }

const uint64_t *kw_plan_profile(const kw_plan *p, uint64_t *runs) {
    if (runs) *runs = p->profile_runs;
    return p->profile_ns;
}

const char *kw_plan_step_name(const kw_plan *p, int step) {
    if (step < 0 || step >= p->n_steps) return NULL;
    const int op = p->info[step].op;
    return op < 0 ? "fallback" : kw_op_get((kw_op_id)op)->name;
}

const char *kw_plan_step_label(const kw_plan *p, int step) {
    return step >= 0 && step < p->n_steps ? p->info[step].label : NULL;
}
