/* kw_plan_dump: the plan as text, in the spirit of SQLite's EXPLAIN listing. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kw_ops.h"
#include "kw_plan_impl.h"

typedef struct text {
    char *s;
    size_t len, cap;
    int failed;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(text *t, const char *fmt, ...) {
    if (t->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        const int n = vsnprintf(t->s + t->len, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = 1;
            return;
        }
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        const size_t cap = 2 * t->cap + (size_t)n + 1;
        char *s = realloc(t->s, cap);
        if (!s) {
            t->failed = 1;
            return;
        }
        t->s = s;
        t->cap = cap;
    }
}

static int contiguous(const kw_tensor *v) {
    int64_t expect = 1;
    for (int d = v->ndim - 1; d >= 0; d--) {
        if (v->shape[d] != 1 && v->stride[d] != expect) return 0;
        expect *= v->shape[d];
    }
    return 1;
}

static void put_layout(text *t, const kw_tensor *v) {
    put(t, "%s[", kw_dtype_name(v->dtype));
    for (int d = 0; d < v->ndim; d++) put(t, d ? ", %" PRId64 : "%" PRId64, v->shape[d]);
    put(t, "]");
    if (contiguous(v)) return;
    put(t, " strides [");
    for (int d = 0; d < v->ndim; d++) put(t, d ? ", %" PRId64 : "%" PRId64, v->stride[d]);
    put(t, "]");
}

static void put_buffer(text *t, const kw_plan *p, int i) {
    const kw__buffer *b = &p->buffers[i];
    put(t, "  b%-3d %-8s %-20s %10zu B", i, kw_buffer_kind_name(b->kind), b->name, b->nbytes);
    if (b->slot >= 0) put(t, "  slot %d", b->slot);
    if (b->kind == KW_BUFFER_ARENA && b->first >= 0)
        put(t, "  arena [%zu, %zu)", b->arena_offset, b->arena_offset + b->nbytes);
    if (b->kind == KW_BUFFER_CONSTANT) put(t, "  at %p", b->base);
    if (b->first >= 0)
        put(t, "  live %d..%d", b->first, b->last);
    else
        put(t, "  unused");
    put(t, "\n");
}

static const char *slot_name(const kw_plan *p, int step, int k) {
    const int op = p->info[step].op;
    return op < 0 ? "view" : kw_op_get((kw_op_id)op)->arg[k].name;
}

static void put_step(text *t, const kw_plan *p, int i) {
    const kw__step_info *in = &p->info[i];
    if (p->steps[i].barrier) put(t, "  ---- barrier\n");
    put(t, "  %4d %-16s %-24s read %" PRId64 " B, write %" PRId64 " B\n", i, kw_plan_step_name(p, i),
        in->label, in->bytes_read, in->bytes_written);
    for (int k = 0; k < in->n_views; k++) {
        if (in->views[k] < 0) continue;
        const kw__view *v = &p->views[in->views[k]];
        put(t, "         %-12s %c  b%d+%zu  ", slot_name(p, i, k), in->access[k], v->buffer, v->offset);
        put_layout(t, &v->t);
        put(t, "\n");
    }
    if (in->op < 0) put(t, "  ---- barrier (after a fallback)\n");
    const kw_call *c = p->steps[i].call;
    if (!c) return;
    const kw_op_info *op = kw_op_get((kw_op_id)in->op);
    if (op->n_ip) {
        put(t, "         ip");
        for (int k = 0; k < op->n_ip; k++) put(t, " %" PRId64, c->ip[k]);
        put(t, "\n");
    }
    if (op->n_fp) {
        put(t, "         fp");
        for (int k = 0; k < op->n_fp; k++) put(t, " %g", c->fp[k]);
        put(t, "\n");
    }
}

char *kw_plan_dump(const kw_plan *p) {
    text t = {.s = malloc(4096), .cap = 4096};
    if (!t.s) return NULL;
    put(&t, "plan: %d steps (%d fallbacks), %d barriers, %d threads, isa %s\n", p->n_steps,
        p->n_fallbacks, p->n_barriers, p->n_threads, kw_isa_name((kw_isa)p->isa));
    put(&t, "arena: %zu B of buffers + %d x %zu B of scratch\n", p->arena_bytes, p->n_threads,
        p->scratch_stride);
    put(&t, "buffers:\n");
    for (int i = 0; i < p->n_buffers; i++) put_buffer(&t, p, i);
    put(&t, "steps: (bytes read and written count whole views: an upper bound for masked or in-place access)\n");
    for (int i = 0; i < p->n_steps; i++) put_step(&t, p, i);
    if (t.failed) {
        free(t.s);
        return NULL;
    }
    return t.s;
}
