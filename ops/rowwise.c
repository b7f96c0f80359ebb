/* softmax over the last dim: y = exp(x - max) * (1 / Σ exp(x - max)) in f32,
 * one rounding to y's dtype (ATen's _vec_softmax_lastdim); y's dtype may differ
 * from x's (softmax(x, dtype=...)). ip[0] KW_SOFTMAX_SAFE: a row of -inf alone
 * gives zeros (aten._safe_softmax, SDPA's math path), where softmax gives NaN.
 * Threads split the rows. */
#include "rowwise.h"

static int softmax_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *x = &c->t[1];
    kw__rowwise *p = prep;
    int64_t rows;
    if (!kw__present(x) || !kw__is_float(x->dtype) || !kw__rows_of(x, &p->rows, &p->x.rs) || kw__last(x) < 1)
        return kw__fail(msg, len, KW_ESHAPE, "softmax: x must be float32 or bfloat16 [..., N], N >= 1, rows of contiguous N (got %s)",
                        kw__shape(x).s);
    p->x.dt = x->dtype, p->N = kw__last(x);
    if (!kw__present(y) || !kw__is_float(y->dtype) || !kw__same_shape(y, x) || !kw__rows_of(y, &rows, &p->y.rs))
        return kw__fail(msg, len, KW_ESHAPE, "softmax: y must be float32 or bfloat16 shaped like x %s with contiguous rows (got %s)",
                        kw__shape(x).s, kw__shape(y).s);
    p->y.dt = y->dtype;
    if (c->ip[0] != 0 && c->ip[0] != KW_SOFTMAX_SAFE)
        return kw__fail(msg, len, KW_EINVAL, "softmax: ip[0] must be 0 or KW_SOFTMAX_SAFE (got %lld)", (long long)c->ip[0]);
    p->safe = c->ip[0] == KW_SOFTMAX_SAFE;
    p->run = KW__PICK(kw__softmax_rows, isa);
    return 0;
}

int kw__softmax_zero_row(const kw__rowwise *p, const char *x, char *y) {
    for (int64_t i = 0; i < p->N; i++)
        if (kw__ldf(x, i, p->x.dt) != -INFINITY) return 0; /* a NaN: softmax's NaN row */
    for (int64_t i = 0; i < p->N; i++) kw__stf(y, i, p->y.dt, 0.0f);
    return 1;
}

void kw__softmax_rows_scalar(const kw__rowwise *p, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const char *x = kw__row(&p->x, r);
        char *y = kw__row(&p->y, r);
        float m = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < p->N; i++) m = fmaxf(m, kw__ldf(x, i, p->x.dt));
        if (p->safe && m == -INFINITY && kw__softmax_zero_row(p, x, y)) continue;
        for (int64_t i = 0; i < p->N; i++) sum += expf(kw__ldf(x, i, p->x.dt) - m);
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < p->N; i++) kw__stf(y, i, p->y.dt, expf(kw__ldf(x, i, p->x.dt) - m) * inv);
    }
}

static void softmax_kernel(const kw_call *c, int ith, int nth) {
    kw__rowwise p = *(const kw__rowwise *)c->prep;
    int64_t r0, r1;
    p.y.p = c->t[0].data, p.x.p = c->t[1].data;
    kw__split(p.rows, 1, ith, nth, &r0, &r1);
    if (r0 < r1) p.run(&p, r0, r1);
}

/* Slots y, x; ip[0] 0 or KW_SOFTMAX_SAFE. */
const kw_op_info kw_op_info_softmax = {
    .name = "softmax",
    .n_tensors = 2,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .n_ip = 1,
    .prepare = softmax_prepare,
    .prep_size = sizeof(kw__rowwise),
    .kernel = softmax_kernel,
};
