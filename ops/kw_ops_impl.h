/* kw_ops_impl.h — private helpers for ops/ sources: bf16/f16 rounding exactly as
 * PyTorch does it, tensor geometry, check messages and work splitting. Nothing
 * outside ops/ (and its tests) includes this header. No intrinsics here: the
 * vector layer is simd.h, included by ISA files only. */
#ifndef KW_OPS_IMPL_H
#define KW_OPS_IMPL_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kw_ops.h"

#define KW__MIN(a, b) ((a) < (b) ? (a) : (b))
#define KW__MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- reduced-precision floats ---------------------------------------------------- */

static inline float kw__bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* c10::BFloat16's round_to_nearest_even: NaN becomes the canonical quiet NaN,
 * everything else (denormals included) rounds to nearest, ties to even. */
static inline uint16_t kw__f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE half, as c10::Half converts (baseline x86-64 has no F16C). */
static inline float kw__f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* denormal half: normalise */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t kw__f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00;              /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00;             /* rounds to inf */
    if (a < 0x38800000u) {                                   /* half denormal or zero */
        if (a < 0x33000000u) return sign;                    /* below half of the smallest */
        const uint32_t man = (a & 0x7fffff) | 0x800000;
        const int shift = 126 - (int)(a >> 23);              /* 14 .. 24 */
        const uint32_t q = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        return sign | (uint16_t)(q + (rem > half || (rem == half && (q & 1))));
    }
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u); /* round mantissa to 10 bits */
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

/* One element of a float-like tensor (F32, BF16, F16) as f32, and back. */
static inline float kw__ldf(const void *p, int64_t i, kw_dtype dt) {
    switch (dt) {
    case KW_BF16: return kw__bf16_to_f32(((const uint16_t *)p)[i]);
    case KW_F16: return kw__f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void kw__stf(void *p, int64_t i, kw_dtype dt, float v) {
    switch (dt) {
    case KW_BF16: ((uint16_t *)p)[i] = kw__f32_to_bf16(v); break;
    case KW_F16: ((uint16_t *)p)[i] = kw__f32_to_f16(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

/* What PyTorch does when it stores an f32 result into a tensor of dtype dt and
 * later reads it back: the intermediate rounding of eager bf16 arithmetic. */
static inline float kw__round_to(float v, kw_dtype dt) {
    return dt == KW_BF16 ? kw__bf16_to_f32(kw__f32_to_bf16(v)) : v;
}

static inline int kw__is_float(kw_dtype dt) { return dt == KW_F32 || dt == KW_BF16; }

/* ---- tensor geometry ------------------------------------------------------------- */

static inline int kw__present(const kw_tensor *t) { return t->data != NULL; }

/* An index out of range in the data (kw_fault): the first report of a replay wins. */
static inline void kw__report_index(const kw_call *c, int64_t index, int64_t size) {
    int expected = 0;
    if (!c->fault || !atomic_compare_exchange_strong(&c->fault->reported, &expected, 1)) return;
    c->fault->call = c;
    c->fault->index = index;
    c->fault->size = size;
}

static inline int64_t kw__numel(const kw_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static inline int64_t kw__last(const kw_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }

static inline char *kw__ptr(const kw_tensor *t, int64_t elem_offset) {
    return (char *)t->data + elem_offset * (int64_t)kw_dtype_size(t->dtype);
}

/* ---- ISA variants ------------------------------------------------------------------
 * A function with vector variants has its scalar reference fn_scalar in its
 * family's <family>.c, and its vector body, written once over simd.h, in
 * <family>_simd.c, which ops/CMakeLists.txt compiles once per vector ISA with
 * that ISA's flags alone (simd.h names each build's copy fn_avx2, fn_avx512,
 * fn_avx512bf16). KW__VARIANTS declares the four; an op's prepare stores
 * KW__PICK(fn, isa), the variant for the plan's ISA cap, in its prepared call. */
#define KW__VARIANTS(ret, fn, params) \
    ret fn##_scalar params;           \
    ret fn##_avx2 params;             \
    ret fn##_avx512 params;           \
    ret fn##_avx512bf16 params;
#define KW__PICK(fn, isa)                          \
    ((isa) >= KW_ISA_AVX512BF16 ? fn##_avx512bf16 \
     : (isa) >= KW_ISA_AVX512   ? fn##_avx512     \
     : (isa) >= KW_ISA_AVX2     ? fn##_avx2       \
                                : fn##_scalar)

/* Thread ith's scratch (kw_call.work), sized by the op's work_size. */
static inline void *kw__work(const kw_call *c, int ith) {
    return c->work ? (char *)c->work + (size_t)ith * c->work_stride : NULL;
}

/* A tensor seen as rows of its last dimension: the last dim is contiguous and the
 * leading dims collapse into one row stride. Returns 0 when they do not. */
int kw__rows_of(const kw_tensor *t, int64_t *rows, int64_t *row_stride);

/* A tensor addressed by rows (see kw__rows_of). */
typedef struct kw__row_ref {
    char *p;    /* NULL when the tensor is absent */
    int64_t rs; /* row stride in elements */
    kw_dtype dt;
} kw__row_ref;

static inline char *kw__row(const kw__row_ref *r, int64_t row) {
    return r->p + (size_t)(row * r->rs) * kw_dtype_size(r->dt);
}

/* Row-major contiguous (size-1 dims may have any stride; a tensor of no elements is). */
int kw__is_contiguous(const kw_tensor *t);

/* Same shape, element for element. */
int kw__same_shape(const kw_tensor *a, const kw_tensor *b);

/* ---- check messages -------------------------------------------------------------- */

typedef struct kw__shape_text {
    char s[112];
} kw__shape_text;

/* "[2, 3] bfloat16": used inside check messages (a temporary lives until the end
 * of the full expression, so kw__shape(t).s may be passed to kw__fail). */
kw__shape_text kw__shape(const kw_tensor *t);

/* Writes the formatted text (which starts with the op's name) into msg and
 * returns err. */
int kw__fail(char *msg, size_t len, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- work splitting -------------------------------------------------------------- */

/* Thread ith's share [lo, hi) of n items, in whole units of `align` items
 * (the last share takes the remainder). Shares differ by at most one unit. */
static inline void kw__split(int64_t n, int64_t align, int ith, int nth, int64_t *lo, int64_t *hi) {
    const int64_t units = (n + align - 1) / align, base = units / nth, extra = units % nth;
    const int64_t u0 = ith * base + KW__MIN(ith, extra), u1 = u0 + base + (ith < extra);
    *lo = KW__MIN(u0 * align, n);
    *hi = KW__MIN(u1 * align, n);
}

/* ---- broadcast iteration for elementwise ops --------------------------------------- */

#define KW__ND_MAX_OPS 3

/* Up to KW__ND_MAX_OPS operands walked over the output's index space in the
 * output's memory order: operand 0 is the output, the others are broadcast to it
 * (size-1 or missing dims get stride 0). Dims that are contiguous for every
 * operand are merged, so tensors of one dense layout become one long inner run. */
typedef struct kw__nd {
    int ndim, n_ops;
    int64_t shape[KW_MAX_DIMS];
    int64_t stride[KW__ND_MAX_OPS][KW_MAX_DIMS];
    int64_t inner, total;
} kw__nd;

/* Returns 0 when an operand does not broadcast to ops[0]'s shape. */
int kw__nd_init(kw__nd *nd, const kw_tensor *const *ops, int n_ops);

/* Thread ith's share of the flat index space (in the walk's order), walked run
 * by run: each kw__nd_next gives `n` elements starting at element offsets off[k],
 * to be stepped with the inner strides nd->stride[k][nd->ndim - 1]. Shares are
 * whole multiples of 64 elements so vector loops rarely see a ragged edge. The
 * index is divided out once per share, then stepped like an odometer: runs of 64
 * (Whisper's heads made contiguous, [6, 1500, 64]) spent more on the divisions
 * than on their data. */
typedef struct kw__nd_it {
    int64_t i, hi;                 /* the next run's flat index; the share's end */
    int64_t idx[KW_MAX_DIMS];      /* the next run's index in each dim */
    int64_t off[KW__ND_MAX_OPS];   /* each operand's element offset there */
} kw__nd_it;

static inline kw__nd_it kw__nd_share(const kw__nd *nd, int ith, int nth) {
    kw__nd_it it;
    kw__split(nd->total, 64, ith, nth, &it.i, &it.hi);
    for (int k = 0; k < nd->n_ops; k++) it.off[k] = 0;
    int64_t rest = it.i;
    for (int d = nd->ndim - 1; d >= 0; d--) {
        it.idx[d] = nd->total ? rest % nd->shape[d] : 0; /* a total of 0: a dim of 0, nothing to walk */
        rest = nd->total ? rest / nd->shape[d] : 0;
        for (int k = 0; k < nd->n_ops; k++) it.off[k] += it.idx[d] * nd->stride[k][d];
    }
    return it;
}

static inline int kw__nd_next(const kw__nd *nd, kw__nd_it *it, int64_t *off, int64_t *n) {
    if (it->i >= it->hi) return 0;
    const int last = nd->ndim - 1;
    *n = KW__MIN(nd->inner - it->idx[last], it->hi - it->i);
    it->i += *n;
    it->idx[last] += *n;
    for (int k = 0; k < nd->n_ops; k++) off[k] = it->off[k], it->off[k] += *n * nd->stride[k][last];
    for (int d = last; d > 0 && it->idx[d] == nd->shape[d]; d--) { /* carry into the dim outside */
        it->idx[d] = 0;
        it->idx[d - 1]++;
        for (int k = 0; k < nd->n_ops; k++) it->off[k] += nd->stride[k][d - 1] - nd->shape[d] * nd->stride[k][d];
    }
    return 1;
}

#endif
