/* kw_capture.h — the builder: buffers, views and steps in, a validated plan out.
 *
 * Declare buffers (per-call inputs, fresh outputs, constants at a
 * fixed address, arena regions), typed views over them, and steps (an ops/ kernel
 * with its views and scalar parameters, or a host fallback). kw_builder_finish
 * checks everything — each kernel's own check, slot access, no arena or output
 * buffer read before a step writes it, no write to a constant, no written view
 * partly overlapping another view of its step — places the arena buffers by
 * liveness, decides where barriers go and returns an immutable kw_plan. Replay
 * then checks nothing: the caller binds a pointer of the right size to each slot.
 *
 * Every call returns an id (>= 0) or a negative KW_E*; the first failing call
 * also makes finish fail with the same code and message (kw_builder_error). */
#ifndef KW_CAPTURE_H
#define KW_CAPTURE_H

#include <stddef.h>
#include <stdint.h>

#include "kw_plan.h"
#include "kw_types.h"

typedef struct kw_builder kw_builder;

kw_builder *kw_builder_create(void); /* NULL when out of memory */
void kw_builder_destroy(kw_builder *b);

/* Buffers. Input and output buffers are per-call: they take replay
 * slots 0, 1, 2... in the order they are declared. The builder copies names.
 *   input:    a new pointer each call, contents defined;
 *   output:   a new pointer each call, contents undefined until a step writes it;
 *   constant: at `addr` for the plan's life, read-only (weights);
 *   arena:    placed by the planner; undefined until a step writes it. */
int kw_builder_input(kw_builder *b, const char *name, size_t nbytes);
int kw_builder_output(kw_builder *b, const char *name, size_t nbytes);
int kw_builder_constant(kw_builder *b, const char *name, const void *addr, size_t nbytes);
int kw_builder_arena(kw_builder *b, const char *name, size_t nbytes);

/* What has been declared, as kw_plan_buffer and kw_plan_view say it of the
 * finished plan (a per-call buffer's replay slot, a view's layout). 0, or
 * KW_EINVAL for a bad id. */
int kw_builder_buffer(const kw_builder *b, int buffer, kw_buffer_kind *kind, int *slot);
int kw_builder_view_layout(const kw_builder *b, int view, int *buffer, size_t *offset, kw_tensor *layout);

/* A view: `offset` bytes into `buffer`, strides in elements (NULL: contiguous;
 * never negative, as in PyTorch). It must lie inside its buffer (KW_EBOUNDS). */
int kw_builder_view(kw_builder *b, int buffer, kw_dtype dtype, int ndim, const int64_t *shape,
                    const int64_t *stride, size_t offset);

/* A kernel step: views[k] goes to the op's tensor slot k (-1: absent, allowed for
 * optional slots only); exactly the op's n_ip ints and n_fp doubles. Returns the
 * step's index. */
int kw_builder_op(kw_builder *b, int op, const int *views, int n_views, const int64_t *ip, int n_ip,
                  const double *fp, int n_fp);

/* Whether kw_builder_op with these arguments would pass the op's own rules
 * (parameter counts, required tensors, its check of dtypes and shapes) at
 * finish: 0, or the KW_E* it would fail with and the reason in msg. Changes
 * nothing, so a caller may take another way (a host step) instead. */
int kw_builder_check_op(const kw_builder *b, int op, const int *views, int n_views, const int64_t *ip, int n_ip,
                        const double *fp, int n_fp, char *msg, size_t len);

/* A host step over n views; access[k] is KW_READ, KW_WRITE or KW_MODIFY. */
int kw_builder_fallback(kw_builder *b, kw_fallback_fn fn, void *user, const int *views,
                        const char *access, int n);

/* A name for a step in messages, the dump and the profile (an FX node's name). */
int kw_builder_label(kw_builder *b, int step, const char *label);

typedef struct kw_finish_opts {
    int n_threads;          /* the most threads a replay will use, >= 1 */
    int barrier_every_step; /* debug: all threads meet before every step */
    int isa;                /* kernels for at most this kw_isa; -1: kw_cpu_isa() */
} kw_finish_opts;

/* Validates and plans. On success *plan is the caller's and the builder is spent
 * (further calls answer KW_ESTATE). On failure *plan is NULL and msg names the
 * step (index, op, label) and the problem. */
int kw_builder_finish(kw_builder *b, const kw_finish_opts *opts, kw_plan **plan, char *msg,
                      size_t msg_len);

/* The message of the most recent failed call, "" when none failed (finish
 * reports the first one's). */
const char *kw_builder_error(const kw_builder *b);

/* The arena planner, exposed for tests. Buffers whose live step ranges
 * [first, last] overlap never share bytes; sizes round up to 64 and offsets are
 * multiples of 64. Items with size 0 or first < 0 get offset 0 and no space.
 * Exact (the smallest arena) for up to 7 live items; best of several greedy
 * orders beyond. Returns the arena size. */
typedef struct kw_arena_item {
    size_t size;
    int first, last;
    size_t offset; /* out */
} kw_arena_item;

size_t kw_arena_plan(kw_arena_item *items, int n);

#endif
