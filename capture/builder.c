/* Declaring buffers, views and steps. Each call checks what it can on its own
 * (ids, sizes, a view inside its buffer); what needs the whole program waits for
 * kw_builder_finish. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builder_impl.h"
#include "kw_ops.h"

kw_builder *kw_builder_create(void) { return calloc(1, sizeof(kw_builder)); }

void kw_builder_destroy(kw_builder *b) {
    if (!b) return;
    for (int i = 0; i < b->n_buffers; i++) free(b->buffers[i].name);
    for (int i = 0; i < b->n_steps; i++) {
        free(b->steps[i].views);
        free(b->steps[i].access);
        free(b->steps[i].label);
    }
    free(b->buffers);
    free(b->views);
    free(b->steps);
    free(b);
}

int kw__builder_fail(kw_builder *b, int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->last_msg, sizeof b->last_msg, fmt, ap);
    va_end(ap);
    if (!b->err) {
        b->err = err;
        memcpy(b->first_msg, b->last_msg, sizeof b->first_msg);
    }
    return err;
}

const char *kw_builder_error(const kw_builder *b) { return b->last_msg; }

/* Makes room for one more element of a growable array. */
static int grow(void **items, int *cap, int n, size_t size) {
    if (n < *cap) return 0;
    const int new_cap = *cap ? 2 * *cap : 16;
    void *p = realloc(*items, (size_t)new_cap * size);
    if (!p) return -1;
    *items = p;
    *cap = new_cap;
    return 0;
}

static int open_for_calls(kw_builder *b, const char *what) {
    if (b->spent) return kw__builder_fail(b, KW_ESTATE, "%s: the builder is already finished", what);
    return 0;
}

static int add_buffer(kw_builder *b, const char *what, kw_buffer_kind kind, const char *name, void *base,
                      size_t nbytes) {
    int rc = open_for_calls(b, what);
    if (rc) return rc;
    if (!name) name = "";
    if (nbytes > KW__MAX_BYTES)
        return kw__builder_fail(b, KW_EINVAL, "%s '%s': %zu bytes is too large", what, name, nbytes);
    if (kind == KW_BUFFER_CONSTANT && !base)
        return kw__builder_fail(b, KW_EINVAL, "%s '%s': NULL address", what, name);
    char *copy = strdup(name);
    if (!copy || grow((void **)&b->buffers, &b->cap_buffers, b->n_buffers, sizeof *b->buffers)) {
        free(copy);
        return kw__builder_fail(b, KW_ENOMEM, "%s '%s': out of memory", what, name);
    }
    const int per_call = kind == KW_BUFFER_INPUT || kind == KW_BUFFER_OUTPUT;
    b->buffers[b->n_buffers] = (kw__buffer){
        .name = copy,
        .kind = kind,
        .slot = per_call ? b->n_slots++ : -1,
        .nbytes = nbytes,
        .base = base,
        .first = -1,
        .last = -1,
    };
    return b->n_buffers++;
}

int kw_builder_input(kw_builder *b, const char *name, size_t nbytes) {
    return add_buffer(b, "input", KW_BUFFER_INPUT, name, NULL, nbytes);
}

int kw_builder_output(kw_builder *b, const char *name, size_t nbytes) {
    return add_buffer(b, "output", KW_BUFFER_OUTPUT, name, NULL, nbytes);
}

int kw_builder_constant(kw_builder *b, const char *name, const void *addr, size_t nbytes) {
    return add_buffer(b, "constant", KW_BUFFER_CONSTANT, name, (void *)addr, nbytes);
}

int kw_builder_arena(kw_builder *b, const char *name, size_t nbytes) {
    return add_buffer(b, "arena buffer", KW_BUFFER_ARENA, name, NULL, nbytes);
}

int kw_builder_buffer(const kw_builder *b, int buffer, kw_buffer_kind *kind, int *slot) {
    if (buffer < 0 || buffer >= b->n_buffers) return KW_EINVAL;
    *kind = b->buffers[buffer].kind;
    *slot = b->buffers[buffer].slot;
    return 0;
}

int kw_builder_view_layout(const kw_builder *b, int view, int *buffer, size_t *offset, kw_tensor *layout) {
    if (view < 0 || view >= b->n_views) return KW_EINVAL;
    *buffer = b->views[view].buffer;
    *offset = b->views[view].offset;
    *layout = b->views[view].t;
    layout->data = NULL;
    return 0;
}

int kw__view_extent(const kw__view *v, int64_t *lo, int64_t *hi) {
    const int64_t es = (int64_t)kw_dtype_size(v->t.dtype);
    int64_t first = 0, last = 0; /* element offsets of the lowest and highest element */
    *lo = *hi = (int64_t)v->offset;
    for (int d = 0; d < v->t.ndim; d++)
        if (v->t.shape[d] == 0) return 1;
    for (int d = 0; d < v->t.ndim; d++) {
        int64_t span;
        if (__builtin_mul_overflow(v->t.shape[d] - 1, v->t.stride[d], &span)) return 0;
        if (span < 0 ? __builtin_add_overflow(first, span, &first) : __builtin_add_overflow(last, span, &last))
            return 0;
    }
    if (__builtin_mul_overflow(first, es, &first) || __builtin_add_overflow(last, 1, &last) ||
        __builtin_mul_overflow(last, es, &last) || __builtin_add_overflow(first, *lo, lo) ||
        __builtin_add_overflow(last, *hi, hi))
        return 0;
    return 1;
}

int64_t kw__view_bytes(const kw__view *v) {
    int64_t n = (int64_t)kw_dtype_size(v->t.dtype);
    for (int d = 0; d < v->t.ndim; d++)
        if ((v->t.stride[d] != 0 || v->t.shape[d] == 0) && __builtin_mul_overflow(n, v->t.shape[d], &n))
            return INT64_MAX; /* overlapping strides: more elements than bytes, and then some */
    return n;
}

int kw_builder_view(kw_builder *b, int buffer, kw_dtype dtype, int ndim, const int64_t *shape,
                    const int64_t *stride, size_t offset) {
    int rc = open_for_calls(b, "view");
    if (rc) return rc;
    const int id = b->n_views;
    if (buffer < 0 || buffer >= b->n_buffers)
        return kw__builder_fail(b, KW_EINVAL, "view v%d: no buffer %d", id, buffer);
    const kw__buffer *buf = &b->buffers[buffer];
    if ((unsigned)dtype >= KW_DTYPE_COUNT)
        return kw__builder_fail(b, KW_EDTYPE, "view v%d on '%s': unknown dtype %d", id, buf->name, (int)dtype);
    if (ndim < 0 || ndim > KW_MAX_DIMS || (ndim > 0 && !shape))
        return kw__builder_fail(b, KW_EINVAL, "view v%d on '%s': %d dims (at most %d)", id, buf->name, ndim,
                                KW_MAX_DIMS);
    kw__view v = {.buffer = buffer, .offset = offset, .t = {.dtype = dtype, .ndim = ndim}};
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return kw__builder_fail(b, KW_ESHAPE, "view v%d on '%s': dim %d has size %lld", id, buf->name, d,
                                    (long long)shape[d]);
        v.t.shape[d] = shape[d];
    }
    int64_t expect = 1; /* contiguous strides when none are given */
    for (int d = ndim - 1; d >= 0; d--) {
        v.t.stride[d] = stride ? stride[d] : expect;
        /* PyTorch has no negative strides, and kernels may assume none. */
        if (v.t.stride[d] < 0)
            return kw__builder_fail(b, KW_EINVAL, "view v%d on '%s': dim %d has stride %lld (negative)", id, buf->name,
                                    d, (long long)v.t.stride[d]);
        if (__builtin_mul_overflow(expect, shape[d], &expect))
            return kw__builder_fail(b, KW_EBOUNDS, "view v%d on '%s': size overflows", id, buf->name);
    }
    if (offset % kw_dtype_size(dtype))
        return kw__builder_fail(b, KW_EINVAL, "view v%d on '%s': byte offset %zu is not a multiple of %s's %zu bytes",
                                id, buf->name, offset, kw_dtype_name(dtype), kw_dtype_size(dtype));
    int64_t lo, hi;
    if (offset > buf->nbytes || !kw__view_extent(&v, &lo, &hi) || lo < 0 || hi > (int64_t)buf->nbytes)
        return kw__builder_fail(b, KW_EBOUNDS, "view v%d: bytes [%lld, %lld) lie outside buffer '%s' of %zu bytes",
                                id, (long long)(offset > buf->nbytes ? (int64_t)offset : lo),
                                (long long)(offset > buf->nbytes ? (int64_t)offset : hi), buf->name, buf->nbytes);
    if (grow((void **)&b->views, &b->cap_views, b->n_views, sizeof *b->views))
        return kw__builder_fail(b, KW_ENOMEM, "view v%d: out of memory", id);
    b->views[b->n_views] = v;
    return b->n_views++;
}

/* Appends a step that owns `views` and `access` (freed here on failure). */
static int add_step(kw_builder *b, const char *what, kw__bstep s) {
    if (grow((void **)&b->steps, &b->cap_steps, b->n_steps, sizeof *b->steps)) {
        free(s.views);
        free(s.access);
        return kw__builder_fail(b, KW_ENOMEM, "%s %d: out of memory", what, b->n_steps);
    }
    b->steps[b->n_steps] = s;
    return b->n_steps++;
}

static int check_view_ids(kw_builder *b, const char *what, const int *views, int n, int absent_ok) {
    for (int k = 0; k < n; k++)
        if (views[k] >= b->n_views || views[k] < (absent_ok ? -1 : 0))
            return kw__builder_fail(b, KW_EINVAL, "%s %d: no view %d (tensor %d)", what, b->n_steps, views[k], k);
    return 0;
}

int kw_builder_op(kw_builder *b, int op, const int *views, int n_views, const int64_t *ip, int n_ip,
                  const double *fp, int n_fp) {
    int rc = open_for_calls(b, "op");
    if (rc) return rc;
    const kw_op_info *info = kw_op_get((kw_op_id)op);
    if (!info) return kw__builder_fail(b, KW_EINVAL, "op %d: no op with id %d", b->n_steps, op);
    if (n_views < 0 || n_views > info->n_tensors || (n_views && !views))
        return kw__builder_fail(b, KW_EINVAL, "op %d (%s): %d tensors given, the op has %d", b->n_steps, info->name,
                                n_views, info->n_tensors);
    if (n_ip < 0 || n_ip > KW_CALL_MAX_PARAMS || n_fp < 0 || n_fp > KW_CALL_MAX_PARAMS || (n_ip && !ip) ||
        (n_fp && !fp))
        return kw__builder_fail(b, KW_EINVAL, "op %d (%s): %d int and %d float parameters (at most %d each)",
                                b->n_steps, info->name, n_ip, n_fp, KW_CALL_MAX_PARAMS);
    if ((rc = check_view_ids(b, "op", views, n_views, 1))) return rc;
    kw__bstep s = {.op = op, .n_views = info->n_tensors, .n_ip = n_ip, .n_fp = n_fp};
    s.views = malloc(sizeof(int) * (size_t)(info->n_tensors ? info->n_tensors : 1));
    s.access = malloc((size_t)(info->n_tensors ? info->n_tensors : 1));
    if (!s.views || !s.access) {
        free(s.views);
        free(s.access);
        return kw__builder_fail(b, KW_ENOMEM, "op %d: out of memory", b->n_steps);
    }
    for (int k = 0; k < info->n_tensors; k++) {
        s.views[k] = k < n_views ? views[k] : -1;
        s.access[k] = info->arg[k].access;
    }
    for (int k = 0; k < n_ip; k++) s.ip[k] = ip[k];
    for (int k = 0; k < n_fp; k++) s.fp[k] = fp[k];
    return add_step(b, "op", s);
}

int kw_builder_fallback(kw_builder *b, kw_fallback_fn fn, void *user, const int *views, const char *access,
                        int n) {
    int rc = open_for_calls(b, "fallback");
    if (rc) return rc;
    if (!fn || n < 0 || (n && (!views || !access)))
        return kw__builder_fail(b, KW_EINVAL, "fallback %d: needs a function and %d views with their access",
                                b->n_steps, n);
    if ((rc = check_view_ids(b, "fallback", views, n, 0))) return rc;
    for (int k = 0; k < n; k++)
        if (access[k] != KW_READ && access[k] != KW_WRITE && access[k] != KW_MODIFY)
            return kw__builder_fail(b, KW_EINVAL, "fallback %d: view %d has access '%c' (not r, w or m)",
                                    b->n_steps, k, access[k]);
    kw__bstep s = {.op = -1, .n_views = n, .fn = fn, .user = user};
    s.views = malloc(sizeof(int) * (size_t)(n ? n : 1));
    s.access = malloc((size_t)(n ? n : 1));
    if (!s.views || !s.access) {
        free(s.views);
        free(s.access);
        return kw__builder_fail(b, KW_ENOMEM, "fallback %d: out of memory", b->n_steps);
    }
    if (n) {
        memcpy(s.views, views, sizeof(int) * (size_t)n);
        memcpy(s.access, access, (size_t)n);
    }
    return add_step(b, "fallback", s);
}

int kw_builder_label(kw_builder *b, int step, const char *label) {
    int rc = open_for_calls(b, "label");
    if (rc) return rc;
    if (step < 0 || step >= b->n_steps || !label)
        return kw__builder_fail(b, KW_EINVAL, "label: no step %d", step);
    char *copy = strdup(label);
    if (!copy) return kw__builder_fail(b, KW_ENOMEM, "label: out of memory");
    free(b->steps[step].label);
    b->steps[step].label = copy;
    return step;
}
