/* linear: y = x·Wᵀ (+ bias) for the few rows of decode (GEMV); linear_multi:
 * one pass over x for weights stored back to back (q/k/v, gate/up) with the result
 * split over up to four outputs; grouped_linear: a mixture of experts' projection,
 * each expert's rows of x over its own weight.
 *
 * Weights are PyTorch's [out, in] layout, F32 or BF16. Activations F32: bf16
 * weights are widened exactly and every product is accumulated in f32, so the
 * result is PyTorch's f32 linear over the same (bf16-valued) weights up to
 * summation order. Activations BF16 (weights BF16 too): f32 accumulation, bias
 * added in f32, one rounding to bf16 (what PyTorch's oneDNN path does). Threads split the weight
 * rows (see kw__lin_claim in linear.h), each reading its own contiguous chunks. */
#include "linear.h"

static int lin_check_out(const kw_call *c, const char *op, int j, const kw__lin *g, kw__lin_out *o, char *msg,
                         size_t len) {
    const kw_tensor *y = &c->t[j];
    int64_t rows;
    if (y->dtype != g->xt)
        return kw__fail(msg, len, KW_EDTYPE, "%s: output %d must have x's dtype %s (got %s)", op, j,
                        kw_dtype_name(g->xt), kw__shape(y).s);
    if (!kw__rows_of(y, &rows, &o->ys) || rows != g->M)
        return kw__fail(msg, len, KW_ESHAPE,
                        "%s: output %d must be %lld contiguous rows like x (got %s with strides of last dim %lld)",
                        op, j, (long long)g->M, kw__shape(y).s, (long long)(y->ndim ? y->stride[y->ndim - 1] : 0));
    o->n = kw__last(y);
    return 0;
}

/* The AMX kernel's terms: bf16 weights, enough rows of x, K in pairs, and
 * every output whole groups of 16 weight rows. */
static int amx_fits(const kw__lin *g) {
    int whole_groups = 1;
    for (int j = 0; j < g->n_out; j++) whole_groups &= g->out[j].n % 16 == 0;
    const int64_t min_m = g->xt == KW_BF16 ? KW_AMX_MIN_M_BF16 : KW_AMX_MIN_M_F32;
    return g->wt == KW_BF16 && g->M >= min_m && g->kblk % 2 == 0 && whole_groups;
}

/* x into g (its rows, K, dtype: y's too), and the rule its dtype sets for the
 * weight w: bf16 x only over bf16 weights. The weight's layout is the caller's. */
static int lin_take_x(const kw_tensor *x, const kw_tensor *w, const char *op, kw__lin *g, char *msg, size_t len) {
    if (!kw__present(x) || !kw__is_float(x->dtype) || !kw__rows_of(x, &g->M, &g->xs) || kw__last(x) < 1)
        return kw__fail(msg, len, KW_ESHAPE,
                        "%s: x must be float32 or bfloat16 [..., K] with K >= 1 and rows of contiguous K (got %s)",
                        op, kw__shape(x).s);
    g->xt = g->yt = x->dtype;
    g->K = kw__last(x);
    if (kw__present(w) && g->xt == KW_BF16 && w->dtype != KW_BF16)
        return kw__fail(msg, len, KW_EDTYPE, "%s: weight must be bfloat16 when x is bfloat16 (got %s)", op,
                        kw__shape(w).s);
    return 0;
}

int kw__lin_prepare(const kw_call *c, const char *op, int n_out, kw_isa isa, kw__lin *g, char *msg, size_t len) {
    const kw_tensor *x = &c->t[n_out], *w = &c->t[n_out + 1], *b = &c->t[n_out + 2];
    int err;
    g->slots = n_out;
    if ((err = lin_take_x(x, w, op, g, msg, len))) return err;

    for (int j = 0; j < n_out; j++) {
        if (!kw__present(&c->t[j])) {
            if (j == 0) return kw__fail(msg, len, KW_EINVAL, "%s: output 0 (y) is required", op);
            for (int k = j + 1; k < n_out; k++)
                if (kw__present(&c->t[k]))
                    return kw__fail(msg, len, KW_EINVAL, "%s: output %d given but output %d absent", op, k, j);
            break;
        }
        if ((err = lin_check_out(c, op, j, g, &g->out[j], msg, len))) return err;
        g->n_total += g->out[j].n;
        g->n_out++;
    }

    const int blocked = w->ndim == 3;
    const int64_t kblk = blocked ? w->shape[2] : w->ndim == 2 ? w->shape[1] : 0;
    if (!kw__present(w) || !kw__is_float(w->dtype) || (w->ndim != 2 && !blocked) || kblk < 1 ||
        (blocked ? w->shape[0] * kblk : kblk) != g->K || w->shape[blocked] != g->n_total ||
        (kblk > 1 && w->stride[w->ndim - 1] != 1))
        return kw__fail(msg, len, KW_ESHAPE,
                        "%s: weight must be float32 or bfloat16 [N, K], or K-blocked [K / B, N, B], with "
                        "K == x.shape[-1] == %lld, N == %lld (the outputs' last dims summed) and contiguous rows "
                        "(got %s)",
                        op, (long long)g->K, (long long)g->n_total, kw__shape(w).s);
    g->ws = w->stride[blocked];
    g->wbs = blocked ? w->stride[0] : 0;
    g->kblk = kblk;
    g->wt = w->dtype;
    g->pf = kw_cpu_prefetch(g->M, g->wt);

    if (kw__present(b)) {
        if (!kw__is_float(b->dtype) || b->ndim != 1 || b->shape[0] != g->n_total)
            return kw__fail(msg, len, KW_ESHAPE, "%s: bias must be float32 or bfloat16 [N] with N == %lld (got %s)",
                            op, (long long)g->n_total, kw__shape(b).s);
        g->bs = b->stride[0];
        g->bt = b->dtype;
    }
    g->acts = KW__PICK(kw__linear_acts, isa);
    g->rows = KW__PICK(kw__linear_rows, isa);
    g->panels = kw__lin_takes_panels(isa, g->wt, g->M);
    if (isa >= KW_ISA_AMX && amx_fits(g)) {
        g->amx_parts = g->xt == KW_BF16 ? 1 : 3;
        g->acts = kw__linear_acts_amx, g->rows = kw__linear_rows_amx, g->done = kw__linear_done_amx;
    }
    return 0;
}

void kw__linear_rows_scalar(const kw__lin *g, int64_t n0, int64_t n1, void *work) {
    const size_t xsz = kw_dtype_size(g->xt);
    for (int j = 0; j < g->n_out; j++) {
        int64_t s0, s1;
        char *y;
        if (!kw__lin_segment(g, j, n0, n1, &s0, &s1, &y)) continue;
        for (int64_t m = 0; m < g->M; m++) {
            const char *xr = g->x + (size_t)(m * g->xs) * xsz;
            for (int64_t n = s0; n < s1; n++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < g->K; k++)
                    acc += kw__ldf(xr, k, g->xt) * kw__ldf(kw__lin_wrow(g, k / g->kblk, n), k % g->kblk, g->wt);
                kw__stf(y, m * g->out[j].ys + (n - s0), g->yt, acc + kw__lin_bias(g, n));
            }
        }
    }
}

int64_t kw_linear_block(int64_t K) {
    return K > KW_LINEAR_BLOCK && K % KW_LINEAR_BLOCK == 0 ? KW_LINEAR_BLOCK : 0;
}

void kw__linear_acts_scalar(const kw__lin *g, void *work) { (void)g, (void)work; }

void kw__linear_run(const kw_call *c, const kw__lin *prepared, int ith, int nth) {
    kw__lin g = *prepared;
    g.x = c->t[g.slots].data, g.w = c->t[g.slots + 1].data, g.b = c->t[g.slots + 2].data;
    for (int j = 0; j < g.n_out; j++) g.out[j].y = c->t[j].data;
    void *work = kw__work(c, ith);
    if (kw__lin_amx_by_rows(&g)) {
        kw__linear_by_rows_amx(&g, c->share, ith, nth, work);
        return;
    }
    const int64_t panels = kw__lin_panels(prepared);
    const char *const x = g.x;
    char *y[KW__LIN_MAX_OUT];
    for (int j = 0; j < g.n_out; j++) y[j] = g.out[j].y;
    int any = 0;
    /* Each panel's chunks are claimed through share words of their own, so no
     * thread waits for another between panels; panels past the share's words
     * are split statically. */
    for (int64_t p = 0; p < panels; p++) {
        const int64_t m0 = kw__lin_panel_start(prepared, p);
        g.M = kw__lin_panel_start(prepared, p + 1) - m0;
        g.x = x + (size_t)(m0 * g.xs) * kw_dtype_size(g.xt);
        for (int j = 0; j < g.n_out; j++) g.out[j].y = y[j] + (size_t)(m0 * g.out[j].ys) * kw_dtype_size(g.yt);
        uint64_t *share = c->share && (p + 1) * nth <= KW__LIN_SHARE_MAX ? (uint64_t *)c->share + p * nth : NULL;
        int64_t own = 0, n0, n1;
        int laid_out = 0;
        while (kw__lin_claim(&g, share, &own, ith, nth, &n0, &n1)) {
            if (!laid_out) g.acts(&g, work), laid_out = any = 1;
            g.rows(&g, n0, n1, work);
        }
    }
    if (any && g.done) g.done(&g);
}

static void linear_kernel(const kw_call *c, int ith, int nth) { kw__linear_run(c, c->prep, ith, nth); }

/* ---- linear: slots y [..., N], x [..., K], weight [N, K] or K-blocked [K / B, N, B],
 * bias [N] (optional) ---- */

static int linear_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    return kw__lin_prepare(c, "linear", 1, isa, prep, msg, len);
}

const kw_op_info kw_op_info_linear = {
    .name = "linear",
    .n_tensors = 4,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}, {"weight", KW_READ, 0}, {"bias", KW_READ, 1}},
    .prepare = linear_prepare,
    .prep_size = sizeof(kw__lin),
    .work_size = kw__lin_work,
    .shares_work = 1,
    .kernel = linear_kernel,
};

/* ---- linear_multi: slots y0, y1, y2, y3, x, weight, bias ----
 * Output j takes the next y_j.shape[-1] rows of the weight; absent outputs
 * (only at the end) take none. One output is the concatenated form. */

static int linear_multi_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    return kw__lin_prepare(c, "linear_multi", KW__LIN_MAX_OUT, isa, prep, msg, len);
}

const kw_op_info kw_op_info_linear_multi = {
    .name = "linear_multi",
    .n_tensors = 7,
    .arg = {{"y0", KW_WRITE, 0},
            {"y1", KW_WRITE, 1},
            {"y2", KW_WRITE, 1},
            {"y3", KW_WRITE, 1},
            {"x", KW_READ, 0},
            {"weight", KW_READ, 0},
            {"bias", KW_READ, 1}},
    .prepare = linear_multi_prepare,
    .prep_size = sizeof(kw__lin),
    .work_size = kw__lin_work,
    .shares_work = 1,
    .kernel = linear_kernel,
};

/* ---- grouped_linear: slots y [S, N], x [S, K], weight [E, N, K], offs [E] (int32 or int64) ----
 * transformers' grouped_mm over a mixture of experts' weights: x's rows are
 * sorted by expert, expert e's are [offs[e - 1], offs[e]) (offs[-1] = 0), and
 * y's rows are x's rows times that expert's weight [N, K], transposed; rows past
 * offs[E - 1] are zero, as transformers' fallback writes them. Each expert with
 * rows is one linear call over its own weight; the threads claim chunks of the
 * weight rows of every such expert in turn, the way linear hands out one
 * weight's, so a call reads only the experts it routes to. Offsets that
 * decrease or pass S are reported (the replay fails with KW_EINDEX) and
 * nothing is computed. Never the AMX kernel: an expert's row count changes
 * every call and is one or two in decode, where AVX-512 measured faster. */

#define KW__GROUPED_MAX_EXPERTS 1024

typedef struct kw__grouped {
    kw__lin lin; /* one expert's call: its x, M, weight and y set per expert, M = S here */
    int64_t experts, es; /* the weight's expert count and expert stride (elements) */
} kw__grouped;

static int64_t grouped_offset(const kw_tensor *offs, int64_t e) {
    const int64_t i = e * offs->stride[0];
    return offs->dtype == KW_I64 ? ((const int64_t *)offs->data)[i] : ((const int32_t *)offs->data)[i];
}

static int grouped_linear_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    kw__grouped *p = prep;
    kw__lin *g = &p->lin;
    const kw_tensor *x = &c->t[1], *w = &c->t[2], *offs = &c->t[3];
    int err;
    if ((err = lin_take_x(x, w, "grouped_linear", g, msg, len))) return err;
    if (x->ndim != 2)
        return kw__fail(msg, len, KW_ESHAPE, "grouped_linear: x must be [S, K] (got %s)", kw__shape(x).s);
    if (!kw__present(w) || !kw__is_float(w->dtype) || w->ndim != 3 || w->shape[0] < 1 ||
        w->shape[0] > KW__GROUPED_MAX_EXPERTS || w->shape[2] != g->K || (g->K > 1 && w->stride[2] != 1))
        return kw__fail(msg, len, KW_ESHAPE,
                        "grouped_linear: weight must be float32 or bfloat16 [E, N, K] with 1 <= E <= %d, K == "
                        "x.shape[-1] == %lld and contiguous rows (got %s)",
                        KW__GROUPED_MAX_EXPERTS, (long long)g->K, kw__shape(w).s);
    if (!kw__present(offs) || (offs->dtype != KW_I32 && offs->dtype != KW_I64) || offs->ndim != 1 ||
        offs->shape[0] != w->shape[0])
        return kw__fail(msg, len, KW_ESHAPE, "grouped_linear: offs must be int32 or int64 [E] with E == %lld (got %s)",
                        (long long)w->shape[0], kw__shape(offs).s);
    if ((err = lin_check_out(c, "grouped_linear", 0, g, &g->out[0], msg, len))) return err;
    if (g->out[0].n != w->shape[1] || c->t[0].ndim != 2)
        return kw__fail(msg, len, KW_ESHAPE, "grouped_linear: y must be [S, N] with N == %lld, the weight's rows (got %s)",
                        (long long)w->shape[1], kw__shape(&c->t[0]).s);
    g->slots = g->n_out = 1;
    g->n_total = w->shape[1];
    g->ws = w->stride[1];
    g->kblk = g->K;
    g->wt = w->dtype;
    g->acts = KW__PICK(kw__linear_acts, isa);
    g->rows = KW__PICK(kw__linear_rows, isa);
    g->panels = kw__lin_takes_panels(isa, g->wt, g->M); /* sizes the scratch; each expert's rows decide */
    p->experts = w->shape[0];
    p->es = w->stride[0];
    return 0;
}

static void grouped_linear_kernel(const kw_call *c, int ith, int nth) {
    const kw__grouped *p = c->prep;
    const kw_tensor *offs = &c->t[3];
    const int64_t S = p->lin.M, N = p->lin.n_total;
    /* The experts with rows this call, the a-th's rows [start[a], start[a + 1]):
     * every thread reads the same offsets and makes the same list. */
    int64_t expert[KW__GROUPED_MAX_EXPERTS], start[KW__GROUPED_MAX_EXPERTS + 1], end = 0;
    int64_t active = 0;
    for (int64_t e = 0; e < p->experts; e++) {
        const int64_t next = grouped_offset(offs, e);
        if (next < end || next > S) {
            kw__report_index(c, next, S + 1);
            return;
        }
        if (next > end) expert[active] = e, start[active++] = end;
        end = next;
    }
    start[active] = end;

    kw__lin g = p->lin, all = p->lin;
    const size_t xsz = kw_dtype_size(g.xt), wsz = kw_dtype_size(g.wt);
    char *const x = c->t[1].data, *const w = c->t[2].data, *const y = c->t[0].data;
    int64_t r0, r1;
    kw__split(S - end, 1, ith, nth, &r0, &r1);
    for (int64_t r = end + r0; r < end + r1; r++) memset(y + (size_t)(r * g.out[0].ys) * xsz, 0, (size_t)N * xsz);

    all.n_total = active * N; /* the active experts' weight rows, one after another */
    void *work = kw__work(c, ith);
    int64_t own = 0, v0, v1, laid_out = -1;
    while (kw__lin_claim(&all, c->share, &own, ith, nth, &v0, &v1)) {
        while (v0 < v1) {
            const int64_t a = v0 / N, n1 = KW__MIN(v1 - a * N, N);
            if (a != laid_out) {
                g.x = x + (size_t)(start[a] * g.xs) * xsz;
                g.M = start[a + 1] - start[a];
                g.w = w + (size_t)(expert[a] * p->es) * wsz;
                g.out[0].y = y + (size_t)(start[a] * g.out[0].ys) * xsz;
                g.pf = kw_cpu_prefetch(g.M, g.wt);
                g.panels = p->lin.panels && g.M >= KW__PANELS_MIN_M;
                g.acts(&g, work);
                laid_out = a;
            }
            g.rows(&g, v0 - a * N, n1, work);
            v0 = a * N + n1;
        }
    }
}

static size_t grouped_linear_work(const void *prep) { return kw__lin_work_size(&((const kw__grouped *)prep)->lin); }

const kw_op_info kw_op_info_grouped_linear = {
    .name = "grouped_linear",
    .n_tensors = 4,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}, {"weight", KW_READ, 0}, {"offs", KW_READ, 0}},
    .prepare = grouped_linear_prepare,
    .prep_size = sizeof(kw__grouped),
    .work_size = grouped_linear_work,
    .shares_work = 1,
    .kernel = grouped_linear_kernel,
};
