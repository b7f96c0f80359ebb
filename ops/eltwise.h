/* eltwise.h — private to the elementwise ops (binary, silu_mul, gelu, convert):
 * the operands walked by one broadcast iterator (kw__nd), built by eltwise.c and
 * run on a thread's share by each ISA. */
#ifndef KW_ELTWISE_H
#define KW_ELTWISE_H

#include "kw_ops_impl.h"

typedef struct kw__ew {
    kw__nd nd;    /* operand 0 is y, then a, then b when present */
    char *y;
    const char *a, *b; /* b NULL: binary uses `scalar` instead */
    kw_dtype yt, at, bt;
    int mode;     /* binary: kw_binary_op; gelu: KW_GELU_* */
    double scalar; /* binary: b when slot 2 is absent (fp[0]) */
} kw__ew;

typedef void (*kw__ew_fn)(const kw__ew *e, int ith, int nth);

#define KW__EW_DECLARE(name)                                   \
    void kw__##name##_share_scalar(const kw__ew *e, int ith, int nth); \
    void kw__##name##_share_avx2(const kw__ew *e, int ith, int nth);   \
    void kw__##name##_share_avx512(const kw__ew *e, int ith, int nth);
KW__EW_DECLARE(binary)
KW__EW_DECLARE(silu_mul)
KW__EW_DECLARE(gelu)
KW__EW_DECLARE(convert)
#undef KW__EW_DECLARE

/* Shared by the scalar references and the ISA files' edge cases. */
static inline float kw__binary_f(int op, float a, float b) {
    switch (op) {
    case KW_BINARY_ADD: return a + b;
    case KW_BINARY_SUB: return a - b;
    case KW_BINARY_MUL: return a * b;
    case KW_BINARY_DIV: return a / b;
    case KW_BINARY_MAX: return a != a || b != b ? a + b : (a > b ? a : b); /* NaN propagates */
    default: return a != a || b != b ? a + b : (a < b ? a : b);
    }
}

static inline float kw__silu(float x) { return x / (1.0f + expf(-x)); }

#endif
