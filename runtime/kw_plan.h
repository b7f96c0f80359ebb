/* kw_plan.h — a replayable plan: a flat array of native calls over preallocated
 * buffers (capture/ builds it, see kw_capture.h).
 *
 * A plan is immutable in structure. Its per-call buffers (graph inputs and fresh
 * outputs) are numbered slots: kw_plan_replay takes one pointer per slot, patches
 * the views on them, and runs every step inside one kw_pool_run, each thread
 * walking the whole array with a barrier only where a step depends on an earlier
 * one. Replay allocates nothing, looks nothing up and fails only on a bad call
 * (a missing pointer, a busy plan), a failing fallback or an index out of range
 * in the data.
 *
 * Two plans may replay at once from two threads (on one pool the runs take turns);
 * a plan replayed while it is already replaying answers KW_EBUSY. */
#ifndef KW_PLAN_H
#define KW_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "kw_pool.h"
#include "kw_types.h"

typedef struct kw_plan kw_plan;

/* What a buffer is (kw_capture.h declares them). */
typedef enum kw_buffer_kind {
    KW_BUFFER_INPUT,    /* per call: a new pointer each replay */
    KW_BUFFER_OUTPUT,   /* per call, written by the plan, undefined before */
    KW_BUFFER_CONSTANT, /* fixed address, read-only */
    KW_BUFFER_ARENA,    /* placed in the plan's arena by liveness */
} kw_buffer_kind;

const char *kw_buffer_kind_name(kw_buffer_kind kind);

/* A host step ("fallback"): runs on thread 0 while the other threads wait at a
 * barrier. views[] are the step's tensors with their data pointers bound for
 * this call. Returns 0, or non-zero to abort the replay with KW_ECALLBACK. */
typedef int (*kw_fallback_fn)(void *user, kw_tensor *views, int n);

void kw_plan_destroy(kw_plan *plan);

/* Runs the plan once. slots[i] is the pointer for slot i (kw_plan_n_slots of
 * them; NULL only for a slot of zero bytes). The pool may have fewer threads than
 * the plan was built for, never more. Returns 0, KW_EINVAL, KW_EBUSY,
 * KW_ECALLBACK, or KW_EINDEX when a kernel met an index out of range in its
 * data (see kw_plan_fault): the replay stops at the first barrier after that
 * step, so no step that reads what it computed runs. */
int kw_plan_replay(kw_plan *plan, kw_pool *pool, void *const *slots);

/* In a child forked while another thread replayed the plan: that replay never
 * ends there (fork copies only the forking thread), and the plan may be
 * replayed again. */
void kw_plan_forget_replay(kw_plan *plan);

/* After a replay that returned KW_EINDEX: the step, the index and the size it
 * had to be below; returns 1. 0 when the last replay reported none. */
int kw_plan_fault(const kw_plan *plan, int *step, int64_t *index, int64_t *size);

int kw_plan_n_slots(const kw_plan *plan);
/* Bytes the pointer for slot i must cover; -1 for a bad index. */
int64_t kw_plan_slot_bytes(const kw_plan *plan, int slot);

/* The plan's buffers and views as declared (ids are the builder's): a buffer's
 * kind and replay slot (-1 for constants and arena buffers); a view's buffer,
 * bytes from the buffer's start and layout (data NULL). 0, or KW_EINVAL for a
 * bad id. */
int kw_plan_buffer(const kw_plan *plan, int buffer, kw_buffer_kind *kind, int *slot);
int kw_plan_view(const kw_plan *plan, int view, int *buffer, size_t *offset, kw_tensor *layout);
int kw_plan_n_views(const kw_plan *plan);

/* The fixed address of a buffer (constant, arena buffer); NULL for
 * per-call inputs and outputs, for arena buffers no step uses and bad ids. */
void *kw_plan_buffer_address(const kw_plan *plan, int buffer);

int kw_plan_n_steps(const kw_plan *plan);
int kw_plan_n_barriers(const kw_plan *plan);
int kw_plan_n_threads(const kw_plan *plan);
/* The arena: intermediate buffers, then per-thread scratch. */
void *kw_plan_arena(const kw_plan *plan);
size_t kw_plan_arena_bytes(const kw_plan *plan);

/* Per-step timing. Off by default and free when off (replay picks another loop);
 * when on, every step is followed by a barrier so that a step's time is its wall
 * time across all threads. Turning it on clears the counters. */
void kw_plan_set_profiling(kw_plan *plan, int on);
int kw_plan_profiling(const kw_plan *plan);
/* Nanoseconds spent in each step, summed over `*runs` profiled replays. */
const uint64_t *kw_plan_profile(const kw_plan *plan, uint64_t *runs);

/* The step's op name ("linear", "fallback") and its label (may be ""). */
const char *kw_plan_step_name(const kw_plan *plan, int step);
const char *kw_plan_step_label(const kw_plan *plan, int step);

/* A readable listing: buffers (kind, bytes, arena offset, live range), steps
 * (op, views, barriers, bytes read and written). malloc'd; free() it. NULL when
 * out of memory. */
char *kw_plan_dump(const kw_plan *plan);

#endif
