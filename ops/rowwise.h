/* rowwise.h — private to softmax, the last-dim reduction: a prepared call as
 * rows of N, filled once by rowwise.c and run over a range of rows by the ISA
 * variant prepare picked. */
#ifndef KW_ROWWISE_H
#define KW_ROWWISE_H

#include "kw_ops_impl.h"

typedef struct kw__rowwise kw__rowwise;

struct kw__rowwise {
    int64_t rows, N;
    int safe; /* KW_SOFTMAX_SAFE: a row of -inf alone gives zeros */
    kw__row_ref y, x;
    void (*run)(const kw__rowwise *p, int64_t r0, int64_t r1);
};

KW__VARIANTS(void, kw__softmax_rows, (const kw__rowwise *p, int64_t r0, int64_t r1))

/* For a safe softmax whose row's max is -inf (every element -inf or NaN, which
 * the max skips): 1 when the row is -inf alone, and its output zeros written. */
int kw__softmax_zero_row(const kw__rowwise *p, const char *x, char *y);

#endif
