/* Row normalisations over the last dim, computed in f32 with the casts where
 * PyTorch eager (HF's modules) puts them.
 *
 * rms_norm, Llama (LlamaRMSNorm.forward):
 *     h = x.float(); h = h * rsqrt(mean(h²) + eps); y = weight * h.to(x.dtype)
 *   so x̂ is rounded to x's dtype before the weight multiply, and y has the
 *   promoted dtype of weight and x.
 * rms_norm, Gemma (ip[0] KW_NORM_GEMMA, GemmaRMSNorm.forward):
 *     y = (h * rsqrt(mean(h²) + eps) * (1 + weight.float())).to(x.dtype)
 * rms_norm, OLMo 2 (ip[0] KW_NORM_OLMO, Olmo2RMSNorm.forward, HeliumRMSNorm's):
 *     y = (weight.float() * (h * rsqrt(mean(h²) + eps))).to(x.dtype)
 *   one rounding, after the weight multiply.
 * add_rms_norm: sum = x + residual (rounded to their dtype, as the eager add
 *   does), then rms_norm(sum); both are written.
 * layer_norm: torch.layer_norm: mean and biased variance in f32, then
 *   y = (x * rstd + (-rstd * mean)) * weight + bias, one rounding to x's dtype.
 *
 * rsqrt is 1 / sqrt, both correctly rounded, as ATen's vectorised rsqrt. Threads
 * split the rows. */
#include "norm.h"

enum norm_kind { NORM_RMS, NORM_ADD_RMS, NORM_LAYER };

static const char *const norm_name[] = {"rms_norm", "add_rms_norm", "layer_norm"};

static int row_ref(const kw_tensor *t, int64_t rows, kw__row_ref *r) {
    int64_t n;
    r->p = t->data;
    r->dt = t->dtype;
    return kw__rows_of(t, &n, &r->rs) && n == rows;
}

static int vec_ref(const kw_tensor *t, int64_t K, kw__row_ref *r) {
    r->p = t->data;
    r->dt = t->dtype;
    return !t->data || (kw__is_float(t->dtype) && t->ndim == 1 && t->shape[0] == K && (K == 1 || t->stride[0] == 1));
}

/* The data pointers of this replay's call. */
static void norm_bind(kw__norm *p, const kw_call *c) {
    const int add = p->kind == NORM_ADD_RMS;
    p->y.p = c->t[0].data;
    p->x.p = c->t[add ? 2 : 1].data;
    p->w.p = c->t[add ? 4 : 2].data;
    if (add) p->sum.p = c->t[1].data, p->res.p = c->t[3].data;
    if (p->kind == NORM_LAYER) p->b.p = c->t[3].data;
}

static int norm_prepare(const kw_call *c, enum norm_kind kind, kw_isa isa, kw__norm *p, char *msg, size_t len) {
    const char *op = norm_name[kind];
    const int xi = kind == NORM_ADD_RMS ? 2 : 1, wi = kind == NORM_ADD_RMS ? 4 : 2;
    const kw_tensor *y = &c->t[0], *x = &c->t[xi];
    p->kind = kind;
    if (!kw__present(x) || !kw__is_float(x->dtype) || !kw__rows_of(x, &p->rows, &p->x.rs) || kw__last(x) < 1)
        return kw__fail(msg, len, KW_ESHAPE,
                        "%s: x must be float32 or bfloat16 [..., K], K >= 1, rows of contiguous K (got %s)", op,
                        kw__shape(x).s);
    p->x.dt = x->dtype;
    p->K = kw__last(x);
    if (!vec_ref(&c->t[wi], p->K, &p->w))
        return kw__fail(msg, len, KW_ESHAPE, "%s: weight must be contiguous float32 or bfloat16 [%lld] (got %s)", op,
                        (long long)p->K, kw__shape(&c->t[wi]).s);

    if (kind == NORM_LAYER) {
        if (!vec_ref(&c->t[3], p->K, &p->b))
            return kw__fail(msg, len, KW_ESHAPE, "layer_norm: bias must be contiguous float32 or bfloat16 [%lld] (got %s)",
                            (long long)p->K, kw__shape(&c->t[3]).s);
    } else {
        if (c->ip[0] < 0 || c->ip[0] >= KW_NORM_FORMS)
            return kw__fail(msg, len, KW_EINVAL, "%s: ip[0] must be a KW_NORM_ form, 0 to %d (got %lld)", op,
                            KW_NORM_FORMS - 1, (long long)c->ip[0]);
        p->form = (int)c->ip[0];
    }
    if (kind == NORM_ADD_RMS) {
        const kw_tensor *res = &c->t[3], *sum = &c->t[1];
        if (!kw__present(res) || res->dtype != x->dtype || !kw__same_shape(res, x) || !row_ref(res, p->rows, &p->res))
            return kw__fail(msg, len, KW_ESHAPE, "add_rms_norm: residual must be like x %s (got %s)", kw__shape(x).s,
                            kw__shape(res).s);
        if (!kw__present(sum) || sum->dtype != x->dtype || !kw__same_shape(sum, x) || !row_ref(sum, p->rows, &p->sum))
            return kw__fail(msg, len, KW_ESHAPE, "add_rms_norm: sum must be like x %s (got %s)", kw__shape(x).s,
                            kw__shape(sum).s);
    }

    const kw_dtype yt = kind == NORM_LAYER ? x->dtype : kw__rms_out_dtype(p);
    if (!kw__present(y) || y->dtype != yt || !kw__same_shape(y, x) || !row_ref(y, p->rows, &p->y))
        return kw__fail(msg, len, KW_ESHAPE, "%s: y must have x's shape, dtype %s and rows of contiguous K (got %s)", op,
                        kw_dtype_name(yt), kw__shape(y).s);
    if (!(c->fp[0] >= 0.0))
        return kw__fail(msg, len, KW_EINVAL, "%s: fp[0] (eps) must be >= 0 (got %g)", op, c->fp[0]);
    p->eps = (float)c->fp[0];
    p->run = kind == NORM_LAYER ? KW__PICK(kw__layer_norm_rows, isa) : KW__PICK(kw__rms_norm_rows, isa);
    return 0;
}

/* ---- scalar references ---- */

void kw__rms_norm_rows_scalar(const kw__norm *p, int64_t r0, int64_t r1) {
    const kw_dtype yt = p->y.dt;
    for (int64_t r = r0; r < r1; r++) {
        const char *x = kw__row(&p->x, r);
        if (p->res.p) { /* the eager residual add, rounded to the dtype, then normalised */
            char *sum = kw__row(&p->sum, r);
            const char *res = kw__row(&p->res, r);
            for (int64_t k = 0; k < p->K; k++)
                kw__stf(sum, k, p->x.dt, kw__ldf(x, k, p->x.dt) + kw__ldf(res, k, p->x.dt));
            x = sum;
        }
        float ss = 0.0f;
        for (int64_t k = 0; k < p->K; k++) {
            const float v = kw__ldf(x, k, p->x.dt);
            ss += v * v;
        }
        const float rstd = 1.0f / sqrtf(ss / (float)p->K + p->eps);
        char *y = kw__row(&p->y, r);
        for (int64_t k = 0; k < p->K; k++) {
            const float h = kw__ldf(x, k, p->x.dt) * rstd;
            float v;
            if (!p->w.p)
                v = h;
            else if (p->form == KW_NORM_GEMMA)
                v = h * (1.0f + kw__ldf(p->w.p, k, p->w.dt));
            else if (p->form == KW_NORM_OLMO)
                v = kw__ldf(p->w.p, k, p->w.dt) * h;
            else
                v = kw__ldf(p->w.p, k, p->w.dt) * kw__round_to(h, p->x.dt);
            kw__stf(y, k, yt, v);
        }
    }
}

void kw__layer_norm_rows_scalar(const kw__norm *p, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const char *x = kw__row(&p->x, r);
        float s = 0.0f, ss = 0.0f;
        for (int64_t k = 0; k < p->K; k++) s += kw__ldf(x, k, p->x.dt);
        const float mean = s / (float)p->K;
        for (int64_t k = 0; k < p->K; k++) {
            const float d = kw__ldf(x, k, p->x.dt) - mean;
            ss += d * d;
        }
        const float rstd = 1.0f / sqrtf(ss / (float)p->K + p->eps), shift = -rstd * mean;
        char *y = kw__row(&p->y, r);
        for (int64_t k = 0; k < p->K; k++) {
            float v = kw__ldf(x, k, p->x.dt) * rstd + shift;
            if (p->w.p) v *= kw__ldf(p->w.p, k, p->w.dt);
            if (p->b.p) v += kw__ldf(p->b.p, k, p->b.dt);
            kw__stf(y, k, p->x.dt, v);
        }
    }
}

/* ---- ops ---- */

static void norm_kernel(const kw_call *c, int ith, int nth) {
    kw__norm p = *(const kw__norm *)c->prep;
    int64_t r0, r1;
    norm_bind(&p, c);
    kw__split(p.rows, 1, ith, nth, &r0, &r1);
    if (r0 < r1) p.run(&p, r0, r1);
}

#define KW__NORM_PREPARE(op, kind)                                                                  \
    static int op##_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {      \
        return norm_prepare(c, kind, isa, prep, msg, len);                                          \
    }
KW__NORM_PREPARE(rms_norm, NORM_RMS)
KW__NORM_PREPARE(add_rms_norm, NORM_ADD_RMS)
KW__NORM_PREPARE(layer_norm, NORM_LAYER)

/* Slots y, x, weight (optional); fp[0] eps; ip[0] the form (KW_NORM_LLAMA, _GEMMA, _OLMO). */
const kw_op_info kw_op_info_rms_norm = {
    .name = "rms_norm",
    .n_tensors = 3,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}, {"weight", KW_READ, 1}},
    .n_ip = 1,
    .n_fp = 1,
    .prepare = rms_norm_prepare,
    .prep_size = sizeof(kw__norm),
    .kernel = norm_kernel,
};

/* Slots y, sum, x, residual, weight (optional); fp[0] eps; ip[0] flags.
 * sum may be the same memory as x or residual (each row is read before written). */
const kw_op_info kw_op_info_add_rms_norm = {
    .name = "add_rms_norm",
    .n_tensors = 5,
    .arg = {{"y", KW_WRITE, 0}, {"sum", KW_WRITE, 0}, {"x", KW_READ, 0}, {"residual", KW_READ, 0}, {"weight", KW_READ, 1}},
    .n_ip = 1,
    .n_fp = 1,
    .prepare = add_rms_norm_prepare,
    .prep_size = sizeof(kw__norm),
    .kernel = norm_kernel,
};

/* Slots y, x, weight (optional), bias (optional); fp[0] eps. */
const kw_op_info kw_op_info_layer_norm = {
    .name = "layer_norm",
    .n_tensors = 4,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}, {"weight", KW_READ, 1}, {"bias", KW_READ, 1}},
    .n_fp = 1,
    .prepare = layer_norm_prepare,
    .prep_size = sizeof(kw__norm),
    .kernel = norm_kernel,
};
