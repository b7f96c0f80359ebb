/* Reductions over the last dim; threads split the rows.
 *
 * softmax: y = exp(x - max) * (1 / Σ exp(x - max)) in f32, one rounding to y's
 *   dtype (ATen's _vec_softmax_lastdim); y's dtype may differ from x's
 *   (softmax(x, dtype=...)).
 * argmax: int64 index of the first maximum per row; a NaN counts as the maximum
 *   (torch.argmax). */
#include "rowwise.h"

static int rowwise_from_call(const kw_call *c, int argmax, kw__rowwise *p, char *msg, size_t len) {
    const char *op = argmax ? "argmax" : "softmax";
    const kw_tensor *y = &c->t[0], *x = &c->t[1];
    memset(p, 0, sizeof *p);
    if (!kw__present(x) || !kw__is_float(x->dtype) || !kw__rows_of(x, &p->rows, &p->x.rs) || kw__last(x) < 1)
        return kw__fail(msg, len, KW_ESHAPE, "%s: x must be float32 or bfloat16 [..., N], N >= 1, rows of contiguous N (got %s)",
                        op, kw__shape(x).s);
    p->x.p = x->data, p->x.dt = x->dtype, p->N = kw__last(x);
    if (argmax) {
        if (!kw__present(y) || y->dtype != KW_I64 || kw__numel(y) != p->rows || !kw__is_contiguous(y))
            return kw__fail(msg, len, KW_ESHAPE, "argmax: y must be contiguous int64 with one element per row of x, %lld (got %s)",
                            (long long)p->rows, kw__shape(y).s);
        p->y.p = y->data, p->y.dt = KW_I64, p->y.rs = 1;
        return 0;
    }
    int64_t rows;
    if (!kw__present(y) || !kw__is_float(y->dtype) || !kw__same_shape(y, x) || !kw__rows_of(y, &rows, &p->y.rs))
        return kw__fail(msg, len, KW_ESHAPE, "softmax: y must be float32 or bfloat16 shaped like x %s with contiguous rows (got %s)",
                        kw__shape(x).s, kw__shape(y).s);
    p->y.p = y->data, p->y.dt = y->dtype;
    return 0;
}

void kw__softmax_rows_scalar(const kw__rowwise *p, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const char *x = kw__row(&p->x, r);
        char *y = kw__row(&p->y, r);
        float m = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < p->N; i++) m = fmaxf(m, kw__ldf(x, i, p->x.dt));
        for (int64_t i = 0; i < p->N; i++) sum += expf(kw__ldf(x, i, p->x.dt) - m);
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < p->N; i++) kw__stf(y, i, p->y.dt, expf(kw__ldf(x, i, p->x.dt) - m) * inv);
    }
}

void kw__argmax_rows_scalar(const kw__rowwise *p, int64_t r0, int64_t r1) {
    float best;
    for (int64_t r = r0; r < r1; r++)
        ((int64_t *)p->y.p)[r] = kw__argmax_scalar(kw__row(&p->x, r), p->x.dt, 0, p->N, &best);
}

#define KW__ROWWISE_OP(name, is_argmax)                                                                 \
    static int name##_check(const kw_call *c, char *msg, size_t len) {                                 \
        kw__rowwise p;                                                                                 \
        return rowwise_from_call(c, is_argmax, &p, msg, len);                                          \
    }                                                                                                  \
    static void name##_run(const kw_call *c, int ith, int nth, kw__rowwise_fn rows) {                 \
        kw__rowwise p;                                                                                 \
        int64_t r0, r1;                                                                                \
        if (rowwise_from_call(c, is_argmax, &p, NULL, 0)) return; /* capture checked it */           \
        kw__split(p.rows, 1, ith, nth, &r0, &r1);                                                      \
        if (r0 < r1) rows(&p, r0, r1);                                                                 \
    }                                                                                                  \
    static void name##_scalar(const kw_call *c, int ith, int nth) { name##_run(c, ith, nth, kw__##name##_rows_scalar); } \
    static void name##_avx2(const kw_call *c, int ith, int nth) { name##_run(c, ith, nth, kw__##name##_rows_avx2); }     \
    static void name##_avx512(const kw_call *c, int ith, int nth) { name##_run(c, ith, nth, kw__##name##_rows_avx512); }
KW__ROWWISE_OP(softmax, 0)
KW__ROWWISE_OP(argmax, 1)

/* Slots y, x. */
const kw_op_info kw_op_info_softmax = {
    .name = "softmax",
    .n_tensors = 2,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .check = softmax_check,
    .kernel = {[KW_ISA_SCALAR] = softmax_scalar, [KW_ISA_AVX2] = softmax_avx2, [KW_ISA_AVX512] = softmax_avx512},
};

/* Slots y (int64, one per row), x. */
const kw_op_info kw_op_info_argmax = {
    .name = "argmax",
    .n_tensors = 2,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .check = argmax_check,
    .kernel = {[KW_ISA_SCALAR] = argmax_scalar, [KW_ISA_AVX2] = argmax_avx2, [KW_ISA_AVX512] = argmax_avx512},
};
