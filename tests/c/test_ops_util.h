/* test_ops_util.h — the harness the op tests share: random tensors in the slots
 * of a kw_call, kernels run the way the pool runs them (every ith of nth, with
 * scratch), and comparison of every ISA variant this CPU has against the scalar
 * reference. */
#ifndef KW_TEST_OPS_UTIL_H
#define KW_TEST_OPS_UTIL_H

#include <stdint.h>

#include "kw_ops.h"

typedef struct tt_rng {
    uint64_t s;
} tt_rng;

uint64_t tt_next(tt_rng *r);
double tt_uniform(tt_rng *r, double lo, double hi);
int64_t tt_int(tt_rng *r, int64_t lo, int64_t hi); /* inclusive */

/* A call under test: the call, and each slot's own allocation (NULL where the
 * slot shares another slot's memory or is absent). */
typedef struct tt_case {
    kw_call c;
    void *mem[KW_CALL_MAX_TENSORS];
    size_t bytes[KW_CALL_MAX_TENSORS];
} tt_case;

#define TT_DIMS(...) ((const int64_t[]){__VA_ARGS__})

/* A tensor in `slot`, uniform in [lo, hi] (integers for integer dtypes). strides
 * NULL: contiguous. Elements outside the view (padding) get random values too,
 * so a kernel that writes outside its view is caught by the comparison. */
kw_tensor *tt_tensor(tt_case *k, int slot, kw_dtype dt, int ndim, const int64_t *shape, const int64_t *strides,
                     double lo, double hi, tt_rng *r);
/* Contiguous, but every dim's stride padded by `pad` elements beyond its inner
 * dims (rows that do not touch). */
kw_tensor *tt_padded(tt_case *k, int slot, kw_dtype dt, int ndim, const int64_t *shape, int64_t pad, double lo,
                     double hi, tt_rng *r);
/* Slot dst views the same memory as src (an in-place op). */
void tt_alias(tt_case *k, int dst, int src);
void tt_free(tt_case *k);

double tt_get(const kw_tensor *t, const int64_t *idx);
void tt_set(kw_tensor *t, const int64_t *idx, double v);

/* Prepares c for `isa` (the op's variant at or below it; failing the test if
 * prepare rejects it) and runs the kernel as the pool would, thread by thread,
 * with scratch from the op's work_size (filled with garbage: kernels must not
 * expect zeros). */
void tt_run(kw_op_id op, kw_isa isa, const kw_call *c, int nth);
/* The same with a zeroed share line when `shared` (ops that hand work out). */
void tt_run_shared(kw_op_id op, kw_isa isa, const kw_call *c, int nth, int shared);

/* |got - want| <= atol + rtol * |want|; NaN matches NaN. */
typedef struct tt_tol {
    double atol, rtol;
} tt_tol;

/* Runs the scalar reference (one thread), then the variant for every ISA at or
 * below kw_cpu_isa() at several thread counts (the reference too), and compares
 * every written slot's whole allocation with the reference's. Fails the test on a
 * mismatch, naming `what`. Returns the number of kernels compared. */
int tt_check_variants(kw_op_id op, tt_case *k, tt_tol tol, const char *what);

/* Compares two allocations of dtype dt, element by element; returns the index of
 * the first mismatch or -1. */
int64_t tt_compare(const void *got, const void *want, kw_dtype dt, size_t bytes, tt_tol tol, double *g, double *w);

/* prepare() must reject the call with `err` and a message containing `needle`. */
void tt_expect_reject(kw_op_id op, const kw_call *c, int err, const char *needle);

#endif
