/* softmax rows over simd.h, built once per vector ISA (see KW__VARIANTS). */
#include "rowwise.h"
#include "simd.h"

/* Elements [i, i + KW_VW) of a row, lanes past n filled with `fill`. */
static inline kw_v ld_fill(const char *x, kw_dtype dt, int64_t i, int64_t n, float fill) {
    return n - i >= KW_VW ? kw_v_ld(x, i, dt) : kw_v_fill_tail(kw_v_ldn(x, i, n - i, dt), n - i, fill);
}

static float row_max(const char *x, kw_dtype dt, int64_t n) {
    kw_v m = kw_v_set1(-INFINITY);
    for (int64_t i = 0; i < n; i += KW_VW) m = kw_v_max(ld_fill(x, dt, i, n, -INFINITY), m);
    return kw_v_reduce_max(m);
}

void KW__ISA_NAME(kw__softmax_rows)(const kw__rowwise *p, int64_t r0, int64_t r1) {
    const kw_dtype xt = p->x.dt, yt = p->y.dt;
    for (int64_t r = r0; r < r1; r++) {
        const char *x = kw__row(&p->x, r);
        char *y = kw__row(&p->y, r);
        const float mx = row_max(x, xt, p->N);
        if (p->safe && mx == -INFINITY && kw__softmax_zero_row(p, x, y)) continue;
        const kw_v m = kw_v_set1(mx); /* a NaN element makes its exp, so the sum, NaN */
        kw_v s = kw_v_zero();
        for (int64_t i = 0; i < p->N; i += KW_VW) {
            const kw_v e = kw_v_exp(kw_v_sub(ld_fill(x, xt, i, p->N, 0.0f), m));
            s = kw_v_add(s, p->N - i >= KW_VW ? e : kw_v_keepn(e, p->N - i));
        }
        const kw_v inv = kw_v_set1(1.0f / kw_v_reduce_add(s));
        for (int64_t i = 0; i < p->N; i += KW_VW) {
            const kw_v e = kw_v_mul(kw_v_exp(kw_v_sub(ld_fill(x, xt, i, p->N, 0.0f), m)), inv);
            if (p->N - i >= KW_VW)
                kw_v_st(y, i, yt, e);
            else
                kw_v_stn(y, i, p->N - i, yt, e);
        }
    }
}
