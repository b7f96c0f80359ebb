/* libFuzzer target: random builder call sequences. Whatever the bytes, the
 * builder never crashes; finish either fails with a code and a message or yields
 * a plan that replays (on zeroed per-call buffers, at 1-3 threads), or reports
 * an index out of range in its data, without touching memory outside its views
 * (ASan) or undefined behaviour (UBSan).
 * Fallbacks read every element of their views and write every written one. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kw_capture.h"
#include "kw_ops.h"

enum { MAX_CMDS = 64, REGION = 4096, N_REGIONS = 16 };

static _Alignas(64) unsigned char const_mem[N_REGIONS][REGION];
static kw_pool *pools[4];

typedef struct reader {
    const uint8_t *p;
    size_t n;
} reader;

static unsigned u8(reader *r) {
    if (!r->n) return 0;
    r->n--;
    return *r->p++;
}

static unsigned u16(reader *r) { return u8(r) | u8(r) << 8; }

static int touch(void *user, kw_tensor *views, int n) {
    const char *access = user;
    for (int k = 0; k < n; k++) {
        const kw_tensor *t = &views[k];
        const size_t es = kw_dtype_size(t->dtype);
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
        for (int64_t i = 0; i < numel; i++) {
            int64_t off = 0, rest = i;
            for (int d = t->ndim - 1; d >= 0; d--) {
                off += rest % t->shape[d] * t->stride[d];
                rest /= t->shape[d];
            }
            unsigned char *e = (unsigned char *)t->data + off * (int64_t)es, tmp[8];
            memcpy(tmp, e, es);
            if (access[k] != KW_READ) memset(e, 0, es);
        }
    }
    return 0;
}

static const char *const access_sets[] = {"r", "w", "m", "rw", "wr", "rm", "mr", "ww", "rr", "rwm"};

static void add_buffer(kw_builder *b, reader *r, int *n_const) {
    const size_t nbytes = u16(r) % (REGION + 1);
    switch (u8(r) % 4) {
    case 0: kw_builder_input(b, "in", nbytes); break;
    case 1: kw_builder_output(b, "out", nbytes); break;
    case 2: kw_builder_arena(b, "tmp", u16(r) % 2 ? nbytes : nbytes / 64); break;
    default: kw_builder_constant(b, "w", const_mem[(*n_const)++ % N_REGIONS], nbytes); break;
    }
}

static void add_view(kw_builder *b, reader *r, int n_buffers) {
    int64_t shape[KW_MAX_DIMS], stride[KW_MAX_DIMS];
    const int ndim = (int)(u8(r) % 5), mode = (int)(u8(r) % 3);
    const kw_dtype dt = (kw_dtype)(u8(r) % KW_DTYPE_COUNT);
    for (int d = 0; d < ndim; d++) {
        shape[d] = u8(r) % 9;
        const unsigned s = u8(r);
        stride[d] = s % 32 == 31 ? -1 : (int64_t)(s % 12); /* now and then a negative one, to be refused */
    }
    const size_t offset = (size_t)u16(r) / kw_dtype_size(dt) * kw_dtype_size(dt) % (REGION + 8);
    kw_builder_view(b, (int)(u8(r) % (n_buffers + 1)), dt, ndim, shape, mode ? NULL : stride, offset);
}

static void add_op(kw_builder *b, reader *r, int n_views) {
    const int op = (int)(u8(r) % KW_OP_COUNT);
    const kw_op_info *info = kw_op_get((kw_op_id)op);
    int views[KW_CALL_MAX_TENSORS];
    int64_t ip[KW_CALL_MAX_PARAMS];
    double fp[KW_CALL_MAX_PARAMS];
    for (int k = 0; k < info->n_tensors; k++) views[k] = (int)(u8(r) % (n_views + 2)) - 1;
    const int exact = u8(r) % 8 != 0;
    const int n_ip = exact ? info->n_ip : (int)(u8(r) % 3), n_fp = exact ? info->n_fp : (int)(u8(r) % 3);
    for (int k = 0; k < n_ip; k++) ip[k] = u8(r) % 4 == 0 ? (int64_t)(int16_t)u16(r) : (int64_t)(u8(r) % 8) - 2;
    for (int k = 0; k < n_fp; k++) fp[k] = ((double)u8(r) - 128.0) / 16.0;
    kw_builder_op(b, op, views, info->n_tensors, ip, n_ip, fp, n_fp);
}

/* An op whose tensors each get a buffer of their own, shaped from a small pool of
 * sizes: matching shapes (elementwise, norm, linear's [M, K] x [N, K]) come up
 * often enough for checks to pass and kernels to run. */
static void add_shaped_op(kw_builder *b, reader *r, int *n_buffers, int *n_views) {
    const int op = (int)(u8(r) % KW_OP_COUNT);
    const kw_op_info *info = kw_op_get((kw_op_id)op);
    int64_t pool[4], shape[3];
    for (int i = 0; i < 4; i++) pool[i] = 1 + u8(r) % 8; /* at most 8^3 x 8 bytes = REGION */
    const kw_dtype dt = u8(r) % 2 ? KW_F32 : KW_BF16;
    int views[KW_CALL_MAX_TENSORS];
    int64_t ip[KW_CALL_MAX_PARAMS] = {0};
    double fp[KW_CALL_MAX_PARAMS] = {0};
    for (int k = 0; k < info->n_tensors; k++) {
        const unsigned pick = u8(r);
        if (info->arg[k].optional && pick % 3 == 0) {
            views[k] = -1;
            continue;
        }
        const int ndim = 1 + (int)(pick % 3);
        for (int d = 0; d < ndim; d++) shape[d] = pool[u8(r) % 4];
        const kw_dtype t = pick % 7 == 6 ? (kw_dtype)(u8(r) % KW_DTYPE_COUNT) : dt;
        size_t nbytes = kw_dtype_size(t);
        for (int d = 0; d < ndim; d++) nbytes *= (size_t)shape[d];
        const char a = info->arg[k].access;
        const int buf = a == KW_WRITE ? (pick & 8 ? kw_builder_arena(b, "y", nbytes) : kw_builder_output(b, "y", nbytes))
                        : pick & 8 || a != KW_READ ? kw_builder_input(b, "x", nbytes)
                                                   : kw_builder_constant(b, "w", const_mem[u8(r) % N_REGIONS], nbytes);
        (*n_buffers)++;
        views[k] = kw_builder_view(b, buf, t, ndim, shape, NULL, 0);
        (*n_views)++;
    }
    for (int k = 0; k < info->n_ip; k++) ip[k] = (int64_t)(u8(r) % 8) - 2;
    for (int k = 0; k < info->n_fp; k++) fp[k] = (double)(u8(r) % 16) / 8.0;
    kw_builder_op(b, op, views, info->n_tensors, ip, info->n_ip, fp, info->n_fp);
}

static void add_fallback(kw_builder *b, reader *r, int n_views) {
    const char *access = access_sets[u8(r) % (sizeof access_sets / sizeof *access_sets)];
    const int n = (int)strlen(access);
    int views[3];
    for (int k = 0; k < n; k++) views[k] = (int)(u8(r) % (n_views + 1));
    kw_builder_fallback(b, touch, (void *)access, views, access, n);
}

static void replay_checked(kw_plan *plan, int n_threads) {
    const int n = kw_plan_n_slots(plan);
    void **slots = calloc((size_t)n + 1, sizeof *slots);
    for (int i = 0; i < n; i++) slots[i] = calloc(1, (size_t)kw_plan_slot_bytes(plan, i) + 1);
    if (!pools[n_threads]) pools[n_threads] = kw_pool_create(n_threads);
    for (int rep = 0; rep < 2; rep++) {
        const int rc = kw_plan_replay(plan, pools[n_threads], slots);
        int step = -1;
        int64_t index = 0, size = 0;
        /* An index read from the data (kv_write's positions, embedding's ids; here
         * whatever an earlier step wrote) may be out of range: the replay then stops
         * at the next barrier and names the step, the index and the size it is not under. */
        if (rc == KW_EINDEX && kw_plan_fault(plan, &step, &index, &size) &&
            step >= 0 && step < kw_plan_n_steps(plan) && (index < 0 || index >= size))
            continue;
        if (rc != 0) __builtin_trap();
    }
    for (int i = 0; i < n; i++) free(slots[i]);
    free(slots);
    free(kw_plan_dump(plan));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size};
    kw_builder *b = kw_builder_create();
    int n_buffers = 0, n_views = 0, n_steps = 0, n_const = 0;
    for (int cmd = 0; cmd < MAX_CMDS && r.n; cmd++) {
        switch (u8(&r) % 7) {
        case 0: add_buffer(b, &r, &n_const); n_buffers++; break;
        case 1: add_view(b, &r, n_buffers); n_views++; break;
        case 2: add_op(b, &r, n_views); n_steps++; break;
        case 3: add_fallback(b, &r, n_views); n_steps++; break;
        case 4: kw_builder_label(b, (int)(u8(&r) % (n_steps + 1)), "label"); break;
        case 5: add_shaped_op(b, &r, &n_buffers, &n_views); n_steps++; break;
        default: add_view(b, &r, n_buffers); n_views++; break;
        }
    }
    const kw_finish_opts o = {.n_threads = 1 + (int)(u8(&r) % 3), .barrier_every_step = u8(&r) & 1, .isa = -1};
    kw_plan *plan;
    char msg[512];
    const int rc = kw_builder_finish(b, &o, &plan, msg, sizeof msg);
    if (rc == 0) {
        replay_checked(plan, o.n_threads);
        kw_plan_destroy(plan);
    } else if (rc > 0 || !msg[0] || strcmp(kw_strerror(rc), "unknown error") == 0) {
        __builtin_trap(); /* every failure has a known code and a message */
    }
    kw_builder_destroy(b);
    return 0;
}
