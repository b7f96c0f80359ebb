/* depthwise_conv2d over simd.h, built once per vector ISA (see KW__VARIANTS).
 * Channels are the lanes. Each input row the taps reach is first copied into a
 * padded f32 row (zeros outside the input, bf16 widened once), so the taps'
 * loop has no borders and no conversions. The padded rows live in a ring of
 * span_h rows, which holds every row one output row reads: the next output row
 * (a thread's next item) pads only the stride's new rows, not all KH (ConvNeXt's
 * 7 × 7 at 56 × 56 × 96 channels, f32, one core: 0.52 ms a call padding every
 * row for every output row, 0.40-0.48 with the ring). Eight output columns
 * (KW__CONV_COLS) stay in registers across a row of taps, each tap's weight
 * loaded once for the eight. Same sums as the scalar reference in conv.c, in
 * the same order, with fused multiply-adds. */
#include "conv.h"
#include "simd.h"

#define COLS KW__CONV_COLS
#define CB KW__CONV_CB

/* Input row ih of image n, channel block cb, padded into `row` ([Wp][CB]):
 * column j is iw = j - pw. */
static void pad_row(const kw__conv *p, int64_t cb, int64_t n, int64_t ih, float *row) {
    const int64_t xo = n * p->xs[0] + ih * p->xs[1];
    for (int64_t v = 0; v < CB; v += KW_VW) {
        const int64_t c0 = cb * CB + v, lanes = KW__MIN(KW_VW, p->C - c0);
        if (lanes <= 0) break;
        for (int64_t j = 0; j < p->Wp; j++) {
            const int64_t iw = j - p->pw;
            kw_v x = kw_v_zero();
            if (iw >= 0 && iw < p->W)
                x = lanes == KW_VW ? kw_v_ld(p->x, xo + iw * p->xs[2] + c0, p->xt)
                                   : kw_v_ldn(p->x, xo + iw * p->xs[2] + c0, lanes, p->xt);
            kw_v_storeu(row + j * CB + v, x);
        }
    }
}

/* One row of K taps, stride and dilation 1, K known when compiled: the
 * COLS + K - 1 input columns a block reads are loaded once each, and each
 * multiply-add reads registers only. The loads of the general loop below (one
 * a multiply-add) were its limit: ConvNeXt's 7 × 7 at 56 × 56 × 96, f32, one
 * core, 0.45-0.47 ms a call with it, 0.32-0.33 with this. */
#define UNIT_MAX_K 7
static inline __attribute__((always_inline)) void taps_row_unit(const float *wk, const float *row, float *acc,
                                                                int64_t OWr, const int K) {
    for (int64_t ow = 0; ow < OWr; ow += COLS) {
        kw_v a[COLS], x[COLS + UNIT_MAX_K - 1], w;
#pragma GCC unroll 8
        for (int t = 0; t < COLS; t++) a[t] = kw_v_loadu(acc + (ow + t) * CB);
#pragma GCC unroll 14
        for (int j = 0; j < COLS + K - 1; j++) x[j] = kw_v_loadu(row + (ow + j) * CB);
#pragma GCC unroll 7
        for (int kw = 0; kw < K; kw++) {
            w = kw_v_loadu(wk + kw * CB);
#pragma GCC unroll 8
            for (int t = 0; t < COLS; t++) a[t] = kw_v_fmadd(x[t + kw], w, a[t]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < COLS; t++) kw_v_storeu(acc + (ow + t) * CB, a[t]);
    }
}

/* One row of taps (weights wk, CB floats apart) over a padded row into the
 * sums of every output column (acc, CB floats a column), whole blocks of COLS. */
static void taps_row(const kw__conv *p, const float *wk, const float *row, float *acc) {
    if (p->sw == 1 && p->dw == 1) switch (p->KW) {
        case 3: return taps_row_unit(wk, row, acc, p->OWr, 3);
        case 5: return taps_row_unit(wk, row, acc, p->OWr, 5);
        case 7: return taps_row_unit(wk, row, acc, p->OWr, 7);
        }
    const int64_t step = p->sw * CB, tap = p->dw * CB;
    for (int64_t ow = 0; ow < p->OWr; ow += COLS) {
        kw_v a[COLS];
#pragma GCC unroll 8
        for (int t = 0; t < COLS; t++) a[t] = kw_v_loadu(acc + (ow + t) * CB);
        const float *xp = row + ow * step;
        for (int64_t kw = 0; kw < p->KW; kw++, xp += tap) {
            const kw_v w = kw_v_loadu(wk + kw * CB);
#pragma GCC unroll 8
            for (int t = 0; t < COLS; t++) a[t] = kw_v_fmadd(kw_v_loadu(xp + t * step), w, a[t]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < COLS; t++) kw_v_storeu(acc + (ow + t) * CB, a[t]);
    }
}

void KW__ISA_NAME(kw__depthwise_conv2d_rows)(const kw__conv *p, void *work, int64_t i0, int64_t i1) {
    const int64_t taps = p->KH * p->KW, R = kw__conv_ring_rows(p);
    const int64_t blocks = kw__conv_blocks(p);
    float *weights = work, *ring = weights + blocks * (taps + 1) * CB, *acc = ring + R * p->Wp * CB;
    int64_t *held = (int64_t *)(acc + p->OWr * CB); /* which input row each ring slot holds */
    char *gathered = (char *)(held + R);             /* which blocks' weights are gathered */
    for (int64_t s = 0; s < R; s++) held[s] = -1;
    memset(gathered, 0, (size_t)blocks);
    for (int64_t i = i0; i < i1; i++) {
        int64_t cb, n, oh;
        kw__conv_item(p, i, &cb, &n, &oh);
        float *wt = weights + cb * (taps + 1) * CB;
        if (!gathered[cb]) kw__conv_gather_weights(p, cb, wt), gathered[cb] = 1;
        const int64_t vmax = KW__MIN(CB, p->C - cb * CB);
        for (int64_t v = 0; v < vmax; v += KW_VW) {
            const kw_v bias = kw_v_loadu(wt + taps * CB + v);
            for (int64_t ow = 0; ow < p->OWr; ow++) kw_v_storeu(acc + ow * CB + v, bias);
        }
        for (int64_t kh = 0; kh < p->KH; kh++) {
            const int64_t ih = oh * p->sh - p->ph + kh * p->dh;
            if (ih < 0 || ih >= p->H) continue;
            const int64_t slot = ih % R, key = (cb * p->N + n) * p->H + ih;
            float *row = ring + slot * p->Wp * CB;
            if (held[slot] != key) pad_row(p, cb, n, ih, row), held[slot] = key;
            for (int64_t v = 0; v < vmax; v += KW_VW) taps_row(p, wt + kh * p->KW * CB + v, row + v, acc + v);
        }
        const int64_t yo = n * p->ys[0] + oh * p->ys[1] + cb * CB;
        for (int64_t v = 0; v < vmax; v += KW_VW) {
            const int64_t lanes = KW__MIN(KW_VW, vmax - v);
            for (int64_t ow = 0; ow < p->OW; ow++) {
                const kw_v a = kw_v_loadu(acc + ow * CB + v);
                if (lanes == KW_VW)
                    kw_v_st(p->y, yo + ow * p->ys[2] + v, p->yt, a);
                else
                    kw_v_stn(p->y, yo + ow * p->ys[2] + v, lanes, p->yt, a);
            }
        }
    }
}
