/* Attention over a static KV cache on simd.h, built once per vector ISA (see
 * KW__VARIANTS). Same arithmetic as the scalar reference in attention.c. A
 * thread's query heads are consecutive, so the heads that share a cache head
 * follow each other and find its valid K/V rows in cache. */
#include "attention_simd.h"

/* scores[j] = dot(q, k[pos[j]]) * scale + mask bias for one query head (qf, f32),
 * KW_VW positions at a time: each position's partial dot stays a vector and
 * kw_v_reduce_add_lanes folds KW_VW of them into one vector of scores. */
static void scores_head(const kw__attn *a, const char *k, const int32_t *pos, int64_t n, const float *qf,
                        const char *mrow, float *scores) {
    const size_t ksz = kw_dtype_size(a->kt);
    const kw_v scale = kw_v_set1(a->scale);
    const int64_t row_bytes = a->D * (int64_t)ksz;
    prefetch_rows(k, pos, 0, KW__MIN(n, KW_VW), a->ks[2], ksz, 0, row_bytes);
    for (int64_t j0 = 0; j0 < n; j0 += KW_VW) {
        const int64_t nj = KW__MIN(KW_VW, n - j0);
        kw_v acc[KW_VW];
        prefetch_rows(k, pos, j0 + KW_VW, KW__MIN(n, j0 + 2 * KW_VW), a->ks[2], ksz, 0, row_bytes);
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

/* out = inv · Σ_j p[j] · v[pos[j]] for one head, C (a constant at each call
 * site) vectors of Dv at a time in registers; the last may be partial (n_last). */
static inline __attribute__((always_inline)) void pv_chunks(const kw__attn *a, const char *v, const int32_t *pos,
                                                            int64_t n, const float *p, float inv, int64_t d0,
                                                            int64_t n_last, int64_t oo, const int C) {
    const size_t vsz = kw_dtype_size(a->vt);
    kw_v acc[8];
    for (int c = 0; c < C; c++) acc[c] = kw_v_zero();
    const int64_t ahead_bytes = KW__MIN(C * KW_VW, a->Dv - d0) * (int64_t)vsz;
    prefetch_rows(v, pos, 0, KW__MIN(n, KW__ATTN_AHEAD), a->vs[2], vsz, d0, ahead_bytes);
    for (int64_t j = 0; j < n; j++) {
        const char *vrow = v + (size_t)(pos[j] * a->vs[2]) * vsz;
        if (j + KW__ATTN_AHEAD < n)
            prefetch_rows(v, pos, j + KW__ATTN_AHEAD, j + KW__ATTN_AHEAD + 1, a->vs[2], vsz, d0, ahead_bytes);
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
    if (n == 0) {
        kw__attn_unkept_row(a, w, b, i, h);
        return;
    }
    for (int64_t d = 0; d < a->D; d++) w->qf[d] = kw__ldf(a->q, qo + d, a->qt);
    scores_head(a, k, w->pos, n, w->qf, mrow, w->scores);
    const float sum = softmax_unnormalised(w->scores, n, a->vt);
    pv_head(a, v, w->pos, n, w->scores, 1.0f / sum, oo);
}

void KW__ISA_NAME(kw__attention_heads)(const kw__attn *a, int64_t u0, int64_t u1, void *work) {
    const kw__attn_scratch w = kw__attn_carve(a, work);
    int64_t cur_mrow = -1, n = 0;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t row = u / a->Hq, b = row / a->L, i = row % a->L;
        const char *mrow = kw__attn_mask_row(a, b, u % a->Hq, i);
        /* the heads of a position share its mask row, unless the mask has one per head */
        if ((a->mh ? u : row) != cur_mrow) n = scan(mrow, a, w.pos), cur_mrow = a->mh ? u : row;
        head(a, &w, mrow, b, i, u % a->Hq, n);
    }
}

/* ---- blocks of query rows: steps of more than one position ---- */

#define ROWS KW__ATTN_ROWS
/* The tiles of the block's rows × vectors whose sums stay in registers: the
 * scores take SC_RT rows × SC_NV vectors of positions at a time, P·V PV_RT
 * rows × PV_NV vectors of Dv. Each loads SC_NV (PV_NV) vectors and SC_RT
 * (PV_RT) broadcasts for their product's FMAs: AVX-512's 32 registers hold
 * all 8 rows × 2; AVX2's 16 hold 4 × 2 and 4 × 3, fewer loads per FMA than
 * 8 rows × 1 (9 loads for 8 FMAs). ops_bench --attention on a Zen 3 EPYC,
 * fastest of three alternated runs, SmolLM2-360M's heads over 512 positions:
 * a step of 128 positions 2.67 → 2.43 ms in f32, 3.03 → 2.86 in bf16; of 8
 * positions 211 → 192 µs in f32 (the host's noise moved single runs by 1.6×). */
#define SC_NV 2
#define SC_RT (KW_VW == 16 ? ROWS : 4)
#define PV_NV (KW_VW == 16 ? 2 : 3)
#define PV_RT (KW_VW == 16 ? ROWS : 4)

/* The cache head's keys k[pos[j]] transposed in panels of KW_VW positions,
 * kt[(j / KW_VW) · D · KW_VW + d · KW_VW + j % KW_VW] in f32, zero for j in
 * [n, np): a vector of kt holds KW_VW positions of one d. */
static inline __attribute__((always_inline)) void pack_panels(const kw__attn *a, const char *k, const int32_t *pos,
                                                              int64_t n, int64_t np, float *kt, const kw_dtype dt) {
    const size_t ksz = kw_dtype_size(dt);
    prefetch_rows(k, pos, 0, KW__MIN(n, KW_VW), a->ks[2], ksz, 0, a->D * (int64_t)ksz);
    for (int64_t j0 = 0; j0 < np; j0 += KW_VW) {
        float *panel = kt + j0 * a->D;
        const char *row[KW_VW];
        prefetch_rows(k, pos, j0 + KW_VW, KW__MIN(n, j0 + 2 * KW_VW), a->ks[2], ksz, 0, a->D * (int64_t)ksz);
        int64_t live[KW_VW]; /* 1 for a position, 0 for the padding past n */
        for (int t = 0; t < KW_VW; t++) {
            live[t] = j0 + t < n;
            row[t] = k + (size_t)(pos[live[t] ? j0 + t : 0] * a->ks[2]) * ksz;
        }
        for (int64_t d0 = 0; d0 < a->D; d0 += KW_VW) {
            const int64_t nd = KW__MIN(KW_VW, a->D - d0);
            kw_v r[KW_VW];
#pragma GCC unroll 16
            for (int t = 0; t < KW_VW; t++) r[t] = kw_v_ldn(row[t], d0, live[t] * nd, dt);
            kw_v_transpose(r);
#pragma GCC unroll 16
            for (int t = 0; t < KW_VW; t++)
                if (t < nd) kw_v_storeu(panel + (d0 + t) * KW_VW, r[t]);
        }
    }
}

static void pack_keys(const kw__attn *a, const char *k, const int32_t *pos, int64_t n, int64_t np, float *kt) {
    if (n == 0) return;
    if (a->kt == KW_BF16)
        pack_panels(a, k, pos, n, np, kt, KW_BF16);
    else
        pack_panels(a, k, pos, n, np, kt, KW_F32);
}

/* scores[t · np + j] += dot(q_t, k[pos[j]]) · scale for the block's ROWS rows and
 * j in [j0, j1), SC_NV·KW_VW positions at a time: each kt vector serves SC_RT rows. */
static void scores_block(const kw__attn *a, const float *kt, int64_t np, const float *qf, int64_t j0, int64_t j1,
                         float *scores) {
    const kw_v scale = kw_v_set1(a->scale);
    for (int64_t j = j0; j < j1; j += SC_NV * KW_VW)
        for (int t0 = 0; t0 < ROWS; t0 += SC_RT) {
            kw_v acc[SC_RT][SC_NV];
            for (int t = 0; t < SC_RT; t++)
                for (int c = 0; c < SC_NV; c++) acc[t][c] = kw_v_zero();
            for (int64_t d = 0; d < a->D; d++) {
                kw_v kv[SC_NV];
                for (int c = 0; c < SC_NV; c++) kv[c] = kw_v_loadu(kt + (j + c * KW_VW) * a->D + d * KW_VW);
                for (int t = 0; t < SC_RT; t++) {
                    const kw_v qb = kw_v_set1(qf[(t0 + t) * a->D + d]);
                    for (int c = 0; c < SC_NV; c++) acc[t][c] = kw_v_fmadd(qb, kv[c], acc[t][c]);
                }
            }
            for (int t = 0; t < SC_RT; t++)
                for (int c = 0; c < SC_NV; c++) {
                    float *s = scores + (t0 + t) * np + j + c * KW_VW;
                    kw_v_storeu(s, kw_v_fmadd(acc[t][c], scale, kw_v_loadu(s)));
                }
        }
}

/* out row t, Dv elements d0 .. d0 + PV_NV·KW_VW (fewer at the end) = inv[t] ·
 * Σ_j p[t · np + j] · v[pos[j]] over j in [j0, j1) for rows t < rows of PV_RT:
 * each V vector serves every row. vt is a constant at each call site: a branch
 * on it inside the loop made the compiler keep the accumulators in memory. */
static inline __attribute__((always_inline)) void pv_chunk(const kw__attn *a, const char *v, const int32_t *pos,
                                                           int64_t j0, int64_t j1, const float *p, int64_t np,
                                                           const float *inv, int64_t rows, const int64_t *oo, int64_t d0,
                                                           const kw_dtype vt) {
    const size_t vsz = kw_dtype_size(vt);
    int64_t nd[PV_NV];
    for (int c = 0; c < PV_NV; c++) nd[c] = KW__MAX(0, KW__MIN(KW_VW, a->Dv - d0 - c * KW_VW));
    kw_v acc[PV_RT][PV_NV];
    for (int t = 0; t < PV_RT; t++)
        for (int c = 0; c < PV_NV; c++) acc[t][c] = kw_v_zero();
    const int64_t ahead_bytes = KW__MAX(0, KW__MIN(PV_NV * KW_VW, a->Dv - d0)) * (int64_t)vsz;
    prefetch_rows(v, pos, j0, KW__MIN(j1, j0 + KW__ATTN_AHEAD), a->vs[2], vsz, d0, ahead_bytes);
    for (int64_t j = j0; j < j1; j++) {
        const char *vrow = v + (size_t)(pos[j] * a->vs[2]) * vsz;
        if (j + KW__ATTN_AHEAD < j1)
            prefetch_rows(v, pos, j + KW__ATTN_AHEAD, j + KW__ATTN_AHEAD + 1, a->vs[2], vsz, d0, ahead_bytes);
        kw_v vv[PV_NV];
        for (int c = 0; c < PV_NV; c++) vv[c] = kw_v_ldn(vrow, d0 + c * KW_VW, nd[c], vt);
        for (int t = 0; t < PV_RT; t++) {
            const kw_v pb = kw_v_set1(p[t * np + j]);
            for (int c = 0; c < PV_NV; c++) acc[t][c] = kw_v_fmadd(pb, vv[c], acc[t][c]);
        }
    }
    /* Unrolled, so that acc's indices are constants and acc stays in registers. */
#pragma GCC unroll 8
    for (int t = 0; t < PV_RT; t++)
#pragma GCC unroll 3
        for (int c = 0; c < PV_NV; c++)
            if (t < rows && nd[c]) kw_v_stn(a->o, oo[t] + d0 + c * KW_VW, nd[c], a->ot, kw_v_mul(acc[t][c], kw_v_set1(inv[t])));
}

static void pv_block(const kw__attn *a, const char *v, const int32_t *pos, int64_t j0, int64_t j1, const float *p,
                     int64_t np, const float *inv, int64_t rows, const int64_t *oo) {
    for (int64_t t0 = 0; t0 < rows; t0 += PV_RT)
        for (int64_t d0 = 0; d0 < a->Dv; d0 += PV_NV * KW_VW)
            if (a->vt == KW_BF16)
                pv_chunk(a, v, pos, j0, j1, p + t0 * np, np, inv + t0, rows - t0, oo + t0, d0, KW_BF16);
            else
                pv_chunk(a, v, pos, j0, j1, p + t0 * np, np, inv + t0, rows - t0, oo + t0, d0, KW_F32);
}

/* The block of rows r0 .. r0 + ROWS - 1 of cache head kh of batch b, over the n
 * positions in w->pos whose keys w->kt holds. Only the span of positions some row
 * keeps is computed: in a causal chunk, a block's last position bounds it. */
static void block(const kw__attn *a, const kw__attn_scratch *w, int64_t b, int64_t kh, int64_t r0, int64_t n) {
    const int64_t np = kw__attn_pad(n), rows = KW__MIN(ROWS, a->L * a->G - r0);
    int64_t oo[ROWS], lo = n, hi = 0;
    int keeps[ROWS] = {0};
    float inv[ROWS];
    for (int64_t t = 0; t < ROWS; t++) { /* the queries widened, zeros past the block's rows */
        float *qf = w->qf + t * a->D;
        int64_t i, h;
        block_row(a, kh, r0 + t, &i, &h);
        const int64_t qo = b * a->qs[0] + h * a->qs[1] + i * a->qs[2];
        for (int64_t d = 0; d < a->D; d++) qf[d] = t < rows ? kw__ldf(a->q, qo + d, a->qt) : 0.0f;
    }
    block_biases(a, w, b, kh, r0, rows, n, np, oo, keeps, &lo, &hi);
    const int64_t j0 = lo / (SC_NV * KW_VW) * (SC_NV * KW_VW), j1 = KW__MIN(np, kw__attn_pad(hi));
    if (j0 < j1) scores_block(a, w->kt, np, w->qf, j0, j1, w->scores);
    for (int64_t t = 0; t < ROWS; t++) {
        float *s = w->scores + t * np + j0;
        if (t >= rows) {
            if (j0 < j1) memset(s, 0, (size_t)(j1 - j0) * sizeof *s);
            inv[t] = 0.0f;
            continue;
        }
        const float sum = j0 < j1 ? softmax_unnormalised(s, j1 - j0, a->vt) : 0.0f;
        inv[t] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    pv_block(a, a->v + (size_t)(b * a->vs[0] + kh * a->vs[1]) * kw_dtype_size(a->vt), w->pos, j0, KW__MIN(j1, n),
             w->scores, np, inv, rows, oo);
    block_unkept(a, w, b, kh, r0, rows, keeps);
}

void KW__ISA_NAME(kw__attention_blocks)(const kw__attn *a, int64_t u0, int64_t u1, void *work) {
    const kw__attn_scratch w = kw__attn_carve(a, work);
    int64_t cur_b = -1, cur_kh = -1, n = 0;
    for (int64_t u = u0; u < u1; u++) {
        int64_t b, kh, r0;
        kw__attn_block_of(a, u, &b, &kh, &r0);
        if (b != cur_b) n = scan_union(a, b, &w), cur_b = b, cur_kh = -1;
        if (kh != cur_kh) {
            const char *k = a->k + (size_t)(b * a->ks[0] + kh * a->ks[1]) * kw_dtype_size(a->kt);
            pack_keys(a, k, w.pos, n, kw__attn_pad(n), w.kt);
            cur_kh = kh;
        }
        block(a, &w, b, kh, r0, n);
    }
}
