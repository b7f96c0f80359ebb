/* rotary: y = x * cos + rot(x) * sin over the first R dims of the last dim, the
 * rest copied (partial rotary), as HF writes it:
 *   KW_ROPE_HALF        rot(x) = cat(-x[R/2:R], x[:R/2])      (rotate_half)
 *   KW_ROPE_INTERLEAVED rot(x)[2i] = -x[2i+1], rot(x)[2i+1] = x[2i]
 * Eager bf16 rounds each product and the sum to the result dtype (the promoted
 * dtype of x, cos and sin); so does this kernel. y may be x (in place): each
 * rotated pair is read before it is written. */
#include "rotary.h"

static int bcast_strides(const kw_tensor *t, const int64_t *shape4, int64_t *st) {
    for (int d = 0; d < 3; d++) {
        const int td = d - (4 - t->ndim);
        if (td < 0 || t->shape[td] == 1)
            st[d] = 0;
        else if (t->shape[td] == shape4[d])
            st[d] = t->stride[td];
        else
            return 0;
    }
    return 1;
}

static int rotary_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *x = &c->t[1], *cs = &c->t[2], *sn = &c->t[3];
    kw__rope *p = prep;
    if (!kw__present(x) || !kw__is_float(x->dtype) || x->ndim != 4 || (x->shape[3] > 1 && x->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "rotary: x must be float32 or bfloat16 [B, H, S, D] with contiguous D (got %s)",
                        kw__shape(x).s);
    p->B = x->shape[0], p->H = x->shape[1], p->S = x->shape[2], p->D = x->shape[3];
    p->R = c->ip[1] ? c->ip[1] : p->D;
    if (c->ip[0] != KW_ROPE_HALF && c->ip[0] != KW_ROPE_INTERLEAVED)
        return kw__fail(msg, len, KW_EINVAL, "rotary: ip[0] must be KW_ROPE_HALF or KW_ROPE_INTERLEAVED (got %lld)",
                        (long long)c->ip[0]);
    p->interleaved = c->ip[0] == KW_ROPE_INTERLEAVED;
    if (p->R < 0 || p->R > p->D || p->R % 2)
        return kw__fail(msg, len, KW_EINVAL, "rotary: ip[1] (rotated dims) must be even and <= D = %lld (got %lld)",
                        (long long)p->D, (long long)p->R);
    for (int i = 0; i < 2; i++) {
        const kw_tensor *t = i ? sn : cs;
        int64_t *st = i ? p->ss : p->cs;
        if (!kw__present(t) || !kw__is_float(t->dtype) || t->ndim < 1 || t->ndim > 4 || t->shape[t->ndim - 1] != p->R ||
            (p->R > 1 && t->stride[t->ndim - 1] != 1) || !bcast_strides(t, x->shape, st))
            return kw__fail(msg, len, KW_ESHAPE,
                            "rotary: %s must be float32 or bfloat16 [..., %lld] with contiguous last dim, "
                            "broadcastable to x's [B, H, S] (got %s)",
                            i ? "sin" : "cos", (long long)p->R, kw__shape(t).s);
    }
    const kw_dtype yt = x->dtype == KW_F32 || cs->dtype == KW_F32 || sn->dtype == KW_F32 ? KW_F32 : KW_BF16;
    if (!kw__present(y) || y->dtype != yt || !kw__same_shape(y, x) || (p->D > 1 && y->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "rotary: y must be %s shaped like x %s with contiguous D (got %s)",
                        kw_dtype_name(yt), kw__shape(x).s, kw__shape(y).s);
    p->yt = yt, p->xt = x->dtype, p->ct = cs->dtype, p->st = sn->dtype;
    for (int d = 0; d < 3; d++) p->ys[d] = y->stride[d], p->xs[d] = x->stride[d];
    p->run = KW__PICK(kw__rotary_rows, isa);
    return 0;
}

/* One rotated pair: a at i, its partner b at j; sign_a multiplies b in a's output. */
static void rope_pair(const kw__rope *p, int64_t yo, int64_t xo, int64_t co, int64_t so, int64_t i, int64_t j) {
    const kw_dtype t = p->yt;
    const float a = kw__ldf(p->x, xo + i, p->xt), b = kw__ldf(p->x, xo + j, p->xt);
    const float ya = kw__round_to(a * kw__ldf(p->cos, co + i, p->ct), t) -
                     kw__round_to(b * kw__ldf(p->sin, so + i, p->st), t);
    const float yb = kw__round_to(b * kw__ldf(p->cos, co + j, p->ct), t) +
                     kw__round_to(a * kw__ldf(p->sin, so + j, p->st), t);
    kw__stf(p->y, yo + i, t, ya);
    kw__stf(p->y, yo + j, t, yb);
}

void kw__rotary_rows_scalar(const kw__rope *p, int64_t r0, int64_t r1) {
    const int64_t half = p->R / 2;
    for (int64_t r = r0; r < r1; r++) {
        int64_t yo, xo, co, so;
        kw__rope_row(p, r, &yo, &xo, &co, &so);
        for (int64_t i = 0; i < half; i++) {
            if (p->interleaved)
                rope_pair(p, yo, xo, co, so, 2 * i, 2 * i + 1);
            else
                rope_pair(p, yo, xo, co, so, i, i + half);
        }
        for (int64_t i = p->R; i < p->D; i++) kw__stf(p->y, yo + i, p->yt, kw__ldf(p->x, xo + i, p->xt));
    }
}

static void rotary_kernel(const kw_call *c, int ith, int nth) {
    kw__rope p = *(const kw__rope *)c->prep;
    int64_t r0, r1;
    p.y = c->t[0].data, p.x = c->t[1].data, p.cos = c->t[2].data, p.sin = c->t[3].data;
    kw__split(p.B * p.H * p.S, 1, ith, nth, &r0, &r1);
    if (r0 < r1) p.run(&p, r0, r1);
}

/* Slots y [B, H, S, D], x [B, H, S, D], cos [..., R], sin [..., R] (broadcast to
 * [B, H, S, R]); ip[0] KW_ROPE_HALF or KW_ROPE_INTERLEAVED; ip[1] R (0: R = D). */
const kw_op_info kw_op_info_rotary = {
    .name = "rotary",
    .n_tensors = 4,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}, {"cos", KW_READ, 0}, {"sin", KW_READ, 0}},
    .n_ip = 2,
    .prepare = rotary_prepare,
    .prep_size = sizeof(kw__rope),
    .kernel = rotary_kernel,
};
