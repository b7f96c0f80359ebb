/* matmul_dnnl: y = x·Wᵀ (+ bias) for prefill-sized M through oneDNN's matmul,
 * with the slots and meaning of linear (f32 x with f32 weights, or bf16 with
 * bf16; oneDNN 2.6 has no f32 × bf16 matmul, so that pair stays on linear).
 *
 * Debian's oneDNN runs on OpenMP. Thread 0 of the pool makes the call and the
 * other pool threads return at once and wait at the next barrier, where they
 * spin briefly and then sleep: OpenMP gets the cores. A primitive (and its
 * memory objects, rebound to each call's pointers) is made the first time a
 * shape is seen and kept: a plan pays for creation once, at its first run.
 * Use it from M >= KW_DNNL_MIN_M_F32 / _BF16, where it measured faster than
 * linear.
 *
 * Without oneDNN (KW_DNNL off) the op still exists and runs linear's kernels. */
#include <pthread.h>

#include "linear.h"

static int dnnl_pair_ok(const kw__lin *g) {
    return g->xt == g->wt && (!g->b || g->bt == g->xt);
}

static int matmul_dnnl_check(const kw_call *c, char *msg, size_t len) {
    kw__lin g;
    int err = kw__lin_from_call(c, "matmul_dnnl", 1, &g, msg, len);
    if (err) return err;
    if (!dnnl_pair_ok(&g))
        return kw__fail(msg, len, KW_EDTYPE, "matmul_dnnl: weight and bias must have x's dtype %s (got weight %s)",
                        kw_dtype_name(g.xt), kw__shape(&c->t[2]).s);
    if (g.kblk != g.K)
        return kw__fail(msg, len, KW_ESHAPE, "matmul_dnnl: weight must be [N, K], not K-blocked (got %s)",
                        kw__shape(&c->t[2]).s);
    return 0;
}

static size_t matmul_dnnl_work(const kw_call *c) {
    kw__lin g;
    return kw__lin_from_call(c, "", 1, &g, NULL, 0) ? 0 : kw__lin_work_size(&g);
}

static void matmul_dnnl_scalar(const kw_call *c, int ith, int nth) { kw__linear_run(c, 1, ith, nth, KW_ISA_SCALAR); }

#ifdef KW_DNNL
#include <oneapi/dnnl/dnnl.h>

typedef struct prim_key {
    int64_t M, N, K, xs, ws, ys;
    int dt, bias;
} prim_key;

typedef struct prim_entry {
    prim_key key;
    dnnl_primitive_t prim;
    dnnl_memory_t src, wei, bias, dst;
} prim_entry;

#define KW__DNNL_CACHE 64

static struct {
    pthread_mutex_t lock; /* one oneDNN call at a time: each takes every core anyway */
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    int ready;
    int n, next; /* entries used; the next one to replace when full */
    prim_entry e[KW__DNNL_CACHE];
} cache = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void entry_destroy(prim_entry *e) {
    dnnl_primitive_destroy(e->prim);
    dnnl_memory_destroy(e->src);
    dnnl_memory_destroy(e->wei);
    if (e->bias) dnnl_memory_destroy(e->bias);
    dnnl_memory_destroy(e->dst);
    memset(e, 0, sizeof *e);
}

static int entry_create(prim_entry *e, const prim_key *k) {
    const dnnl_data_type_t dt = k->dt == KW_BF16 ? dnnl_bf16 : dnnl_f32;
    dnnl_memory_desc_t src, wei, bias, dst;
    dnnl_matmul_desc_t md;
    dnnl_primitive_desc_t pd;
    /* Weights are PyTorch's [N, K] rows, which is a K × N matrix with strides (1, ws). */
    if (dnnl_memory_desc_init_by_strides(&src, 2, (dnnl_dims_t){k->M, k->K}, dt, (dnnl_dims_t){k->xs, 1}) ||
        dnnl_memory_desc_init_by_strides(&wei, 2, (dnnl_dims_t){k->K, k->N}, dt, (dnnl_dims_t){1, k->ws}) ||
        dnnl_memory_desc_init_by_strides(&bias, 2, (dnnl_dims_t){1, k->N}, dt, (dnnl_dims_t){k->N, 1}) ||
        dnnl_memory_desc_init_by_strides(&dst, 2, (dnnl_dims_t){k->M, k->N}, dt, (dnnl_dims_t){k->ys, 1}) ||
        dnnl_matmul_desc_init(&md, &src, &wei, k->bias ? &bias : NULL, &dst) ||
        dnnl_primitive_desc_create(&pd, &md, NULL, cache.engine, NULL))
        return -1;
    memset(e, 0, sizeof *e);
    const dnnl_status_t st = dnnl_primitive_create(&e->prim, pd);
    dnnl_primitive_desc_destroy(pd);
    if (st) return -1;
    if (dnnl_memory_create(&e->src, &src, cache.engine, DNNL_MEMORY_NONE) ||
        dnnl_memory_create(&e->wei, &wei, cache.engine, DNNL_MEMORY_NONE) ||
        (k->bias && dnnl_memory_create(&e->bias, &bias, cache.engine, DNNL_MEMORY_NONE)) ||
        dnnl_memory_create(&e->dst, &dst, cache.engine, DNNL_MEMORY_NONE)) {
        entry_destroy(e);
        return -1;
    }
    e->key = *k;
    return 0;
}

static prim_entry *entry_get(const prim_key *k) {
    if (!cache.ready) {
        if (dnnl_engine_create(&cache.engine, dnnl_cpu, 0) ||
            dnnl_stream_create(&cache.stream, cache.engine, dnnl_stream_default_flags))
            return NULL;
        cache.ready = 1;
    }
    for (int i = 0; i < cache.n; i++)
        if (!memcmp(&cache.e[i].key, k, sizeof *k)) return &cache.e[i];
    prim_entry *e = &cache.e[cache.n < KW__DNNL_CACHE ? cache.n++ : cache.next++ % KW__DNNL_CACHE];
    if (e->prim) entry_destroy(e);
    return entry_create(e, k) ? NULL : e;
}

/* Runs the matmul on oneDNN; returns 0 when it could not (then linear runs it). */
static int run_onednn(const kw__lin *g) {
    prim_key k;
    memset(&k, 0, sizeof k); /* compared bytewise: padding included */
    k.M = g->M, k.N = g->n_total, k.K = g->K, k.xs = g->xs, k.ws = g->ws, k.ys = g->out[0].ys;
    k.dt = g->xt, k.bias = g->b != NULL;
    pthread_mutex_lock(&cache.lock);
    prim_entry *e = entry_get(&k);
    int ok = e != NULL;
    if (ok) {
        dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, e->src}, {DNNL_ARG_WEIGHTS, e->wei}, {DNNL_ARG_DST, e->dst}};
        int nargs = 3;
        dnnl_memory_set_data_handle(e->src, (void *)g->x);
        dnnl_memory_set_data_handle(e->wei, (void *)g->w);
        dnnl_memory_set_data_handle(e->dst, g->out[0].y);
        if (g->b) {
            dnnl_memory_set_data_handle(e->bias, (void *)g->b);
            args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, e->bias};
        }
        ok = !dnnl_primitive_execute(e->prim, cache.stream, nargs, args) && !dnnl_stream_wait(cache.stream);
    }
    pthread_mutex_unlock(&cache.lock);
    return ok;
}

static void matmul_dnnl_onednn(const kw_call *c, int ith, int nth) {
    kw__lin g;
    if (ith != 0 || kw__lin_from_call(c, "", 1, &g, NULL, 0)) return;
    /* oneDNN wants a contiguous bias; a strided one (never seen in practice) and
     * a failed primitive fall back to linear's kernel on this thread alone. */
    if ((g.b && g.bs != 1) || !run_onednn(&g)) kw__linear_run(c, 1, 0, 1, KW_ISA_SCALAR);
}
#define KW__MATMUL_FAST matmul_dnnl_onednn
#else
static void matmul_dnnl_linear(const kw_call *c, int ith, int nth) { kw__linear_run(c, 1, ith, nth, kw_cpu_isa()); }
#define KW__MATMUL_FAST matmul_dnnl_linear
#endif

/* Slots y [M, N], x [M, K], weight [N, K], bias [N] (optional): as linear. */
const kw_op_info kw_op_info_matmul_dnnl = {
    .name = "matmul_dnnl",
    .n_tensors = 4,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}, {"weight", KW_READ, 0}, {"bias", KW_READ, 1}},
    .check = matmul_dnnl_check,
    .work_size = matmul_dnnl_work,
    .shares_work = 1,
    .kernel = {[KW_ISA_SCALAR] = matmul_dnnl_scalar, [KW_ISA_AVX2] = KW__MATMUL_FAST},
};
