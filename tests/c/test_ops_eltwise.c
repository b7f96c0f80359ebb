/* binary, silu_mul, gelu, convert, rotary: every variant against the scalar
 * reference, and the reference against hand-computed or double values.
 *
 * Tolerances. binary, convert and rotary do the same IEEE operations in the
 * same order in every variant: exact (0). silu_mul and gelu use a vector expf
 * (about 1 ulp) and ATen's erf polynomial (absolute error < 1.5e-7) against
 * libm: f32 atol 5e-7 + rtol 2e-6; bf16 outputs one ulp more per rounding
 * (silu_mul rounds twice): rtol 2^-6. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "kw_ops_impl.h"
#include "test_ops_util.h"

static const tt_tol exact = {0, 0};

/* A random shape of 1..4 dims, sizes on and off the vector widths. */
static int rand_shape(tt_rng *r, int64_t *shape) {
    static const int64_t sizes[] = {1, 2, 3, 5, 16, 17, 33};
    const int nd = (int)tt_int(r, 1, 4);
    for (int d = 0; d < nd; d++) shape[d] = sizes[tt_int(r, 0, 6)];
    return nd;
}

/* Strides for a layout with some padding between rows and, sometimes, the last
 * two dims swapped in memory (a transposed view: inner stride > 1). */
static void rand_strides(tt_rng *r, int nd, const int64_t *shape, int64_t *st) {
    int order[4]; /* dims from innermost in memory */
    for (int i = 0; i < nd; i++) order[i] = nd - 1 - i;
    if (nd >= 2 && tt_int(r, 0, 3) == 0) order[0] = nd - 2, order[1] = nd - 1;
    int64_t s = 1;
    for (int i = 0; i < nd; i++) st[order[i]] = s, s = s * shape[order[i]] + tt_int(r, 0, 1) * tt_int(r, 1, 3);
}

/* Slots 0 (y), 1 (a) and, for n_in 2, 2 (b): a and b broadcast to y. */
static void eltwise_case(tt_case *k, int n_in, kw_dtype yt, kw_dtype at, kw_dtype bt, double lo, double hi,
                         tt_rng *r) {
    int64_t shape[4], st[4];
    const int nd = rand_shape(r, shape);
    rand_strides(r, nd, shape, st);
    tt_tensor(k, 0, yt, nd, shape, st, 0, 0, r);
    for (int i = 1; i <= n_in; i++) {
        int64_t s[4], sst[4];
        const int lead = (int)tt_int(r, 0, nd - 1) * (int)tt_int(r, 0, 1), snd = nd - lead;
        for (int d = 0; d < snd; d++) s[d] = tt_int(r, 0, 2) ? shape[lead + d] : 1;
        rand_strides(r, snd, s, sst);
        tt_tensor(k, i, i == 1 ? at : bt, snd, s, sst, lo, hi, r);
    }
}

static const kw_dtype fdt[] = {KW_F32, KW_BF16};

Test(binary, every_variant_matches_the_reference) {
    tt_rng r = {21};
    for (int trial = 0; trial < 300; trial++) {
        const kw_dtype at = fdt[tt_int(&r, 0, 1)], bt = fdt[tt_int(&r, 0, 1)];
        const int scalar = trial % 7 == 0;
        const kw_dtype yt = scalar ? at : (at == KW_F32 || bt == KW_F32 ? KW_F32 : KW_BF16);
        tt_case k = {0};
        eltwise_case(&k, scalar ? 1 : 2, yt, at, bt, -3, 3, &r);
        k.c.ip[0] = trial % KW_BINARY_FLOOR_DIV; /* the float ops: every one before floor_divide */
        k.c.fp[0] = 1.75;
        if (trial % 11 == 0) tt_set(&k.c.t[1], (int64_t[]){0, 0, 0, 0}, NAN);
        tt_check_variants(KW_OP_BINARY, &k, exact, "binary");
        tt_free(&k);
    }
}

Test(binary, in_place_and_int64) {
    tt_rng r = {22};
    tt_case k = {0};
    tt_tensor(&k, 1, KW_BF16, 2, TT_DIMS(3, 70), NULL, -2, 2, &r);
    tt_tensor(&k, 2, KW_BF16, 1, TT_DIMS(70), NULL, -2, 2, &r);
    tt_alias(&k, 0, 1);
    k.c.ip[0] = KW_BINARY_ADD;
    tt_check_variants(KW_OP_BINARY, &k, exact, "in place");
    tt_free(&k);

    for (int op = 0; op < KW_BINARY_COUNT; op++) {
        if (op == KW_BINARY_DIV) continue;
        tt_tensor(&k, 1, KW_I64, 2, TT_DIMS(3, 5), NULL, -1000, 1000, &r);
        tt_tensor(&k, 0, KW_I64, 2, TT_DIMS(3, 5), NULL, 0, 0, &r);
        k.c.ip[0] = op;
        k.c.fp[0] = 7;
        tt_check_variants(KW_OP_BINARY, &k, exact, "int64");
        for (int64_t i = 0; i < 15; i++) {
            const int64_t a = ((int64_t *)k.c.t[1].data)[i], y = ((int64_t *)k.c.t[0].data)[i];
            const int64_t floored = (int64_t)floor((double)a / 7.0); /* exact for |a| <= 1000 */
            const int64_t want = op == KW_BINARY_ADD   ? a + 7
                                 : op == KW_BINARY_SUB ? a - 7
                                 : op == KW_BINARY_MUL ? a * 7
                                 : op == KW_BINARY_MAX ? (a > 7 ? a : 7)
                                 : op == KW_BINARY_MIN ? (a < 7 ? a : 7)
                                                       : floored;
            cr_expect_eq(y, want, "op %d: %lld", op, (long long)a);
        }
        tt_free(&k);
    }
}

/* Python's // on integers: towards -inf for either sign; INT64_MIN // -1 wraps
 * (PyTorch's own division would trap). */
Test(binary, int64_floor_divide_by_a_scalar) {
    tt_rng r = {24};
    const int64_t av[6] = {7, -7, 6, -6, 0, INT64_MIN}, bs[3] = {2, -2, -1};
    for (int bi = 0; bi < 3; bi++) {
        tt_case k = {0};
        kw_tensor *a = tt_tensor(&k, 1, KW_I64, 1, TT_DIMS(6), NULL, 0, 0, &r);
        memcpy(a->data, av, sizeof av);
        tt_tensor(&k, 0, KW_I64, 1, TT_DIMS(6), NULL, 0, 0, &r);
        k.c.ip[0] = KW_BINARY_FLOOR_DIV;
        k.c.fp[0] = (double)bs[bi];
        tt_run(KW_OP_BINARY, kw_cpu_isa(), &k.c, 2);
        const int64_t *y = k.c.t[0].data;
        static const int64_t want[3][5] = {{3, -4, 3, -3, 0}, {-4, 3, -3, 3, 0}, {-7, 7, -6, 6, 0}};
        for (int i = 0; i < 5; i++)
            cr_expect_eq(y[i], want[bi][i], "%lld // %lld = %lld", (long long)av[i], (long long)bs[bi], (long long)y[i]);
        cr_expect_eq(y[5], bs[bi] == -1 ? INT64_MIN : INT64_MIN / bs[bi]);
        tt_free(&k);
    }
}

Test(binary, reference_by_hand) {
    tt_rng r = {23};
    tt_case k = {0};
    const float av[2][3] = {{1, -2, 3}, {NAN, 0.5f, 1e-3f}}, bv[3] = {2, 4, -8};
    tt_tensor(&k, 1, KW_F32, 2, TT_DIMS(2, 3), NULL, 0, 0, &r);
    tt_tensor(&k, 2, KW_F32, 1, TT_DIMS(3), NULL, 0, 0, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(2, 3), NULL, 0, 0, &r);
    for (int64_t i = 0; i < 2; i++)
        for (int64_t j = 0; j < 3; j++) tt_set(&k.c.t[1], (int64_t[]){i, j}, av[i][j]);
    for (int64_t j = 0; j < 3; j++) tt_set(&k.c.t[2], &j, bv[j]);
    static const float want[KW_BINARY_FLOOR_DIV][2][3] = {
        {{3, 2, -5}, {NAN, 4.5f, -7.999f}},
        {{-1, -6, 11}, {NAN, -3.5f, 8.001f}},
        {{2, -8, -24}, {NAN, 2, -8e-3f}},
        {{0.5f, -0.5f, -0.375f}, {NAN, 0.125f, -1.25e-4f}},
        {{2, 4, 3}, {NAN, 4, 1e-3f}},
        {{1, -2, -8}, {NAN, 0.5f, -8}},
    };
    for (int op = 0; op < KW_BINARY_FLOOR_DIV; op++) {
        k.c.ip[0] = op;
        tt_run(KW_OP_BINARY, KW_ISA_SCALAR, &k.c, 1);
        for (int64_t i = 0; i < 2; i++)
            for (int64_t j = 0; j < 3; j++) {
                const double g = tt_get(y, (int64_t[]){i, j}), w = want[op][i][j];
                cr_expect(isnan(w) ? isnan(g) : g == (float)w, "op %d y[%lld,%lld] = %g, want %g", op, (long long)i,
                          (long long)j, g, w);
            }
    }
    tt_free(&k);
}

/* clamp and relu keep x where it equals the bound: max(-0.0, 0) is -0.0 in
 * PyTorch, and 1 / relu(x) tells the two zeros apart. */
Test(binary, max_and_min_with_an_equal_scalar_keep_x_and_its_signed_zero) {
    tt_rng r = {24};
    for (int isa = 0; isa <= (int)kw_cpu_isa(); isa++)
        for (int op = KW_BINARY_MAX; op <= KW_BINARY_MIN; op++)
            for (int bound = 0; bound < 2; bound++) {
                tt_case k = {0};
                tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(37), NULL, 0, 0, &r);
                kw_tensor *y = tt_tensor(&k, 0, KW_F32, 1, TT_DIMS(37), NULL, 0, 0, &r);
                for (int64_t i = 0; i < 37; i++) tt_set(&k.c.t[1], &i, i % 2 ? 0.0 : -0.0);
                k.c.ip[0] = op;
                k.c.fp[0] = bound ? -0.0 : 0.0;
                tt_run(KW_OP_BINARY, (kw_isa)isa, &k.c, 1);
                for (int64_t i = 0; i < 37; i++) {
                    const double g = tt_get(y, &i);
                    cr_expect(g == 0 && !signbit(g) == (i % 2 == 1), "%s op %d bound %s: y[%lld] = %g",
                              kw_isa_name((kw_isa)isa), op, bound ? "-0.0" : "0.0", (long long)i, g);
                }
                tt_free(&k);
            }
}

Test(silu_mul, every_variant_matches_the_reference) {
    tt_rng r = {24};
    for (int trial = 0; trial < 120; trial++) {
        const kw_dtype gt = fdt[trial % 2], ut = fdt[trial / 2 % 2];
        const kw_dtype yt = gt == KW_F32 || ut == KW_F32 ? KW_F32 : KW_BF16;
        tt_case k = {0};
        eltwise_case(&k, 2, yt, gt, ut, -12, 12, &r);
        tt_check_variants(KW_OP_SILU_MUL, &k, (tt_tol){5e-7, yt == KW_BF16 ? 0x1p-6 : 2e-6}, "silu_mul");
        tt_free(&k);
    }
}

Test(silu_mul, reference_matches_double_precision) {
    tt_rng r = {25};
    tt_case k = {0};
    kw_tensor *g = tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(200), NULL, -20, 20, &r);
    kw_tensor *u = tt_tensor(&k, 2, KW_F32, 1, TT_DIMS(200), NULL, -2, 2, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_F32, 1, TT_DIMS(200), NULL, 0, 0, &r);
    tt_run(KW_OP_SILU_MUL, KW_ISA_SCALAR, &k.c, 1);
    for (int64_t i = 0; i < 200; i++) {
        const double x = tt_get(g, &i), want = x / (1 + exp(-x)) * tt_get(u, &i);
        cr_expect_leq(fabs(tt_get(y, &i) - want), 1e-6 * fabs(want) + 1e-30, "y[%lld]", (long long)i);
    }
    tt_free(&k);
}

Test(gelu_mul, every_variant_matches_the_reference) {
    tt_rng r = {36};
    for (int trial = 0; trial < 120; trial++) {
        const kw_dtype gt = fdt[trial % 2], ut = fdt[trial / 2 % 2];
        const kw_dtype yt = gt == KW_F32 || ut == KW_F32 ? KW_F32 : KW_BF16;
        tt_case k = {0};
        eltwise_case(&k, 2, yt, gt, ut, -6, 6, &r);
        k.c.ip[0] = trial / 4 % 2 ? KW_GELU_TANH : KW_GELU_ERF;
        /* GELU is rounded to gate's dtype before the product: a vector GELU an ulp of
         * f32 away can round to the next bf16, 2^-8 away, even when y is f32. GELU's
         * absolute error near its tail (gelu's own test: 1e-6) is scaled by |up| <= 6. */
        const double rtol = gt == KW_BF16 || yt == KW_BF16 ? 0x1p-6 : 2e-6;
        tt_check_variants(KW_OP_GELU_MUL, &k, (tt_tol){6e-6, rtol}, "gelu_mul");
        tt_free(&k);
    }
}

Test(gelu_mul, reference_matches_double_precision_and_rejects_a_bad_mode) {
    tt_rng r = {37};
    for (int mode = 0; mode < 2; mode++) {
        tt_case k = {0};
        kw_tensor *g = tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(300), NULL, -8, 8, &r);
        kw_tensor *u = tt_tensor(&k, 2, KW_F32, 1, TT_DIMS(300), NULL, -2, 2, &r);
        kw_tensor *y = tt_tensor(&k, 0, KW_F32, 1, TT_DIMS(300), NULL, 0, 0, &r);
        k.c.ip[0] = mode ? KW_GELU_TANH : KW_GELU_ERF;
        tt_run(KW_OP_GELU_MUL, KW_ISA_SCALAR, &k.c, 1);
        for (int64_t i = 0; i < 300; i++) {
            const double v = tt_get(g, &i);
            const double gelu = mode ? 0.5 * v * (1 + tanh(sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)))
                                     : 0.5 * v * (1 + erf(v / sqrt(2)));
            const double want = gelu * tt_get(u, &i);
            cr_expect_leq(fabs(tt_get(y, &i) - want), 2e-6 * (1 + fabs(want)), "mode %d at %g", mode, v);
        }
        k.c.ip[0] = 7;
        tt_expect_reject(KW_OP_GELU_MUL, &k.c, KW_EINVAL, "ip[0] must be KW_GELU_ERF or KW_GELU_TANH");
        tt_free(&k);
    }
}

Test(gelu, every_variant_matches_the_reference) {
    tt_rng r = {26};
    for (int trial = 0; trial < 80; trial++) {
        const kw_dtype dt = fdt[trial % 2];
        tt_case k = {0};
        eltwise_case(&k, 1, dt, dt, dt, -6, 6, &r);
        k.c.ip[0] = trial / 2 % 2 ? KW_GELU_TANH : KW_GELU_ERF;
        tt_check_variants(KW_OP_GELU, &k, (tt_tol){1e-6, dt == KW_BF16 ? 0x1p-7 : 2e-6}, "gelu");
        tt_free(&k);
    }
}

/* The erf form's clamps and signs: far tails (e^(-x²/2) clamped), values at and
 * around zero (denormals too) and NaN, in every variant against the reference. */
Test(gelu, tails_zeros_and_nan_match_the_reference) {
    static const double v[] = {-100, -30, -13.5, -9, -5.5, -1e-30, -1e-40, -0.0, 0, 1e-40, 1e-30, 5.5, 9, 30, 100, NAN};
    tt_rng r = {29};
    for (int d = 0; d < 2; d++) {
        tt_case k = {0};
        kw_tensor *x = tt_tensor(&k, 1, fdt[d], 1, TT_DIMS(48), NULL, -1, 1, &r);
        tt_tensor(&k, 0, fdt[d], 1, TT_DIMS(48), NULL, 0, 0, &r);
        for (int64_t i = 0; i < 48; i++) tt_set(x, &i, v[i % 16]);
        k.c.ip[0] = KW_GELU_ERF;
        tt_check_variants(KW_OP_GELU, &k, (tt_tol){1e-6, 2e-6}, "gelu tails");
        tt_free(&k);
    }
}

Test(gelu, reference_matches_double_precision) {
    tt_rng r = {27};
    for (int mode = 0; mode < 2; mode++) {
        tt_case k = {0};
        kw_tensor *x = tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(300), NULL, -8, 8, &r);
        kw_tensor *y = tt_tensor(&k, 0, KW_F32, 1, TT_DIMS(300), NULL, 0, 0, &r);
        k.c.ip[0] = mode ? KW_GELU_TANH : KW_GELU_ERF;
        tt_run(KW_OP_GELU, KW_ISA_SCALAR, &k.c, 1);
        for (int64_t i = 0; i < 300; i++) {
            const double v = tt_get(x, &i);
            const double want = mode ? 0.5 * v * (1 + tanh(sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)))
                                     : 0.5 * v * (1 + erf(v / sqrt(2)));
            cr_expect_leq(fabs(tt_get(y, &i) - want), 1e-6 * (1 + fabs(v)), "mode %d gelu(%g)", mode, v);
        }
        tt_free(&k);
    }
}

Test(convert, every_variant_matches_the_reference) {
    tt_rng r = {28};
    static const kw_dtype all[] = {KW_F32, KW_BF16, KW_F16, KW_I64, KW_I32, KW_BOOL, KW_U8};
    for (int trial = 0; trial < 200; trial++) {
        const kw_dtype yt = all[trial % 7], xt = all[trial / 7 % 7];
        const int ints = xt == KW_I64 || xt == KW_I32 || xt == KW_BOOL || xt == KW_U8;
        tt_case k = {0};
        eltwise_case(&k, 1, yt, xt, xt, ints ? 0 : -300, xt == KW_BOOL ? 1 : ints ? 255 : 300, &r);
        tt_check_variants(KW_OP_CONVERT, &k, exact, "convert");
        tt_free(&k);
    }
}

/* A convolution's patches copied into rows (kwker's patch linears): x [N, C,
 * H, W] viewed as [N, H / k, W / k, C, k, k], runs of k values, moved a run at a
 * time where they are at most 64 bytes and by memcpy where longer; exact in
 * every dtype width. */
Test(convert, a_convolutions_patches_are_copied_exactly) {
    tt_rng r = {32};
    static const struct {
        kw_dtype dt;
        int64_t k;
    } cases[] = {{KW_U8, 3}, {KW_BF16, 3}, {KW_F32, 4}, {KW_I64, 2}, {KW_F32, 16}, {KW_F32, 20}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const kw_dtype dt = cases[c].dt;
        const int64_t k = cases[c].k, N = 2, C = 3, H = 2 * k + 1, W = 3 * k, ho = H / k, wo = W / k;
        tt_case t = {0};
        kw_tensor *x = tt_tensor(&t, 1, dt, 6, TT_DIMS(N, ho, wo, C, k, k),
                                 TT_DIMS(C * H * W, k * W, k, H * W, W, 1), 0, 100, &r);
        kw_tensor *y = tt_tensor(&t, 0, dt, 6, TT_DIMS(N, ho, wo, C, k, k), NULL, 0, 0, &r);
        tt_check_variants(KW_OP_CONVERT, &t, exact, "patches");
        for (int64_t i = 0; i < N * ho * wo * C * k * k; i++) {
            int64_t at[6], rest = i;
            for (int d = 5; d >= 0; d--) at[d] = rest % y->shape[d], rest /= y->shape[d];
            cr_assert_eq(tt_get(y, at), tt_get(x, at), "case %zu element %lld", c, (long long)i);
        }
        tt_free(&t);
    }
}

/* A transpose made contiguous (T5's position bias: [B, L, S, H] memory viewed as
 * [B, H, L, S]) takes the tiled path: exact, at sizes that are not multiples of
 * a vector, a dim of 1 and a broadcast batch among them. */
Test(convert, a_transpose_is_copied_exactly) {
    tt_rng r = {30};
    static const int64_t sizes[] = {1, 3, 16, 17, 40};
    for (int trial = 0; trial < 40; trial++) {
        const kw_dtype yt = fdt[trial % 2], xt = fdt[trial / 2 % 2];
        const int64_t B = 1 + trial % 3 % 2, H = sizes[tt_int(&r, 0, 4)], L = sizes[tt_int(&r, 0, 4)];
        const int64_t S = sizes[tt_int(&r, 0, 4)], xb = trial % 5 == 4 ? 0 : L * S * H;
        tt_case k = {0};
        kw_tensor *x = tt_tensor(&k, 1, xt, 4, TT_DIMS(B, H, L, S), TT_DIMS(xb, 1, S * H, H), -100, 100, &r);
        kw_tensor *y = tt_tensor(&k, 0, yt, 4, TT_DIMS(B, H, L, S), NULL, 0, 0, &r);
        tt_check_variants(KW_OP_CONVERT, &k, exact, "convert");
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < L; i++)
                    for (int64_t j = 0; j < S; j++) {
                        const int64_t at[4] = {b, h, i, j};
                        cr_assert_eq(tt_get(y, at), kw__round_to((float)tt_get(x, at), yt), "trial %d [%lld,%lld,%lld,%lld]",
                                     trial, (long long)b, (long long)h, (long long)i, (long long)j);
                    }
        tt_free(&k);
    }
}

/* Strides of a dense tensor of `shape` whose dims lie in memory in `order`
 * (outermost first). */
static void strides_in_order(int nd, const int64_t *shape, const int *order, int64_t *st) {
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; i--) st[order[i]] = s, s *= shape[order[i]];
}

/* y, a and b each dense in its own memory order (contiguous, channels-last,
 * transposed: ConvNeXt's residual adds in channels-last, Whisper's over a [C, T]
 * stream and a [T, C] layer output), b sometimes broadcast over the batch:
 * every variant equals the reference, and the reference equals each element's
 * sum, difference or product computed from its logical index. */
Test(binary, any_dense_layouts_match_logical_indexing) {
    tt_rng r = {33};
    static const int orders[][4] = {{0, 1, 2, 3}, {0, 2, 3, 1}, {0, 1, 3, 2}, {0, 3, 2, 1}, {1, 0, 2, 3}};
    static const int64_t sizes[] = {1, 3, 16, 17, 40};
    for (int trial = 0; trial < 60; trial++) {
        const kw_dtype at = fdt[trial % 2], bt = fdt[trial / 2 % 2];
        const kw_dtype yt = at == KW_F32 || bt == KW_F32 ? KW_F32 : KW_BF16;
        int64_t shape[4] = {1 + trial % 3 % 2, sizes[tt_int(&r, 0, 4)], sizes[tt_int(&r, 0, 4)], sizes[tt_int(&r, 0, 4)]};
        int64_t ys[4], as[4], bs[4], bshape[4];
        memcpy(bshape, shape, sizeof shape);
        if (trial % 4 == 3) bshape[0] = 1;
        strides_in_order(4, shape, orders[tt_int(&r, 0, 4)], ys);
        strides_in_order(4, shape, orders[tt_int(&r, 0, 4)], as);
        strides_in_order(4, bshape, orders[tt_int(&r, 0, 4)], bs);
        tt_case k = {0};
        kw_tensor *y = tt_tensor(&k, 0, yt, 4, shape, ys, 0, 0, &r);
        kw_tensor *a = tt_tensor(&k, 1, at, 4, shape, as, -3, 3, &r);
        kw_tensor *b = tt_tensor(&k, 2, bt, 4, bshape, bs, -3, 3, &r);
        static const int ops[] = {KW_BINARY_ADD, KW_BINARY_SUB, KW_BINARY_MUL};
        k.c.ip[0] = ops[trial % 3];
        tt_check_variants(KW_OP_BINARY, &k, exact, "binary");
        tt_run(KW_OP_BINARY, kw_cpu_isa(), &k.c, 2);
        for (int64_t i0 = 0; i0 < shape[0]; i0++)
            for (int64_t i1 = 0; i1 < shape[1]; i1++)
                for (int64_t i2 = 0; i2 < shape[2]; i2++)
                    for (int64_t i3 = 0; i3 < shape[3]; i3++) {
                        const int64_t i[4] = {i0, i1, i2, i3}, ib[4] = {bshape[0] == 1 ? 0 : i0, i1, i2, i3};
                        const float x = (float)tt_get(a, i), z = (float)tt_get(b, ib);
                        const float want = k.c.ip[0] == KW_BINARY_ADD ? x + z : k.c.ip[0] == KW_BINARY_SUB ? x - z : x * z;
                        cr_assert_eq(tt_get(y, i), kw__round_to(want, yt), "trial %d [%lld,%lld,%lld,%lld]", trial,
                                     (long long)i0, (long long)i1, (long long)i2, (long long)i3);
                    }
        tt_free(&k);
    }
}

/* A dim of 0 (an empty slice of a sequence) is nothing to walk: every variant
 * and thread count returns without dividing by it or touching memory. */
Test(binary, a_dim_of_zero_walks_nothing) {
    tt_rng r = {34};
    for (int isa = KW_ISA_SCALAR; isa <= (int)kw_cpu_isa(); isa++)
        for (int nth = 1; nth <= 3; nth++) {
            tt_case k = {0};
            tt_tensor(&k, 0, KW_F32, 3, TT_DIMS(3, 0, 5), TT_DIMS(1, 15, 3), 0, 0, &r);
            tt_tensor(&k, 1, KW_F32, 3, TT_DIMS(3, 0, 5), NULL, -1, 1, &r);
            tt_tensor(&k, 2, KW_BF16, 3, TT_DIMS(3, 0, 5), TT_DIMS(5, 15, 1), -1, 1, &r);
            k.c.ip[0] = KW_BINARY_ADD;
            tt_run(KW_OP_BINARY, (kw_isa)isa, &k.c, nth);
            tt_free(&k);
        }
}

/* where: a bool cond broadcast over heads (T5's padding mask), x permuted (its
 * position bias), the scalar on either side and rounded to y's dtype (float's
 * lowest is -inf in bfloat16). */
Test(where, takes_x_where_cond_says_and_the_scalar_elsewhere) {
    tt_rng r = {31};
    for (int trial = 0; trial < 8; trial++) {
        const kw_dtype dt = fdt[trial % 2];
        const int mode = trial / 2 % 2 ? KW_WHERE_X_IF_FALSE : KW_WHERE_X_IF_TRUE;
        const int64_t B = 2, H = 3, L = 5, S = 19;
        tt_case k = {0};
        kw_tensor *cond = tt_tensor(&k, 1, KW_BOOL, 4, TT_DIMS(B, 1, 1, S), NULL, 0, 1, &r);
        kw_tensor *x = tt_tensor(&k, 2, dt, 4, TT_DIMS(B, H, L, S), TT_DIMS(L * S * H, 1, S * H, H), -9, 9, &r);
        kw_tensor *y = tt_tensor(&k, 0, dt, 4, TT_DIMS(B, H, L, S), NULL, 0, 0, &r);
        k.c.ip[0] = mode;
        k.c.fp[0] = trial / 4 ? -FLT_MAX : 2.5;
        tt_run(KW_OP_WHERE, kw_cpu_isa(), &k.c, 2);
        int64_t taken = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < L; i++)
                    for (int64_t s = 0; s < S; s++) {
                        const int64_t at[4] = {b, h, i, s}, c_at[4] = {b, 0, 0, s};
                        const int take_x = (tt_get(cond, c_at) != 0) == (mode == KW_WHERE_X_IF_TRUE);
                        taken += take_x;
                        const double want = take_x ? tt_get(x, at) : kw__round_to((float)k.c.fp[0], dt);
                        cr_assert_eq(tt_get(y, at), want, "trial %d [%lld,%lld,%lld,%lld]", trial, (long long)b,
                                     (long long)h, (long long)i, (long long)s);
                    }
        cr_expect(taken > 0 && taken < B * H * L * S, "trial %d: both sides taken", trial);
        tt_free(&k);
    }
}

/* f32 to bf16 bit for bit as c10 rounds, in every variant: denormals (which
 * vcvtneps2bf16 flushes) and NaNs of either sign and any payload (c10 writes
 * 0x7fc0) among ordinary values, in every lane of a vector. */
Test(convert, f32_to_bf16_rounds_bit_for_bit_in_every_variant) {
    static const uint32_t special[] = {0x00018000, 0x80018000, 0x007fffff, 0x00000001, 0x7fc00001,
                                       0xffc00000, 0x7f800001, 0x3f808000, 0x3f818000, 0x7f7fffff};
    const int64_t n = 64;
    tt_rng r = {33};
    for (size_t i = 0; i < sizeof special / sizeof *special; i++) {
        tt_case k = {0};
        kw_tensor *x = tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(n), NULL, -3, 3, &r);
        kw_tensor *y = tt_tensor(&k, 0, KW_BF16, 1, TT_DIMS(n), NULL, 0, 0, &r);
        for (int64_t j = (int64_t)i % 7; j < n; j += 9) memcpy((float *)x->data + j, &special[i], 4);
        for (int isa = KW_ISA_SCALAR; isa <= (int)kw_cpu_isa(); isa++) {
            tt_run(KW_OP_CONVERT, (kw_isa)isa, &k.c, 2);
            for (int64_t j = 0; j < n; j++)
                cr_assert_eq(((const uint16_t *)y->data)[j], kw__f32_to_bf16(((const float *)x->data)[j]),
                             "%s: bf16(0x%08x) is 0x%04x", kw_isa_name((kw_isa)isa),
                             ((const uint32_t *)x->data)[j], ((const uint16_t *)y->data)[j]);
        }
        tt_free(&k);
    }
}

/* Known conversions, bit for bit as c10 does them. */
Test(convert, reference_by_hand) {
    static const struct {
        uint32_t f;
        uint16_t bf16;
    } bf[] = {
        {0x3f800000, 0x3f80}, {0x3f808000, 0x3f80}, /* a tie rounds to even (down) */
        {0x3f818000, 0x3f82},                       /* a tie rounds to even (up) */
        {0x3f808001, 0x3f81}, {0x7f800000, 0x7f80}, {0xff800000, 0xff80},
        {0x7fc00001, 0x7fc0}, {0x7f7fffff, 0x7f80}, /* the largest float rounds to inf */
        {0x00018000, 0x0002},                       /* a denormal tie rounds to even */
        {0x80000000, 0x8000},
    };
    for (size_t i = 0; i < sizeof bf / sizeof *bf; i++) {
        float f;
        memcpy(&f, &bf[i].f, 4);
        cr_expect_eq(kw__f32_to_bf16(f), bf[i].bf16, "bf16(0x%08x)", bf[i].f);
    }
    static const struct {
        float f;
        uint16_t h;
    } to_half[] = {{1.0f, 0x3c00}, {-2.5f, 0xc100}, {65504.0f, 0x7bff}, {65520.0f, 0x7c00} /* rounds to inf */,
                   {0x1p-14f, 0x0400}, {0x1p-24f, 0x0001}, {0x1p-25f, 0x0000} /* tie to even */,
                   {0x1.8p-24f, 0x0002} /* tie to even */, {1.00048828125f, 0x3c00} /* tie to even */,
                   {1.00146484375f, 0x3c02} /* tie to even */},
      from_half[] = {{1.0f, 0x3c00}, {-2.5f, 0xc100}, {65504.0f, 0x7bff}, {INFINITY, 0x7c00},
                     {0x1p-14f, 0x0400}, {0x1p-24f, 0x0001}, {0x1.8p-23f, 0x0003}, {-0.0f, 0x8000}};
    for (size_t i = 0; i < sizeof to_half / sizeof *to_half; i++)
        cr_expect_eq(kw__f32_to_f16(to_half[i].f), to_half[i].h, "f16(%a) = 0x%04x", to_half[i].f,
                     kw__f32_to_f16(to_half[i].f));
    for (size_t i = 0; i < sizeof from_half / sizeof *from_half; i++)
        cr_expect_eq(kw__f16_to_f32(from_half[i].h), from_half[i].f, "f16 0x%04x", from_half[i].h);

    tt_rng r = {29};
    tt_case k = {0};
    kw_tensor *x = tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(6), NULL, 0, 0, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_I32, 1, TT_DIMS(6), NULL, 0, 0, &r);
    const float xv[6] = {2.9f, -2.9f, NAN, 1e30f, -1e30f, 0.0f};
    for (int64_t i = 0; i < 6; i++) tt_set(x, &i, xv[i]);
    tt_run(KW_OP_CONVERT, KW_ISA_SCALAR, &k.c, 1);
    const int32_t want[6] = {2, -2, INT32_MIN, INT32_MIN, INT32_MIN, 0}; /* truncated; else x86's indefinite */
    for (int64_t i = 0; i < 6; i++) cr_expect_eq(((int32_t *)y->data)[i], want[i], "int32(%g)", xv[i]);
    tt_free(&k);
}

/* rotary slots: y 0, x 1, cos 2, sin 3; ip[0] mode, ip[1] rotated dims. */
static void rotary_case(tt_case *k, kw_dtype xt, kw_dtype ct, int64_t B, int64_t H, int64_t S, int64_t D, int64_t R,
                        int in_place, tt_rng *r) {
    /* x as [B, S, H, D] memory seen as [B, H, S, D] (HF's transpose(1, 2)) */
    const int64_t st[4] = {S * H * D, D, H * D, 1};
    tt_tensor(k, 1, xt, 4, TT_DIMS(B, H, S, D), st, -3, 3, r);
    const kw_dtype yt = xt == KW_F32 || ct == KW_F32 ? KW_F32 : KW_BF16;
    if (in_place && yt == xt)
        tt_alias(k, 0, 1);
    else
        tt_tensor(k, 0, yt, 4, TT_DIMS(B, H, S, D), NULL, 0, 0, r);
    tt_tensor(k, 2, ct, 4, TT_DIMS(B, 1, S, R), NULL, -1, 1, r); /* cos[position_ids].unsqueeze(1) */
    tt_tensor(k, 3, ct, 3, TT_DIMS(1, S, R), NULL, -1, 1, r);    /* rank 3: broadcast from the left */
}

Test(rotary, every_variant_matches_the_reference) {
    tt_rng r = {30};
    static const int64_t Ds[] = {2, 8, 30, 64, 80, 128};
    for (int trial = 0; trial < 96; trial++) {
        const kw_dtype xt = fdt[trial % 2], ct = fdt[trial / 2 % 2];
        const int64_t D = Ds[tt_int(&r, 0, 5)], R = trial % 3 ? D : 2 * tt_int(&r, 1, D / 2);
        tt_case k = {0};
        rotary_case(&k, xt, ct, tt_int(&r, 1, 2), tt_int(&r, 1, 4), tt_int(&r, 1, 3), D, R, trial % 5 == 0, &r);
        k.c.ip[0] = trial / 4 % 2 ? KW_ROPE_INTERLEAVED : KW_ROPE_HALF;
        k.c.ip[1] = R == D && trial % 2 ? 0 : R;
        tt_check_variants(KW_OP_ROTARY, &k, exact, "rotary");
        tt_free(&k);
    }
}

/* HF's formula with eager's roundings, written out: round(round(x·cos) + round(rot(x)·sin)). */
Test(rotary, reference_matches_hf_formula) {
    tt_rng r = {31};
    for (int mode = 0; mode < 2; mode++)
        for (int bf = 0; bf < 2; bf++) {
            const kw_dtype dt = bf ? KW_BF16 : KW_F32;
            const int64_t D = 16;
            tt_case k = {0};
            rotary_case(&k, dt, dt, 1, 2, 3, D, D, 0, &r);
            k.c.ip[0] = mode;
            tt_run(KW_OP_ROTARY, KW_ISA_SCALAR, &k.c, 1);
            for (int64_t h = 0; h < 2; h++)
                for (int64_t s = 0; s < 3; s++)
                    for (int64_t i = 0; i < D; i++) {
                        const int64_t j = mode ? i ^ 1 : (i + D / 2) % D;
                        const double sign = mode ? (i % 2 ? 1 : -1) : (i < D / 2 ? -1 : 1);
                        const double x = tt_get(&k.c.t[1], (int64_t[]){0, h, s, i});
                        const double rot = sign * tt_get(&k.c.t[1], (int64_t[]){0, h, s, j});
                        const double c = tt_get(&k.c.t[2], (int64_t[]){0, 0, s, i}),
                                     sn = tt_get(&k.c.t[3], (int64_t[]){0, s, i});
                        const float a = kw__round_to((float)(x * c), dt), b = kw__round_to((float)(rot * sn), dt);
                        const float want = kw__round_to(a + b, dt);
                        cr_expect_eq(tt_get(&k.c.t[0], (int64_t[]){0, h, s, i}), want, "mode %d bf16 %d [%lld,%lld,%lld]",
                                     mode, bf, (long long)h, (long long)s, (long long)i);
                    }
            tt_free(&k);
        }
}

Test(rotary, check_names_the_bad_slot) {
    tt_rng r = {32};
    tt_case k = {0};
    rotary_case(&k, KW_F32, KW_F32, 1, 2, 3, 8, 8, 0, &r);
    k.c.ip[1] = 3;
    tt_expect_reject(KW_OP_ROTARY, &k.c, KW_EINVAL, "rotary: ip[1]");
    k.c.ip[1] = 6;
    tt_expect_reject(KW_OP_ROTARY, &k.c, KW_ESHAPE, "rotary: cos must be");
    tt_free(&k);
}

/* unary has one (scalar) kernel: check it against double-precision libm, on
 * strided views of random shapes. Tolerance: libm's float functions are within
 * a few ulp (f32: rtol 4e-7 + atol 1e-7); bf16 adds one rounding (rtol 2^-8). */
static double unary_ref(int op, double v) {
    switch (op) {
    case KW_UNARY_COS: return cos(v);
    case KW_UNARY_SIN: return sin(v);
    case KW_UNARY_EXP: return exp(v);
    case KW_UNARY_TANH: return tanh(v);
    case KW_UNARY_SQRT: return sqrt(v);
    case KW_UNARY_RSQRT: return 1 / sqrt(v);
    case KW_UNARY_SILU: return v / (1 + exp(-v));
    case KW_UNARY_SIGMOID: return 1 / (1 + exp(-v));
    case KW_UNARY_LOG: return log(v);
    case KW_UNARY_FLOOR: return floor(v);
    default: return fabs(v);
    }
}

Test(unary, matches_double_precision_on_strided_views) {
    tt_rng r = {31};
    for (int trial = 0; trial < 80; trial++) {
        const kw_dtype dt = fdt[trial % 2];
        const int op = trial % KW_UNARY_COUNT;
        const double lo = op == KW_UNARY_SQRT || op == KW_UNARY_RSQRT || op == KW_UNARY_LOG ? 0.1 : -4;
        int64_t shape[4], ys[4], xs[4];
        const int nd = rand_shape(&r, shape);
        rand_strides(&r, nd, shape, ys);
        rand_strides(&r, nd, shape, xs);
        tt_case k = {0};
        tt_tensor(&k, 0, dt, nd, shape, ys, 0, 0, &r);
        tt_tensor(&k, 1, dt, nd, shape, xs, lo, 4, &r);
        k.c.ip[0] = op;
        tt_run(KW_OP_UNARY, KW_ISA_SCALAR, &k.c, 1 + trial % 2); /* fails the test if prepare rejects the call */
        int64_t idx[4] = {0}, total = 1;
        for (int d = 0; d < nd; d++) total *= shape[d];
        for (int64_t flat = 0; flat < total; flat++) {
            for (int64_t d = nd - 1, rest = flat; d >= 0; d--) idx[d] = rest % shape[d], rest /= shape[d];
            const double want = unary_ref(op, tt_get(&k.c.t[1], idx)), got = tt_get(&k.c.t[0], idx);
            const double tol = dt == KW_BF16 ? fabs(want) * 0x1p-8 : fabs(want) * 4e-7 + 1e-7;
            cr_expect_leq(fabs(got - want), tol, "unary op %d at %lld: %g vs %g", op, (long long)flat, got, want);
        }
        tt_free(&k);
    }
}

Test(unary, rejects_a_bad_mode_and_mixed_dtypes) {
    tt_rng r = {32};
    tt_case k = {0};
    tt_tensor(&k, 0, KW_F32, 1, TT_DIMS(8), NULL, 0, 0, &r);
    tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(8), NULL, -1, 1, &r);
    k.c.ip[0] = KW_UNARY_COUNT;
    tt_expect_reject(KW_OP_UNARY, &k.c, KW_EINVAL, "kw_unary_op");
    k.c.ip[0] = KW_UNARY_COS;
    k.c.t[0].dtype = KW_BF16;
    tt_expect_reject(KW_OP_UNARY, &k.c, KW_EDTYPE, "x's dtype");
    k.c.t[0].dtype = KW_F32;
    tt_free(&k);
}

/* ---- compare: slots y 0, a 1, b 2 (optional); ip[0] kw_compare_op ---- */

static int compare_ref(int op, double a, double b) {
    switch (op) {
    case KW_COMPARE_EQ: return a == b;
    case KW_COMPARE_NE: return a != b;
    case KW_COMPARE_LT: return a < b;
    case KW_COMPARE_LE: return a <= b;
    case KW_COMPARE_GT: return a > b;
    default: return a >= b;
    }
}

Test(compare, every_op_on_broadcast_operands_and_scalars_nans_unequal) {
    tt_rng r = {57};
    static const kw_dtype dts[] = {KW_I64, KW_I32, KW_F32, KW_BF16};
    for (int trial = 0; trial < 48; trial++) {
        const int op = trial % KW_COMPARE_COUNT, scalar = trial / KW_COMPARE_COUNT % 2;
        const kw_dtype dt = dts[trial / (2 * KW_COMPARE_COUNT)];
        const int64_t M = 5, N = 11;
        tt_case k = {0};
        /* small integers, so that equal values are common; a transposed a */
        kw_tensor *a = tt_tensor(&k, 1, dt, 2, TT_DIMS(M, N), TT_DIMS(1, M), -3, 3, &r);
        kw_tensor *b = scalar ? NULL : tt_tensor(&k, 2, dt, 2, TT_DIMS(1, N), NULL, -3, 3, &r);
        kw_tensor *y = tt_tensor(&k, 0, KW_BOOL, 2, TT_DIMS(M, N), NULL, 0, 1, &r);
        tt_set(a, (int64_t[]){1, 1}, 1.0); /* equal to the scalar (in bf16) */
        if (b) tt_set(a, (int64_t[]){2, 3}, tt_get(b, (int64_t[]){0, 3}));
        if (dt == KW_F32 || dt == KW_BF16) {
            tt_set(a, (int64_t[]){0, 0}, NAN);
            if (b) tt_set(b, (int64_t[]){0, 1}, NAN);
        }
        k.c.ip[0] = op;
        k.c.fp[0] = dt == KW_I64 || dt == KW_I32 ? 1.0 : 1.00390625; /* float: 1 + 2^-8, 1.0 in bf16 */
        tt_run(KW_OP_COMPARE, kw_cpu_isa(), &k.c, 2);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                const int64_t at[2] = {i, j}, b_at[2] = {0, j};
                const double bv = b ? tt_get(b, b_at) : kw__round_to((float)k.c.fp[0], dt == KW_BF16 ? KW_BF16 : KW_F32);
                cr_assert_eq(tt_get(y, at), compare_ref(op, tt_get(a, at), bv), "trial %d op %d [%lld, %lld]: %g vs %g",
                             trial, op, (long long)i, (long long)j, tt_get(a, at), bv);
            }
        tt_free(&k);
    }
}

Test(compare, int64_is_compared_exactly_and_bad_calls_are_named) {
    tt_case k = {0};
    tt_rng r = {58};
    kw_tensor *a = tt_tensor(&k, 1, KW_I64, 1, TT_DIMS(2), NULL, 0, 0, &r);
    kw_tensor *b = tt_tensor(&k, 2, KW_I64, 1, TT_DIMS(2), NULL, 0, 0, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_BOOL, 1, TT_DIMS(2), NULL, 0, 0, &r);
    ((int64_t *)a->data)[0] = INT64_MAX, ((int64_t *)b->data)[0] = INT64_MAX - 1; /* equal as doubles */
    ((int64_t *)a->data)[1] = INT64_MIN, ((int64_t *)b->data)[1] = INT64_MIN;
    k.c.ip[0] = KW_COMPARE_LE;
    tt_run(KW_OP_COMPARE, kw_cpu_isa(), &k.c, 1);
    cr_expect_eq(((uint8_t *)y->data)[0], 0);
    cr_expect_eq(((uint8_t *)y->data)[1], 1);
    k.c.ip[0] = KW_COMPARE_COUNT;
    tt_expect_reject(KW_OP_COMPARE, &k.c, KW_EINVAL, "ip[0] must be a kw_compare_op");
    k.c.ip[0] = KW_COMPARE_EQ;
    b->dtype = KW_I32;
    tt_expect_reject(KW_OP_COMPARE, &k.c, KW_EDTYPE, "b of a's dtype");
    b->dtype = KW_I64, y->dtype = KW_U8;
    tt_expect_reject(KW_OP_COMPARE, &k.c, KW_EDTYPE, "y must be bool");
    y->dtype = KW_BOOL;
    k.c.t[2] = (kw_tensor){0};
    k.c.fp[0] = 0x1p54;
    tt_expect_reject(KW_OP_COMPARE, &k.c, KW_EINVAL, "integer scalar b (fp[0]) within +-2^53");
    k.c.fp[0] = 0.5;
    tt_expect_reject(KW_OP_COMPARE, &k.c, KW_EINVAL, "integer scalar");
    a->dtype = KW_I32, a->stride[0] = 2; /* int32 view of the same memory */
    k.c.fp[0] = 2147483648.0;
    tt_expect_reject(KW_OP_COMPARE, &k.c, KW_EINVAL, "within int32's range");
    tt_free(&k);
}
