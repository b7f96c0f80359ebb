/* Attention over a static KV cache on simd.h, built once per vector ISA (see
 * KW__VARIANTS). Same arithmetic as the scalar reference in attention.c. A
 * thread's query heads are consecutive, so the heads that share a cache head
 * follow each other and find its valid K/V rows in cache. */
#include "attention.h"
#include "simd.h"

static inline void append_bits(int32_t *pos, int64_t *n, int64_t base, uint32_t bits) {
    while (bits) {
        pos[(*n)++] = (int32_t)(base + __builtin_ctz(bits));
        bits &= bits - 1;
    }
}

/* The positions the mask keeps, 32 bool bytes or KW_VW floats per compare. */
static int64_t scan(const char *mrow, const kw__attn *a, int32_t *pos) {
    int64_t n = 0, s = 0;
    if (!mrow) {
        for (; s < a->S; s++) pos[s] = (int32_t)s;
        return a->S;
    }
    if (a->mt == KW_BOOL) {
        for (; s + 32 <= a->S; s += 32) {
            const __m256i m = _mm256_loadu_si256((const __m256i *)(mrow + s));
            append_bits(pos, &n, s, ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(m, _mm256_setzero_si256())));
        }
    } else {
        const kw_v lim = kw_v_set1(KW__ATTN_MASKED);
        for (; s + KW_VW <= a->S; s += KW_VW) append_bits(pos, &n, s, kw_v_gt_bits(kw_v_ld(mrow, s, a->mt), lim));
    }
    for (; s < a->S; s++)
        if (kw__attn_keep(a, mrow, s)) pos[n++] = (int32_t)s;
    return n;
}

/* scores[j] = dot(q, k[pos[j]]) * scale + mask bias for one query head (qf, f32),
 * KW_VW positions at a time: each position's partial dot stays a vector and
 * kw_v_reduce_add_lanes folds KW_VW of them into one vector of scores. */
static void scores_head(const kw__attn *a, const char *k, const int32_t *pos, int64_t n, const float *qf,
                        const char *mrow, float *scores) {
    const size_t ksz = kw_dtype_size(a->kt);
    const kw_v scale = kw_v_set1(a->scale);
    for (int64_t j0 = 0; j0 < n; j0 += KW_VW) {
        const int64_t nj = KW__MIN(KW_VW, n - j0);
        kw_v acc[KW_VW];
        for (int t = 0; t < KW_VW; t++) {
            acc[t] = kw_v_zero();
            if (t >= nj) continue;
            const char *krow = k + (size_t)(pos[j0 + t] * a->ks[2]) * ksz;
            int64_t d = 0;
            for (; d + KW_VW <= a->D; d += KW_VW) acc[t] = kw_v_fmadd(kw_v_ld(krow, d, a->kt), kw_v_loadu(qf + d), acc[t]);
            if (d < a->D)
                acc[t] = kw_v_fmadd(kw_v_ldn(krow, d, a->D - d, a->kt), kw_v_loadn(qf + d, a->D - d), acc[t]);
        }
        const kw_v sv = kw_v_mul(kw_v_reduce_add_lanes(acc), scale);
        if (nj == KW_VW)
            kw_v_storeu(scores + j0, sv);
        else
            kw_v_storen(scores + j0, sv, nj);
    }
    if (mrow && a->mt != KW_BOOL)
        for (int64_t j = 0; j < n; j++) scores[j] += kw__attn_bias(a, mrow, pos[j]);
}

/* In place: s[j] = exp(s[j] - max), rounded to dtype vt; returns Σ of the
 * unrounded values. */
static float softmax_unnormalised(float *s, int64_t n, kw_dtype vt) {
    kw_v mv = kw_v_set1(-INFINITY);
    int64_t j = 0;
    for (; j + KW_VW <= n; j += KW_VW) mv = kw_v_max(kw_v_loadu(s + j), mv);
    if (j < n) mv = kw_v_max(kw_v_fill_tail(kw_v_loadn(s + j, n - j), n - j, -INFINITY), mv);
    const kw_v m = kw_v_set1(kw_v_reduce_max(mv));
    kw_v sum = kw_v_zero();
    for (j = 0; j + KW_VW <= n; j += KW_VW) {
        const kw_v p = kw_v_exp(kw_v_sub(kw_v_loadu(s + j), m));
        kw_v_storeu(s + j, kw_v_round_to(p, vt));
        sum = kw_v_add(sum, p);
    }
    if (j < n) {
        const kw_v p = kw_v_keepn(kw_v_exp(kw_v_sub(kw_v_loadn(s + j, n - j), m)), n - j);
        kw_v_storen(s + j, kw_v_round_to(p, vt), n - j);
        sum = kw_v_add(sum, p);
    }
    return kw_v_reduce_add(sum);
}

/* out = inv · Σ_j p[j] · v[pos[j]] for one head, C (a constant at each call
 * site) vectors of Dv at a time in registers; the last may be partial (n_last). */
static inline __attribute__((always_inline)) void pv_chunks(const kw__attn *a, const char *v, const int32_t *pos,
                                                            int64_t n, const float *p, float inv, int64_t d0,
                                                            int64_t n_last, int64_t oo, const int C) {
    const size_t vsz = kw_dtype_size(a->vt);
    kw_v acc[8];
    for (int c = 0; c < C; c++) acc[c] = kw_v_zero();
    for (int64_t j = 0; j < n; j++) {
        const char *vrow = v + (size_t)(pos[j] * a->vs[2]) * vsz;
        const kw_v pj = kw_v_set1(p[j]);
        for (int c = 0; c < C - 1; c++) acc[c] = kw_v_fmadd(pj, kw_v_ld(vrow, d0 + c * KW_VW, a->vt), acc[c]);
        const int64_t dl = d0 + (C - 1) * KW_VW;
        acc[C - 1] = kw_v_fmadd(pj, n_last == KW_VW ? kw_v_ld(vrow, dl, a->vt) : kw_v_ldn(vrow, dl, n_last, a->vt),
                                acc[C - 1]);
    }
    const kw_v s = kw_v_set1(inv);
    for (int c = 0; c < C - 1; c++) kw_v_st(a->o, oo + d0 + c * KW_VW, a->ot, kw_v_mul(acc[c], s));
    const int64_t dl = d0 + (C - 1) * KW_VW;
    if (n_last == KW_VW)
        kw_v_st(a->o, oo + dl, a->ot, kw_v_mul(acc[C - 1], s));
    else
        kw_v_stn(a->o, oo + dl, n_last, a->ot, kw_v_mul(acc[C - 1], s));
}

static void pv_head(const kw__attn *a, const char *v, const int32_t *pos, int64_t n, const float *p, float inv,
                    int64_t oo) {
    for (int64_t d0 = 0; d0 < a->Dv; d0 += 8 * KW_VW) {
        const int64_t rest = KW__MIN(8 * KW_VW, a->Dv - d0), C = (rest + KW_VW - 1) / KW_VW;
        const int64_t n_last = rest - (C - 1) * KW_VW;
        switch (C) {
        case 1: pv_chunks(a, v, pos, n, p, inv, d0, n_last, oo, 1); break;
        case 2: pv_chunks(a, v, pos, n, p, inv, d0, n_last, oo, 2); break;
        case 3: pv_chunks(a, v, pos, n, p, inv, d0, n_last, oo, 3); break;
        case 4: pv_chunks(a, v, pos, n, p, inv, d0, n_last, oo, 4); break;
        case 5: pv_chunks(a, v, pos, n, p, inv, d0, n_last, oo, 5); break;
        case 6: pv_chunks(a, v, pos, n, p, inv, d0, n_last, oo, 6); break;
        case 7: pv_chunks(a, v, pos, n, p, inv, d0, n_last, oo, 7); break;
        default: pv_chunks(a, v, pos, n, p, inv, d0, n_last, oo, 8); break;
        }
    }
}

/* Query head h at position i of batch b over the n valid positions in pos,
 * which the mask row mrow keeps. */
static void head(const kw__attn *a, const kw__attn_scratch *w, const char *mrow, int64_t b, int64_t i, int64_t h,
                 int64_t n) {
    const int64_t kh = h / a->G;
    const int64_t qo = b * a->qs[0] + h * a->qs[1] + i * a->qs[2], oo = b * a->os[0] + h * a->os[1] + i * a->os[2];
    const char *k = a->k + (size_t)(b * a->ks[0] + kh * a->ks[1]) * kw_dtype_size(a->kt);
    const char *v = a->v + (size_t)(b * a->vs[0] + kh * a->vs[1]) * kw_dtype_size(a->vt);
    for (int64_t d = 0; d < a->D; d++) w->qf[d] = kw__ldf(a->q, qo + d, a->qt);
    scores_head(a, k, w->pos, n, w->qf, mrow, w->scores);
    const float sum = softmax_unnormalised(w->scores, n, a->vt);
    pv_head(a, v, w->pos, n, w->scores, n ? 1.0f / sum : 0.0f, oo);
}

void KW__ISA_NAME(kw__attention_heads)(const kw__attn *a, int64_t u0, int64_t u1, void *work) {
    const kw__attn_scratch w = kw__attn_carve(a, work);
    int64_t cur_row = -1, n = 0;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t row = u / a->Hq, b = row / a->L, i = row % a->L;
        const char *mrow = kw__attn_mask_row(a, b, i);
        if (row != cur_row) n = scan(mrow, a, w.pos), cur_row = row;
        head(a, &w, mrow, b, i, u % a->Hq, n);
    }
}
