/* rms_norm / add_rms_norm / layer_norm rows over simd.h, built once per vector
 * ISA (see KW__VARIANTS). Same casts as the scalar references in norm.c; only
 * the order of the f32 sums differs. */
#include "norm.h"
#include "simd.h"

/* Σ (x - shift)^p over a row for p = 1 or 2, two accumulators deep. */
static float row_sum(const char *x, kw_dtype xt, int64_t K, float shift, int square) {
    const kw_v c = kw_v_set1(shift);
    kw_v a0 = kw_v_zero(), a1 = kw_v_zero();
    int64_t k = 0;
    for (; k + 2 * KW_VW <= K; k += 2 * KW_VW) {
        const kw_v v0 = kw_v_sub(kw_v_ld(x, k, xt), c), v1 = kw_v_sub(kw_v_ld(x, k + KW_VW, xt), c);
        a0 = square ? kw_v_fmadd(v0, v0, a0) : kw_v_add(a0, v0);
        a1 = square ? kw_v_fmadd(v1, v1, a1) : kw_v_add(a1, v1);
    }
    for (; k < K; k += KW_VW) {
        const int64_t n = KW__MIN(KW_VW, K - k);
        const kw_v v = n == KW_VW ? kw_v_sub(kw_v_ld(x, k, xt), c) : kw_v_keepn(kw_v_sub(kw_v_ldn(x, k, n, xt), c), n);
        a0 = square ? kw_v_fmadd(v, v, a0) : kw_v_add(a0, v);
    }
    return kw_v_reduce_add(kw_v_add(a0, a1));
}

static void add_rows(const kw__norm *p, int64_t r, char *sum) {
    const char *x = kw__row(&p->x, r), *res = kw__row(&p->res, r);
    const kw_dtype dt = p->x.dt;
    int64_t k = 0;
    for (; k + KW_VW <= p->K; k += KW_VW) kw_v_st(sum, k, dt, kw_v_add(kw_v_ld(x, k, dt), kw_v_ld(res, k, dt)));
    if (k < p->K) {
        const int64_t n = p->K - k;
        kw_v_stn(sum, k, n, dt, kw_v_add(kw_v_ldn(x, k, n, dt), kw_v_ldn(res, k, n, dt)));
    }
}

/* y for n (<= KW_VW) elements from k: Llama's, Gemma's, OLMo's or no weight. */
static inline kw_v rms_scale(const kw__norm *p, kw_v h, int64_t k, int64_t n) {
    if (!p->w.p) return h;
    const kw_v w = n == KW_VW ? kw_v_ld(p->w.p, k, p->w.dt) : kw_v_ldn(p->w.p, k, n, p->w.dt);
    if (p->form == KW_NORM_GEMMA) return kw_v_mul(h, kw_v_add(kw_v_set1(1.0f), w));
    if (p->form == KW_NORM_OLMO) return kw_v_mul(w, h);
    return kw_v_mul(w, kw_v_round_to(h, p->x.dt));
}

void KW__ISA_NAME(kw__rms_norm_rows)(const kw__norm *p, int64_t r0, int64_t r1) {
    const kw_dtype xt = p->x.dt, yt = p->y.dt;
    for (int64_t r = r0; r < r1; r++) {
        const char *x = kw__row(&p->x, r);
        if (p->res.p) {
            char *sum = kw__row(&p->sum, r);
            add_rows(p, r, sum);
            x = sum;
        }
        const float rstd = 1.0f / sqrtf(row_sum(x, xt, p->K, 0.0f, 1) / (float)p->K + p->eps);
        const kw_v rv = kw_v_set1(rstd);
        char *y = kw__row(&p->y, r);
        int64_t k = 0;
        for (; k + KW_VW <= p->K; k += KW_VW) kw_v_st(y, k, yt, rms_scale(p, kw_v_mul(kw_v_ld(x, k, xt), rv), k, KW_VW));
        if (k < p->K) {
            const int64_t n = p->K - k;
            kw_v_stn(y, k, n, yt, rms_scale(p, kw_v_mul(kw_v_ldn(x, k, n, xt), rv), k, n));
        }
    }
}

static inline kw_v ln_affine(const kw__norm *p, kw_v v, int64_t k, int64_t n) {
    if (p->w.p) v = kw_v_mul(v, n == KW_VW ? kw_v_ld(p->w.p, k, p->w.dt) : kw_v_ldn(p->w.p, k, n, p->w.dt));
    if (p->b.p) v = kw_v_add(v, n == KW_VW ? kw_v_ld(p->b.p, k, p->b.dt) : kw_v_ldn(p->b.p, k, n, p->b.dt));
    return v;
}

void KW__ISA_NAME(kw__layer_norm_rows)(const kw__norm *p, int64_t r0, int64_t r1) {
    const kw_dtype xt = p->x.dt;
    for (int64_t r = r0; r < r1; r++) {
        const char *x = kw__row(&p->x, r);
        const float mean = row_sum(x, xt, p->K, 0.0f, 0) / (float)p->K;
        const float rstd = 1.0f / sqrtf(row_sum(x, xt, p->K, mean, 1) / (float)p->K + p->eps);
        const kw_v rv = kw_v_set1(rstd), sv = kw_v_set1(-rstd * mean);
        char *y = kw__row(&p->y, r);
        int64_t k = 0;
        for (; k + KW_VW <= p->K; k += KW_VW)
            kw_v_st(y, k, xt, ln_affine(p, kw_v_add(kw_v_mul(kw_v_ld(x, k, xt), rv), sv), k, KW_VW));
        if (k < p->K) {
            const int64_t n = p->K - k;
            kw_v_stn(y, k, n, xt, ln_affine(p, kw_v_add(kw_v_mul(kw_v_ldn(x, k, n, xt), rv), sv), k, n));
        }
    }
}
