/* rotary rows over simd.h, built once per vector ISA (see KW__VARIANTS). Same
 * roundings as the scalar reference in rotary.c. */
#include "rotary.h"
#include "simd.h"

static inline kw_v ld(const void *p, int64_t i, int64_t n, kw_dtype dt) {
    return n == KW_VW ? kw_v_ld(p, i, dt) : kw_v_ldn(p, i, n, dt);
}

static inline void st(void *p, int64_t i, int64_t n, kw_dtype dt, kw_v v) {
    if (n == KW_VW)
        kw_v_st(p, i, dt, v);
    else
        kw_v_stn(p, i, n, dt, v);
}

/* rotate_half: lanes i of both halves at once, so the update can be in place.
 * The dtypes are constants where all four are one (rows_half), so that the
 * loads and stores do not branch on them. */
static inline __attribute__((always_inline)) void rows_half_as(const kw__rope *p, int64_t yo, int64_t xo, int64_t co,
                                                               int64_t so, const kw_dtype xt, const kw_dtype ct,
                                                               const kw_dtype st_, const kw_dtype t) {
    const int64_t h = p->R / 2;
    for (int64_t i = 0; i < h; i += KW_VW) {
        const int64_t n = KW__MIN(KW_VW, h - i);
        const kw_v a = ld(p->x, xo + i, n, xt), b = ld(p->x, xo + i + h, n, xt);
        const kw_v ya = kw_v_sub(kw_v_round_to(kw_v_mul(a, ld(p->cos, co + i, n, ct)), t),
                                 kw_v_round_to(kw_v_mul(b, ld(p->sin, so + i, n, st_)), t));
        const kw_v yb = kw_v_add(kw_v_round_to(kw_v_mul(b, ld(p->cos, co + i + h, n, ct)), t),
                                 kw_v_round_to(kw_v_mul(a, ld(p->sin, so + i + h, n, st_)), t));
        st(p->y, yo + i, n, t, ya);
        st(p->y, yo + i + h, n, t, yb);
    }
}

static void rows_half(const kw__rope *p, int64_t yo, int64_t xo, int64_t co, int64_t so) {
    const int same = p->xt == p->yt && p->ct == p->yt && p->st == p->yt;
    if (same && p->yt == KW_BF16)
        rows_half_as(p, yo, xo, co, so, KW_BF16, KW_BF16, KW_BF16, KW_BF16);
    else if (same && p->yt == KW_F32)
        rows_half_as(p, yo, xo, co, so, KW_F32, KW_F32, KW_F32, KW_F32);
    else
        rows_half_as(p, yo, xo, co, so, p->xt, p->ct, p->st, p->yt);
}

/* interleaved: pairs sit in adjacent lanes; rot(x) is a lane swap with the even
 * lanes negated. R is even, so a partial vector never splits a pair. */
static void rows_interleaved(const kw__rope *p, int64_t yo, int64_t xo, int64_t co, int64_t so) {
    const kw_dtype t = p->yt;
    const kw_v neg_even = kw_v_signs_even();
    for (int64_t i = 0; i < p->R; i += KW_VW) {
        const int64_t n = KW__MIN(KW_VW, p->R - i);
        const kw_v a = ld(p->x, xo + i, n, p->xt), rot = kw_v_xor(kw_v_swap_pairs(a), neg_even);
        const kw_v y = kw_v_add(kw_v_round_to(kw_v_mul(a, ld(p->cos, co + i, n, p->ct)), t),
                                kw_v_round_to(kw_v_mul(rot, ld(p->sin, so + i, n, p->st)), t));
        st(p->y, yo + i, n, t, y);
    }
}

void KW__ISA_NAME(kw__rotary_rows)(const kw__rope *p, int64_t r0, int64_t r1) {
    /* row r = (b · H + h) · S + s, counted up rather than divided out per row */
    int64_t s = r0 % p->S, h = r0 / p->S % p->H, b = r0 / (p->S * p->H);
    for (int64_t r = r0; r < r1; r++) {
        int64_t yo, xo, co, so;
        kw__rope_at(p, b, h, s, &yo, &xo, &co, &so);
        if (++s == p->S) {
            s = 0;
            if (++h == p->H) h = 0, b++;
        }
        if (p->interleaved)
            rows_interleaved(p, yo, xo, co, so);
        else
            rows_half(p, yo, xo, co, so);
        for (int64_t i = p->R; i < p->D; i += KW_VW) {
            const int64_t n = KW__MIN(KW_VW, p->D - i);
            st(p->y, yo + i, n, p->yt, ld(p->x, xo + i, n, p->xt));
        }
    }
}
