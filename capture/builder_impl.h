/* builder_impl.h — the builder's state, shared by capture/ sources only. */
#ifndef KW_BUILDER_IMPL_H
#define KW_BUILDER_IMPL_H

#include "kw_capture.h"
#include "kw_plan_impl.h"

#define KW__MSG 512
/* Larger buffers are refused, so that offsets and arena sums never overflow. */
#define KW__MAX_BYTES ((size_t)1 << 48)

typedef struct kw__bstep {
    int op; /* kw_op_id, or -1 for a fallback */
    int n_views;
    int *views;   /* view ids, -1 absent */
    char *access; /* per view */
    int64_t ip[KW_CALL_MAX_PARAMS];
    double fp[KW_CALL_MAX_PARAMS];
    int n_ip, n_fp;
    kw_fallback_fn fn;
    void *user;
    char *label; /* NULL until labelled */
} kw__bstep;

struct kw_builder {
    int err;   /* the first failure, sticky */
    int spent; /* finish succeeded */
    char first_msg[KW__MSG], last_msg[KW__MSG];
    kw__buffer *buffers;
    kw__view *views;
    kw__bstep *steps;
    int n_buffers, n_views, n_steps, n_slots;
    int cap_buffers, cap_views, cap_steps;
};

/* The bytes [lo, hi) a view can touch, relative to its buffer's start (lo == hi
 * for an empty view). Returns 0 when the arithmetic overflows. */
int kw__view_extent(const kw__view *v, int64_t *lo, int64_t *hi);

/* Bytes a view really touches: stride-0 (broadcast) dims count once. */
int64_t kw__view_bytes(const kw__view *v);

/* Records a failure: the return value is err. */
int kw__builder_fail(kw_builder *b, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
