/* norm.h — private to the row normalisations (rms_norm, add_rms_norm, layer_norm):
 * one prepared call as a struct of row-addressed tensors (norm.c fills it once;
 * the kernel binds each replay's data pointers) run over a range of rows by the
 * ISA variant prepare picked. */
#ifndef KW_NORM_H
#define KW_NORM_H

#include "kw_ops_impl.h"

typedef struct kw__norm kw__norm;
typedef void (*kw__norm_rows_fn)(const kw__norm *p, int64_t r0, int64_t r1);

struct kw__norm {
    int kind; /* enum norm_kind (norm.c) */
    int64_t rows, K;
    kw__row_ref y, x;
    kw__row_ref res, sum; /* add_rms_norm: sum = x + res, normalised into y */
    kw__row_ref w, b;     /* contiguous [K] weight and bias */
    float eps;
    int form; /* rms_norm's KW_NORM_ form */
    kw__norm_rows_fn run;
};

KW__VARIANTS(void, kw__rms_norm_rows, (const kw__norm *p, int64_t r0, int64_t r1))
KW__VARIANTS(void, kw__layer_norm_rows, (const kw__norm *p, int64_t r0, int64_t r1))

static inline kw_dtype kw__promote(kw_dtype a, kw_dtype b) {
    return a == KW_F32 || b == KW_F32 ? KW_F32 : a;
}

/* The dtype of rms_norm's result: Llama's weight * x̂.to(x.dtype) promotes with
 * the weight's dtype; Gemma's and OLMo's cast back to x's dtype. */
static inline kw_dtype kw__rms_out_dtype(const kw__norm *p) {
    return p->w.p && p->form == KW_NORM_LLAMA ? kw__promote(p->x.dt, p->w.dt) : p->x.dt;
}

#endif
