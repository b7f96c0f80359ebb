/* Elementwise ops over strided tensors with broadcasting (any rank up to
 * KW_MAX_DIMS; dims contiguous in every operand are merged first): inputs are
 * broadcast to y's shape as in PyTorch (missing or size-1 dims repeat).
 * Computation is in f32 with one rounding to y's dtype, as ATen does for bf16,
 * except where eager rounds an intermediate (silu_mul rounds silu to the gate's
 * dtype). y may be the same memory as an input of its shape (in place). Threads
 * split the flat index space.
 *
 *   binary   y = a (op) b, op = ip[0] (kw_binary_op); b absent: b = fp[0].
 *            F32/BF16 (y has the promoted dtype), or I64 throughout
 *            (add, sub, mul, maximum, minimum; wrapping like PyTorch; and
 *            floor_divide by a scalar b != 0: rounded towards -inf, as
 *            PyTorch's integer floor division, INT64_MIN // -1 wrapping).
 *   silu_mul y = F.silu(gate) * up: silu rounded to gate's dtype, then the product
 *            rounded to y's (the promoted dtype of gate and up).
 *   gelu_mul y = F.gelu(gate, approximate=...) * up (Gemma's MLP), rounded as
 *            silu_mul; ip[0] KW_GELU_ERF or KW_GELU_TANH.
 *   gelu     y = F.gelu(x, approximate=...), ip[0] KW_GELU_ERF or KW_GELU_TANH.
 *   unary    y = f(x), f = ip[0] (kw_unary_op: cos, sin, exp, ...), y with x's
 *            dtype. Scalar only (libm): it serves decode-sized tensors such as
 *            the rotary tables, where a vector variant would buy nothing.
 *   compare  y = a (op) b, op = ip[0] (kw_compare_op: eq, ne, lt, le, gt, ge),
 *            y bool; a and b of one dtype: int64 or int32 (compared as
 *            integers), float32 or bfloat16 (a NaN is unequal to everything);
 *            b absent: b = fp[0], rounded to a's dtype as ATen casts a scalar.
 *            Scalar only: it serves masks made once per call.
 *   where    y = cond ? x : fp[0] (ip[0] KW_WHERE_X_IF_TRUE) or cond ? fp[0] : x
 *            (KW_WHERE_X_IF_FALSE), cond bool, x and y float32 or bfloat16 of one
 *            dtype (fp[0] rounded to it). Scalar only: it serves masks made once
 *            per call (T5's position bias where the padding mask keeps it).
 *   convert  y = x.to(y.dtype) for any two dtypes. Float to an integer truncates,
 *            and where C leaves it undefined (NaN, out of range) gives what
 *            PyTorch's conversion gives on x86-64, cvttss2si's "integer
 *            indefinite": the minimum of int64 for int64, of int32 for int32
 *            and uint8, which takes the low bits of an int32 (-1.0 -> 255,
 *            300.0 -> 44, 3e9 -> 0). */
#include "eltwise.h"

static kw_dtype promote(kw_dtype a, kw_dtype b) { return a == KW_F32 || b == KW_F32 ? KW_F32 : a; }

static int need(const kw_tensor *t, const char *op, const char *slot, int floats_only, char *msg, size_t len) {
    if (!kw__present(t) || (floats_only && !kw__is_float(t->dtype)))
        return kw__fail(msg, len, KW_EDTYPE, "%s: %s must be %s (got %s)", op, slot,
                        floats_only ? "float32 or bfloat16" : "present", kw__shape(t).s);
    return 0;
}

static int ew_init(kw__ew *e, const kw_call *c, int n_in, const char *op, char *msg, size_t len) {
    const kw_tensor *ops[3] = {&c->t[0], &c->t[1], &c->t[2]};
    if (!kw__nd_init(&e->nd, ops, n_in + 1))
        return kw__fail(msg, len, KW_ESHAPE, "%s: inputs %s%s%s must broadcast to y %s", op, kw__shape(ops[1]).s,
                        n_in > 1 ? " and " : "", n_in > 1 ? kw__shape(ops[2]).s : "", kw__shape(ops[0]).s);
    e->n_in = n_in;
    e->yt = c->t[0].dtype, e->at = c->t[1].dtype, e->bt = n_in > 1 ? c->t[2].dtype : e->at;
    return 0;
}

/* ---- binary ---- */

static int binary_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *a = &c->t[1], *b = &c->t[2];
    const int has_b = kw__present(b), ints = a->dtype == KW_I64;
    kw__ew *e = prep;
    int err;
    if (c->ip[0] < 0 || c->ip[0] >= KW_BINARY_COUNT || (ints && c->ip[0] == KW_BINARY_DIV))
        return kw__fail(msg, len, KW_EINVAL, "binary: ip[0] must be a kw_binary_op, not div for int64 (got %lld)",
                        (long long)c->ip[0]);
    if (c->ip[0] == KW_BINARY_FLOOR_DIV && (!ints || has_b || c->fp[0] == 0.0 || c->fp[0] != (double)(int64_t)c->fp[0]))
        return kw__fail(msg, len, KW_EINVAL,
                        "binary: floor_divide takes int64 a and an integer scalar b (fp[0]) other than 0 (got %s, b %s, "
                        "fp[0] %g)",
                        kw__shape(a).s, has_b ? "a tensor" : "absent", c->fp[0]);
    if ((err = need(y, "binary", "y", !ints, msg, len)) || (err = need(a, "binary", "a", !ints, msg, len)) ||
        (has_b && (err = need(b, "binary", "b", !ints, msg, len))))
        return err;
    const kw_dtype yt = ints ? KW_I64 : has_b ? promote(a->dtype, b->dtype) : a->dtype;
    if (y->dtype != yt || (ints && has_b && b->dtype != KW_I64))
        return kw__fail(msg, len, KW_EDTYPE, "binary: y must be %s, and int64 mixes with no other dtype (got y %s, b %s)",
                        kw_dtype_name(yt), kw__shape(y).s, kw__shape(b).s);
    if ((err = ew_init(e, c, has_b ? 2 : 1, "binary", msg, len))) return err;
    e->mode = (int)c->ip[0];
    e->scalar = c->fp[0];
    e->run = KW__PICK(kw__binary_share, isa);
    return 0;
}

/* a // b rounded towards -inf, b != 0 (prepare); -1 negates, so INT64_MIN wraps
 * instead of trapping. */
static uint64_t floor_div(int64_t a, int64_t b) {
    if (b == -1) return -(uint64_t)a;
    const int64_t q = a / b;
    return (uint64_t)(q - ((a % b != 0) && ((a < 0) != (b < 0))));
}

static void binary_int(const kw__ew *e, int ith, int nth) {
    const int last = e->nd.ndim - 1;
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3], n;
    while (kw__nd_next(&e->nd, &it, off, &n)) {
        const int64_t *a = (const int64_t *)e->a + off[1], *b = e->b ? (const int64_t *)e->b + off[2] : NULL;
        int64_t *y = (int64_t *)e->y + off[0];
        for (int64_t i = 0; i < n; i++) {
            const uint64_t x = (uint64_t)a[i * e->nd.stride[1][last]];
            const uint64_t z = b ? (uint64_t)b[i * e->nd.stride[2][last]] : (uint64_t)(int64_t)e->scalar;
            uint64_t r;
            switch (e->mode) {
            case KW_BINARY_ADD: r = x + z; break;
            case KW_BINARY_SUB: r = x - z; break;
            case KW_BINARY_MUL: r = x * z; break;
            case KW_BINARY_MAX: r = (int64_t)x > (int64_t)z ? x : z; break;
            case KW_BINARY_MIN: r = (int64_t)x < (int64_t)z ? x : z; break;
            default: r = floor_div((int64_t)x, (int64_t)z); break;
            }
            y[i * e->nd.stride[0][last]] = (int64_t)r;
        }
    }
}

void kw__binary_share_scalar(const kw__ew *e, int ith, int nth) {
    if (e->yt == KW_I64) {
        binary_int(e, ith, nth);
        return;
    }
    const int last = e->nd.ndim - 1;
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i++) {
            const float a = kw__ldf(e->a, off[1] + i * e->nd.stride[1][last], e->at);
            const float b = e->b ? kw__ldf(e->b, off[2] + i * e->nd.stride[2][last], e->bt) : (float)e->scalar;
            kw__stf(e->y, off[0] + i * e->nd.stride[0][last], e->yt, kw__binary_f(e->mode, a, b));
        }
}

/* ---- silu_mul ---- */

/* silu_mul and gelu_mul: y, gate, up, y of their promoted dtype. */
static int gated_prepare(const kw_call *c, const char *op, kw__ew *e, char *msg, size_t len) {
    int err;
    if ((err = need(&c->t[0], op, "y", 1, msg, len)) || (err = need(&c->t[1], op, "gate", 1, msg, len)) ||
        (err = need(&c->t[2], op, "up", 1, msg, len)))
        return err;
    const kw_dtype yt = promote(c->t[1].dtype, c->t[2].dtype);
    if (c->t[0].dtype != yt)
        return kw__fail(msg, len, KW_EDTYPE, "%s: y must be %s, the promoted dtype of gate and up (got %s)", op,
                        kw_dtype_name(yt), kw__shape(&c->t[0]).s);
    return ew_init(e, c, 2, op, msg, len);
}

static int silu_mul_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    kw__ew *e = prep;
    e->run = KW__PICK(kw__silu_mul_share, isa);
    return gated_prepare(c, "silu_mul", e, msg, len);
}

void kw__silu_mul_share_scalar(const kw__ew *e, int ith, int nth) {
    const int last = e->nd.ndim - 1;
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i++) {
            const float g = kw__ldf(e->a, off[1] + i * e->nd.stride[1][last], e->at);
            const float u = kw__ldf(e->b, off[2] + i * e->nd.stride[2][last], e->bt);
            kw__stf(e->y, off[0] + i * e->nd.stride[0][last], e->yt, kw__round_to(kw__silu(g), e->at) * u);
        }
}

/* ---- gelu_mul ---- */

static int gelu_mul_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    kw__ew *e = prep;
    if (c->ip[0] != KW_GELU_ERF && c->ip[0] != KW_GELU_TANH)
        return kw__fail(msg, len, KW_EINVAL, "gelu_mul: ip[0] must be KW_GELU_ERF or KW_GELU_TANH (got %lld)",
                        (long long)c->ip[0]);
    e->mode = (int)c->ip[0];
    e->run = KW__PICK(kw__gelu_mul_share, isa);
    return gated_prepare(c, "gelu_mul", e, msg, len);
}

void kw__gelu_mul_share_scalar(const kw__ew *e, int ith, int nth) {
    const int last = e->nd.ndim - 1;
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i++) {
            const float g = kw__ldf(e->a, off[1] + i * e->nd.stride[1][last], e->at);
            const float u = kw__ldf(e->b, off[2] + i * e->nd.stride[2][last], e->bt);
            kw__stf(e->y, off[0] + i * e->nd.stride[0][last], e->yt, kw__round_to(kw__gelu(g, e->mode), e->at) * u);
        }
}

/* ---- gelu ---- */

static int gelu_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    kw__ew *e = prep;
    int err;
    if ((err = need(&c->t[0], "gelu", "y", 1, msg, len)) || (err = need(&c->t[1], "gelu", "x", 1, msg, len))) return err;
    if (c->t[0].dtype != c->t[1].dtype)
        return kw__fail(msg, len, KW_EDTYPE, "gelu: y must have x's dtype %s (got %s)", kw_dtype_name(c->t[1].dtype),
                        kw__shape(&c->t[0]).s);
    if (c->ip[0] != KW_GELU_ERF && c->ip[0] != KW_GELU_TANH)
        return kw__fail(msg, len, KW_EINVAL, "gelu: ip[0] must be KW_GELU_ERF or KW_GELU_TANH (got %lld)",
                        (long long)c->ip[0]);
    e->mode = (int)c->ip[0];
    e->run = KW__PICK(kw__gelu_share, isa);
    return ew_init(e, c, 1, "gelu", msg, len);
}

/* ---- unary ---- */

static void unary_share(const kw__ew *e, int ith, int nth);

static int unary_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    kw__ew *e = prep;
    int err;
    if ((err = need(&c->t[0], "unary", "y", 1, msg, len)) || (err = need(&c->t[1], "unary", "x", 1, msg, len)))
        return err;
    if (c->t[0].dtype != c->t[1].dtype)
        return kw__fail(msg, len, KW_EDTYPE, "unary: y must have x's dtype %s (got %s)", kw_dtype_name(c->t[1].dtype),
                        kw__shape(&c->t[0]).s);
    if (c->ip[0] < 0 || c->ip[0] >= KW_UNARY_COUNT)
        return kw__fail(msg, len, KW_EINVAL, "unary: ip[0] must be a kw_unary_op (got %lld)", (long long)c->ip[0]);
    e->mode = (int)c->ip[0];
    e->run = unary_share; /* scalar only (libm): decode-sized tensors such as rotary tables */
    return ew_init(e, c, 1, "unary", msg, len);
}

static float unary_f(int op, float x) {
    switch (op) {
    case KW_UNARY_COS: return cosf(x);
    case KW_UNARY_SIN: return sinf(x);
    case KW_UNARY_EXP: return expf(x);
    case KW_UNARY_TANH: return tanhf(x);
    case KW_UNARY_SQRT: return sqrtf(x);
    case KW_UNARY_RSQRT: return 1.0f / sqrtf(x);
    case KW_UNARY_SILU: return kw__silu(x);
    case KW_UNARY_SIGMOID: return 1.0f / (1.0f + expf(-x));
    case KW_UNARY_LOG: return logf(x);
    case KW_UNARY_FLOOR: return floorf(x);
    default: return fabsf(x);
    }
}

static void unary_share(const kw__ew *e, int ith, int nth) {
    const int last = e->nd.ndim - 1;
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[2], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i++)
            kw__stf(e->y, off[0] + i * e->nd.stride[0][last], e->yt,
                    unary_f(e->mode, kw__ldf(e->a, off[1] + i * e->nd.stride[1][last], e->at)));
}

void kw__gelu_share_scalar(const kw__ew *e, int ith, int nth) {
    const int last = e->nd.ndim - 1;
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[2], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i++)
            kw__stf(e->y, off[0] + i * e->nd.stride[0][last], e->yt,
                    kw__gelu(kw__ldf(e->a, off[1] + i * e->nd.stride[1][last], e->at), e->mode));
}

/* ---- convert ---- */

static int convert_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    kw__ew *e = prep;
    int err;
    if ((err = need(&c->t[0], "convert", "y", 0, msg, len)) || (err = need(&c->t[1], "convert", "x", 0, msg, len)))
        return err;
    e->run = KW__PICK(kw__convert_share, isa);
    return ew_init(e, c, 1, "convert", msg, len);
}

static int is_floatish(kw_dtype dt) { return dt == KW_F32 || dt == KW_BF16 || dt == KW_F16; }

static int64_t ld_int(const void *p, int64_t i, kw_dtype dt) {
    switch (dt) {
    case KW_I64: return ((const int64_t *)p)[i];
    case KW_I32: return ((const int32_t *)p)[i];
    default: return ((const uint8_t *)p)[i]; /* U8, BOOL */
    }
}

static void st_int(void *p, int64_t i, kw_dtype dt, int64_t v) {
    switch (dt) {
    case KW_I64: ((int64_t *)p)[i] = v; break;
    case KW_I32: ((int32_t *)p)[i] = (int32_t)(uint32_t)(uint64_t)v; break; /* wraps, as PyTorch */
    case KW_BOOL: ((uint8_t *)p)[i] = v != 0; break;
    default: ((uint8_t *)p)[i] = (uint8_t)(uint64_t)v; break;
    }
}

/* f32 to an integer dtype as on x86-64 (convert, above): int64 through a 64-bit
 * truncation, int32 and uint8 through a 32-bit one (st_int keeps uint8's low
 * bits), NaN and out of range giving that width's minimum; to bool: x != 0. */
static int64_t f_to_int(float v, kw_dtype dt) {
    if (dt == KW_BOOL) return v != 0.0f;
    const float hi = dt == KW_I64 ? 9223372036854775808.0f : 2147483648.0f;
    if (!(v >= -hi && v < hi)) return dt == KW_I64 ? INT64_MIN : INT32_MIN;
    return (int64_t)v;
}

static void convert_one(const kw__ew *e, int64_t yo, int64_t xo) {
    if (is_floatish(e->at)) {
        const float v = kw__ldf(e->a, xo, e->at);
        if (is_floatish(e->yt))
            kw__stf(e->y, yo, e->yt, v);
        else
            st_int(e->y, yo, e->yt, f_to_int(v, e->yt));
    } else {
        const int64_t v = ld_int(e->a, xo, e->at);
        if (is_floatish(e->yt))
            kw__stf(e->y, yo, e->yt, (float)v);
        else
            st_int(e->y, yo, e->yt, v);
    }
}

void kw__convert_share_scalar(const kw__ew *e, int ith, int nth) {
    const int last = e->nd.ndim - 1;
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[2], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i++)
            convert_one(e, off[0] + i * e->nd.stride[0][last], off[1] + i * e->nd.stride[1][last]);
}

/* ---- where ---- */

static void where_share(const kw__ew *e, int ith, int nth);

static int where_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *cond = &c->t[1], *x = &c->t[2];
    kw__ew *e = prep;
    int err;
    if ((err = need(y, "where", "y", 1, msg, len)) || (err = need(cond, "where", "cond", 0, msg, len)) ||
        (err = need(x, "where", "x", 1, msg, len)))
        return err;
    if (cond->dtype != KW_BOOL || x->dtype != y->dtype)
        return kw__fail(msg, len, KW_EDTYPE, "where: cond must be bool and x of y's dtype %s (got cond %s, x %s)",
                        kw_dtype_name(y->dtype), kw__shape(cond).s, kw__shape(x).s);
    if (c->ip[0] != KW_WHERE_X_IF_TRUE && c->ip[0] != KW_WHERE_X_IF_FALSE)
        return kw__fail(msg, len, KW_EINVAL, "where: ip[0] must be KW_WHERE_X_IF_TRUE or _FALSE (got %lld)",
                        (long long)c->ip[0]);
    e->mode = (int)c->ip[0];
    e->scalar = c->fp[0];
    e->run = where_share;
    return ew_init(e, c, 2, "where", msg, len);
}

/* One run of n elements; e->a is cond, e->b is x. dt is a constant at each call
 * site, so that the loads and stores are plain ones: T5-small's [1, 8, 128, 128]
 * mask, a step of its plan, 265 us with the dtype switched per element, 180 so. */
static inline __attribute__((always_inline)) void where_run(const kw__ew *e, const int64_t *off, int64_t n,
                                                            const kw_dtype dt) {
    const int last = e->nd.ndim - 1;
    const int64_t sy = e->nd.stride[0][last], sc = e->nd.stride[1][last], sx = e->nd.stride[2][last];
    const uint8_t *cond = (const uint8_t *)e->a + off[1], keep_x = e->mode == KW_WHERE_X_IF_TRUE;
    const float s = kw__round_to((float)e->scalar, dt);
    for (int64_t i = 0; i < n; i++)
        kw__stf(e->y, off[0] + i * sy, dt, (cond[i * sc] != 0) == keep_x ? kw__ldf(e->b, off[2] + i * sx, dt) : s);
}

static void where_share(const kw__ew *e, int ith, int nth) {
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        if (e->yt == KW_F32)
            where_run(e, off, n, KW_F32);
        else
            where_run(e, off, n, KW_BF16);
}

/* ---- compare ---- */

static void compare_share(const kw__ew *e, int ith, int nth);

static int is_int(kw_dtype dt) { return dt == KW_I64 || dt == KW_I32; }

static int compare_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *a = &c->t[1], *b = &c->t[2];
    const int has_b = kw__present(b), ints = is_int(a->dtype);
    kw__ew *e = prep;
    int err;
    if ((err = need(y, "compare", "y", 0, msg, len)) || (err = need(a, "compare", "a", 0, msg, len))) return err;
    if (c->ip[0] < 0 || c->ip[0] >= KW_COMPARE_COUNT)
        return kw__fail(msg, len, KW_EINVAL, "compare: ip[0] must be a kw_compare_op (got %lld)", (long long)c->ip[0]);
    if (y->dtype != KW_BOOL || !(ints || kw__is_float(a->dtype)) || (has_b && b->dtype != a->dtype))
        return kw__fail(msg, len, KW_EDTYPE,
                        "compare: y must be bool, a int64, int32, float32 or bfloat16 and b of a's dtype (got y %s, "
                        "a %s, b %s)",
                        kw__shape(y).s, kw__shape(a).s, has_b ? kw__shape(b).s : "absent");
    /* ATen casts a scalar to a's dtype first: a float one is rounded, an integer
     * one must be exact, and in int32's range for an int32 a (where ATen wraps it). */
    const double lim = a->dtype == KW_I32 ? 2147483647.0 : 0x1p53, s = c->fp[0];
    if (!has_b && ints && !(s >= -lim - (a->dtype == KW_I32) && s <= lim && s == (double)(int64_t)s))
        return kw__fail(msg, len, KW_EINVAL, "compare: an integer a takes an integer scalar b (fp[0]) within %s (got %g)",
                        a->dtype == KW_I32 ? "int32's range" : "+-2^53", s);
    e->mode = (int)c->ip[0];
    e->scalar = ints ? s : kw__round_to((float)s, a->dtype);
    e->run = compare_share;
    return ew_init(e, c, has_b ? 2 : 1, "compare", msg, len);
}

/* NaN compares unequal to everything, itself included, as in C. */
#define KW__COMPARE(op, x, z)             \
    ((op) == KW_COMPARE_EQ   ? (x) == (z) \
     : (op) == KW_COMPARE_NE ? (x) != (z) \
     : (op) == KW_COMPARE_LT ? (x) < (z)  \
     : (op) == KW_COMPARE_LE ? (x) <= (z) \
     : (op) == KW_COMPARE_GT ? (x) > (z)  \
                             : (x) >= (z))

static void compare_share(const kw__ew *e, int ith, int nth) {
    const int last = e->nd.ndim - 1, ints = is_int(e->at);
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i++) {
            const int64_t ao = off[1] + i * e->nd.stride[1][last], bo = off[2] + i * e->nd.stride[2][last];
            uint8_t r;
            if (ints) {
                const int64_t x = ld_int(e->a, ao, e->at), z = e->b ? ld_int(e->b, bo, e->bt) : (int64_t)e->scalar;
                r = KW__COMPARE(e->mode, x, z);
            } else {
                const float x = kw__ldf(e->a, ao, e->at), z = e->b ? kw__ldf(e->b, bo, e->bt) : (float)e->scalar;
                r = KW__COMPARE(e->mode, x, z);
            }
            ((uint8_t *)e->y)[off[0] + i * e->nd.stride[0][last]] = r;
        }
}

/* ---- ops ---- */

static void ew_kernel(const kw_call *c, int ith, int nth) {
    kw__ew e = *(const kw__ew *)c->prep;
    e.y = c->t[0].data, e.a = c->t[1].data, e.b = e.n_in > 1 ? c->t[2].data : NULL;
    e.run(&e, ith, nth);
}

/* Slots y, a, b (optional); ip[0] kw_binary_op; fp[0] b when b is absent. */
const kw_op_info kw_op_info_binary = {
    .name = "binary",
    .n_tensors = 3,
    .arg = {{"y", KW_WRITE, 0}, {"a", KW_READ, 0}, {"b", KW_READ, 1}},
    .n_ip = 1,
    .n_fp = 1,
    .prepare = binary_prepare,
    .prep_size = sizeof(kw__ew),
    .kernel = ew_kernel,
    .in_place = 1,
};

/* Slots y, x; ip[0] kw_unary_op. */
const kw_op_info kw_op_info_unary = {
    .name = "unary",
    .n_tensors = 2,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .n_ip = 1,
    .prepare = unary_prepare,
    .prep_size = sizeof(kw__ew),
    .kernel = ew_kernel,
    .in_place = 1,
};

/* Slots y, gate, up. */
const kw_op_info kw_op_info_silu_mul = {
    .name = "silu_mul",
    .n_tensors = 3,
    .arg = {{"y", KW_WRITE, 0}, {"gate", KW_READ, 0}, {"up", KW_READ, 0}},
    .prepare = silu_mul_prepare,
    .prep_size = sizeof(kw__ew),
    .kernel = ew_kernel,
    .in_place = 1,
};

/* Slots y, gate, up; ip[0] KW_GELU_ERF or KW_GELU_TANH. */
const kw_op_info kw_op_info_gelu_mul = {
    .name = "gelu_mul",
    .n_tensors = 3,
    .arg = {{"y", KW_WRITE, 0}, {"gate", KW_READ, 0}, {"up", KW_READ, 0}},
    .n_ip = 1,
    .prepare = gelu_mul_prepare,
    .prep_size = sizeof(kw__ew),
    .kernel = ew_kernel,
    .in_place = 1,
};

/* Slots y, x; ip[0] KW_GELU_ERF or KW_GELU_TANH. */
const kw_op_info kw_op_info_gelu = {
    .name = "gelu",
    .n_tensors = 2,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .n_ip = 1,
    .prepare = gelu_prepare,
    .prep_size = sizeof(kw__ew),
    .kernel = ew_kernel,
    .in_place = 1,
};

/* Slots y, cond, x (both broadcast to y); ip[0] KW_WHERE_X_IF_TRUE or _FALSE;
 * fp[0] the other side. */
const kw_op_info kw_op_info_where = {
    .name = "where",
    .n_tensors = 3,
    .arg = {{"y", KW_WRITE, 0}, {"cond", KW_READ, 0}, {"x", KW_READ, 0}},
    .n_ip = 1,
    .n_fp = 1,
    .prepare = where_prepare,
    .prep_size = sizeof(kw__ew),
    .kernel = ew_kernel,
    .in_place = 1,
};

/* Slots y, a, b (optional; both broadcast to y); ip[0] kw_compare_op; fp[0] b
 * when b is absent. */
const kw_op_info kw_op_info_compare = {
    .name = "compare",
    .n_tensors = 3,
    .arg = {{"y", KW_WRITE, 0}, {"a", KW_READ, 0}, {"b", KW_READ, 1}},
    .n_ip = 1,
    .n_fp = 1,
    .prepare = compare_prepare,
    .prep_size = sizeof(kw__ew),
    .kernel = ew_kernel,
};

/* Slots y, x (x broadcast to y; also a plain strided copy when dtypes match). */
const kw_op_info kw_op_info_convert = {
    .name = "convert",
    .n_tensors = 2,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .prepare = convert_prepare,
    .prep_size = sizeof(kw__ew),
    .kernel = ew_kernel,
    .in_place = 1,
};
