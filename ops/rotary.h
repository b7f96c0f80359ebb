/* rotary.h — private to rotary: a prepared call as a struct (rows are the B·H·S
 * vectors of length D), filled once by rotary.c and run over a range of rows by
 * the ISA variant prepare picked. */
#ifndef KW_ROTARY_H
#define KW_ROTARY_H

#include "kw_ops_impl.h"

typedef struct kw__rope kw__rope;

struct kw__rope {
    int64_t B, H, S, D, R; /* R (even) leading dims rotate, D - R pass through */
    char *y;
    const char *x, *cos, *sin;
    int64_t ys[3], xs[3], cs[3], ss[3]; /* strides of B, H, S (0 where cos/sin broadcast) */
    kw_dtype yt, xt, ct, st;
    int interleaved;
    void (*run)(const kw__rope *p, int64_t r0, int64_t r1);
};

/* The row of batch b, head h, position s: its first element in each tensor, as
 * element offsets. */
static inline void kw__rope_at(const kw__rope *p, int64_t b, int64_t h, int64_t s, int64_t *yo, int64_t *xo,
                               int64_t *co, int64_t *so) {
    *yo = b * p->ys[0] + h * p->ys[1] + s * p->ys[2];
    *xo = b * p->xs[0] + h * p->xs[1] + s * p->xs[2];
    *co = b * p->cs[0] + h * p->cs[1] + s * p->cs[2];
    *so = b * p->ss[0] + h * p->ss[1] + s * p->ss[2];
}

/* Row r = (b · H + h) · S + s. */
static inline void kw__rope_row(const kw__rope *p, int64_t r, int64_t *yo, int64_t *xo, int64_t *co, int64_t *so) {
    kw__rope_at(p, r / (p->S * p->H), r / p->S % p->H, r % p->S, yo, xo, co, so);
}

KW__VARIANTS(void, kw__rotary_rows, (const kw__rope *p, int64_t r0, int64_t r1))

#endif
