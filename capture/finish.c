/* kw_builder_finish: validate the whole program, place the arena, bind every
 * view, decide the barriers, and lay the result out as a kw_plan. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builder_impl.h"
#include "kw_mem.h"
#include "kw_ops.h"

/* Op checks see a call before the arena exists and before any per-call pointer
 * is known: such tensors get distinct, never dereferenced, non-NULL addresses
 * (NULL would mean "absent"). */
#define FAKE_BASE ((uintptr_t)1 << 40)
#define MAX_THREADS 1024

static int reads(char access) { return access == KW_READ || access == KW_MODIFY; }
static int writes(char access) { return access == KW_WRITE || access == KW_MODIFY; }

static size_t round_up(size_t n) { return (n + KW__ALIGN - 1) & ~(size_t)(KW__ALIGN - 1); }

/* "op 3 (linear 'q_proj'): " followed by the formatted text. */
static int step_fail(const kw_builder *b, int i, char *msg, size_t len, int err, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

static int step_fail(const kw_builder *b, int i, char *msg, size_t len, int err, const char *fmt, ...) {
    if (!msg || !len) return err;
    const kw__bstep *s = &b->steps[i];
    const char *label = s->label ? s->label : "";
    int n = snprintf(msg, len, "op %d (%s%s%s%s): ", i, s->op < 0 ? "fallback" : kw_op_get((kw_op_id)s->op)->name,
                     *label ? " '" : "", label, *label ? "'" : "");
    if (n >= 0 && (size_t)n < len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg + n, len - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return err;
}

static const char *tensor_name(const kw__bstep *s, int k, char *buf, size_t len) {
    if (s->op >= 0) return kw_op_get((kw_op_id)s->op)->arg[k].name;
    snprintf(buf, len, "view %d", k);
    return buf;
}

static int same_view(const kw__view *a, const kw__view *c) {
    if (a->offset != c->offset || a->t.dtype != c->t.dtype || a->t.ndim != c->t.ndim) return 0;
    for (int d = 0; d < a->t.ndim; d++)
        if (a->t.shape[d] != c->t.shape[d] || a->t.stride[d] != c->t.stride[d]) return 0;
    return 1;
}

/* A written view may coincide with another view of its step (an in-place
 * update) where the op allows it (kw_op_info.in_place; a fallback runs
 * PyTorch's own in-place op), but never partly overlap one: threads would race
 * inside the step. */
static int check_aliasing(const kw_builder *b, int i, char *msg, size_t len) {
    const kw__bstep *s = &b->steps[i];
    char na[32], nb[32];
    for (int k = 0; k < s->n_views; k++) {
        if (s->views[k] < 0 || !writes(s->access[k])) continue;
        const kw__view *w = &b->views[s->views[k]];
        int64_t wlo, whi;
        kw__view_extent(w, &wlo, &whi);
        for (int j = 0; j < s->n_views; j++) {
            if (j == k || s->views[j] < 0) continue;
            const kw__view *o = &b->views[s->views[j]];
            int64_t olo, ohi;
            kw__view_extent(o, &olo, &ohi);
            if (o->buffer != w->buffer || !(wlo < ohi && olo < whi)) continue;
            if (same_view(w, o)) {
                if (s->op < 0 || kw_op_get(s->op)->in_place) continue;
                return step_fail(b, i, msg, len, KW_EALIAS, "%s is written over %s, which it reads (in place), in '%s'",
                                 tensor_name(s, k, na, sizeof na), tensor_name(s, j, nb, sizeof nb),
                                 b->buffers[w->buffer].name);
            }
            return step_fail(b, i, msg, len, KW_EALIAS,
                             "%s (written, bytes [%lld, %lld)) partly overlaps %s (bytes [%lld, %lld)) in '%s'",
                             tensor_name(s, k, na, sizeof na), (long long)wlo, (long long)whi,
                             tensor_name(s, j, nb, sizeof nb), (long long)olo, (long long)ohi,
                             b->buffers[w->buffer].name);
        }
    }
    return 0;
}

static void *fake_address(const kw_builder *b, const kw__view *v) {
    const kw__buffer *buf = &b->buffers[v->buffer];
    if (buf->kind == KW_BUFFER_CONSTANT) return (char *)buf->base + v->offset;
    return (void *)(FAKE_BASE + ((uintptr_t)v->buffer << 20) + v->offset);
}

static kw_tensor bound_tensor(const kw__view *v, void *data) {
    kw_tensor t = v->t;
    t.data = data;
    return t;
}

/* The op's own rules for one call, and its preparation: parameter counts,
 * required tensors, its prepare function (into prep, zeroed, prep_size bytes);
 * *work gets its per-thread scratch. msg gets the problem. */
static int check_op_call(const kw_builder *b, const kw__bstep *s, int isa, int n_threads, void *prep, size_t *work,
                         char *msg, size_t len) {
    const kw_op_info *info = kw_op_get((kw_op_id)s->op);
    if (s->n_ip != info->n_ip || s->n_fp != info->n_fp) {
        snprintf(msg, len, "takes %d int and %d float parameters, got %d and %d", info->n_ip, info->n_fp, s->n_ip,
                 s->n_fp);
        return KW_EINVAL;
    }
    kw_call call = {.n_threads = n_threads};
    for (int k = 0; k < info->n_tensors; k++) {
        if (s->views[k] < 0) {
            if (!info->arg[k].optional) {
                snprintf(msg, len, "tensor '%s' is required", info->arg[k].name);
                return KW_EINVAL;
            }
            continue;
        }
        const kw__view *v = &b->views[s->views[k]];
        call.t[k] = bound_tensor(v, fake_address(b, v));
    }
    memcpy(call.ip, s->ip, sizeof call.ip);
    memcpy(call.fp, s->fp, sizeof call.fp);
    if (info->prepare) {
        const int rc = info->prepare(&call, (kw_isa)isa, prep, msg, len);
        if (rc) return rc < 0 ? rc : KW_EINVAL;
    }
    *work = info->work_size ? info->work_size(prep) : 0;
    if (*work > KW__MAX_BYTES) {
        snprintf(msg, len, "asks for %zu bytes of scratch per thread", *work);
        return KW_ENOMEM;
    }
    return 0;
}

/* A step's preparation, in memory of its own (freed by free_preps). */
static int prepare_kernel_step(const kw_builder *b, int i, int isa, int n_threads, void **prep, size_t *work, char *msg,
                               size_t len) {
    char text[KW__MSG] = "";
    *prep = calloc(1, kw_op_prep_size((kw_op_id)b->steps[i].op));
    if (!*prep) return KW_ENOMEM;
    const int rc = check_op_call(b, &b->steps[i], isa, n_threads, *prep, work, text, sizeof text);
    return rc ? step_fail(b, i, msg, len, rc, "%s", text) : 0;
}

/* Each kernel step's preparation; `release` also frees what prepare made in it
 * (when the plan was not made, so no plan owns it). */
static void free_preps(const kw_builder *b, void **preps, int release) {
    for (int i = 0; preps && i < b->n_steps; i++) {
        if (!preps[i]) continue;
        const kw_op_info *info = kw_op_get((kw_op_id)b->steps[i].op);
        if (release && info->release) info->release(preps[i]);
        free(preps[i]);
    }
    free(preps);
}

int kw_builder_check_op(const kw_builder *b, int op, const int *views, int n_views, const int64_t *ip, int n_ip,
                        const double *fp, int n_fp, char *msg, size_t len) {
    char text[KW__MSG] = "";
    const kw_op_info *info = kw_op_get((kw_op_id)op);
    int rc = 0;
    if (!info || n_views < 0 || n_views > info->n_tensors || n_ip < 0 || n_ip > KW_CALL_MAX_PARAMS || n_fp < 0 ||
        n_fp > KW_CALL_MAX_PARAMS) {
        snprintf(text, sizeof text, "no such op, or too many tensors or parameters");
        rc = KW_EINVAL;
    }
    kw__bstep s = {.op = op, .n_views = info ? info->n_tensors : 0, .n_ip = n_ip, .n_fp = n_fp};
    int ids[KW_CALL_MAX_TENSORS];
    void *prep = info ? calloc(1, kw_op_prep_size((kw_op_id)op)) : NULL;
    if (info && !prep) {
        snprintf(text, sizeof text, "out of memory");
        rc = KW_ENOMEM;
    }
    for (int k = 0; !rc && k < info->n_tensors; k++) {
        ids[k] = k < n_views ? views[k] : -1;
        if (ids[k] >= b->n_views || ids[k] < -1) {
            snprintf(text, sizeof text, "no view %d (tensor %d)", ids[k], k);
            rc = KW_EINVAL;
        }
    }
    s.views = ids;
    for (int k = 0; !rc && k < n_ip; k++) s.ip[k] = ip[k];
    for (int k = 0; !rc && k < n_fp; k++) s.fp[k] = fp[k];
    size_t work;
    if (!rc) {
        rc = check_op_call(b, &s, (int)kw_cpu_isa(), 1, prep, &work, text, sizeof text);
        if (!rc && info->release) info->release(prep);
    }
    free(prep);
    if (rc && msg && len) snprintf(msg, len, "%s", text);
    return rc;
}

/* Every step in program order, so the first problem reported is the first one
 * a replay would hit. Kernel step i is prepared for `isa` and n_threads into preps[i];
 * work[i] gets its per-thread scratch. */
static int validate(const kw_builder *b, int isa, int n_threads, void **preps, size_t *work, char *msg, size_t len) {
    char *written = calloc((size_t)b->n_buffers + 1, 1);
    if (!written) return KW_ENOMEM;
    int rc = 0;
    char name[32];
    for (int i = 0; i < b->n_steps && !rc; i++) {
        const kw__bstep *s = &b->steps[i];
        work[i] = 0;
        for (int k = 0; k < s->n_views && !rc; k++) {
            if (s->views[k] < 0) continue;
            const kw__buffer *buf = &b->buffers[b->views[s->views[k]].buffer];
            const int uninit = buf->kind == KW_BUFFER_ARENA || buf->kind == KW_BUFFER_OUTPUT;
            if (writes(s->access[k]) && buf->kind == KW_BUFFER_CONSTANT)
                rc = step_fail(b, i, msg, len, KW_EREADONLY, "%s writes constant '%s'",
                               tensor_name(s, k, name, sizeof name), buf->name);
            else if (reads(s->access[k]) && uninit && !written[b->views[s->views[k]].buffer])
                rc = step_fail(b, i, msg, len, KW_EUNINIT, "%s reads %s buffer '%s' before any step writes it",
                               tensor_name(s, k, name, sizeof name), kw_buffer_kind_name(buf->kind), buf->name);
        }
        if (!rc) rc = check_aliasing(b, i, msg, len);
        if (!rc && s->op >= 0) rc = prepare_kernel_step(b, i, isa, n_threads, &preps[i], &work[i], msg, len);
        for (int k = 0; k < s->n_views && !rc; k++)
            if (s->views[k] >= 0 && writes(s->access[k])) written[b->views[s->views[k]].buffer] = 1;
    }
    for (int j = 0; j < b->n_buffers && !rc; j++)
        if (b->buffers[j].kind == KW_BUFFER_OUTPUT && !written[j]) {
            rc = KW_EUNINIT;
            snprintf(msg, len, "output '%s' is never written", b->buffers[j].name);
        }
    free(written);
    return rc;
}

/* ---- assembly ------------------------------------------------------------------ */

/* Physical memory a view touches: arena buffers share one address space (the
 * planner lets dead buffers share bytes), every other buffer is its own. */
typedef struct region {
    int space;
    int64_t lo, hi;
} region;

static region view_region(const kw_plan *p, const kw__view *v) {
    const kw__buffer *buf = &p->buffers[v->buffer];
    region r = {v->buffer, 0, 0};
    kw__view_extent(v, &r.lo, &r.hi);
    if (buf->kind == KW_BUFFER_ARENA) {
        r.space = -1;
        r.lo += (int64_t)buf->arena_offset;
        r.hi += (int64_t)buf->arena_offset;
    }
    return r;
}

static int hits(const region *set, int n, region r) {
    for (int i = 0; i < n; i++)
        if (set[i].space == r.space && set[i].lo < r.hi && r.lo < set[i].hi) return 1;
    return 0;
}

/* A barrier goes before a step that reads what was written, or writes what was
 * read or written, since the last barrier (threads split each step their own
 * way, so any such overlap is a race). A fallback ends with a barrier. */
static int place_barriers(kw_plan *p, int every_step) {
    int total = 0;
    for (int i = 0; i < p->n_steps; i++) total += p->info[i].n_views;
    region *rd = malloc(sizeof(region) * (size_t)(total + 1)), *wr = malloc(sizeof(region) * (size_t)(total + 1));
    if (!rd || !wr) {
        free(rd);
        free(wr);
        return KW_ENOMEM;
    }
    int n_rd = 0, n_wr = 0, after_fallback = 1;
    for (int i = 0; i < p->n_steps; i++) {
        const kw__step_info *in = &p->info[i];
        int need = every_step && !after_fallback;
        for (int k = 0; k < in->n_views && !need; k++) {
            if (in->views[k] < 0) continue;
            const region r = view_region(p, &p->views[in->views[k]]);
            if (r.lo == r.hi) continue;
            need = (reads(in->access[k]) && hits(wr, n_wr, r)) ||
                   (writes(in->access[k]) && (hits(rd, n_rd, r) || hits(wr, n_wr, r)));
        }
        if (need) {
            p->steps[i].barrier = 1;
            p->n_barriers++;
            n_rd = n_wr = 0;
        }
        for (int k = 0; k < in->n_views; k++) {
            if (in->views[k] < 0) continue;
            const region r = view_region(p, &p->views[in->views[k]]);
            if (r.lo == r.hi) continue;
            if (reads(in->access[k])) rd[n_rd++] = r;
            if (writes(in->access[k])) wr[n_wr++] = r;
        }
        after_fallback = in->op < 0;
        if (after_fallback) {
            p->n_barriers++;
            n_rd = n_wr = 0;
        }
    }
    free(rd);
    free(wr);
    return 0;
}

static int place_arena(kw_plan *p) {
    kw_arena_item *items = calloc((size_t)p->n_buffers + 1, sizeof *items);
    if (!items) return KW_ENOMEM;
    for (int i = 0; i < p->n_buffers; i++) {
        const kw__buffer *buf = &p->buffers[i];
        if (buf->kind == KW_BUFFER_ARENA) items[i] = (kw_arena_item){buf->nbytes, buf->first, buf->last, 0};
        else items[i].first = -1;
    }
    p->arena_bytes = kw_arena_plan(items, p->n_buffers);
    for (int i = 0; i < p->n_buffers; i++) p->buffers[i].arena_offset = items[i].offset;
    free(items);
    return 0;
}

static void mark_liveness(kw_plan *p) {
    for (int i = 0; i < p->n_steps; i++)
        for (int k = 0; k < p->info[i].n_views; k++) {
            if (p->info[i].views[k] < 0) continue;
            kw__buffer *buf = &p->buffers[p->views[p->info[i].views[k]].buffer];
            if (buf->first < 0) buf->first = i;
            buf->last = i;
        }
}

/* The plan's own copies of the builder's tables. */
static int copy_description(kw_plan *p, const kw_builder *b) {
    p->buffers = calloc((size_t)b->n_buffers + 1, sizeof *p->buffers);
    p->views = malloc(sizeof *p->views * ((size_t)b->n_views + 1));
    p->info = calloc((size_t)b->n_steps + 1, sizeof *p->info);
    p->steps = calloc((size_t)b->n_steps + 1, sizeof *p->steps);
    p->profile_ns = calloc((size_t)b->n_steps + 1, sizeof *p->profile_ns);
    if (!p->buffers || !p->views || !p->info || !p->steps || !p->profile_ns) return KW_ENOMEM;
    p->n_buffers = b->n_buffers;
    for (int i = 0; i < b->n_buffers; i++) {
        p->buffers[i] = b->buffers[i];
        p->buffers[i].name = strdup(b->buffers[i].name);
        if (!p->buffers[i].name) return KW_ENOMEM;
    }
    p->n_views = b->n_views;
    if (b->n_views) memcpy(p->views, b->views, sizeof *p->views * (size_t)b->n_views);
    p->n_steps = b->n_steps;
    for (int i = 0; i < b->n_steps; i++) {
        const kw__bstep *s = &b->steps[i];
        kw__step_info *in = &p->info[i];
        in->op = s->op;
        in->n_views = s->n_views;
        in->label = strdup(s->label ? s->label : "");
        in->views = malloc(sizeof(int) * (size_t)(s->n_views + 1));
        in->access = malloc((size_t)s->n_views + 1);
        if (!in->label || !in->views || !in->access) return KW_ENOMEM;
        memcpy(in->views, s->views, sizeof(int) * (size_t)s->n_views);
        memcpy(in->access, s->access, (size_t)s->n_views);
        for (int k = 0; k < s->n_views; k++) {
            if (s->views[k] < 0) continue;
            const int64_t bytes = kw__view_bytes(&b->views[s->views[k]]);
            if (reads(s->access[k]) && __builtin_add_overflow(in->bytes_read, bytes, &in->bytes_read))
                in->bytes_read = INT64_MAX;
            if (writes(s->access[k]) && __builtin_add_overflow(in->bytes_written, bytes, &in->bytes_written))
                in->bytes_written = INT64_MAX;
        }
    }
    return 0;
}

static int allocate_arena(kw_plan *p, const size_t *work, int n_threads) {
    size_t scratch = 0;
    for (int i = 0; i < p->n_steps; i++)
        if (work[i] > scratch) scratch = work[i];
    p->scratch_stride = round_up(scratch);
    p->alloc_bytes = p->arena_bytes + (size_t)n_threads * p->scratch_stride;
    if (p->alloc_bytes && !(p->arena = kw_mem_alloc(p->alloc_bytes))) return KW_ENOMEM;
    /* A used buffer of zero bytes still needs a non-NULL address (NULL marks an
     * absent tensor); it is never dereferenced. */
    for (int i = 0; i < p->n_buffers; i++)
        if (p->buffers[i].kind == KW_BUFFER_ARENA && p->buffers[i].first >= 0)
            p->buffers[i].base = p->arena ? p->arena + p->buffers[i].arena_offset : kw__empty;
    return 0;
}

static void *view_address(const kw_plan *p, const kw__view *v) {
    const kw__buffer *buf = &p->buffers[v->buffer];
    return buf->base ? (char *)buf->base + v->offset : NULL;
}

static size_t prep_bytes(const kw__bstep *s) { return round_up(kw_op_prep_size((kw_op_id)s->op)); }

/* Kernel calls and fallback view arrays, with every fixed address bound; each
 * call's preparation moves into the plan's prep_mem (preps[i] is then freed). */
static int build_steps(kw_plan *p, const kw_builder *b, const size_t *work, void **preps) {
    int n_calls = 0, n_fallbacks = 0, n_shares = 0;
    size_t prep_total = 0;
    for (int i = 0; i < b->n_steps; i++) {
        b->steps[i].op < 0 ? n_fallbacks++ : n_calls++;
        n_shares += b->steps[i].op >= 0 && kw_op_get((kw_op_id)b->steps[i].op)->shares_work;
        if (b->steps[i].op >= 0) prep_total += prep_bytes(&b->steps[i]);
    }
    p->prep_mem = kw_mem_alloc(prep_total + KW__ALIGN);
    p->prep_bytes = prep_total + KW__ALIGN;
    if (!p->prep_mem) return KW_ENOMEM;
    char *prep = p->prep_mem;
    p->calls = calloc((size_t)n_calls + 1, sizeof *p->calls);
    p->fallbacks = calloc((size_t)n_fallbacks + 1, sizeof *p->fallbacks);
    p->share_bytes = (size_t)n_shares * KW_SHARE_BYTES;
    p->shares = p->share_bytes ? kw_mem_alloc(p->share_bytes) : NULL;
    if (!p->calls || !p->fallbacks || (p->share_bytes && !p->shares)) return KW_ENOMEM;
    char *share = p->shares;
    int c = 0;
    for (int i = 0; i < b->n_steps; i++) {
        const kw__bstep *s = &b->steps[i];
        kw__step *st = &p->steps[i];
        if (s->op < 0) {
            kw__fallback *f = &p->fallbacks[p->n_fallbacks];
            f->views = calloc((size_t)s->n_views + 1, sizeof *f->views);
            if (!f->views) return KW_ENOMEM;
            p->n_fallbacks++;
            f->fn = s->fn;
            f->user = s->user;
            f->n = s->n_views;
            for (int k = 0; k < s->n_views; k++) {
                const kw__view *v = &p->views[s->views[k]];
                f->views[k] = bound_tensor(v, view_address(p, v));
            }
            *st = (kw__step){.fallback = p->n_fallbacks - 1};
            continue;
        }
        kw_call *call = &p->calls[c++];
        for (int k = 0; k < s->n_views; k++)
            if (s->views[k] >= 0) {
                const kw__view *v = &p->views[s->views[k]];
                call->t[k] = bound_tensor(v, view_address(p, v));
            }
        memcpy(call->ip, s->ip, sizeof call->ip);
        memcpy(call->fp, s->fp, sizeof call->fp);
        call->fault = &p->fault;
        if (work[i]) {
            call->work = p->arena + p->arena_bytes;
            call->work_stride = p->scratch_stride;
        }
        if (kw_op_get((kw_op_id)s->op)->shares_work) {
            call->share = share;
            share += KW_SHARE_BYTES;
        }
        memcpy(prep, preps[i], kw_op_prep_size((kw_op_id)s->op));
        free(preps[i]);
        preps[i] = NULL;
        call->prep = prep;
        prep += prep_bytes(s);
        *st = (kw__step){.fn = kw_op_get((kw_op_id)s->op)->kernel, .call = call, .fallback = -1};
    }
    return 0;
}

/* The tensors replay re-points on every call, grouped by slot. */
static int build_patches(kw_plan *p, const kw_builder *b) {
    p->n_slots = b->n_slots;
    p->slots = calloc((size_t)b->n_slots + 1, sizeof *p->slots);
    if (!p->slots) return KW_ENOMEM;
    for (int i = 0; i < p->n_buffers; i++)
        if (p->buffers[i].slot >= 0) p->slots[p->buffers[i].slot].buffer = i;
    /* Two passes over the same walk: count, then fill. */
    int total = 0;
    for (int pass = 0; pass < 2; pass++) {
        int c = 0, f = 0;
        for (int i = 0; i < b->n_steps; i++) {
            const kw__bstep *s = &b->steps[i];
            kw_tensor *t = s->op < 0 ? p->fallbacks[f++].views : p->calls[c++].t;
            for (int k = 0; k < s->n_views; k++) {
                if (s->views[k] < 0) continue;
                const kw__view *v = &p->views[s->views[k]];
                const kw__buffer *buf = &p->buffers[v->buffer];
                if (buf->kind != KW_BUFFER_INPUT && buf->kind != KW_BUFFER_OUTPUT) continue;
                kw__slot *slot = &p->slots[buf->slot];
                if (pass == 0) {
                    slot->n_patches++;
                    total++;
                } else {
                    slot->patches[slot->n_patches++] = (kw__patch){&t[k], v->offset};
                }
            }
        }
        if (pass == 0) {
            p->patches = malloc(sizeof *p->patches * ((size_t)total + 1));
            if (!p->patches) return KW_ENOMEM;
            kw__patch *next = p->patches;
            for (int j = 0; j < p->n_slots; j++) {
                p->slots[j].patches = next;
                next += p->slots[j].n_patches;
                p->slots[j].n_patches = 0;
            }
        }
    }
    return 0;
}

static int assemble(kw_plan *p, const kw_builder *b, const kw_finish_opts *o, const size_t *work, void **preps) {
    int rc = copy_description(p, b);
    if (!rc) {
        mark_liveness(p);
        rc = place_arena(p);
    }
    if (!rc) rc = allocate_arena(p, work, o->n_threads);
    if (!rc) rc = build_steps(p, b, work, preps);
    if (!rc) rc = build_patches(p, b);
    if (!rc) rc = place_barriers(p, o->barrier_every_step);
    return rc;
}

int kw_builder_finish(kw_builder *b, const kw_finish_opts *opts, kw_plan **out, char *msg, size_t msg_len) {
    static const kw_finish_opts defaults = {.n_threads = 1, .isa = -1};
    kw_finish_opts o = opts ? *opts : defaults;
    if (!msg) msg_len = 0;
    if (msg_len) msg[0] = '\0';
    if (out) *out = NULL;
    if (!out) return KW_EINVAL;
    if (b->spent) {
        snprintf(msg, msg_len, "finish: the builder is already finished");
        return KW_ESTATE;
    }
    if (b->err) {
        snprintf(msg, msg_len, "%s", b->first_msg);
        return b->err;
    }
    if (o.n_threads < 1 || o.n_threads > MAX_THREADS || o.isa < -1 || o.isa >= KW_ISA_COUNT) {
        snprintf(msg, msg_len, "finish: n_threads %d (1..%d) or isa %d is out of range", o.n_threads, MAX_THREADS,
                 o.isa);
        return KW_EINVAL;
    }
    if (o.isa < 0) o.isa = (int)kw_cpu_isa();

    size_t *work = calloc((size_t)b->n_steps + 1, sizeof *work);
    void **preps = calloc((size_t)b->n_steps + 1, sizeof *preps);
    kw_plan *p = calloc(1, sizeof *p);
    int rc = work && preps && p ? 0 : KW_ENOMEM;
    if (!rc) rc = validate(b, o.isa, o.n_threads, preps, work, msg, msg_len);
    if (!rc) {
        p->n_threads = o.n_threads;
        p->isa = o.isa;
        rc = assemble(p, b, &o, work, preps);
        if (rc) snprintf(msg, msg_len, "finish: %s", kw_strerror(rc));
    } else if (rc == KW_ENOMEM && msg_len && !msg[0]) {
        snprintf(msg, msg_len, "finish: out of memory");
    }
    free(work);
    free_preps(b, preps, 1); /* those not moved into the plan: a failed finish's */
    if (rc) {
        kw_plan_destroy(p);
        return rc;
    }
    b->spent = 1;
    *out = p;
    return 0;
}
