/* kw_plan_impl.h — the layout of a kw_plan, shared by runtime/ (which replays
 * and dumps it) and capture/ (which fills it in). Nothing else includes it.
 *
 * Hot data (the step array, the calls, the fallbacks) is what replay reads; the
 * rest describes the plan for the dump and the profile and is never read by the
 * loop. */
#ifndef KW_PLAN_IMPL_H
#define KW_PLAN_IMPL_H

#include <stdatomic.h>

#include "kw_plan.h"

#define KW__ALIGN 64


/* The address given to tensors of zero bytes that have no memory of their own:
 * never dereferenced, but not NULL (NULL marks an absent tensor). */
extern char kw__empty[KW__ALIGN];

typedef struct kw__buffer {
    char *name;
    kw_buffer_kind kind;
    int slot;            /* per-call slot, or -1 */
    size_t nbytes;
    void *base;          /* fixed address; NULL for input and output buffers */
    size_t arena_offset; /* arena buffers only */
    int first, last;     /* first and last step that touches it; -1 when none */
} kw__buffer;

typedef struct kw__view {
    int buffer;
    size_t offset; /* bytes from the buffer's start */
    kw_tensor t;   /* dtype, shape and strides; data is bound per step */
} kw__view;

typedef struct kw__step {
    kw_kernel_fn fn;     /* NULL for a fallback */
    const kw_call *call; /* a kernel's arguments */
    int barrier;         /* all threads meet before this step */
    int fallback;        /* index into kw_plan.fallbacks, or -1 */
} kw__step;

typedef struct kw__fallback {
    kw_fallback_fn fn;
    void *user;
    int n;
    kw_tensor *views;
} kw__fallback;

/* Where replay writes a per-call pointer: t->data = slot pointer + offset. */
typedef struct kw__patch {
    kw_tensor *t;
    size_t offset;
} kw__patch;

typedef struct kw__slot {
    int buffer;
    int n_patches;
    kw__patch *patches;
} kw__slot;

/* What a step is, for the dump and the profile. */
typedef struct kw__step_info {
    int op;      /* kw_op_id, or -1 for a fallback */
    char *label; /* never NULL */
    int n_views;
    int *views;   /* view ids, -1 for an absent optional slot */
    char *access; /* KW_READ, KW_WRITE or KW_MODIFY for each view */
    int64_t bytes_read, bytes_written;
} kw__step_info;

struct kw_plan {
    /* replay */
    int n_steps;
    kw__step *steps;
    kw_call *calls;
    kw__fallback *fallbacks;
    int n_fallbacks;
    int n_threads;
    int n_slots;
    kw__slot *slots;
    kw__patch *patches;

    /* memory: buffers at [0, arena_bytes), then n_threads scratch strides */
    char *arena;
    size_t arena_bytes, scratch_stride, alloc_bytes;
    /* the share lines of calls whose op shares work, zeroed before each replay */
    char *shares;
    size_t share_bytes;
    /* each call's preparation (kw_op_info.prepare), 64-byte aligned, in step order */
    char *prep_mem;
    size_t prep_bytes;

    /* description */
    int n_buffers, n_views, n_barriers;
    kw__buffer *buffers;
    kw__view *views;
    kw__step_info *info;
    int isa;

    /* state */
    kw_fault fault; /* cleared before each replay */
    atomic_int busy;
    int profiling;
    uint64_t *profile_ns;
    uint64_t profile_runs;
};

#endif
