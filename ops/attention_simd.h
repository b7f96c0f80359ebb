/* attention_simd.h — private to attention's vector kernels (attention_simd.c,
 * once per vector ISA, and attention_amx.c): the valid positions of mask rows,
 * the mask's bias of a row, and the softmax, on simd.h's vectors. */
#ifndef KW_ATTENTION_SIMD_H
#define KW_ATTENTION_SIMD_H

#include "attention.h"
#include "simd.h"

static inline void append_bits(int32_t *pos, int64_t *n, int64_t base, uint32_t bits) {
    while (bits) {
        pos[(*n)++] = (int32_t)(base + __builtin_ctz(bits));
        bits &= bits - 1;
    }
}

/* Bits of the positions s0 .. s0 + 31 (fewer at the end) the mask row keeps,
 * 32 bool bytes or KW_VW floats per compare. */
static inline uint32_t keep_bits(const kw__attn *a, const char *mrow, int64_t s0) {
    const int64_t cnt = KW__MIN(32, a->S - s0);
    if (a->mt == KW_BOOL && cnt == 32) {
        const __m256i m = _mm256_loadu_si256((const __m256i *)(mrow + s0));
        return ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(m, _mm256_setzero_si256()));
    }
    uint32_t bits = 0;
    int64_t s = 0;
    if (a->mt != KW_BOOL) {
        const kw_v lim = kw_v_set1(KW__ATTN_MASKED);
        for (; s + KW_VW <= cnt; s += KW_VW) bits |= (uint32_t)kw_v_nle_bits(kw_v_ld(mrow, s0 + s, a->mt), lim) << s;
    }
    for (; s < cnt; s++) bits |= (uint32_t)kw__attn_keep(a, mrow, s0 + s) << s;
    return bits;
}

/* The cache's K and V rows were written tokens ago and the weights have streamed
 * through every cache since, so each row comes from memory; the kernels ask for
 * the rows a few positions ahead of the one they read (KW__ATTN_AHEAD), every
 * line of them, instead of waiting on each in turn. */
#define KW__ATTN_AHEAD 8

/* Every line of `bytes` from element `offset` of the rows of positions pos[j0 ..
 * j1) of a cache head at `head` (rows `stride` elements of `esz` bytes apart). */
static inline void prefetch_rows(const char *head, const int32_t *pos, int64_t j0, int64_t j1, int64_t stride,
                                 size_t esz, int64_t offset, int64_t bytes) {
    for (int64_t j = j0; j < j1; j++)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(head + (size_t)(pos[j] * stride + offset) * esz + o);
}

/* The positions the mask row keeps (every one without a mask). */
static inline int64_t scan(const char *mrow, const kw__attn *a, int32_t *pos) {
    int64_t n = 0;
    if (!mrow) {
        for (; n < a->S; n++) pos[n] = (int32_t)n;
        return n;
    }
    for (int64_t s0 = 0; s0 < a->S; s0 += 32) append_bits(pos, &n, s0, keep_bits(a, mrow, s0));
    return n;
}

/* In place: s[j] = exp(s[j] - max), rounded to dtype vt; returns Σ of the
 * unrounded values, 0 (and zeros) when every s[j] is -inf, NaN (and NaNs) when
 * the others are (a NaN mask value: SDPA's row is NaN). */
static inline float softmax_unnormalised(float *s, int64_t n, kw_dtype vt) {
    /* Four running maxima: one waited on each max's latency (Whisper-tiny's
     * rows of 1500 scores: 10 % of its attention in this loop, perf). */
    kw_v mv = kw_v_set1(-INFINITY), m1 = mv, m2 = mv, m3 = mv;
    int64_t j = 0;
    for (; j + 4 * KW_VW <= n; j += 4 * KW_VW) {
        mv = kw_v_max(kw_v_loadu(s + j), mv), m1 = kw_v_max(kw_v_loadu(s + j + KW_VW), m1);
        m2 = kw_v_max(kw_v_loadu(s + j + 2 * KW_VW), m2), m3 = kw_v_max(kw_v_loadu(s + j + 3 * KW_VW), m3);
    }
    mv = kw_v_max(kw_v_max(m1, mv), kw_v_max(m3, m2)); /* NaN never reaches a running maximum */
    for (; j + KW_VW <= n; j += KW_VW) mv = kw_v_max(kw_v_loadu(s + j), mv);
    if (j < n) mv = kw_v_max(kw_v_fill_tail(kw_v_loadn(s + j, n - j), n - j, -INFINITY), mv);
    const float mx = kw_v_reduce_max(mv);
    if (mx == -INFINITY) { /* the max skips NaNs */
        float fill = 0.0f;
        for (j = 0; j < n && fill == 0.0f; j++) fill = s[j] != s[j] ? NAN : 0.0f;
        for (j = 0; j < n; j++) s[j] = fill;
        return fill;
    }
    const kw_v m = kw_v_set1(mx);
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

/* The positions any query row of batch b keeps, ascending (of any head, where
 * the mask has one per head: a superset for each cache head's blocks). */
static inline int64_t scan_union(const kw__attn *a, int64_t b, const kw__attn_scratch *w) {
    if (!a->mask) return scan(NULL, a, w->pos);
    const int64_t words = (a->S + 31) / 32;
    memset(w->bits, 0, (size_t)words * sizeof *w->bits);
    for (int64_t h = 0; h < (a->mh ? a->Hq : 1); h++)
        for (int64_t i = 0; i < (a->ml ? a->L : 1); i++) {
            const char *mrow = kw__attn_mask_row(a, b, h, i);
            for (int64_t wi = 0; wi < words; wi++) w->bits[wi] |= keep_bits(a, mrow, wi * 32);
        }
    int64_t n = 0;
    for (int64_t wi = 0; wi < words; wi++) append_bits(w->pos, &n, wi * 32, w->bits[wi]);
    return n;
}

/* s[j] = the mask's bias at pos[j] (0 for bool or no mask), -inf where the mask
 * row drops it and for j in [n, np); widens [lo, hi) to cover every kept j. When
 * the positions are consecutive (a causal or padded prefix), KW_VW at a time.
 * Returns whether the row keeps any position. */
static inline int bias_row(const kw__attn *a, const char *mrow, const int32_t *pos, int64_t n, int64_t np, float *s,
                     int64_t *lo, int64_t *hi) {
    int64_t first = n, last = -1;
    if (n && pos[n - 1] - pos[0] == n - 1) {
        const kw_v none = kw_v_set1(-INFINITY);
        for (int64_t j = 0; j < n; j += 32) {
            const int64_t cnt = KW__MIN(32, n - j);
            uint32_t bits = mrow ? keep_bits(a, mrow, pos[0] + j) : ~0u;
            bits &= cnt == 32 ? ~0u : (1u << cnt) - 1;
            if (bits) first = KW__MIN(first, j + __builtin_ctz(bits)), last = j + 31 - __builtin_clz(bits);
            for (int64_t t = 0; t < cnt; t += KW_VW) {
                const int64_t m = KW__MIN(KW_VW, cnt - t);
                const kw_v bias = mrow && a->mt != KW_BOOL ? kw_v_ldn(mrow, pos[0] + j + t, m, a->mt) : kw_v_zero();
                kw_v_storen(s + j + t, kw_v_blend_bits(bits >> t, bias, none), m);
            }
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            if (mrow && !kw__attn_keep(a, mrow, pos[j])) {
                s[j] = -INFINITY;
                continue;
            }
            s[j] = kw__attn_bias(a, mrow, pos[j]);
            first = KW__MIN(first, j), last = j;
        }
    }
    for (int64_t j = n; j < np; j++) s[j] = -INFINITY;
    *lo = KW__MIN(*lo, first), *hi = KW__MAX(*hi, last + 1);
    return last >= 0;
}

/* Row r of cache head kh's blocks: position i, query head h (r = i · G + g). */
static inline void block_row(const kw__attn *a, int64_t kh, int64_t r, int64_t *i, int64_t *h) {
    *i = r / a->G, *h = kh * a->G + r % a->G;
}

/* For each row t < rows of the block of rows r0 .. of cache head kh of batch b:
 * its output's offset oo[t], its mask's bias over the n positions in w->pos at
 * w->scores + t · np (bias_row; a row at the same position as the one before,
 * with one mask row for all heads, copies it) and whether it keeps any
 * position, keeps[t]; [lo, hi) widened to the positions kept. */
static inline void block_biases(const kw__attn *a, const kw__attn_scratch *w, int64_t b, int64_t kh, int64_t r0,
                                int64_t rows, int64_t n, int64_t np, int64_t *oo, int *keeps, int64_t *lo,
                                int64_t *hi) {
    int64_t i_prev = -1;
    for (int64_t t = 0; t < rows; t++) {
        float *s = w->scores + t * np;
        int64_t i, h;
        block_row(a, kh, r0 + t, &i, &h);
        oo[t] = b * a->os[0] + h * a->os[1] + i * a->os[2];
        if (i == i_prev && !a->mh)
            memcpy(s, s - np, (size_t)np * sizeof *s), keeps[t] = keeps[t - 1];
        else
            keeps[t] = bias_row(a, kw__attn_mask_row(a, b, h, i), w->pos, n, np, s, lo, hi);
        i_prev = i;
    }
}

/* The block's rows that keep no position are SDPA's (kw__attn_unkept_row). */
static inline void block_unkept(const kw__attn *a, const kw__attn_scratch *w, int64_t b, int64_t kh, int64_t r0,
                                int64_t rows, const int *keeps) {
    for (int64_t t = 0; t < rows; t++) {
        int64_t i, h;
        block_row(a, kh, r0 + t, &i, &h);
        if (!keeps[t]) kw__attn_unkept_row(a, w, b, i, h);
    }
}

#endif
