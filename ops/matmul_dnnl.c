/* matmul_dnnl: y = x·Wᵀ (+ bias) for prefill-sized M through oneDNN's matmul,
 * with the slots and meaning of linear (f32 x with f32 weights, or bf16 with
 * bf16; oneDNN 2.6 has no f32 × bf16 matmul, so that pair is refused: linear
 * takes it). Use it from M >= KW_DNNL_MIN_M_F32 / _BF16 (_F32_AVX2 below
 * AVX-512, _F32_AMX / _BF16_AMX on an AMX CPU), where it measured faster than linear.
 *
 * The weight [N, K] may also be the transpose of a [K, N] matrix (strides
 * (1, wk)): GPT-2's Conv1D multiplies x by its [K, N] weight as stored. oneDNN
 * reads it through its strides; linear's kernels cannot, so under the scalar
 * reference such a call runs the plain loop of matmul_dnnl_kn_scalar.
 *
 * Prepared once: the weight's columns are cut into one slice per thread the
 * call is prepared for (kw_call.n_threads), each with its primitive and memory
 * objects, made when the plan is finished (a failure there is the step's error,
 * never a fallback at replay), owned by the step and released with the plan.
 * Each replay rebinds the memory objects to the call's pointers.
 *
 * Each thread of the pool runs its own slices, and runs them on itself alone:
 * Debian's oneDNN runs on OpenMP, and a call handed to its threads left them
 * spinning (GOMP_SPINCOUNT) on the cores kwker's pool needed for the steps
 * after it. A 256 -> 512 -> 512 -> 64 float32 MLP at batch 8, three oneDNN
 * matmuls between two GELUs, took 0.13-0.47 ms a call that way against 0.08-0.11
 * with linear alone (2-vCPU Intel Xeon), its pool worker on the core of the
 * OpenMP thread with thousands of involuntary context switches. So oneDNN is
 * told to use one thread (OpenMP's per-thread nthreads-var, set around the
 * primitive's creation and each execution and put back after: PyTorch's
 * calling thread keeps its own), and no OpenMP thread ever runs for kwker.
 * Where a plan runs on fewer threads than it was prepared for, a thread runs
 * more than one slice; its scratchpad (oneDNN's, in user mode) is the
 * thread's scratch. oneDNN picks its own ISA (ONEDNN_MAX_CPU_ISA caps it);
 * under a plan capped at the scalar reference the op runs linear's scalar
 * kernel instead. */
#include <oneapi/dnnl/dnnl.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"

#if DNNL_CPU_THREADING_RUNTIME != DNNL_RUNTIME_OMP
#error "matmul_dnnl sets OpenMP's thread count for oneDNN: it needs a oneDNN built on OpenMP (Debian's)"
#endif

/* OpenMP's own API (libgomp's, linked): declared here rather than through
 * omp.h, which clang (the fuzzing build) has only with LLVM's OpenMP. */
int omp_get_max_threads(void);
void omp_set_num_threads(int n);

/* One thread's share of the weight's columns [n0, n0 + n): its primitive and the
 * memory objects its execution binds (each slice its own: threads rebind theirs
 * at the same time). */
typedef struct kw__dnnl_slice {
    int64_t n0, n;
    int staged; /* y's columns are written to the thread's scratch first, rows n apart, then copied */
    dnnl_stream_t stream;
    dnnl_primitive_t prim;
    dnnl_memory_t src, wei, bias, dst, scratch;
} kw__dnnl_slice;

typedef struct kw__dnnl {
    kw__lin lin; /* linear's preparation: its kernel runs the call when there are no slices */
    int64_t wk;  /* a [K, N] weight's K stride (its view's strides are (1, wk)); 0: [N, K] rows */
    int bias;
    int n_slices;
    size_t scratchpad; /* the largest slice's scratchpad, bytes (a multiple of 64) */
    size_t staging;    /* the largest staged slice's y, bytes */
    dnnl_engine_t engine;
    kw__dnnl_slice *slices;
} kw__dnnl;

static void matmul_dnnl_release(void *prep) {
    kw__dnnl *p = prep;
    for (int i = 0; p->slices && i < p->n_slices; i++) {
        kw__dnnl_slice *s = &p->slices[i];
        if (s->prim) dnnl_primitive_destroy(s->prim);
        dnnl_memory_t mems[] = {s->src, s->wei, s->bias, s->dst, s->scratch};
        for (size_t m = 0; m < sizeof mems / sizeof *mems; m++)
            if (mems[m]) dnnl_memory_destroy(mems[m]);
        if (s->stream) dnnl_stream_destroy(s->stream);
    }
    free(p->slices);
    if (p->engine) dnnl_engine_destroy(p->engine);
    p->slices = NULL, p->n_slices = 0, p->engine = NULL;
}

typedef struct kw__dnnl_descs {
    dnnl_memory_desc_t src, wei, bias, dst;
} kw__dnnl_descs;

/* A matmul of an M × K x (rows xs apart) by a K × N weight (strides wk, wn)
 * into an M × N y (rows ys apart), plus a [1, N] bias where `bias`, all of
 * dtype dt, with the scratchpad left to the caller where `attr`: its memory
 * descriptors, and in *pd the primitive descriptor oneDNN chose (nonzero where
 * it has none: no such matmul on this CPU). */
static int describe(dnnl_engine_t engine, dnnl_data_type_t dt, int64_t M, int64_t N, int64_t K, int64_t xs,
                    int64_t wk, int64_t wn, int64_t ys, int bias, const_dnnl_primitive_attr_t attr,
                    kw__dnnl_descs *d, dnnl_primitive_desc_t *pd) {
    dnnl_matmul_desc_t md;
    return dnnl_memory_desc_init_by_strides(&d->src, 2, (dnnl_dims_t){M, K}, dt, (dnnl_dims_t){xs, 1}) ||
           dnnl_memory_desc_init_by_strides(&d->wei, 2, (dnnl_dims_t){K, N}, dt, (dnnl_dims_t){wk, wn}) ||
           dnnl_memory_desc_init_by_strides(&d->bias, 2, (dnnl_dims_t){1, N}, dt, (dnnl_dims_t){N, 1}) ||
           dnnl_memory_desc_init_by_strides(&d->dst, 2, (dnnl_dims_t){M, N}, dt, (dnnl_dims_t){ys, 1}) ||
           dnnl_matmul_desc_init(&md, &d->src, &d->wei, bias ? &d->bias : NULL, &d->dst) ||
           dnnl_primitive_desc_create(pd, &md, attr, engine, NULL);
}

/* Columns [s->n0, s->n0 + s->n) of the weight as slice s's primitive and
 * memory objects; *scratch gets its scratchpad's bytes. */
static int make_slice(kw__dnnl *p, const kw__lin *g, const_dnnl_primitive_attr_t attr, kw__dnnl_slice *s,
                      size_t *scratch) {
    /* The weight as a K × N matrix: PyTorch's [N, K] rows have strides (1, ws); a
     * [K, N] matrix read as stored, (wk, 1). */
    const int64_t wk_stride = p->wk ? p->wk : 1, wn_stride = p->wk ? 1 : g->ws;
    kw__dnnl_descs d;
    dnnl_primitive_desc_t pd;
    if (dnnl_stream_create(&s->stream, p->engine, dnnl_stream_default_flags) ||
        describe(p->engine, g->xt == KW_BF16 ? dnnl_bf16 : dnnl_f32, g->M, s->n, g->K, g->xs, wk_stride,
                 wn_stride, s->staged ? s->n : g->out[0].ys, p->bias, attr, &d, &pd))
        return -1;
    const dnnl_memory_desc_t *queried = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    dnnl_memory_desc_t scratch_md = {0}; /* a copy: the pd's own goes with it */
    if (queried) scratch_md = *queried;
    *scratch = dnnl_memory_desc_get_size(&scratch_md);
    const dnnl_status_t st = queried ? dnnl_primitive_create(&s->prim, pd) : dnnl_runtime_error;
    dnnl_primitive_desc_destroy(pd);
    return st || dnnl_memory_create(&s->src, &d.src, p->engine, DNNL_MEMORY_NONE) ||
           dnnl_memory_create(&s->wei, &d.wei, p->engine, DNNL_MEMORY_NONE) ||
           (p->bias && dnnl_memory_create(&s->bias, &d.bias, p->engine, DNNL_MEMORY_NONE)) ||
           dnnl_memory_create(&s->dst, &d.dst, p->engine, DNNL_MEMORY_NONE) ||
           (*scratch && dnnl_memory_create(&s->scratch, &scratch_md, p->engine, DNNL_MEMORY_NONE));
}

/* Slices start at multiples of this many columns (a cache line of f32 y); only
 * the last is narrower (and the only one, for fewer columns). Threads past the
 * slices have nothing to do. */
#define KW__DNNL_SLICE_COLS 16
/* A thread stages at most this much of y: staged, y would be kept twice over in
 * the plan's scratch (a 49152-token head at 512 rows: 96 MiB). A larger slice
 * is written into y's rows as they are, by oneDNN's gemm:jit (8 % slower than
 * its brgemm at 128 rows, where the product is compute-bound). */
#define KW__DNNL_MAX_STAGING (4u << 20)

/* The slices for n_threads threads, made with oneDNN on one thread. */
static int make_slices(kw__dnnl *p, const kw__lin *g, int n_threads) {
    const int64_t N = g->n_total, blocks = KW__MAX((N + KW__DNNL_SLICE_COLS - 1) / KW__DNNL_SLICE_COLS, 1);
    p->n_slices = (int)KW__MIN((int64_t)KW__MAX(n_threads, 1), blocks);
    p->slices = calloc((size_t)p->n_slices, sizeof *p->slices);
    dnnl_primitive_attr_t attr = NULL;
    if (!p->slices || dnnl_engine_create(&p->engine, dnnl_cpu, 0) || dnnl_primitive_attr_create(&attr) ||
        dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user)) {
        if (attr) dnnl_primitive_attr_destroy(attr);
        return -1;
    }
    for (int i = 0; i < p->n_slices; i++) {
        kw__dnnl_slice *s = &p->slices[i];
        s->n0 = blocks * i / p->n_slices * KW__DNNL_SLICE_COLS;
        s->n = KW__MIN(blocks * (i + 1) / p->n_slices * KW__DNNL_SLICE_COLS, N) - s->n0;
        /* oneDNN's brgemm matmul wants y's rows dense (it took its slower gemm:jit for a slice of them,
         * 1.5x the time at 8 rows); one row has no row stride */
        const size_t bytes = (size_t)(g->M * s->n) * kw_dtype_size(g->xt);
        s->staged = g->M > 1 && s->n != g->out[0].ys && bytes <= KW__DNNL_MAX_STAGING;
        if (s->staged) p->staging = KW__MAX(p->staging, bytes);
    }
    const int icv = omp_get_max_threads();
    omp_set_num_threads(1); /* oneDNN sizes its blocking for the threads it will run on */
    int rc = 0;
    for (int i = 0; i < p->n_slices && !rc; i++) {
        size_t scratch = 0;
        rc = make_slice(p, g, attr, &p->slices[i], &scratch);
        p->scratchpad = KW__MAX(p->scratchpad, (scratch + 63) / 64 * 64);
    }
    omp_set_num_threads(icv);
    dnnl_primitive_attr_destroy(attr);
    return rc;
}

/* Asks for a small one's descriptor: 16 × 64 by 64 rows of 64. */
int kw_dnnl_has_bf16_matmul(void) {
    dnnl_engine_t engine;
    if (dnnl_engine_create(&engine, dnnl_cpu, 0)) return 0;
    kw__dnnl_descs d;
    dnnl_primitive_desc_t pd = NULL;
    const int made = !describe(engine, dnnl_bf16, 16, 64, 64, 64, 1, 64, 64, 0, NULL, &d, &pd);
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
    /* the scalar reference, and no rows (oneDNN 2.6 divides by zero describing them): linear's */
    if (isa == KW_ISA_SCALAR || g->M == 0) return 0;
    if (make_slices(p, g, c->n_threads)) {
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

/* Binds slice sl to this call's pointers and this thread's scratch, and runs it. */
static void run_slice(const kw_call *c, const kw__dnnl *p, const kw__dnnl_slice *sl, void *work) {
    const kw__lin *g = &p->lin;
    const size_t es = kw_dtype_size(g->xt);
    /* column n0 of the weight: row n0 of [N, K] rows, element n0 of a [K, N] matrix's rows */
    const int64_t w_off = p->wk ? sl->n0 : sl->n0 * g->ws;
    dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, sl->src}, {DNNL_ARG_WEIGHTS, sl->wei}, {DNNL_ARG_DST, sl->dst}};
    int nargs = 3;
    dnnl_memory_set_data_handle(sl->src, c->t[1].data);
    dnnl_memory_set_data_handle(sl->wei, (char *)c->t[2].data + w_off * (int64_t)es);
    char *y = (char *)c->t[0].data + sl->n0 * (int64_t)es, *staged = (char *)work + p->scratchpad;
    dnnl_memory_set_data_handle(sl->dst, sl->staged ? staged : y);
    if (p->bias) {
        dnnl_memory_set_data_handle(sl->bias, (char *)c->t[3].data + sl->n0 * (int64_t)es);
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, sl->bias};
    }
    if (sl->scratch) {
        dnnl_memory_set_data_handle(sl->scratch, work);
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, sl->scratch};
    }
    dnnl_primitive_execute(sl->prim, sl->stream, nargs, args);
    dnnl_stream_wait(sl->stream);
    for (int64_t m = 0; sl->staged && m < g->M; m++)
        memcpy(y + m * g->out[0].ys * (int64_t)es, staged + m * sl->n * (int64_t)es, (size_t)sl->n * es);
}

static void matmul_dnnl_kernel(const kw_call *c, int ith, int nth) {
    const kw__dnnl *p = c->prep;
    if (!p->slices) {
        if (p->wk) matmul_dnnl_kn_scalar(c, p, ith, nth);
        else kw__linear_run(c, &p->lin, ith, nth);
        return;
    }
    if (ith >= p->n_slices) return;
    const int icv = omp_get_max_threads();
    if (icv != 1) omp_set_num_threads(1);
    for (int i = ith; i < p->n_slices; i += nth) run_slice(c, p, &p->slices[i], kw__work(c, ith));
    if (icv != 1) omp_set_num_threads(icv);
}

static size_t matmul_dnnl_work(const void *prep) {
    const kw__dnnl *p = prep;
    return p->slices ? p->scratchpad + p->staging : kw__lin_work_size(&p->lin);
}

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
