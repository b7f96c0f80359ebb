/* eltwise.h — private to the elementwise ops (binary, unary, silu_mul,
 * gelu_mul, gelu, where, compare, convert): a prepared call as the operands walked by one broadcast iterator
 * (kw__nd), filled once by eltwise.c and run on a thread's share by the ISA
 * variant prepare picked. */
#ifndef KW_ELTWISE_H
#define KW_ELTWISE_H

#include "kw_ops_impl.h"

typedef struct kw__ew kw__ew;
typedef void (*kw__ew_fn)(const kw__ew *e, int ith, int nth);

struct kw__ew {
    kw__nd nd;    /* operand 0 is y, then a, then b when present */
    int n_in;     /* 1 or 2 */
    char *y;
    const char *a, *b; /* b NULL: binary uses `scalar` instead */
    kw_dtype yt, at, bt;
    int mode;     /* binary: kw_binary_op; unary: kw_unary_op; gelu, gelu_mul: KW_GELU_*; where: KW_WHERE_*;
                     compare: kw_compare_op */
    double scalar; /* binary, compare: b when slot 2 is absent (fp[0]); where: the value not taken from x */
    kw__ew_fn run;
};

KW__VARIANTS(void, kw__binary_share, (const kw__ew *e, int ith, int nth))
KW__VARIANTS(void, kw__silu_mul_share, (const kw__ew *e, int ith, int nth))
KW__VARIANTS(void, kw__gelu_mul_share, (const kw__ew *e, int ith, int nth))
KW__VARIANTS(void, kw__gelu_share, (const kw__ew *e, int ith, int nth))
KW__VARIANTS(void, kw__convert_share, (const kw__ew *e, int ith, int nth))

/* Shared by the scalar references and the ISA files' edge cases. */
static inline float kw__binary_f(int op, float a, float b) {
    switch (op) {
    case KW_BINARY_ADD: return a + b;
    case KW_BINARY_SUB: return a - b;
    case KW_BINARY_MUL: return a * b;
    case KW_BINARY_DIV: return a / b;
    /* a NaN propagates; equal values (-0.0 and +0.0) give a, as clamp and relu keep x */
    case KW_BINARY_MAX: return a != a || b != b ? a + b : (b > a ? b : a);
    default: return a != a || b != b ? a + b : (b < a ? b : a);
    }
}

static inline float kw__silu(float x) { return x / (1.0f + expf(-x)); }

/* ATen's scalar formulas (activation.cpp): kAlpha = M_SQRT1_2,
 * kBeta = M_SQRT2 * M_2_SQRTPI * 0.5, kKappa = 0.044715. */
static inline float kw__gelu(float x, int mode) {
    if (mode == KW_GELU_ERF) return x * 0.5f * (1.0f + erff(x * 0.70710678118654752f));
    const float inner = 0.79788456080286536f * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
}

#endif
