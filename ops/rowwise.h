/* rowwise.h — private to the last-dim reductions (softmax, argmax): rows of N,
 * built by rowwise.c and run over a range of rows per ISA. */
#ifndef KW_ROWWISE_H
#define KW_ROWWISE_H

#include "kw_ops_impl.h"

typedef struct kw__rowwise {
    int64_t rows, N;
    kw__row_ref y, x; /* argmax: y is int64 [rows], rs 1 */
} kw__rowwise;

typedef void (*kw__rowwise_fn)(const kw__rowwise *p, int64_t r0, int64_t r1);

void kw__softmax_rows_scalar(const kw__rowwise *p, int64_t r0, int64_t r1);
void kw__softmax_rows_avx2(const kw__rowwise *p, int64_t r0, int64_t r1);
void kw__softmax_rows_avx512(const kw__rowwise *p, int64_t r0, int64_t r1);
void kw__argmax_rows_scalar(const kw__rowwise *p, int64_t r0, int64_t r1);
void kw__argmax_rows_avx2(const kw__rowwise *p, int64_t r0, int64_t r1);
void kw__argmax_rows_avx512(const kw__rowwise *p, int64_t r0, int64_t r1);

/* The first index of the maximum of row x[0, n), NaN counting as the maximum
 * (torch.argmax). */
static inline int64_t kw__argmax_scalar(const char *x, kw_dtype dt, int64_t from, int64_t n, float *best) {
    int64_t idx = from;
    float b = kw__ldf(x, from, dt);
    for (int64_t i = from + 1; i < n && b == b; i++) {
        const float v = kw__ldf(x, i, dt);
        if (v > b || v != v) b = v, idx = i;
    }
    *best = b;
    return idx;
}

#endif
