/* matmul_dnnl: y = x·Wᵀ (+ bias) for prefill-sized M through oneDNN's matmul,
 * with the slots and meaning of linear (f32 x with f32 weights, or bf16 with
 * bf16; oneDNN 2.6 has no f32 × bf16 matmul, so that pair is refused: linear
 * takes it). Use it from M >= KW_DNNL_MIN_M_F32 / _BF16 (_F32_AVX2 below
 * AVX-512, _BF16_AMX on an AMX CPU), where it measured faster than linear.
 *
 * The weight [N, K] may also be the transpose of a [K, N] matrix (strides
 * (1, wk)): GPT-2's Conv1D multiplies x by its [K, N] weight as stored. oneDNN
 * reads it through its strides; linear's kernels cannot, so under the scalar
 * reference such a call runs the plain loop of matmul_dnnl_kn_scalar.
 *
 * Prepared once: the primitive for this shape and its memory objects are made
 * when the plan is finished (a failure there is the step's error, never a
 * fallback at replay), owned by the step and released with the plan. Each
 * replay rebinds the memory objects to the call's pointers. A plan runs one
 * call at a time, so no lock is needed around them.
 *
 * Debian's oneDNN runs on OpenMP. Thread 0 of the pool makes the call and the
 * other pool threads return at once and wait at the next barrier, where they
 * spin briefly and then sleep: OpenMP gets the cores. oneDNN picks its own ISA
 * (ONEDNN_MAX_CPU_ISA caps it); under a plan capped at the scalar reference the
 * op runs linear's scalar kernel instead. */
#include <oneapi/dnnl/dnnl.h>

#include "linear.h"

typedef struct kw__dnnl {
    kw__lin lin; /* linear's preparation: its kernel runs the call when prim is NULL */
    int64_t wk;  /* a [K, N] weight's K stride (its view's strides are (1, wk)); 0: [N, K] rows */
    int bias;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    dnnl_primitive_t prim;
    dnnl_memory_t src, wei, bias_mem, dst;
} kw__dnnl;

static void matmul_dnnl_release(void *prep) {
    kw__dnnl *p = prep;
    if (p->prim) dnnl_primitive_destroy(p->prim);
    if (p->src) dnnl_memory_destroy(p->src);
    if (p->wei) dnnl_memory_destroy(p->wei);
    if (p->bias_mem) dnnl_memory_destroy(p->bias_mem);
    if (p->dst) dnnl_memory_destroy(p->dst);
    if (p->stream) dnnl_stream_destroy(p->stream);
    if (p->engine) dnnl_engine_destroy(p->engine);
    p->prim = NULL, p->src = p->wei = p->bias_mem = p->dst = NULL, p->stream = NULL, p->engine = NULL;
}

typedef struct kw__dnnl_descs {
    dnnl_memory_desc_t src, wei, bias, dst;
} kw__dnnl_descs;

/* A matmul of an M × K x (rows xs apart) by a K × N weight (strides wk, wn)
 * into an M × N y (rows ys apart), plus a [1, N] bias where `bias`, all of
 * dtype dt: its memory descriptors, and in *pd the primitive descriptor oneDNN
 * chose (nonzero where it has none: no such matmul on this CPU). */
static int describe(dnnl_engine_t engine, dnnl_data_type_t dt, int64_t M, int64_t N, int64_t K, int64_t xs,
                    int64_t wk, int64_t wn, int64_t ys, int bias, kw__dnnl_descs *d, dnnl_primitive_desc_t *pd) {
    dnnl_matmul_desc_t md;
    return dnnl_memory_desc_init_by_strides(&d->src, 2, (dnnl_dims_t){M, K}, dt, (dnnl_dims_t){xs, 1}) ||
           dnnl_memory_desc_init_by_strides(&d->wei, 2, (dnnl_dims_t){K, N}, dt, (dnnl_dims_t){wk, wn}) ||
           dnnl_memory_desc_init_by_strides(&d->bias, 2, (dnnl_dims_t){1, N}, dt, (dnnl_dims_t){N, 1}) ||
           dnnl_memory_desc_init_by_strides(&d->dst, 2, (dnnl_dims_t){M, N}, dt, (dnnl_dims_t){ys, 1}) ||
           dnnl_matmul_desc_init(&md, &d->src, &d->wei, bias ? &d->bias : NULL, &d->dst) ||
           dnnl_primitive_desc_create(pd, &md, NULL, engine, NULL);
}

/* The primitive for g's shape, dtypes and strides, and its memory objects. */
static int make_primitive(kw__dnnl *p, const kw__lin *g) {
    /* The weight as a K × N matrix: PyTorch's [N, K] rows have strides (1, ws); a
     * [K, N] matrix read as stored, (wk, 1). */
    const int64_t wk_stride = p->wk ? p->wk : 1, wn_stride = p->wk ? 1 : g->ws;
    kw__dnnl_descs d;
    dnnl_primitive_desc_t pd;
    if (dnnl_engine_create(&p->engine, dnnl_cpu, 0) ||
        dnnl_stream_create(&p->stream, p->engine, dnnl_stream_default_flags) ||
        describe(p->engine, g->xt == KW_BF16 ? dnnl_bf16 : dnnl_f32, g->M, g->n_total, g->K, g->xs, wk_stride,
                 wn_stride, g->out[0].ys, p->bias, &d, &pd))
        return -1;
    const dnnl_status_t st = dnnl_primitive_create(&p->prim, pd);
    dnnl_primitive_desc_destroy(pd);
    if (st || dnnl_memory_create(&p->src, &d.src, p->engine, DNNL_MEMORY_NONE) ||
        dnnl_memory_create(&p->wei, &d.wei, p->engine, DNNL_MEMORY_NONE) ||
        (p->bias && dnnl_memory_create(&p->bias_mem, &d.bias, p->engine, DNNL_MEMORY_NONE)) ||
        dnnl_memory_create(&p->dst, &d.dst, p->engine, DNNL_MEMORY_NONE))
        return -1;
    return 0;
}

/* Asks for a small one's descriptor: 16 × 64 by 64 rows of 64. */
int kw_dnnl_has_bf16_matmul(void) {
    dnnl_engine_t engine;
    if (dnnl_engine_create(&engine, dnnl_cpu, 0)) return 0;
    kw__dnnl_descs d;
    dnnl_primitive_desc_t pd = NULL;
    const int made = !describe(engine, dnnl_bf16, 16, 64, 64, 64, 1, 64, 64, 0, &d, &pd);
    if (made) dnnl_primitive_desc_destroy(pd);
    dnnl_engine_destroy(engine);
    return made;
}

/* A weight [N, K] whose strides are (1, wk), wk >= N: the transpose of a [K, N] matrix. */
static int64_t kn_stride(const kw_tensor *w) {
    return w->ndim == 2 && w->shape[0] > 1 && w->shape[1] > 1 && w->stride[0] == 1 && w->stride[1] >= w->shape[0]
               ? w->stride[1]
               : 0;
}

static int matmul_dnnl_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    kw__dnnl *p = prep;
    kw__lin *g = &p->lin;
    /* linear's checks see a [K, N] weight as the [N, K] rows it is the transpose of */
    kw_call rows = *c;
    p->wk = kn_stride(&c->t[2]);
    if (p->wk) rows.t[2].stride[0] = c->t[2].shape[1], rows.t[2].stride[1] = 1;
    int err = kw__lin_prepare(&rows, "matmul_dnnl", 1, isa, g, msg, len);
    if (err) return err;
    if (g->xt != g->wt || (kw__present(&c->t[3]) && g->bt != g->xt))
        return kw__fail(msg, len, KW_EDTYPE, "matmul_dnnl: weight and bias must have x's dtype %s (got weight %s)",
                        kw_dtype_name(g->xt), kw__shape(&c->t[2]).s);
    if (g->kblk != g->K)
        return kw__fail(msg, len, KW_ESHAPE, "matmul_dnnl: weight must be [N, K], not K-blocked (got %s)",
                        kw__shape(&c->t[2]).s);
    p->bias = kw__present(&c->t[3]);
    if (p->bias && g->bs != 1)
        return kw__fail(msg, len, KW_ESHAPE, "matmul_dnnl: bias must be contiguous (got %s)", kw__shape(&c->t[3]).s);
    if (isa == KW_ISA_SCALAR) return 0; /* the scalar reference: linear's */
    if (make_primitive(p, g)) {
        matmul_dnnl_release(p);
        return kw__fail(msg, len, KW_EINVAL, "matmul_dnnl: oneDNN made no matmul primitive for [%lld, %lld] x [%lld, %lld]ᵀ %s",
                        (long long)g->M, (long long)g->K, (long long)g->n_total, (long long)g->K, kw_dtype_name(g->xt));
    }
    return 0;
}

/* The scalar reference for a [K, N] weight: output rows split over the threads. */
static void matmul_dnnl_kn_scalar(const kw_call *c, const kw__dnnl *p, int ith, int nth) {
    kw__lin g = p->lin;
    g.b = c->t[3].data;
    for (int64_t m = g.M * ith / nth; m < g.M * (ith + 1) / nth; m++)
        for (int64_t n = 0; n < g.n_total; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < g.K; k++)
                acc += kw__ldf(c->t[1].data, m * g.xs + k, g.xt) * kw__ldf(c->t[2].data, n + k * p->wk, g.wt);
            kw__stf(c->t[0].data, m * g.out[0].ys + n, g.yt, acc + kw__lin_bias(&g, n));
        }
}

static void matmul_dnnl_kernel(const kw_call *c, int ith, int nth) {
    const kw__dnnl *p = c->prep;
    if (!p->prim) {
        if (p->wk) matmul_dnnl_kn_scalar(c, p, ith, nth);
        else kw__linear_run(c, &p->lin, ith, nth);
        return;
    }
    if (ith != 0) return;
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, p->src}, {DNNL_ARG_WEIGHTS, p->wei}, {DNNL_ARG_DST, p->dst}};
    int nargs = 3;
    dnnl_memory_set_data_handle(p->src, c->t[1].data);
    dnnl_memory_set_data_handle(p->wei, c->t[2].data);
    dnnl_memory_set_data_handle(p->dst, c->t[0].data);
    if (p->bias) {
        dnnl_memory_set_data_handle(p->bias_mem, c->t[3].data);
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, p->bias_mem};
    }
    dnnl_primitive_execute(p->prim, p->stream, nargs, args);
    dnnl_stream_wait(p->stream);
}

static size_t matmul_dnnl_work(const void *prep) { return kw__lin_work_size(&((const kw__dnnl *)prep)->lin); }

/* Slots y [M, N], x [M, K], weight [N, K], bias [N] (optional): as linear. */
const kw_op_info kw_op_info_matmul_dnnl = {
    .name = "matmul_dnnl",
    .n_tensors = 4,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}, {"weight", KW_READ, 0}, {"bias", KW_READ, 1}},
    .prepare = matmul_dnnl_prepare,
    .prep_size = sizeof(kw__dnnl),
    .release = matmul_dnnl_release,
    .work_size = matmul_dnnl_work,
    .shares_work = 1,
    .kernel = matmul_dnnl_kernel,
};
