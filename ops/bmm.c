/* bmm: y[b] = alpha · (a[b] @ m[b]) + beta · c[b] for each batch b — aten.bmm
 * (alpha 1, no c) and aten.baddbmm (BLOOM's attention scores: its ALiBi bias
 * plus the scaled q·kᵀ, then probabilities times V). All operands of one dtype,
 * float32 or bfloat16; products summed in f32 (a bf16 product is exact there),
 * the result rounded once, as ATen's bf16 matmuls do. beta 0 reads no c, as
 * ATen ignores its NaNs then.
 *
 * Layouts, what decode attention reads in place: y's and a's rows contiguous,
 * and m either column-contiguous (kᵀ, a transposed view of the cache's rows: each
 * output is a dot product of two contiguous vectors) or row-contiguous (V: rows
 * of m scaled by a's elements and summed). Threads split rows and chunks of
 * KW__BMM_COLS columns. */
#include "bmm.h"

static int matrix3(const kw_tensor *t, int64_t B, int64_t R, int64_t C) {
    return t->ndim == 3 && t->shape[0] == B && t->shape[1] == R && t->shape[2] == C;
}

static int bmm_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *a = &c->t[1], *m = &c->t[2], *add = &c->t[3];
    kw__bmm *p = prep;
    if (!kw__present(a) || !kw__is_float(a->dtype) || a->ndim != 3)
        return kw__fail(msg, len, KW_ESHAPE, "bmm: a must be float32 or bfloat16 [B, M, K] (got %s)", kw__shape(a).s);
    p->B = a->shape[0], p->M = a->shape[1], p->K = a->shape[2], p->dt = a->dtype;
    if (!kw__present(m) || m->dtype != p->dt || m->ndim != 3 || m->shape[0] != p->B || m->shape[1] != p->K)
        return kw__fail(msg, len, KW_ESHAPE, "bmm: b must be [%lld, %lld, N] of a's dtype %s (got %s)",
                        (long long)p->B, (long long)p->K, kw_dtype_name(p->dt), kw__shape(m).s);
    p->N = m->shape[2];
    if (!kw__present(y) || y->dtype != p->dt || !matrix3(y, p->B, p->M, p->N))
        return kw__fail(msg, len, KW_ESHAPE, "bmm: y must be [%lld, %lld, %lld] of a's dtype %s (got %s)",
                        (long long)p->B, (long long)p->M, (long long)p->N, kw_dtype_name(p->dt), kw__shape(y).s);
    if (kw__present(add) && (add->dtype != p->dt || !matrix3(add, p->B, p->M, p->N)))
        return kw__fail(msg, len, KW_ESHAPE, "bmm: c must be y's shape and dtype %s (broadcast dims as stride 0; got %s)",
                        kw__shape(y).s, kw__shape(add).s);
    for (int d = 0; d < 3; d++) {
        p->ys[d] = y->stride[d], p->as[d] = a->stride[d], p->bs[d] = m->stride[d];
        p->cs[d] = kw__present(add) ? add->stride[d] : 0;
    }
    /* A dim of size 1 is contiguous whatever its stride. */
    if (p->K <= 1) p->as[2] = p->bs[1] = 1;
    if (p->N <= 1) p->ys[2] = p->bs[2] = 1;
    const int m_cols = p->bs[1] == 1 && p->as[2] == 1, m_rows = p->bs[2] == 1;
    if (p->ys[2] != 1 || !(m_rows || m_cols))
        return kw__fail(msg, len, KW_ESHAPE,
                        "bmm: y's rows must be contiguous, and b's rows, or b's columns and a's rows (strides y "
                        "[%lld, %lld, %lld], a [%lld, %lld, %lld], b [%lld, %lld, %lld])",
                        (long long)p->ys[0], (long long)p->ys[1], (long long)p->ys[2], (long long)p->as[0],
                        (long long)p->as[1], (long long)p->as[2], (long long)p->bs[0], (long long)p->bs[1],
                        (long long)p->bs[2]);
    p->dot = m_cols && (!m_rows || p->N < 16); /* a column of one: one dot product, not K scaled rows of one */
    p->alpha = (float)c->fp[0], p->beta = (float)c->fp[1];
    p->chunks = (p->N + KW__BMM_COLS - 1) / KW__BMM_COLS;
    p->units = p->B * p->M * p->chunks;
    p->run = KW__PICK(kw__bmm_units, isa);
    return 0;
}

void kw__bmm_store(const kw__bmm *p, int64_t b, int64_t i, int64_t j0, int64_t n, const float *acc) {
    char *y = p->y + (size_t)(b * p->ys[0] + i * p->ys[1] + j0) * kw_dtype_size(p->dt);
    for (int64_t j = 0; j < n; j++) {
        float v = p->alpha * acc[j];
        if (p->c) v += p->beta * kw__ldf(p->c, b * p->cs[0] + i * p->cs[1] + (j0 + j) * p->cs[2], p->dt);
        kw__stf(y, j, p->dt, v);
    }
}

void kw__bmm_units_scalar(const kw__bmm *p, int64_t u0, int64_t u1) {
    float acc[KW__BMM_COLS];
    for (int64_t u = u0; u < u1; u++) {
        const int64_t row = u / p->chunks, j0 = u % p->chunks * KW__BMM_COLS, b = row / p->M, i = row % p->M;
        const int64_t n = KW__MIN(KW__BMM_COLS, p->N - j0);
        const int64_t a0 = b * p->as[0] + i * p->as[1];
        for (int64_t j = 0; j < n; j++) {
            const int64_t m0 = b * p->bs[0] + (j0 + j) * p->bs[2];
            float s = 0.0f;
            for (int64_t k = 0; k < p->K; k++)
                s += kw__ldf(p->a, a0 + k * p->as[2], p->dt) * kw__ldf(p->b, m0 + k * p->bs[1], p->dt);
            acc[j] = s;
        }
        kw__bmm_store(p, b, i, j0, n, acc);
    }
}

static void bmm_kernel(const kw_call *c, int ith, int nth) {
    kw__bmm p = *(const kw__bmm *)c->prep;
    int64_t u0, u1;
    p.y = c->t[0].data, p.a = c->t[1].data, p.b = c->t[2].data, p.c = p.beta != 0.0f ? c->t[3].data : NULL;
    kw__split(p.units, 1, ith, nth, &u0, &u1);
    if (u0 < u1) p.run(&p, u0, u1);
}

/* Slots y [B, M, N], a [B, M, K], b [B, K, N], c [B, M, N] (optional; broadcast
 * dims with stride 0); fp[0] alpha, fp[1] beta. */
const kw_op_info kw_op_info_bmm = {
    .name = "bmm",
    .n_tensors = 4,
    .arg = {{"y", KW_WRITE, 0}, {"a", KW_READ, 0}, {"b", KW_READ, 0}, {"c", KW_READ, 1}},
    .n_fp = 2,
    .prepare = bmm_prepare,
    .prep_size = sizeof(kw__bmm),
    .kernel = bmm_kernel,
};
