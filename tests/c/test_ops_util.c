#include "test_ops_util.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kw_ops_impl.h"

uint64_t tt_next(tt_rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double tt_uniform(tt_rng *r, double lo, double hi) { return lo + (hi - lo) * (double)(tt_next(r) >> 11) * 0x1p-53; }

int64_t tt_int(tt_rng *r, int64_t lo, int64_t hi) { return lo + (int64_t)(tt_next(r) % (uint64_t)(hi - lo + 1)); }

static int is_floaty(kw_dtype dt) { return dt == KW_F32 || dt == KW_BF16 || dt == KW_F16; }

static void put(void *p, int64_t i, kw_dtype dt, double v) {
    switch (dt) {
    case KW_F32: ((float *)p)[i] = (float)v; break;
    case KW_BF16: ((uint16_t *)p)[i] = kw__f32_to_bf16((float)v); break;
    case KW_F16: ((uint16_t *)p)[i] = kw__f32_to_f16((float)v); break;
    case KW_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case KW_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    default: ((uint8_t *)p)[i] = (uint8_t)v; break;
    }
}

static double get(const void *p, int64_t i, kw_dtype dt) {
    switch (dt) {
    case KW_F32: return ((const float *)p)[i];
    case KW_BF16: return kw__bf16_to_f32(((const uint16_t *)p)[i]);
    case KW_F16: return kw__f16_to_f32(((const uint16_t *)p)[i]);
    case KW_I64: return (double)((const int64_t *)p)[i];
    case KW_I32: return ((const int32_t *)p)[i];
    default: return ((const uint8_t *)p)[i];
    }
}

kw_tensor *tt_tensor(tt_case *k, int slot, kw_dtype dt, int ndim, const int64_t *shape, const int64_t *strides,
                     double lo, double hi, tt_rng *r) {
    kw_tensor *t = &k->c.t[slot];
    int64_t extent = 1, st = 1;
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->ndim = ndim;
    for (int d = ndim - 1; d >= 0; d--) {
        t->shape[d] = shape[d];
        t->stride[d] = strides ? strides[d] : st;
        st *= shape[d];
        if (shape[d] == 0) extent = 0;
    }
    if (extent)
        for (int d = 0; d < ndim; d++) extent += (shape[d] - 1) * t->stride[d];
    k->bytes[slot] = (size_t)(extent ? extent : 1) * kw_dtype_size(dt);
    free(k->mem[slot]); /* a slot given again (a test of the next rejection) */
    k->mem[slot] = malloc(k->bytes[slot]);
    cr_assert_not_null(k->mem[slot]);
    t->data = k->mem[slot];
    for (int64_t i = 0; i < (int64_t)(k->bytes[slot] / kw_dtype_size(dt)); i++)
        put(t->data, i, dt, is_floaty(dt) ? tt_uniform(r, lo, hi) : (double)tt_int(r, (int64_t)lo, (int64_t)hi));
    return t;
}

kw_tensor *tt_padded(tt_case *k, int slot, kw_dtype dt, int ndim, const int64_t *shape, int64_t pad, double lo,
                     double hi, tt_rng *r) {
    int64_t strides[KW_MAX_DIMS], st = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = st;
        st = st * shape[d] + pad;
    }
    return tt_tensor(k, slot, dt, ndim, shape, strides, lo, hi, r);
}

void tt_alias(tt_case *k, int dst, int src) {
    k->c.t[dst] = k->c.t[src];
    k->mem[dst] = NULL;
    k->bytes[dst] = 0;
}

void tt_free(tt_case *k) {
    for (int i = 0; i < KW_CALL_MAX_TENSORS; i++) free(k->mem[i]);
    memset(k, 0, sizeof *k);
}

static int64_t offset(const kw_tensor *t, const int64_t *idx) {
    int64_t o = 0;
    for (int d = 0; d < t->ndim; d++) o += idx[d] * t->stride[d];
    return o;
}

double tt_get(const kw_tensor *t, const int64_t *idx) { return get(t->data, offset(t, idx), t->dtype); }

void tt_set(kw_tensor *t, const int64_t *idx, double v) { put(t->data, offset(t, idx), t->dtype, v); }

void tt_run_shared(kw_op_id op, kw_isa isa, const kw_call *c, int nth, int shared) {
    const kw_op_info *info = kw_op_get(op);
    kw_call call = *c;
    if (!call.n_threads) call.n_threads = nth; /* prepared for the threads it runs on, as a plan's */
    void *prep = malloc(kw_op_prep_size(op));
    char msg[256];
    cr_assert_eq(kw_op_prepare(op, &call, isa, prep, msg, sizeof msg), 0, "%s: prepare rejected the call: %s",
                 info->name, msg);
    const size_t ws = info->work_size ? (info->work_size(prep) + 63) / 64 * 64 : 0;
    void *work = ws ? malloc(ws * (size_t)nth) : NULL;
    /* NaN in every float and bf16: a kernel that reads scratch it has not written
     * (padding it assumed zero) makes NaN of what it multiplies by zero */
    if (work) memset(work, 0xff, ws * (size_t)nth);
    call.work = work;
    call.work_stride = ws;
    /* Threads run one after another here, so with a share line the first takes
     * its own work and then every other thread's from the back. */
    _Alignas(64) unsigned char share[KW_SHARE_BYTES] = {0};
    call.share = shared ? share : NULL;
    for (int ith = 0; ith < nth; ith++) info->kernel(&call, ith, nth);
    free(work);
    if (info->release) info->release(prep);
    free(prep);
}

void tt_run(kw_op_id op, kw_isa isa, const kw_call *c, int nth) { tt_run_shared(op, isa, c, nth, 0); }

int64_t tt_compare(const void *got, const void *want, kw_dtype dt, size_t bytes, tt_tol tol, double *g, double *w) {
    const int64_t n = (int64_t)(bytes / kw_dtype_size(dt));
    for (int64_t i = 0; i < n; i++) {
        *g = get(got, i, dt), *w = get(want, i, dt);
        if ((isnan(*g) && isnan(*w)) || *g == *w) continue; /* equal infinities too */
        if (!(fabs(*g - *w) <= tol.atol + tol.rtol * fabs(*w))) return i;
    }
    return -1;
}

/* Slot o's allocation holds memory some slot writes (itself or an alias). */
static int written(const kw_op_info *info, const tt_case *k, int o) {
    if (!k->mem[o]) return 0;
    for (int s = 0; s < info->n_tensors; s++) {
        const char *p = k->c.t[s].data, *base = k->mem[o];
        if ((info->arg[s].access == KW_WRITE || info->arg[s].access == KW_MODIFY) && p >= base &&
            p < base + k->bytes[o])
            return 1;
    }
    return 0;
}

int tt_check_variants(kw_op_id op, tt_case *k, tt_tol tol, const char *what) {
    const kw_op_info *info = kw_op_get(op);

    /* The written slots' memory before any run, then the reference's result. */
    void *before[KW_CALL_MAX_TENSORS] = {0}, *ref[KW_CALL_MAX_TENSORS] = {0};
    for (int s = 0; s < info->n_tensors; s++)
        if (written(info, k, s)) {
            before[s] = malloc(k->bytes[s]);
            memcpy(before[s], k->mem[s], k->bytes[s]);
        }
    tt_run(op, KW_ISA_SCALAR, &k->c, 1);
    for (int s = 0; s < info->n_tensors; s++)
        if (before[s]) {
            ref[s] = malloc(k->bytes[s]);
            memcpy(ref[s], k->mem[s], k->bytes[s]);
        }

    static const int nths[] = {1, 2, 3, 7};
    int compared = 0;
    for (int isa = KW_ISA_SCALAR; isa <= (int)kw_cpu_isa(); isa++) {
        for (size_t t = 0; t < sizeof nths / sizeof *nths; t++)
            for (int shared = 0; shared <= info->shares_work; shared++) {
                for (int s = 0; s < info->n_tensors; s++)
                    if (before[s]) memcpy(k->mem[s], before[s], k->bytes[s]);
                tt_run_shared(op, (kw_isa)isa, &k->c, nths[t], shared);
                for (int s = 0; s < info->n_tensors; s++) {
                    if (!before[s]) continue;
                    double g, w;
                    const int64_t i = tt_compare(k->mem[s], ref[s], k->c.t[s].dtype, k->bytes[s], tol, &g, &w);
                    cr_assert_eq(i, -1, "%s: %s/%s nth=%d%s slot %s: element %lld is %.9g, reference %.9g", what,
                                 info->name, kw_isa_name((kw_isa)isa), nths[t], shared ? " shared" : "",
                                 info->arg[s].name, (long long)i, g, w);
                }
                compared++;
            }
    }
    for (int s = 0; s < info->n_tensors; s++) {
        free(before[s]);
        free(ref[s]);
    }
    return compared;
}

void tt_expect_reject(kw_op_id op, const kw_call *c, int err, const char *needle) {
    const kw_op_info *info = kw_op_get(op);
    char msg[512] = "";
    kw_call call = *c;
    void *prep = malloc(kw_op_prep_size(op));
    cr_expect_eq(kw_op_prepare(op, &call, kw_cpu_isa(), prep, msg, sizeof msg), err,
                 "%s: expected %s, message \"%s\"", info->name, kw_strerror(err), msg);
    free(prep);
    cr_expect(strstr(msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", info->name, msg, needle);
}
