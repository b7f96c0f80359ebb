#include "kw_call.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    kw_kernel_fn kernel;
    const kw_call *c;
} task;

static void run_task(void *arg, int ith, int nth) {
    const task *t = arg;
    t->kernel(t->c, ith, nth);
}

/* The elements of every tensor of the call, in bytes: how much work it is. */
static size_t call_bytes(const kw_op_info *info, const kw_call *c) {
    size_t bytes = 0;
    for (int k = 0; k < info->n_tensors; k++) {
        if (!c->t[k].data) continue;
        size_t n = kw_dtype_size(c->t[k].dtype);
        for (int d = 0; d < c->t[k].ndim; d++) n *= (size_t)c->t[k].shape[d];
        bytes += n;
    }
    return bytes;
}

/* Whether t's elements are at distinct addresses: with its dims ordered by
 * stride, each stride passes the span of the dims below it. (Some layouts that
 * interleave their dims are distinct too and are refused here: nothing writes them.) */
static int distinct_elements(const kw_tensor *t) {
    int order[KW_MAX_DIMS], n = 0;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] > 1) order[n++] = d;
    for (int i = 1; i < n; i++) /* insertion sort by stride: at most 6 dims */
        for (int j = i; j > 0 && t->stride[order[j]] < t->stride[order[j - 1]]; j--) {
            const int tmp = order[j];
            order[j] = order[j - 1], order[j - 1] = tmp;
        }
    int64_t span = 1; /* elements the dims so far reach */
    for (int i = 0; i < n; i++) {
        const int d = order[i];
        if (t->stride[d] < span) return 0;
        span = t->stride[d] * (t->shape[d] - 1) + span;
    }
    return 1;
}

/* A written tensor overlaps no other tensor of the call, nor itself: an op run
 * alone is never in place (kwker's ops allocate their outputs; a kernel that
 * reads rows while it writes others would read its own results), and threads
 * writing one element twice would race. */
static int check_aliasing(const kw_op_info *info, const kw_call *c, char *msg, size_t len) {
    for (int k = 0; k < info->n_tensors; k++) {
        if (!c->t[k].data || info->arg[k].access == KW_READ) continue;
        if (!distinct_elements(&c->t[k])) {
            snprintf(msg, len, "%s: %s is written and its elements overlap", info->name, info->arg[k].name);
            return KW_EALIAS;
        }
        const char *w = c->t[k].data;
        const int64_t w_bytes = kw_tensor_extent(&c->t[k]);
        for (int j = 0; j < info->n_tensors; j++) {
            if (j == k || !c->t[j].data) continue;
            const char *o = c->t[j].data;
            if (w < o + kw_tensor_extent(&c->t[j]) && o < w + w_bytes) {
                snprintf(msg, len, "%s: %s (written) overlaps %s", info->name, info->arg[k].name, info->arg[j].name);
                return KW_EALIAS;
            }
        }
    }
    return 0;
}

static int check_args(const kw_op_info *info, const kw_call *c, int n_ip, int n_fp, char *msg, size_t len) {
    if (n_ip != info->n_ip || n_fp != info->n_fp) {
        snprintf(msg, len, "%s: takes %d int and %d float parameters, got %d and %d", info->name, info->n_ip, info->n_fp,
                 n_ip, n_fp);
        return KW_EINVAL;
    }
    for (int k = 0; k < info->n_tensors; k++) {
        if (!c->t[k].data && !info->arg[k].optional) {
            snprintf(msg, len, "%s: tensor '%s' is required", info->name, info->arg[k].name);
            return KW_EINVAL;
        }
        if (c->t[k].data && kw_tensor_extent(&c->t[k]) < 0) {
            snprintf(msg, len, "%s: tensor '%s' has a negative stride or a size that overflows", info->name,
                     info->arg[k].name);
            return KW_EINVAL;
        }
    }
    return check_aliasing(info, c, msg, len);
}

int kw_call_run(kw_op_id id, kw_call *c, int n_ip, int n_fp, kw_isa isa, kw_pool *pool, kw_fault *fault, char *msg,
                size_t len) {
    const kw_op_info *info = kw_op_get(id);
    if (msg && len) msg[0] = '\0';
    if (!info) return KW_EINVAL;
    int rc = check_args(info, c, n_ip, n_fp, msg, len);
    if (rc) return rc;
    void *prep = malloc(kw_op_prep_size(id));
    if (!prep) return KW_ENOMEM;
    if (call_bytes(info, c) < KW_CALL_INLINE_BYTES) pool = NULL;
    const int nth = pool ? kw_pool_size(pool) : 1;
    c->n_threads = nth;
    rc = kw_op_prepare(id, c, isa, prep, msg, len);
    if (rc) {
        free(prep);
        return rc < 0 ? rc : KW_EINVAL;
    }
    const size_t stride = info->work_size ? (info->work_size(prep) + 63) / 64 * 64 : 0;
    void *work = stride ? aligned_alloc(64, stride * (size_t)nth) : NULL;
    _Alignas(64) unsigned char share[KW_SHARE_BYTES] = {0};
    if (stride && !work) {
        rc = KW_ENOMEM;
    } else {
        memset(fault, 0, sizeof *fault);
        c->work = work;
        c->work_stride = stride;
        c->share = info->shares_work ? share : NULL;
        c->fault = fault;
        task t = {info->kernel, c};
        if (pool)
            kw_pool_run(pool, run_task, &t);
        else
            run_task(&t, 0, 1);
        rc = atomic_load(&fault->reported) ? KW_EINDEX : 0;
    }
    free(work);
    if (info->release) info->release(prep);
    free(prep);
    c->prep = NULL;
    return rc;
}
