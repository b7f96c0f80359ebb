/* attention.h — private to attention (attention of L query positions over a
 * static KV cache): a prepared call as a struct, filled once by attention.c and
 * run over a range of query rows by the ISA variant prepare picked. */
#ifndef KW_ATTENTION_H
#define KW_ATTENTION_H

#include "kw_ops_impl.h"

typedef struct kw__attn kw__attn;
typedef void (*kw__attn_fn)(const kw__attn *a, int64_t u0, int64_t u1, void *work);

/* A unit of work is one query head at one position: u = (b · L + i) · Hq + h. */
struct kw__attn {
    int64_t B, Hq, L, Hkv, G, S, D, Dv; /* G = Hq / Hkv query heads per cache head */
    char *o;
    const char *q, *k, *v, *mask; /* mask NULL: every position is valid */
    int64_t os[3], qs[3];         /* strides of B, H and L */
    int64_t ks[3], vs[3];         /* strides of B, H and S */
    int64_t ms, ml;               /* strides of the mask's B and L (0 when broadcast) */
    kw_dtype ot, qt, kt, vt, mt;
    float scale;
    kw__attn_fn run;
};

/* Scratch per thread: the valid positions (int32[S]), one head's scores (f32[S]),
 * its query widened (f32[D]) and its output accumulators (f32[Dv]). */
static inline size_t kw__attn_work_size(const kw__attn *a) {
    return (size_t)(2 * a->S + a->D + a->Dv) * 4 + 4 * 64;
}

typedef struct kw__attn_scratch {
    int32_t *pos;
    float *scores, *qf, *acc;
} kw__attn_scratch;

static inline kw__attn_scratch kw__attn_carve(const kw__attn *a, void *work) {
    kw__attn_scratch s;
    char *p = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    s.pos = (int32_t *)p;
    p += ((size_t)a->S * 4 + 63) / 64 * 64;
    s.scores = (float *)p;
    p += ((size_t)a->S * 4 + 63) / 64 * 64;
    s.qf = (float *)p;
    p += ((size_t)a->D * 4 + 63) / 64 * 64;
    s.acc = (float *)p;
    return s;
}

/* An additive mask value at or below bfloat16's finfo.min (so float32's min and
 * -inf too) gives exp() == 0 exactly: the position is excluded, never read. */
#define KW__ATTN_MASKED (-3.38953139e38f)

static inline int kw__attn_keep(const kw__attn *a, const char *mrow, int64_t s) {
    if (a->mt == KW_BOOL) return ((const uint8_t *)mrow)[s] != 0;
    return kw__ldf(mrow, s, a->mt) > KW__ATTN_MASKED;
}

static inline float kw__attn_bias(const kw__attn *a, const char *mrow, int64_t s) {
    return a->mask && a->mt != KW_BOOL ? kw__ldf(mrow, s, a->mt) : 0.0f;
}

/* The mask row of query position i of batch b. */
static inline const char *kw__attn_mask_row(const kw__attn *a, int64_t b, int64_t i) {
    return a->mask ? a->mask + (size_t)(b * a->ms + i * a->ml) * kw_dtype_size(a->mt) : NULL;
}

KW__VARIANTS(void, kw__attention_heads, (const kw__attn *a, int64_t u0, int64_t u1, void *work))

#endif
