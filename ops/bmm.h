/* bmm.h — private to bmm (batched matrix products, baddbmm's too): a prepared
 * call as a struct, filled once by bmm.c and run over a range of units of work
 * by the ISA variant prepare picked. */
#ifndef KW_BMM_H
#define KW_BMM_H

#include "kw_ops_impl.h"

typedef struct kw__bmm kw__bmm;

/* Output columns per unit of work: a unit is one row i of one batch b and up to
 * this many of its columns, u = (b · M + i) · chunks + chunk. */
#define KW__BMM_COLS 64

struct kw__bmm {
    int64_t B, M, N, K, chunks, units;
    kw_dtype dt; /* of every operand */
    char *y;
    const char *a, *b, *c; /* c NULL: absent, or beta 0 (ATen then reads none of it) */
    /* element strides of the batch and the two matrix dims: y [B, M, N], a [B, M, K],
     * b [B, K, N], c [B, M, N] (0 where broadcast) */
    int64_t ys[3], as[3], bs[3], cs[3];
    int dot; /* a's rows and b's columns are contiguous (as[2] == bs[1] == 1): a row of
              * a dotted with each column; else b's rows are (bs[2] == 1): rows of b
              * scaled by a's elements and summed */
    float alpha, beta;
    void (*run)(const kw__bmm *p, int64_t u0, int64_t u1);
};

KW__VARIANTS(void, kw__bmm_units, (const kw__bmm *p, int64_t u0, int64_t u1))

/* Stores y[b, i, j0 .. j0 + n) = alpha · acc[..] + beta · c[b, i, ..], rounded once
 * to y's dtype: the variants' epilogue. */
void kw__bmm_store(const kw__bmm *p, int64_t b, int64_t i, int64_t j0, int64_t n, const float *acc);

#endif
