/* linear, linear_multi and matmul_dnnl: every variant against the scalar
 * reference, and the reference against double precision.
 *
 * Tolerances. f32 outputs differ from the reference only in summation order
 * (FMA, per-lane partial sums, dpbf16 pairs): with |x|, |w| <= 1 each output's
 * rounding error stays well below 1e-7 * K, so atol = 1e-7 * K + rtol 1e-6.
 * bf16 outputs may also round to the neighbouring bf16 when the f32 sums differ
 * in the last bits: rtol 2^-7 (one bf16 ulp). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>

#include "kw_ops_impl.h"
#include "linear.h"
#include "test_ops_util.h"

static tt_tol lin_tol(kw_dtype yt, int64_t K) {
    return (tt_tol){1e-7 * (double)K + 1e-6, yt == KW_BF16 ? 0x1p-7 : 1e-6};
}

static const int64_t Ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17};
static const int64_t Ks[] = {1, 7, 16, 17, 31, 32, 33, 64, 100, 257};
static const int64_t Ns[] = {1, 3, 4, 5, 17, 40};
#define PICK(a, r) ((a)[tt_int(r, 0, (int64_t)(sizeof(a) / sizeof *(a)) - 1)])

/* x [.., M, K] (rows maybe padded), weight [N, K] (rows maybe padded). */
static void make_x_w(tt_case *k, int xs, int ws, kw_dtype xt, kw_dtype wt, int64_t M, int64_t K, int64_t N,
                     tt_rng *r) {
    tt_padded(k, xs, xt, 3, TT_DIMS(1, M, K), tt_int(r, 0, 1) * tt_int(r, 1, 9), -1, 1, r);
    tt_padded(k, ws, wt, 2, TT_DIMS(N, K), tt_int(r, 0, 1) * tt_int(r, 1, 9), -1, 1, r);
}

Test(linear, every_variant_matches_the_reference) {
    tt_rng r = {1};
    static const kw_dtype pairs[][2] = {{KW_F32, KW_F32}, {KW_F32, KW_BF16}, {KW_BF16, KW_BF16}};
    for (int trial = 0; trial < 150; trial++) {
        const kw_dtype xt = pairs[trial % 3][0], wt = pairs[trial % 3][1];
        const int64_t M = trial < 30 ? (trial % 2 ? 1 : 7) : PICK(Ms, &r), K = PICK(Ks, &r), N = PICK(Ns, &r);
        tt_case k = {0};
        make_x_w(&k, 1, 2, xt, wt, M, K, N, &r);
        tt_padded(&k, 0, xt, 3, TT_DIMS(1, M, N), tt_int(&r, 0, 1) * 3, -1, 1, &r);
        if (tt_int(&r, 0, 1)) tt_tensor(&k, 3, tt_int(&r, 0, 1) ? KW_F32 : KW_BF16, 1, TT_DIMS(N), NULL, -1, 1, &r);
        char what[96];
        snprintf(what, sizeof what, "x %s w %s M=%lld K=%lld N=%lld", kw_dtype_name(xt), kw_dtype_name(wt),
                 (long long)M, (long long)K, (long long)N);
        tt_check_variants(KW_OP_LINEAR, &k, lin_tol(xt, K), what);
        tt_free(&k);
    }
}

/* Weight slot 2 as [K / B, N, B]: W[n, kb·B + j] at [kb, n, j], rows maybe padded. */
static kw_tensor *make_blocked_w(tt_case *k, int slot, kw_dtype wt, int64_t K, int64_t N, int64_t B, tt_rng *r) {
    const int64_t pad = tt_int(r, 0, 1) * 3;
    return tt_tensor(k, slot, wt, 3, TT_DIMS(K / B, N, B), TT_DIMS(N * (B + pad), B + pad, 1), -1, 1, r);
}

Test(linear, k_blocked_weights_match_the_reference_and_the_plain_layout) {
    tt_rng r = {11};
    static const kw_dtype pairs[][2] = {{KW_F32, KW_F32}, {KW_F32, KW_BF16}, {KW_BF16, KW_BF16}};
    static const int64_t Bs[] = {1, 16, 17, 32, 64};
    for (int trial = 0; trial < 60; trial++) {
        const kw_dtype xt = pairs[trial % 3][0], wt = pairs[trial % 3][1];
        const int64_t B = Bs[tt_int(&r, 0, 4)], K = B * tt_int(&r, 1, 5), N = PICK(Ns, &r);
        const int64_t M = trial < 20 ? 1 : PICK(Ms, &r);
        tt_case k = {0};
        tt_padded(&k, 1, xt, 2, TT_DIMS(M, K), tt_int(&r, 0, 2), -1, 1, &r);
        kw_tensor *w = make_blocked_w(&k, 2, wt, K, N, B, &r);
        kw_tensor *y = tt_tensor(&k, 0, xt, 2, TT_DIMS(M, N), NULL, 0, 0, &r);
        if (trial % 4 == 0) tt_tensor(&k, 3, KW_F32, 1, TT_DIMS(N), NULL, -1, 1, &r);
        tt_check_variants(KW_OP_LINEAR, &k, lin_tol(xt, K), "k-blocked");

        /* The same weights in [N, K]: the best variant gives the same result. */
        tt_case plain = {0};
        plain.c = k.c;
        kw_tensor *wp = tt_tensor(&plain, 2, wt, 2, TT_DIMS(N, K), NULL, 0, 0, &r);
        kw_tensor *yp = tt_tensor(&plain, 0, xt, 2, TT_DIMS(M, N), NULL, 0, 0, &r);
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < K; i++) tt_set(wp, (int64_t[]){n, i}, tt_get(w, (int64_t[]){i / B, n, i % B}));
        tt_run(KW_OP_LINEAR, kw_cpu_isa(), &plain.c, 2);
        tt_run(KW_OP_LINEAR, kw_cpu_isa(), &k.c, 2);
        const tt_tol tol = lin_tol(xt, K);
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) {
                const double a = tt_get(y, (int64_t[]){m, n}), b = tt_get(yp, (int64_t[]){m, n});
                cr_assert_leq(fabs(a - b), tol.atol + tol.rtol * fabs(b), "B=%lld K=%lld y[%lld,%lld]: %g vs %g",
                              (long long)B, (long long)K, (long long)m, (long long)n, a, b);
            }
        tt_free(&plain);
        tt_free(&k);
    }
    cr_expect_eq(kw_linear_block(2048), 0);
    cr_expect_eq(kw_linear_block(8192), KW_LINEAR_BLOCK);
    cr_expect_eq(kw_linear_block(8192 + 1), 0);
}

/* Rows per thread > KW__CHUNK, and tiles of 3 or more activation rows of 4 KiB
 * or more, which bf16 weights read three rows at a time on AVX-512
 * (KW__WIDE_ROW_BYTES): a K of 2051 (a partial group at the end of each row),
 * and K blocked by 2048; N = 301 and 97 leave one row after the threes. 17
 * rows of x over bf16 weights are packed panels on AVX2 (KW__PANELS_MIN_M),
 * each block of K in parts of KW__PANEL_K, the last panel of 13 and 1 rows. */
Test(linear, long_rows_and_many_outputs) {
    tt_rng r = {2};
    static const kw_dtype pairs[][2] = {{KW_F32, KW_F32}, {KW_F32, KW_BF16}, {KW_BF16, KW_BF16}};
    static const int64_t rows[] = {1, 3, 4, 7, 17};
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < 5; i++) {
            const int64_t M = rows[i], K = 2051, N = 301;
            tt_case k = {0};
            make_x_w(&k, 1, 2, pairs[p][0], pairs[p][1], M, K, N, &r);
            tt_tensor(&k, 0, pairs[p][0], 2, TT_DIMS(M, N), NULL, 0, 0, &r);
            char what[64];
            snprintf(what, sizeof what, "long rows, %s x %s M=%lld", kw_dtype_name(pairs[p][0]),
                     kw_dtype_name(pairs[p][1]), (long long)M);
            tt_check_variants(KW_OP_LINEAR, &k, lin_tol(pairs[p][0], K), what);
            tt_free(&k);
        }
    for (int p = 1; p < 3; p++)
        for (int64_t M = 3; M <= 17; M = M == 6 ? 17 : M + 3) {
            const int64_t K = 2 * KW_LINEAR_BLOCK, N = 97;
            tt_case k = {0};
            tt_padded(&k, 1, pairs[p][0], 2, TT_DIMS(M, K), 0, -1, 1, &r);
            make_blocked_w(&k, 2, KW_BF16, K, N, KW_LINEAR_BLOCK, &r);
            tt_tensor(&k, 0, pairs[p][0], 2, TT_DIMS(M, N), NULL, 0, 0, &r);
            tt_check_variants(KW_OP_LINEAR, &k, lin_tol(pairs[p][0], K), "long rows, blocked");
            tt_free(&k);
        }
}

/* The call as prepared for this CPU (linear or linear_multi). */
static kw__lin prepared(kw_op_id op, const kw_call *c) {
    kw__lin prep;
    kw_call call = *c;
    char msg[256];
    cr_assert_eq(kw_op_prepare(op, &call, kw_cpu_isa(), &prep, msg, sizeof msg), 0, "%s", msg);
    return prep;
}

/* Whether the call, prepared for this CPU, runs linear's AMX kernel. */
static int runs_on_amx(kw_op_id op, const kw_call *c) { return prepared(op, c).rows == kw__linear_rows_amx; }

/* A random call of the AMX kernel's kind into k: linear, or linear_multi with
 * outputs of 16 rows and the rest; y's and the weight's rows maybe padded, x's
 * by a random multiple of x_pad; a K-blocked weight (blocks of K / 2 where
 * that is even, else K) or [N, K]; a bias of either dtype when `bias`.
 * Returns the op; `what` names the case. */
static kw_op_id amx_case(tt_case *k, kw_dtype xt, int64_t M, int64_t K, int64_t N, int blocked, int multi, int bias,
                         int64_t x_pad, tt_rng *r, char *what, size_t len) {
    const int xslot = multi ? 4 : 1;
    if (multi) {
        tt_padded(k, 0, xt, 2, TT_DIMS(M, 16), tt_int(r, 0, 2), 0, 0, r);
        if (N > 16) tt_padded(k, 1, xt, 2, TT_DIMS(M, N - 16), tt_int(r, 0, 2), 0, 0, r);
    } else {
        tt_padded(k, 0, xt, 3, TT_DIMS(1, M, N), tt_int(r, 0, 1) * 3, 0, 0, r);
    }
    tt_padded(k, xslot, xt, 2, TT_DIMS(M, K), tt_int(r, 0, 1) * tt_int(r, 1, 9) * x_pad, -1, 1, r);
    if (blocked) make_blocked_w(k, xslot + 1, KW_BF16, K, N, K / 2 % 2 ? K : K / 2, r);
    else tt_padded(k, xslot + 1, KW_BF16, 2, TT_DIMS(N, K), tt_int(r, 0, 1) * 5, -1, 1, r);
    if (bias) tt_tensor(k, xslot + 2, tt_int(r, 0, 1) ? KW_F32 : KW_BF16, 1, TT_DIMS(N), NULL, -1, 1, r);
    snprintf(what, len, "%s x %s M=%lld K=%lld N=%lld%s", multi ? "linear_multi" : "linear", kw_dtype_name(xt),
             (long long)M, (long long)K, (long long)N, blocked ? " k-blocked" : "");
    return multi ? KW_OP_LINEAR_MULTI : KW_OP_LINEAR;
}

/* Shapes the AMX kernel takes (bf16 weights in groups of 16 rows, K in pairs),
 * with bf16 and f32 x: every variant against the reference, across blocks of 16
 * rows of x, steps of K shorter than 32, K-blocked weights, padded rows and
 * outputs split at groups; from 17 rows with K in steps of 32, the wide tiles
 * (pairs of weight groups and of blocks of x, an odd one left over of either).
 * On an AMX CPU the kernel must be the one that ran; elsewhere these are
 * AVX-512 cases. */
Test(linear, amx_shapes_match_the_reference) {
    tt_rng r = {21};
    /* both sides of each threshold */
    static const int64_t Ms_amx[] = {1, 2, 3, 5, 8, 11, 12, 15, 16, 17, 31, 33, 48, 64, 80};
    static const int64_t Ks_amx[] = {2, 30, 32, 34, 64, 100, 960};
    static const int64_t Ns_amx[] = {16, 32, 48, 80};
    const int nm = (int)(sizeof Ms_amx / sizeof *Ms_amx), amx = kw_cpu_isa() >= KW_ISA_AMX;
    for (int trial = 0; trial < 12 * nm; trial++) {
        const kw_dtype xt = trial % 2 ? KW_F32 : KW_BF16;
        const int64_t M = Ms_amx[trial / 2 % nm], K = PICK(Ks_amx, &r), N = PICK(Ns_amx, &r);
        const int blocked = trial % 5 == 4 && K % 2 == 0 && K >= 32, multi = trial % 3 == 1;
        tt_case k = {0};
        char what[96];
        const kw_op_id op = amx_case(&k, xt, M, K, N, blocked, multi, trial % 4 == 0, 1, &r, what, sizeof what);
        const int want = amx && M >= (xt == KW_BF16 ? KW_AMX_MIN_M_BF16 : KW_AMX_MIN_M_F32);
        cr_assert_eq(runs_on_amx(op, &k.c), want, "%s: the AMX kernel %s", what, want ? "did not run" : "ran");
        tt_check_variants(op, &k, lin_tol(xt, K), what);
        tt_free(&k);
    }
}

/* The rows of x in the AMX kernel's panels (kw__lin_panel_rows,
 * kw__lin_panel_start): more rows than a panel, so that x is laid out and
 * multiplied panel after panel, the last one short (an odd block, a block of
 * fewer than 16 rows) or the rows split evenly; weight groups stored in pairs,
 * and split where a pair straddles two outputs of linear_multi. Fewer rows than
 * the product by rows of x takes (KW__LIN_BY_ROWS_MIN_M), so long rows of x
 * make the panels short. */
Test(linear, amx_panels_of_x_match_the_reference) {
    tt_rng r = {29};
    static const struct {
        kw_dtype xt;
        int64_t M, K, n_out, N[3];
    } cases[] = {
        {KW_BF16, 90, 9000, 1, {80}},          /* panels of 32 rows, the last a block and 10 rows */
        {KW_BF16, 100, 9000, 3, {16, 64, 48}}, /* pairs (0, 16) and (64, 80) straddle outputs */
        {KW_BF16, 72, 9000, 1, {48}},          /* a last panel of 8 rows: narrow tiles */
        {KW_BF16, 130, 6000, 1, {208}},        /* panels of at most 64 rows: 64, 32 and 34 */
        {KW_F32, 100, 4000, 1, {48}},          /* three parts, panels of 32 rows; f32 y */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const kw_dtype xt = cases[i].xt;
        const int64_t M = cases[i].M, K = cases[i].K;
        const kw_op_id op = cases[i].n_out > 1 ? KW_OP_LINEAR_MULTI : KW_OP_LINEAR;
        const int xslot = cases[i].n_out > 1 ? 4 : 1;
        int64_t N = 0;
        tt_case k = {0};
        for (int j = 0; j < cases[i].n_out; j++) {
            tt_padded(&k, j, xt, 2, TT_DIMS(M, cases[i].N[j]), tt_int(&r, 0, 2), 0, 0, &r);
            N += cases[i].N[j];
        }
        tt_tensor(&k, xslot, xt, 2, TT_DIMS(M, K), NULL, -1, 1, &r);
        tt_tensor(&k, xslot + 1, KW_BF16, 2, TT_DIMS(N, K), NULL, -1, 1, &r);
        tt_tensor(&k, xslot + 2, xt, 1, TT_DIMS(N), NULL, -1, 1, &r);
        char what[64];
        snprintf(what, sizeof what, "%s x M=%lld K=%lld", kw_dtype_name(xt), (long long)M, (long long)K);
        if (kw_cpu_isa() >= KW_ISA_AMX) {
            const kw__lin prep = prepared(op, &k.c);
            cr_assert(prep.rows == kw__linear_rows_amx && !kw__lin_amx_by_rows(&prep) && kw__lin_panels(&prep) >= 3,
                      "%s: not three panels on the AMX kernel", what);
        }
        tt_check_variants(op, &k, lin_tol(xt, K), what);
        tt_free(&k);
    }
}

/* Many rows of x over a small weight, the product by rows of x
 * (kw__lin_amx_by_rows): a last pair of blocks that is one block, or one of
 * fewer than 16 rows; K in place (bf16, whole steps), padded (a short step,
 * K-blocked weights) or split in parts (f32 x); an odd group of weight rows
 * left over, outputs of linear_multi split inside a pair of groups; padded rows
 * of x and of y, biases of either dtype. On an AMX CPU it must be the kernel
 * that ran; elsewhere these are AVX-512 cases. */
Test(linear, amx_by_rows_of_x_match_the_reference) {
    tt_rng r = {37};
    static const int64_t Ms_rows[] = {256, 257, 272, 300, 319};
    static const int64_t Ks_rows[] = {2, 30, 96, 100, 192, 384};
    static const int64_t Ns_rows[] = {16, 48, 96, 112};
    const int amx = kw_cpu_isa() >= KW_ISA_AMX;
    for (int trial = 0; trial < 40; trial++) {
        const kw_dtype xt = trial % 2 ? KW_F32 : KW_BF16;
        const int64_t M = PICK(Ms_rows, &r), K = PICK(Ks_rows, &r), N = PICK(Ns_rows, &r);
        const int blocked = trial % 5 == 4 && K >= 64, multi = trial % 3 == 1;
        tt_case k = {0};
        char what[96];
        const kw_op_id op = amx_case(&k, xt, M, K, N, blocked, multi, trial % 4 < 2, 2, &r, what, sizeof what);
        if (amx) {
            const kw__lin prep = prepared(op, &k.c);
            cr_assert(prep.rows == kw__linear_rows_amx && kw__lin_amx_by_rows(&prep),
                      "%s: not the product by rows of x", what);
        }
        tt_check_variants(op, &k, lin_tol(xt, K), what);
        tt_free(&k);
    }
}

/* bf16 y below 2^-126 keeps its denormal value, as PyTorch rounds it: the AMX
 * kernel's stores round with vcvtne2ps2bf16, which flushes denormals, except
 * where a vector holds one. x is zero, so y is the bias. */
Test(linear, amx_denormal_bf16_outputs_are_kept) {
    tt_rng r = {31};
    const int64_t M = 40, K = 64, N = 48;
    tt_case k = {0};
    kw_tensor *y = tt_tensor(&k, 0, KW_BF16, 2, TT_DIMS(M, N), NULL, 0, 0, &r);
    tt_tensor(&k, 1, KW_BF16, 2, TT_DIMS(M, K), NULL, 0, 0, &r);
    tt_tensor(&k, 2, KW_BF16, 2, TT_DIMS(N, K), NULL, -1, 1, &r);
    kw_tensor *b = tt_tensor(&k, 3, KW_BF16, 1, TT_DIMS(N), NULL, -1, 1, &r);
    for (int64_t n = 0; n < N; n += 3) tt_set(b, (int64_t[]){n}, ldexp(1 + n % 5 / 8.0, -130 - n % 4));
    tt_run(KW_OP_LINEAR, kw_cpu_isa(), &k.c, 2);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++)
            cr_assert_eq(tt_get(y, (int64_t[]){m, n}), tt_get(b, (int64_t[]){n}), "y[%lld, %lld] is %g, bias %g",
                         (long long)m, (long long)n, tt_get(y, (int64_t[]){m, n}), tt_get(b, (int64_t[]){n}));
    tt_free(&k);
}

/* ±value at every other row of an f32 x over bf16 weights in [-w, w], in
 * narrow tiles (their short step of K laid out element by element) and wide
 * ones, and the AVX-512 kernels, against the reference. */
static void check_extreme_activations(float value, double w, tt_rng *r, const char *what) {
    static const int64_t Ms[] = {16, 20}, Ks[] = {100, 64}; /* narrow with a short step of K (4); wide */
    for (int i = 0; i < 2; i++) {
        const int64_t M = Ms[i], K = Ks[i], N = 32;
        tt_case k = {0};
        kw_tensor *x = tt_tensor(&k, 1, KW_F32, 2, TT_DIMS(M, K), NULL, -1, 1, r);
        tt_tensor(&k, 2, KW_BF16, 2, TT_DIMS(N, K), NULL, -w, w, r);
        tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(M, N), NULL, 0, 0, r);
        for (int64_t m = 0; m < M; m += 2) tt_set(x, (int64_t[]){m, (m * 7) % K}, m % 4 ? value : -value);
        char name[64];
        snprintf(name, sizeof name, "%s in x, %s tiles", what, i ? "wide" : "narrow");
        tt_check_variants(KW_OP_LINEAR, &k, lin_tol(KW_F32, K), name);
        tt_free(&k);
    }
}

/* Infinite activations give the f32 linear's ±inf (NaN under a zero weight):
 * the AMX kernel's split of an f32 x into bf16 parts must not turn inf - inf
 * into NaN parts. */
Test(linear, infinite_f32_activations_give_infinite_outputs) {
    tt_rng r = {23};
    check_extreme_activations(INFINITY, 1, &r, "inf");
}

/* A finite activation near float's largest (3.4e38, above bf16's 3.39e38)
 * gives the f32 linear's finite outputs (weights under 0.5: products stay
 * finite): the AMX kernel's first part of it, rounded to bf16, was infinite,
 * and every output of its row NaN. */
Test(linear, f32_activations_near_floats_largest_give_finite_outputs) {
    tt_rng r = {29};
    check_extreme_activations(3.4e38f, 0.5, &r, "3.4e38");
}

/* Exactly representable sums: the reference must be exact, and so every variant. */
Test(linear, reference_is_exact_on_exact_inputs) {
    static const float x[2][3] = {{0.5f, -1.25f, 3.0f}, {2.0f, 0.25f, -0.75f}};
    static const float w[4][3] = {{1, 2, 3}, {-0.5f, 0.5f, 0}, {4, -4, 0.125f}, {0, 0, 1}};
    static const float b[4] = {0.5f, -1, 0, 2};
    for (int wbf = 0; wbf < 2; wbf++)
        for (int xbf = 0; xbf <= wbf; xbf++) {
            tt_case k = {0};
            tt_rng r = {3};
            const kw_dtype xt = xbf ? KW_BF16 : KW_F32, wt = wbf ? KW_BF16 : KW_F32;
            kw_tensor *tx = tt_tensor(&k, 1, xt, 2, TT_DIMS(2, 3), NULL, 0, 0, &r);
            kw_tensor *tw = tt_tensor(&k, 2, wt, 2, TT_DIMS(4, 3), NULL, 0, 0, &r);
            kw_tensor *tb = tt_tensor(&k, 3, KW_F32, 1, TT_DIMS(4), NULL, 0, 0, &r);
            kw_tensor *ty = tt_tensor(&k, 0, xt, 2, TT_DIMS(2, 4), NULL, 0, 0, &r);
            for (int64_t i = 0; i < 2; i++)
                for (int64_t j = 0; j < 3; j++) tt_set(tx, (int64_t[]){i, j}, x[i][j]);
            for (int64_t i = 0; i < 4; i++) {
                tt_set(tb, (int64_t[]){i}, b[i]);
                for (int64_t j = 0; j < 3; j++) tt_set(tw, (int64_t[]){i, j}, w[i][j]);
            }
            for (int isa = 0; isa <= (int)kw_cpu_isa(); isa++) {
                tt_run(KW_OP_LINEAR, isa, &k.c, 2);
                for (int64_t i = 0; i < 2; i++)
                    for (int64_t n = 0; n < 4; n++) {
                        double want = b[n];
                        for (int j = 0; j < 3; j++) want += (double)x[i][j] * w[n][j];
                        cr_expect_eq(tt_get(ty, (int64_t[]){i, n}), want, "%s y[%lld,%lld]", kw_isa_name((kw_isa)isa),
                                     (long long)i, (long long)n);
                    }
            }
            tt_free(&k);
        }
}

/* Random inputs against a double-precision sum of the same (widened) values. */
Test(linear, reference_matches_double_precision) {
    tt_rng r = {4};
    const int64_t M = 3, K = 1000, N = 9;
    tt_case k = {0};
    kw_tensor *x = tt_tensor(&k, 1, KW_F32, 2, TT_DIMS(M, K), NULL, -1, 1, &r);
    kw_tensor *w = tt_tensor(&k, 2, KW_BF16, 2, TT_DIMS(N, K), NULL, -1, 1, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(M, N), NULL, 0, 0, &r);
    tt_run(KW_OP_LINEAR, KW_ISA_SCALAR, &k.c, 1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double want = 0, mag = 0;
            for (int64_t i = 0; i < K; i++) {
                const double p = tt_get(x, (int64_t[]){m, i}) * tt_get(w, (int64_t[]){n, i});
                want += p, mag += fabs(p);
            }
            cr_expect_leq(fabs(tt_get(y, (int64_t[]){m, n}) - want), 1e-6 * mag, "y[%lld,%lld]", (long long)m, (long long)n);
        }
    tt_free(&k);
}

Test(linear, check_names_the_bad_slot) {
    tt_rng r = {5};
    tt_case k = {0};
    tt_tensor(&k, 1, KW_F32, 2, TT_DIMS(2, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 2, KW_BF16, 2, TT_DIMS(4, 9), NULL, -1, 1, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(2, 4), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_LINEAR, &k.c, KW_ESHAPE, "linear: weight must be");
    tt_free(&k);

    tt_tensor(&k, 1, KW_BF16, 2, TT_DIMS(2, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 2, KW_BF16, 2, TT_DIMS(4, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(2, 4), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_LINEAR, &k.c, KW_EDTYPE, "output 0 must have x's dtype bfloat16");
    tt_free(&k);

    tt_tensor(&k, 1, KW_F32, 2, TT_DIMS(2, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 2, KW_F32, 2, TT_DIMS(4, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 3, KW_F32, 1, TT_DIMS(5), NULL, -1, 1, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(2, 4), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_LINEAR, &k.c, KW_ESHAPE, "linear: bias must be");
    tt_free(&k);
}

/* linear_multi: slots y0..y3 (4), x (4), weight (5), bias (6). */
Test(linear_multi, every_variant_matches_the_reference) {
    tt_rng r = {6};
    for (int trial = 0; trial < 60; trial++) {
        const kw_dtype xt = trial % 3 == 2 ? KW_BF16 : KW_F32, wt = trial % 3 ? KW_BF16 : KW_F32;
        const int n_out = (int)tt_int(&r, 1, 4);
        const int64_t M = trial % 2 ? 1 : PICK(Ms, &r), K = PICK(Ks, &r);
        int64_t N = 0;
        tt_case k = {0};
        for (int j = 0; j < n_out; j++) {
            const int64_t n = PICK(Ns, &r);
            tt_padded(&k, j, xt, 2, TT_DIMS(M, n), tt_int(&r, 0, 2), 0, 0, &r);
            N += n;
        }
        make_x_w(&k, 4, 5, xt, wt, M, K, N, &r);
        if (trial % 4 == 0) tt_tensor(&k, 6, xt, 1, TT_DIMS(N), NULL, -1, 1, &r);
        tt_check_variants(KW_OP_LINEAR_MULTI, &k, lin_tol(xt, K), "linear_multi");
        tt_free(&k);
    }
}

/* Split outputs hold exactly the columns of the one concatenated output. */
Test(linear_multi, split_outputs_equal_the_concatenated_linear) {
    tt_rng r = {7};
    const int64_t M = 2, K = 40, sizes[3] = {24, 8, 8}, N = 40;
    tt_case multi = {0}, cat = {0};
    for (int j = 0; j < 3; j++) tt_tensor(&multi, j, KW_F32, 2, TT_DIMS(M, sizes[j]), NULL, 0, 0, &r);
    make_x_w(&multi, 4, 5, KW_F32, KW_BF16, M, K, N, &r);
    cat.c.t[1] = multi.c.t[4];
    cat.c.t[2] = multi.c.t[5];
    kw_tensor *y = tt_tensor(&cat, 0, KW_F32, 2, TT_DIMS(M, N), NULL, 0, 0, &r);
    const kw_isa isa = kw_cpu_isa();
    tt_run(KW_OP_LINEAR_MULTI, isa, &multi.c, 3);
    tt_run(KW_OP_LINEAR, isa, &cat.c, 2);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0, j = 0, col = 0; n < N; n++, col++) {
            if (col == sizes[j]) j++, col = 0;
            cr_expect_eq(tt_get(&multi.c.t[j], (int64_t[]){m, col}), tt_get(y, (int64_t[]){m, n}), "y%lld[%lld,%lld]",
                         (long long)j, (long long)m, (long long)col);
        }
    cat.mem[1] = cat.mem[2] = NULL; /* owned by multi */
    tt_free(&cat);
    tt_free(&multi);
}

/* Outputs of 64, 17 and 22 weight rows, read by wide tiles (KW__WIDE_ROW_BYTES). */
Test(linear_multi, long_rows) {
    tt_rng r = {14};
    for (int p = 0; p < 2; p++) {
        const kw_dtype xt = p ? KW_BF16 : KW_F32;
        const int64_t M = 5, K = 2051, sizes[3] = {64, 17, 22};
        int64_t N = 0;
        tt_case k = {0};
        for (int j = 0; j < 3; j++) {
            tt_tensor(&k, j, xt, 2, TT_DIMS(M, sizes[j]), NULL, 0, 0, &r);
            N += sizes[j];
        }
        make_x_w(&k, 4, 5, xt, KW_BF16, M, K, N, &r);
        tt_check_variants(KW_OP_LINEAR_MULTI, &k, lin_tol(xt, K), "linear_multi, long rows");
        tt_free(&k);
    }
}

Test(linear_multi, k_blocked_weights) {
    tt_rng r = {12};
    for (int trial = 0; trial < 12; trial++) {
        const kw_dtype xt = trial % 3 == 2 ? KW_BF16 : KW_F32, wt = trial % 3 ? KW_BF16 : KW_F32;
        const int64_t B = 32, K = 96, M = trial % 2 ? 1 : 5;
        int64_t N = 0;
        tt_case k = {0};
        for (int j = 0; j < 3; j++) {
            const int64_t n = PICK(Ns, &r);
            tt_tensor(&k, j, xt, 2, TT_DIMS(M, n), NULL, 0, 0, &r);
            N += n;
        }
        tt_tensor(&k, 4, xt, 2, TT_DIMS(M, K), NULL, -1, 1, &r);
        make_blocked_w(&k, 5, wt, K, N, B, &r);
        tt_check_variants(KW_OP_LINEAR_MULTI, &k, lin_tol(xt, K), "linear_multi k-blocked");
        tt_free(&k);
    }
}

Test(linear_multi, check_names_the_bad_slot) {
    tt_rng r = {8};
    tt_case k = {0};
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(1, 4), NULL, 0, 0, &r);
    tt_tensor(&k, 2, KW_F32, 2, TT_DIMS(1, 4), NULL, 0, 0, &r);
    tt_tensor(&k, 4, KW_F32, 2, TT_DIMS(1, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 5, KW_F32, 2, TT_DIMS(8, 8), NULL, -1, 1, &r);
    tt_expect_reject(KW_OP_LINEAR_MULTI, &k.c, KW_EINVAL, "output 2 given but output 1 absent");
    tt_free(&k);
}

/* Where oneDNN makes no bf16 matmul (below AVX-512; kw_dnnl_has_bf16_matmul),
 * matmul_dnnl's prepare must refuse bf16 by name: lower.py's _linear_step then
 * takes kwker's linear. True when it refused. */
static int dnnl_refused_bf16(const tt_case *k) {
    if (k->c.t[1].dtype != KW_BF16 || kw_dnnl_has_bf16_matmul()) return 0;
    cr_assert_lt(kw_cpu_isa(), KW_ISA_AVX512, "oneDNN made no bf16 matmul on an AVX-512 CPU");
    tt_expect_reject(KW_OP_MATMUL_DNNL, &k->c, KW_EINVAL, "oneDNN made no matmul primitive");
    return 1;
}

/* oneDNN blocks and orders its sums its own way; bf16 goes through vdpbf16ps.
 * Each call is cut into a slice of columns per thread it is prepared for (up to
 * one per 16 columns: N = 45 gives 3, the last one short), run on the threads it
 * runs on (1, 2, 3, 7: tt_check_variants), or for 2 and 5 threads whatever it
 * runs on, as a plan run on a smaller pool than it was made for. */
Test(matmul_dnnl, matches_the_reference) {
    tt_rng r = {9};
    static const int64_t Mm[] = {1, 7, 33, 64};
    static const int prepared_for[] = {0, 2, 5}; /* 0: the threads it runs on */
    for (int t = 0; t < 8; t++)
        for (int f = 0; f < 3; f++) {
            const kw_dtype dt = t % 2 ? KW_BF16 : KW_F32;
            const int64_t M = Mm[t / 2], K = 67, N = 45;
            tt_case k = {0};
            make_x_w(&k, 1, 2, dt, dt, M, K, N, &r);
            tt_tensor(&k, 0, dt, 3, TT_DIMS(1, M, N), NULL, 0, 0, &r);
            if (t % 3) tt_tensor(&k, 3, dt, 1, TT_DIMS(N), NULL, -1, 1, &r);
            k.c.n_threads = prepared_for[f];
            if (!dnnl_refused_bf16(&k)) tt_check_variants(KW_OP_MATMUL_DNNL, &k, lin_tol(dt, K), "matmul_dnnl");
            tt_free(&k);
        }
}

/* y's rows wider than the call's columns (a view into a wider tensor): each
 * slice is staged in the thread's scratch and copied into y's rows, and the
 * columns of y past N are never written. */
Test(matmul_dnnl, writes_a_slice_of_wider_rows_and_nothing_past_it) {
    tt_rng r = {12};
    for (int t = 0; t < 4; t++) {
        const kw_dtype dt = t % 2 ? KW_BF16 : KW_F32;
        const int64_t M = 9, K = 40, N = 70, ys = 96;
        tt_case k = {0};
        make_x_w(&k, 1, 2, dt, dt, M, K, N, &r);
        tt_tensor(&k, 0, dt, 2, TT_DIMS(M, N), TT_DIMS(ys, 1), -1, 1, &r); /* the padding random: a write shows */
        k.c.n_threads = t < 2 ? 0 : 3;
        if (!dnnl_refused_bf16(&k)) tt_check_variants(KW_OP_MATMUL_DNNL, &k, lin_tol(dt, K), "matmul_dnnl, wide rows");
        tt_free(&k);
    }
}

/* A [K, N] weight read as stored (GPT-2's Conv1D): its [N, K] view has strides
 * (1, wk). The scalar reference is checked against a double-precision sum first,
 * then every variant (oneDNN) against it. */
Test(matmul_dnnl, reads_a_transposed_weight_through_its_strides) {
    tt_rng r = {11};
    for (int t = 0; t < 6; t++) {
        const kw_dtype dt = t % 2 ? KW_BF16 : KW_F32;
        const int64_t M = t < 2 ? 3 : 40, K = 67, N = 45, wk = N + (t % 3) * 5;
        tt_case k = {0};
        tt_padded(&k, 1, dt, 2, TT_DIMS(M, K), t % 3, -1, 1, &r);
        tt_tensor(&k, 2, dt, 2, TT_DIMS(N, K), TT_DIMS(1, wk), -1, 1, &r);
        tt_tensor(&k, 0, dt, 2, TT_DIMS(M, N), NULL, 0, 0, &r);
        const int bias = t % 3 != 0;
        if (bias) tt_tensor(&k, 3, dt, 1, TT_DIMS(N), NULL, -1, 1, &r);
        tt_run(KW_OP_MATMUL_DNNL, KW_ISA_SCALAR, &k.c, 2);
        const tt_tol tol = lin_tol(dt, K);
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) {
                double want = bias ? tt_get(&k.c.t[3], TT_DIMS(n)) : 0.0;
                for (int64_t i = 0; i < K; i++) want += tt_get(&k.c.t[1], TT_DIMS(m, i)) * tt_get(&k.c.t[2], TT_DIMS(n, i));
                const double got = tt_get(&k.c.t[0], TT_DIMS(m, n));
                cr_assert_leq(fabs(got - want), tol.atol + tol.rtol * fabs(want), "y[%lld, %lld] = %g, want %g",
                              (long long)m, (long long)n, got, want);
            }
        if (!dnnl_refused_bf16(&k)) tt_check_variants(KW_OP_MATMUL_DNNL, &k, tol, "matmul_dnnl, [K, N] weight");
        tt_free(&k);
    }
}

/* A slice of y too large to stage (over 4 MiB a thread: 65 rows of 16384 f32
 * columns) is written into y's wider rows directly. */
Test(matmul_dnnl, writes_a_slice_too_large_to_stage_into_y_directly) {
    tt_rng r = {13};
    const int64_t M = 65, K = 8, N = 32768, ys = N + 16;
    tt_case k = {0};
    make_x_w(&k, 1, 2, KW_F32, KW_F32, M, K, N, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(M, N), TT_DIMS(ys, 1), -1, 1, &r);
    k.c.n_threads = 2;
    tt_check_variants(KW_OP_MATMUL_DNNL, &k, lin_tol(KW_F32, K), "matmul_dnnl, unstaged wide rows");
    tt_free(&k);
}

/* No rows: nothing is written, and nothing divides by them (oneDNN 2.6 did, in
 * describing the matmul: SIGFPE). */
Test(matmul_dnnl, runs_no_rows) {
    tt_rng r = {14};
    for (int t = 0; t < 2; t++) {
        tt_case k = {0};
        make_x_w(&k, 1, 2, KW_F32, KW_F32, 0, 8, 20, &r);
        tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(0, 20), t ? TT_DIMS(24, 1) : NULL, 0, 0, &r);
        tt_check_variants(KW_OP_MATMUL_DNNL, &k, lin_tol(KW_F32, 8), "matmul_dnnl, no rows");
        tt_free(&k);
    }
}

Test(matmul_dnnl, rejects_mixed_dtypes) {
    tt_rng r = {10};
    tt_case k = {0};
    tt_tensor(&k, 1, KW_F32, 2, TT_DIMS(4, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 2, KW_BF16, 2, TT_DIMS(4, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(4, 4), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_MATMUL_DNNL, &k.c, KW_EDTYPE, "matmul_dnnl: weight and bias must have x's dtype");
    tt_free(&k);
}

/* grouped_linear: slots y (0), x (1), weight [E, N, K] (2), offs (3). Offsets
 * sorted from random draws in [0, S]: experts without rows, several rows each,
 * and (one trial in three) rows past the last offset, which must come out zero. */
static void make_grouped(tt_case *k, kw_dtype xt, kw_dtype wt, int64_t S, int64_t E, int64_t K, int64_t N,
                         kw_dtype ot, int tail, tt_rng *r) {
    tt_padded(k, 1, xt, 2, TT_DIMS(S, K), tt_int(r, 0, 1) * 5, -1, 1, r);
    tt_padded(k, 2, wt, 3, TT_DIMS(E, N, K), tt_int(r, 0, 1) * 3, -1, 1, r);
    tt_padded(k, 0, xt, 2, TT_DIMS(S, N), tt_int(r, 0, 1) * 3, -1, 1, r);
    kw_tensor *offs = tt_tensor(k, 3, ot, 1, TT_DIMS(E), NULL, 0, 0, r);
    int64_t v[16];
    for (int64_t e = 0; e < E; e++) v[e] = tt_int(r, 0, S);
    for (int64_t i = 1; i < E; i++)
        for (int64_t j = i; j > 0 && v[j - 1] > v[j]; j--) {
            const int64_t t = v[j];
            v[j] = v[j - 1], v[j - 1] = t;
        }
    if (!tail) v[E - 1] = S;
    for (int64_t e = 0; e < E; e++) tt_set(offs, (int64_t[]){e}, (double)v[e]);
}

/* y against a double-precision sum of the same values, row by row from its expert. */
static void expect_grouped_product(const tt_case *k, int64_t S, int64_t E, int64_t K, int64_t N, const char *what) {
    const kw_tensor *y = &k->c.t[0], *x = &k->c.t[1], *w = &k->c.t[2], *offs = &k->c.t[3];
    for (int64_t s = 0, e = 0; s < S; s++) {
        while (e < E && tt_get(offs, (int64_t[]){e}) <= s) e++;
        for (int64_t n = 0; n < N; n++) {
            double want = 0, mag = 0;
            for (int64_t i = 0; e < E && i < K; i++) {
                const double p = tt_get(x, (int64_t[]){s, i}) * tt_get(w, (int64_t[]){e, n, i});
                want += p, mag += fabs(p);
            }
            const double got = tt_get(y, (int64_t[]){s, n});
            cr_assert_leq(fabs(got - want), 2e-6 * mag + (y->dtype == KW_BF16 ? 0x1p-7 * fabs(want) : 0),
                          "%s: y[%lld, %lld] = %g, want %g (expert %lld)", what, (long long)s, (long long)n, got, want,
                          (long long)e);
        }
    }
}

Test(grouped_linear, every_variant_matches_the_reference_and_each_expert_its_rows) {
    tt_rng r = {12};
    static const kw_dtype pairs[][2] = {{KW_F32, KW_F32}, {KW_F32, KW_BF16}, {KW_BF16, KW_BF16}};
    static const int64_t Es[] = {1, 2, 3, 5, 8, 16}, Ss[] = {1, 2, 3, 4, 8, 13};
    for (int trial = 0; trial < 90; trial++) {
        const kw_dtype xt = pairs[trial % 3][0], wt = pairs[trial % 3][1];
        const int64_t S = PICK(Ss, &r), E = PICK(Es, &r), K = PICK(Ks, &r), N = trial % 5 ? PICK(Ns, &r) : 100;
        tt_case k = {0};
        make_grouped(&k, xt, wt, S, E, K, N, trial % 2 ? KW_I32 : KW_I64, trial % 3 == 1, &r);
        char what[112];
        snprintf(what, sizeof what, "x %s w %s S=%lld E=%lld K=%lld N=%lld", kw_dtype_name(xt), kw_dtype_name(wt),
                 (long long)S, (long long)E, (long long)K, (long long)N);
        tt_check_variants(KW_OP_GROUPED_LINEAR, &k, lin_tol(xt, K), what);
        tt_run_shared(KW_OP_GROUPED_LINEAR, kw_cpu_isa(), &k.c, 2, 1);
        expect_grouped_product(&k, S, E, K, N, what);
        tt_free(&k);
    }
}

/* Experts' rows long enough for wide tiles (KW__WIDE_ROW_BYTES), with up to 16
 * rows an expert; in the last two trials 20, 2 and 18 rows of 40, which AVX2
 * takes as packed panels where an expert has 16 rows or more
 * (KW__PANELS_MIN_M). */
Test(grouped_linear, long_rows) {
    tt_rng r = {13};
    for (int trial = 0; trial < 8; trial++) {
        const kw_dtype xt = trial % 2 ? KW_BF16 : KW_F32;
        const int64_t S = trial < 6 ? 16 : 40, E = 3, K = 2051, N = 40;
        tt_case k = {0};
        make_grouped(&k, xt, KW_BF16, S, E, K, N, KW_I64, 0, &r);
        if (trial >= 6)
            for (int64_t e = 0; e < E; e++) tt_set(&k.c.t[3], (int64_t[]){e}, (double[]){20, 22, 40}[e]);
        tt_check_variants(KW_OP_GROUPED_LINEAR, &k, lin_tol(xt, K), "grouped_linear, long rows");
        tt_run_shared(KW_OP_GROUPED_LINEAR, kw_cpu_isa(), &k.c, 2, 1);
        expect_grouped_product(&k, S, E, K, N, "grouped_linear, long rows");
        tt_free(&k);
    }
}

Test(grouped_linear, reports_offsets_out_of_order_or_past_the_rows) {
    tt_rng r = {13};
    for (int bad = 0; bad < 2; bad++) {
        tt_case k = {0};
        make_grouped(&k, KW_F32, KW_BF16, 4, 3, 16, 8, KW_I64, 0, &r);
        const int64_t offs[2][3] = {{3, 1, 4}, {1, 2, 5}};
        for (int64_t e = 0; e < 3; e++) tt_set(&k.c.t[3], (int64_t[]){e}, (double)offs[bad][e]);
        kw_fault fault = {0};
        k.c.fault = &fault;
        tt_run_shared(KW_OP_GROUPED_LINEAR, kw_cpu_isa(), &k.c, 2, 1);
        cr_expect(atomic_load(&fault.reported), "offsets %d", bad);
        cr_expect(fault.index == (bad ? 5 : 1) && fault.size == 5, "offsets %d: index %lld size %lld", bad,
                  (long long)fault.index, (long long)fault.size);
        tt_free(&k);
    }
}

Test(grouped_linear, check_names_the_bad_slot) {
    tt_rng r = {14};
    tt_case k = {0};
    make_grouped(&k, KW_BF16, KW_F32, 4, 3, 16, 8, KW_I64, 0, &r);
    tt_expect_reject(KW_OP_GROUPED_LINEAR, &k.c, KW_EDTYPE, "grouped_linear: weight must be bfloat16 when x is");
    tt_free(&k);

    make_grouped(&k, KW_F32, KW_F32, 4, 3, 16, 8, KW_I64, 0, &r);
    tt_tensor(&k, 2, KW_F32, 2, TT_DIMS(8, 16), NULL, -1, 1, &r);
    tt_expect_reject(KW_OP_GROUPED_LINEAR, &k.c, KW_ESHAPE, "grouped_linear: weight must be float32 or bfloat16 [E, N, K]");
    tt_free(&k);

    make_grouped(&k, KW_F32, KW_F32, 4, 3, 16, 8, KW_I64, 0, &r);
    tt_tensor(&k, 3, KW_F32, 1, TT_DIMS(3), NULL, 0, 4, &r);
    tt_expect_reject(KW_OP_GROUPED_LINEAR, &k.c, KW_ESHAPE, "grouped_linear: offs must be int32 or int64 [E]");
    tt_free(&k);

    make_grouped(&k, KW_F32, KW_F32, 4, 3, 16, 8, KW_I32, 0, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(4, 9), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_GROUPED_LINEAR, &k.c, KW_ESHAPE, "grouped_linear: y must be [S, N] with N == 8");
    tt_free(&k);
}
