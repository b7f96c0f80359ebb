/* linear.h — private to the linear family (linear, linear_multi, matmul_dnnl): one
 * y = x·Wᵀ (+ bias) job as a plain struct, built by linear.c from a kw_call and run
 * over a range of weight rows by each ISA's kw__linear_rows_<isa>. */
#ifndef KW_LINEAR_H
#define KW_LINEAR_H

#include "kw_ops_impl.h"

#define KW__LIN_MAX_OUT 4

typedef struct kw__lin_out {
    char *y;
    int64_t ys; /* row stride in elements */
    int64_t n;  /* this output's weight rows (its last dim) */
} kw__lin_out;

typedef struct kw__lin {
    const char *x; /* M rows of K, row stride xs */
    int64_t xs, M, K;
    kw_dtype xt;
    /* Weight row n, elements [kb·kblk, (kb + 1)·kblk), starts at w + kb·wbs + n·ws:
     * [N, K] is one block (kblk = K); K-blocked weights are [K / kblk, N, kblk]. */
    const char *w;
    int64_t ws, wbs, kblk, n_total;
    kw_dtype wt;
    const char *b; /* bias [n_total], NULL when absent */
    int64_t bs;
    kw_dtype bt;
    kw_dtype yt;
    int n_out; /* weight rows are split over the outputs in order */
    kw__lin_out out[KW__LIN_MAX_OUT];
} kw__lin;

/* Weight rows [n0, n1) of every output row. `work` is the thread's scratch of at
 * least kw__lin_work_size bytes: the activations rearranged for bf16 weights
 * (linear_body.h), then the partial sums of K-blocked weights. */
typedef void (*kw__lin_rows_fn)(const kw__lin *g, int64_t n0, int64_t n1, void *work);

void kw__linear_rows_scalar(const kw__lin *g, int64_t n0, int64_t n1, void *work);
void kw__linear_rows_avx2(const kw__lin *g, int64_t n0, int64_t n1, void *work);
void kw__linear_rows_avx512(const kw__lin *g, int64_t n0, int64_t n1, void *work);
void kw__linear_rows_avx512bf16(const kw__lin *g, int64_t n0, int64_t n1, void *work);

/* A block of K in the rearranged activations, padded to whole groups of the
 * widest vector's 32 bf16. */
static inline int64_t kw__lin_block_padded(int64_t kblk) { return (kblk + 31) / 32 * 32; }

static inline size_t kw__lin_acts_bytes(const kw__lin *g) {
    const int64_t floats = g->wt == KW_BF16 ? g->M * (g->K / g->kblk) * kw__lin_block_padded(g->kblk) : 0;
    return ((size_t)floats * sizeof(float) + 63) / 64 * 64;
}

static inline size_t kw__lin_work_size(const kw__lin *g) {
    const int64_t partial = g->kblk < g->K ? g->M * g->n_total : 0;
    return kw__lin_acts_bytes(g) + (size_t)partial * sizeof(float) + 128;
}

static inline const char *kw__lin_wrow(const kw__lin *g, int64_t kb, int64_t n) {
    return g->w + (size_t)(kb * g->wbs + n * g->ws) * kw_dtype_size(g->wt);
}

/* The part of weight rows [n0, n1) that lands in output j: rows [*s0, *s1) and
 * the address of y[0, *s0 - start of output j]. Returns 0 when empty. */
static inline int kw__lin_segment(const kw__lin *g, int j, int64_t n0, int64_t n1, int64_t *s0, int64_t *s1,
                                  char **y) {
    int64_t start = 0;
    for (int i = 0; i < j; i++) start += g->out[i].n;
    *s0 = KW__MAX(n0, start);
    *s1 = KW__MIN(n1, start + g->out[j].n);
    *y = g->out[j].y + (*s0 - start) * (int64_t)kw_dtype_size(g->yt);
    return *s0 < *s1;
}

/* Bias for weight row n as f32 (0 when absent), first cast to x's dtype as
 * F.linear(x, w, bias.to(x.dtype)) does. */
static inline float kw__lin_bias(const kw__lin *g, int64_t n) {
    return g->b ? kw__round_to(kw__ldf(g->b, n * g->bs, g->bt), g->xt) : 0.0f;
}

/* Fills *g from a call whose slots are (outputs..., x, weight, bias); n_out outputs
 * start at slot 0. Returns 0 or KW_E* with a message naming the bad slot. */
int kw__lin_from_call(const kw_call *c, const char *op, int n_out, kw__lin *g, char *msg, size_t len);

#endif
