/* Every rule of every op is enforced by its prepare, once, when a plan is
 * finished (kernels check nothing at replay): each rejection branch below is
 * hit by a call that differs from an accepted one in that one respect, and
 * named with its error code and the words of its message. */
#include <criterion/criterion.h>
#include <string.h>

#include "kw_ops.h"
#include "test_ops_util.h"

static _Alignas(64) char mem[64]; /* prepare reads no data: every tensor may point here */

#define DIMS(...) ((const int64_t[]){__VA_ARGS__})

static kw_tensor S(kw_dtype dt, int nd, const int64_t *shape, const int64_t *stride) {
    kw_tensor t = {.data = mem, .dtype = dt, .ndim = nd};
    int64_t expect = 1;
    for (int d = nd - 1; d >= 0; d--) {
        t.shape[d] = shape[d];
        t.stride[d] = stride ? stride[d] : expect;
        expect *= shape[d];
    }
    return t;
}

static kw_tensor T(kw_dtype dt, int nd, const int64_t *shape) { return S(dt, nd, shape, NULL); }

static const kw_tensor absent = {0};

static void accepted(kw_op_id op, kw_call c) {
    char msg[512] = "";
    static _Alignas(64) char prep[4096];
    cr_assert_leq(kw_op_prep_size(op), sizeof prep);
    const int rc = kw_op_prepare(op, &c, kw_cpu_isa(), prep, msg, sizeof msg);
    cr_assert_eq(rc, 0, "%s: the accepted call was rejected: %s", kw_op_get(op)->name, msg);
    if (kw_op_get(op)->release) kw_op_get(op)->release(prep);
}

/* ---- linear, linear_multi, matmul_dnnl: outputs..., x, weight, bias ---- */

static kw_call linear_call(void) {
    return (kw_call){.t = {T(KW_F32, 2, DIMS(2, 8)), T(KW_F32, 2, DIMS(2, 4)), T(KW_F32, 2, DIMS(8, 4)),
                           T(KW_F32, 1, DIMS(8))}};
}

Test(reject, linear) {
    accepted(KW_OP_LINEAR, linear_call());
    kw_call c = linear_call();
    c.t[0] = T(KW_BF16, 2, DIMS(2, 8));
    tt_expect_reject(KW_OP_LINEAR, &c, KW_EDTYPE, "output 0 must have x's dtype");
    c = linear_call();
    c.t[0] = S(KW_F32, 2, DIMS(2, 8), DIMS(1, 2));
    tt_expect_reject(KW_OP_LINEAR, &c, KW_ESHAPE, "contiguous rows like x");
    c = linear_call();
    c.t[1] = T(KW_I64, 2, DIMS(2, 4));
    tt_expect_reject(KW_OP_LINEAR, &c, KW_ESHAPE, "x must be float32 or bfloat16");
    c = linear_call();
    c.t[0] = absent;
    tt_expect_reject(KW_OP_LINEAR, &c, KW_EINVAL, "output 0 (y) is required");
    c = linear_call();
    c.t[1] = T(KW_BF16, 2, DIMS(2, 4)), c.t[0] = T(KW_BF16, 2, DIMS(2, 8));
    tt_expect_reject(KW_OP_LINEAR, &c, KW_EDTYPE, "weight must be bfloat16 when x is bfloat16");
    c = linear_call();
    c.t[2] = T(KW_F32, 2, DIMS(8, 5));
    tt_expect_reject(KW_OP_LINEAR, &c, KW_ESHAPE, "weight must be float32 or bfloat16 [N, K]");
    c = linear_call();
    c.t[3] = T(KW_F32, 1, DIMS(7));
    tt_expect_reject(KW_OP_LINEAR, &c, KW_ESHAPE, "bias must be float32 or bfloat16 [N]");
}

Test(reject, linear_multi) {
    const kw_call ok = {.t = {T(KW_F32, 2, DIMS(2, 6)), T(KW_F32, 2, DIMS(2, 2)), absent, absent,
                              T(KW_F32, 2, DIMS(2, 4)), T(KW_F32, 2, DIMS(8, 4))}};
    accepted(KW_OP_LINEAR_MULTI, ok);
    kw_call c = ok;
    c.t[1] = absent, c.t[2] = T(KW_F32, 2, DIMS(2, 2));
    tt_expect_reject(KW_OP_LINEAR_MULTI, &c, KW_EINVAL, "output 2 given but output 1 absent");
}

Test(reject, matmul_dnnl) {
    accepted(KW_OP_MATMUL_DNNL, linear_call());
    kw_call c = linear_call();
    c.t[2] = T(KW_BF16, 2, DIMS(8, 4));
    tt_expect_reject(KW_OP_MATMUL_DNNL, &c, KW_EDTYPE, "must have x's dtype");
    c = linear_call();
    c.t[1] = T(KW_F32, 2, DIMS(2, 4)), c.t[2] = T(KW_F32, 3, DIMS(2, 8, 2));
    tt_expect_reject(KW_OP_MATMUL_DNNL, &c, KW_ESHAPE, "not K-blocked");
    c = linear_call();
    c.t[3] = S(KW_F32, 1, DIMS(8), DIMS(2));
    tt_expect_reject(KW_OP_MATMUL_DNNL, &c, KW_ESHAPE, "bias must be contiguous");
    /* "oneDNN made no matmul primitive": oneDNN accepts every call the rules above let through. */
}

/* ---- rms_norm (y, x, weight), layer_norm (y, x, weight, bias), add_rms_norm (y, sum, x, residual, weight) ---- */

static kw_call rms_call(void) {
    return (kw_call){.t = {T(KW_F32, 2, DIMS(2, 16)), T(KW_F32, 2, DIMS(2, 16)), T(KW_F32, 1, DIMS(16))},
                     .fp = {1e-5}};
}

Test(reject, rms_norm) {
    accepted(KW_OP_RMS_NORM, rms_call());
    kw_call c = rms_call();
    c.t[1] = T(KW_I64, 2, DIMS(2, 16));
    tt_expect_reject(KW_OP_RMS_NORM, &c, KW_ESHAPE, "x must be float32 or bfloat16 [..., K]");
    c = rms_call();
    c.t[2] = T(KW_F32, 1, DIMS(15));
    tt_expect_reject(KW_OP_RMS_NORM, &c, KW_ESHAPE, "weight must be contiguous");
    c = rms_call();
    c.ip[0] = KW_NORM_FORMS;
    tt_expect_reject(KW_OP_RMS_NORM, &c, KW_EINVAL, "ip[0] must be a KW_NORM_ form, 0 to 2 (got 3)");
    c.ip[0] = -1;
    tt_expect_reject(KW_OP_RMS_NORM, &c, KW_EINVAL, "ip[0] must be a KW_NORM_ form");
    c = rms_call();
    c.t[0] = T(KW_F32, 2, DIMS(2, 15));
    tt_expect_reject(KW_OP_RMS_NORM, &c, KW_ESHAPE, "y must have x's shape");
    c = rms_call();
    c.fp[0] = -1.0;
    tt_expect_reject(KW_OP_RMS_NORM, &c, KW_EINVAL, "(eps) must be >= 0");
}

Test(reject, layer_norm) {
    const kw_call ok = {.t = {T(KW_F32, 2, DIMS(2, 16)), T(KW_F32, 2, DIMS(2, 16)), T(KW_F32, 1, DIMS(16)),
                              T(KW_F32, 1, DIMS(16))},
                        .fp = {1e-5}};
    accepted(KW_OP_LAYER_NORM, ok);
    kw_call c = ok;
    c.t[3] = T(KW_F32, 1, DIMS(15));
    tt_expect_reject(KW_OP_LAYER_NORM, &c, KW_ESHAPE, "layer_norm: bias must be contiguous");
}

Test(reject, add_rms_norm) {
    const kw_call ok = {.t = {T(KW_F32, 2, DIMS(2, 16)), T(KW_F32, 2, DIMS(2, 16)), T(KW_F32, 2, DIMS(2, 16)),
                              T(KW_F32, 2, DIMS(2, 16)), T(KW_F32, 1, DIMS(16))},
                        .fp = {1e-5}};
    accepted(KW_OP_ADD_RMS_NORM, ok);
    kw_call c = ok;
    c.t[3] = T(KW_BF16, 2, DIMS(2, 16));
    tt_expect_reject(KW_OP_ADD_RMS_NORM, &c, KW_ESHAPE, "residual must be like x");
    c = ok;
    c.t[1] = T(KW_F32, 2, DIMS(2, 15));
    tt_expect_reject(KW_OP_ADD_RMS_NORM, &c, KW_ESHAPE, "sum must be like x");
}

/* ---- rotary: y, x, cos, sin; ip[0] mode, ip[1] rotated dims ---- */

static kw_call rotary_call(void) {
    return (kw_call){.t = {T(KW_F32, 4, DIMS(1, 2, 1, 8)), T(KW_F32, 4, DIMS(1, 2, 1, 8)), T(KW_F32, 3, DIMS(1, 1, 8)),
                           T(KW_F32, 3, DIMS(1, 1, 8))}};
}

Test(reject, rotary) {
    accepted(KW_OP_ROTARY, rotary_call());
    kw_call c = rotary_call();
    c.t[1] = T(KW_F32, 3, DIMS(2, 1, 8));
    tt_expect_reject(KW_OP_ROTARY, &c, KW_ESHAPE, "x must be float32 or bfloat16 [B, H, S, D]");
    c = rotary_call();
    c.ip[0] = 5;
    tt_expect_reject(KW_OP_ROTARY, &c, KW_EINVAL, "ip[0] must be KW_ROPE_HALF or KW_ROPE_INTERLEAVED");
    c = rotary_call();
    c.ip[1] = 3;
    tt_expect_reject(KW_OP_ROTARY, &c, KW_EINVAL, "ip[1] (rotated dims) must be even");
    c = rotary_call();
    c.t[2] = T(KW_F32, 3, DIMS(1, 1, 6));
    tt_expect_reject(KW_OP_ROTARY, &c, KW_ESHAPE, "cos must be float32 or bfloat16");
    c = rotary_call();
    c.t[0] = T(KW_BF16, 4, DIMS(1, 2, 1, 8));
    tt_expect_reject(KW_OP_ROTARY, &c, KW_ESHAPE, "y must be float32 shaped like x");
}

/* ---- softmax: y, x ---- */

Test(reject, softmax) {
    const kw_call ok = {.t = {T(KW_F32, 2, DIMS(3, 5)), T(KW_F32, 2, DIMS(3, 5))}};
    accepted(KW_OP_SOFTMAX, ok);
    kw_call c = ok;
    c.t[1] = T(KW_I64, 2, DIMS(3, 5));
    tt_expect_reject(KW_OP_SOFTMAX, &c, KW_ESHAPE, "softmax: x must be float32 or bfloat16");
    c = ok;
    c.t[0] = T(KW_F32, 2, DIMS(3, 4));
    tt_expect_reject(KW_OP_SOFTMAX, &c, KW_ESHAPE, "softmax: y must be float32 or bfloat16 shaped like x");
}

/* ---- attention: out, q, k_cache, v_cache, mask; fp[0] scale ---- */

static kw_call attention_call(void) {
    return (kw_call){.t = {T(KW_F32, 4, DIMS(1, 4, 1, 8)), T(KW_F32, 4, DIMS(1, 4, 1, 8)), T(KW_F32, 4, DIMS(1, 2, 6, 8)),
                           T(KW_F32, 4, DIMS(1, 2, 6, 8)), T(KW_BOOL, 4, DIMS(1, 1, 1, 6))},
                     .fp = {0.35}};
}

Test(reject, attention) {
    accepted(KW_OP_ATTENTION, attention_call());
    kw_call c = attention_call();
    c.t[1] = T(KW_F32, 4, DIMS(1, 4, 2, 8));
    tt_expect_reject(KW_OP_ATTENTION, &c, KW_ESHAPE, "out must be float32 [B, Hq, L, Dv] = [1, 4, 2, 8]");
    c = attention_call();
    c.t[1] = T(KW_I64, 4, DIMS(1, 4, 1, 8));
    tt_expect_reject(KW_OP_ATTENTION, &c, KW_ESHAPE, "q must be float32 or bfloat16 [B, Hq, L, D]");
    c = attention_call();
    c.t[4] = T(KW_BOOL, 4, DIMS(1, 1, 2, 6));
    tt_expect_reject(KW_OP_ATTENTION, &c, KW_ESHAPE, "mask must be bool, float32 or bfloat16 [B or 1, Hq = 4 or 1, L = 1 or 1");
    c = attention_call();
    c.t[4] = T(KW_BOOL, 4, DIMS(1, 4, 1, 6)); /* one mask row per head */
    accepted(KW_OP_ATTENTION, c);
    c.t[4] = T(KW_BOOL, 4, DIMS(1, 2, 1, 6));
    tt_expect_reject(KW_OP_ATTENTION, &c, KW_ESHAPE, "mask must be");
    c = attention_call();
    c.t[2] = T(KW_F32, 4, DIMS(1, 3, 6, 8));
    tt_expect_reject(KW_OP_ATTENTION, &c, KW_ESHAPE, "k_cache must be");
    c = attention_call();
    c.t[3] = T(KW_F32, 4, DIMS(1, 2, 5, 8));
    tt_expect_reject(KW_OP_ATTENTION, &c, KW_ESHAPE, "v_cache must be");
    c = attention_call();
    c.t[0] = T(KW_BF16, 4, DIMS(1, 4, 1, 8));
    tt_expect_reject(KW_OP_ATTENTION, &c, KW_ESHAPE, "out must be float32");
    c = attention_call();
    c.t[4] = T(KW_BOOL, 4, DIMS(1, 1, 1, 5));
    tt_expect_reject(KW_OP_ATTENTION, &c, KW_ESHAPE, "mask must be bool, float32 or bfloat16");
}

/* ---- embedding (y, ids, table), kv_write (cache, src, pos) ---- */

Test(reject, embedding) {
    const kw_call ok = {.t = {T(KW_F32, 3, DIMS(1, 2, 8)), T(KW_I64, 2, DIMS(1, 2)), T(KW_F32, 2, DIMS(10, 8))}};
    accepted(KW_OP_EMBEDDING, ok);
    kw_call c = ok;
    c.t[1] = T(KW_F32, 2, DIMS(1, 2));
    tt_expect_reject(KW_OP_EMBEDDING, &c, KW_EDTYPE, "ids must be contiguous int64 or int32");
    c = ok;
    c.t[2] = T(KW_F32, 3, DIMS(10, 8, 1));
    tt_expect_reject(KW_OP_EMBEDDING, &c, KW_ESHAPE, "table must be float32 or bfloat16 [V, D]");
    c = ok;
    c.t[0] = T(KW_F32, 3, DIMS(1, 2, 7));
    tt_expect_reject(KW_OP_EMBEDDING, &c, KW_ESHAPE, "embedding: y must be");
}

Test(reject, kv_write) {
    const kw_call ok = {.t = {T(KW_F32, 4, DIMS(1, 2, 6, 8)), T(KW_F32, 4, DIMS(1, 2, 1, 8)), T(KW_I64, 1, DIMS(1))}};
    accepted(KW_OP_KV_WRITE, ok);
    kw_call c = ok;
    c.t[0] = T(KW_F32, 3, DIMS(2, 6, 8));
    tt_expect_reject(KW_OP_KV_WRITE, &c, KW_ESHAPE, "kv_write: cache must be");
    c = ok;
    c.t[1] = T(KW_F32, 4, DIMS(1, 3, 1, 8));
    tt_expect_reject(KW_OP_KV_WRITE, &c, KW_ESHAPE, "kv_write: src must be");
    c = ok;
    c.t[2] = T(KW_I64, 1, DIMS(2));
    tt_expect_reject(KW_OP_KV_WRITE, &c, KW_ESHAPE, "kv_write: pos must be");
}

/* ---- binary (y, a, b; ip[0] op, fp[0] scalar), silu_mul and gelu_mul (y, gate, up), gelu, unary, convert ---- */

static kw_call binary_call(void) {
    return (kw_call){.t = {T(KW_F32, 1, DIMS(4)), T(KW_F32, 1, DIMS(4)), T(KW_F32, 1, DIMS(4))}};
}

Test(reject, binary) {
    accepted(KW_OP_BINARY, binary_call());
    kw_call c = binary_call();
    c.t[0] = absent;
    tt_expect_reject(KW_OP_BINARY, &c, KW_EDTYPE, "binary: y must be float32 or bfloat16");
    c = binary_call();
    c.t[1] = T(KW_F32, 1, DIMS(3));
    tt_expect_reject(KW_OP_BINARY, &c, KW_ESHAPE, "must broadcast to y");
    c = binary_call();
    c.t[0] = T(KW_I64, 1, DIMS(4)), c.t[1] = T(KW_I64, 1, DIMS(4)), c.t[2] = T(KW_I64, 1, DIMS(4));
    c.ip[0] = KW_BINARY_DIV;
    tt_expect_reject(KW_OP_BINARY, &c, KW_EINVAL, "not div for int64");
    c.ip[0] = KW_BINARY_FLOOR_DIV; /* b a tensor: a zero in it could not raise */
    tt_expect_reject(KW_OP_BINARY, &c, KW_EINVAL, "floor_divide takes int64 a and an integer scalar b");
    c.t[2] = absent, c.fp[0] = 0;
    tt_expect_reject(KW_OP_BINARY, &c, KW_EINVAL, "other than 0");
    c.fp[0] = 2;
    accepted(KW_OP_BINARY, c);
    c = binary_call();
    c.ip[0] = KW_BINARY_FLOOR_DIV;
    tt_expect_reject(KW_OP_BINARY, &c, KW_EINVAL, "floor_divide takes int64 a");
    c = binary_call();
    c.t[1] = T(KW_BF16, 1, DIMS(4)), c.t[2] = T(KW_BF16, 1, DIMS(4));
    tt_expect_reject(KW_OP_BINARY, &c, KW_EDTYPE, "y must be bfloat16");
}

Test(reject, gated_and_gelu_and_unary_and_convert) {
    kw_call c = binary_call();
    accepted(KW_OP_SILU_MUL, c);
    c.t[0] = T(KW_BF16, 1, DIMS(4));
    tt_expect_reject(KW_OP_SILU_MUL, &c, KW_EDTYPE, "the promoted dtype of gate and up");
    c = binary_call();
    accepted(KW_OP_GELU_MUL, c);
    c.ip[0] = 7;
    tt_expect_reject(KW_OP_GELU_MUL, &c, KW_EINVAL, "gelu_mul: ip[0] must be KW_GELU_ERF or KW_GELU_TANH");
    const kw_call one = {.t = {T(KW_F32, 1, DIMS(4)), T(KW_F32, 1, DIMS(4))}};
    accepted(KW_OP_GELU, one);
    c = one;
    c.t[0] = T(KW_BF16, 1, DIMS(4));
    tt_expect_reject(KW_OP_GELU, &c, KW_EDTYPE, "gelu: y must have x's dtype");
    c = one;
    c.ip[0] = 9;
    tt_expect_reject(KW_OP_GELU, &c, KW_EINVAL, "gelu: ip[0] must be");
    accepted(KW_OP_UNARY, one);
    c = one;
    c.t[0] = T(KW_BF16, 1, DIMS(4));
    tt_expect_reject(KW_OP_UNARY, &c, KW_EDTYPE, "unary: y must have x's dtype");
    c = one;
    c.ip[0] = 99;
    tt_expect_reject(KW_OP_UNARY, &c, KW_EINVAL, "unary: ip[0] must be a kw_unary_op");
    accepted(KW_OP_CONVERT, one);
    c = one;
    c.t[1] = absent;
    tt_expect_reject(KW_OP_CONVERT, &c, KW_EDTYPE, "convert: x must be present");
    const kw_call pick = {.t = {T(KW_F32, 2, DIMS(3, 4)), T(KW_BOOL, 1, DIMS(4)), T(KW_F32, 2, DIMS(3, 4))}};
    accepted(KW_OP_WHERE, pick);
    c = pick;
    c.t[1] = T(KW_U8, 1, DIMS(4));
    tt_expect_reject(KW_OP_WHERE, &c, KW_EDTYPE, "where: cond must be bool and x of y's dtype float32");
    c = pick;
    c.t[2] = T(KW_BF16, 2, DIMS(3, 4));
    tt_expect_reject(KW_OP_WHERE, &c, KW_EDTYPE, "where: cond must be bool and x of y's dtype float32");
    c = pick;
    c.t[1] = T(KW_BOOL, 1, DIMS(3));
    tt_expect_reject(KW_OP_WHERE, &c, KW_ESHAPE, "where: inputs");
    c = pick;
    c.ip[0] = 2;
    tt_expect_reject(KW_OP_WHERE, &c, KW_EINVAL, "where: ip[0] must be");
}
