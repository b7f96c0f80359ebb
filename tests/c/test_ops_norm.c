/* rms_norm, add_rms_norm, layer_norm: every variant against the scalar reference,
 * and the reference against double precision.
 *
 * Tolerances. The variants sum x² (and x) in another order, so rstd differs in
 * the last bits: f32 outputs rtol 1e-5 (atol 1e-6 for outputs near 0). bf16
 * outputs go through two roundings in Llama's form (x̂ to bf16, then w·x̂), each of
 * which may land on the neighbouring bf16: rtol 2^-6 (two bf16 ulps). */
#include <criterion/criterion.h>
#include <math.h>

#include "kw_ops_impl.h"
#include "test_ops_util.h"

static tt_tol norm_tol(kw_dtype yt) { return (tt_tol){1e-6, yt == KW_BF16 ? 0x1p-6 : 1e-5}; }

static const int64_t Ks[] = {1, 5, 16, 31, 33, 64, 100, 2048, 2053};
#define PICK(a, r) ((a)[tt_int(r, 0, (int64_t)(sizeof(a) / sizeof *(a)) - 1)])

/* rms_norm slots: y 0, x 1, weight 2; add_rms_norm: y 0, sum 1, x 2, residual 3, weight 4. */
static void rms_case(int add, int trial, tt_rng *r) {
    const kw_dtype xt = trial % 2 ? KW_BF16 : KW_F32;
    const int wmode = trial / 2 % 3; /* none, f32, bf16 */
    const int form = trial / 6 % KW_NORM_FORMS;
    const int64_t K = PICK(Ks, r), M = tt_int(r, 1, 7), xi = add ? 2 : 1, wi = add ? 4 : 2;
    const kw_dtype wt = wmode == 1 ? KW_F32 : KW_BF16;
    const kw_dtype yt = wmode && form == KW_NORM_LLAMA && wt == KW_F32 ? KW_F32 : xt;
    tt_case k = {0};
    tt_padded(&k, (int)xi, xt, 2, TT_DIMS(M, K), tt_int(r, 0, 3), -3, 3, r);
    if (wmode) tt_tensor(&k, (int)wi, wt, 1, TT_DIMS(K), NULL, -2, 2, r);
    tt_padded(&k, 0, yt, 2, TT_DIMS(M, K), tt_int(r, 0, 3), 0, 0, r);
    if (add) {
        tt_padded(&k, 3, xt, 2, TT_DIMS(M, K), 0, -3, 3, r);
        if (trial % 3 == 0)
            tt_alias(&k, 1, 2); /* the sum written over x, as an in-place add would */
        else
            tt_padded(&k, 1, xt, 2, TT_DIMS(M, K), 1, 0, 0, r);
    }
    k.c.fp[0] = 1e-6 * (1 + trial % 4);
    k.c.ip[0] = form;
    char what[96];
    snprintf(what, sizeof what, "x %s weight %d form %d K=%lld", kw_dtype_name(xt), wmode, form, (long long)K);
    tt_check_variants(add ? KW_OP_ADD_RMS_NORM : KW_OP_RMS_NORM, &k, norm_tol(yt), what);
    tt_free(&k);
}

Test(rms_norm, every_variant_matches_the_reference) {
    tt_rng r = {11};
    for (int trial = 0; trial < 48; trial++) rms_case(0, trial, &r);
}

Test(add_rms_norm, every_variant_matches_the_reference) {
    tt_rng r = {12};
    for (int trial = 0; trial < 48; trial++) rms_case(1, trial, &r);
}

/* HF's RMSNorms in double with the same casts: Llama's x̂ = x / sqrt(mean(x²) + eps)
 * rounded to bf16, then w * x̂ rounded to bf16; Gemma's x̂ * (1 + w) and OLMo 2's
 * w * x̂, each rounded once. */
Test(rms_norm, reference_matches_double_precision) {
    tt_rng r = {13};
    const int64_t K = 300;
    for (int bf = 0; bf < 2; bf++)
        for (int form = 0; form < KW_NORM_FORMS; form++) {
            const kw_dtype dt = bf ? KW_BF16 : KW_F32;
            tt_case k = {0};
            kw_tensor *x = tt_tensor(&k, 1, dt, 1, TT_DIMS(K), NULL, -4, 4, &r);
            kw_tensor *w = tt_tensor(&k, 2, dt, 1, TT_DIMS(K), NULL, -2, 2, &r);
            kw_tensor *y = tt_tensor(&k, 0, dt, 1, TT_DIMS(K), NULL, 0, 0, &r);
            k.c.fp[0] = 1e-5;
            k.c.ip[0] = form;
            tt_run(KW_OP_RMS_NORM, KW_ISA_SCALAR, &k.c, 1);
            double ss = 0;
            for (int64_t i = 0; i < K; i++) ss += tt_get(x, &i) * tt_get(x, &i);
            const double rstd = 1 / sqrt(ss / K + 1e-5);
            for (int64_t i = 0; i < K; i++) {
                const double h = tt_get(x, &i) * rstd;
                const double rounded = bf ? kw__bf16_to_f32(kw__f32_to_bf16((float)h)) : h;
                double want = form == KW_NORM_GEMMA ? h * (1 + tt_get(w, &i))
                              : form == KW_NORM_OLMO ? tt_get(w, &i) * h
                                                     : tt_get(w, &i) * rounded;
                if (bf) want = kw__bf16_to_f32(kw__f32_to_bf16((float)want));
                cr_expect_leq(fabs(tt_get(y, &i) - want), 1e-6 + (bf ? 0x1p-7 : 1e-6) * fabs(want),
                              "bf16 %d form %d y[%lld] = %.8g, want %.8g", bf, form, (long long)i, tt_get(y, &i), want);
            }
            tt_free(&k);
        }
}

Test(add_rms_norm, writes_the_rounded_sum) {
    tt_rng r = {14};
    const int64_t K = 37;
    tt_case k = {0};
    kw_tensor *x = tt_tensor(&k, 2, KW_BF16, 1, TT_DIMS(K), NULL, -3, 3, &r);
    kw_tensor *res = tt_tensor(&k, 3, KW_BF16, 1, TT_DIMS(K), NULL, -3, 3, &r);
    kw_tensor *sum = tt_tensor(&k, 1, KW_BF16, 1, TT_DIMS(K), NULL, 0, 0, &r);
    tt_tensor(&k, 0, KW_BF16, 1, TT_DIMS(K), NULL, 0, 0, &r);
    for (int isa = 0; isa <= (int)kw_cpu_isa(); isa++) {
        tt_run(KW_OP_ADD_RMS_NORM, isa, &k.c, 1);
        for (int64_t i = 0; i < K; i++)
            cr_expect_eq(tt_get(sum, &i), kw__bf16_to_f32(kw__f32_to_bf16((float)(tt_get(x, &i) + tt_get(res, &i)))));
    }
    tt_free(&k);
}

/* layer_norm slots: y 0, x 1, weight 2, bias 3. */
Test(layer_norm, every_variant_matches_the_reference) {
    tt_rng r = {15};
    for (int trial = 0; trial < 40; trial++) {
        const kw_dtype xt = trial % 2 ? KW_BF16 : KW_F32;
        const int64_t K = PICK(Ks, &r), M = tt_int(&r, 1, 5);
        tt_case k = {0};
        tt_padded(&k, 1, xt, 2, TT_DIMS(M, K), tt_int(&r, 0, 2), 1, 3, &r); /* a mean away from 0 */
        if (trial / 2 % 2) tt_tensor(&k, 2, trial % 3 ? KW_BF16 : KW_F32, 1, TT_DIMS(K), NULL, -2, 2, &r);
        if (trial / 4 % 2) tt_tensor(&k, 3, trial % 5 ? KW_F32 : KW_BF16, 1, TT_DIMS(K), NULL, -2, 2, &r);
        tt_padded(&k, 0, xt, 2, TT_DIMS(M, K), tt_int(&r, 0, 2), 0, 0, &r);
        k.c.fp[0] = 1e-5;
        tt_check_variants(KW_OP_LAYER_NORM, &k, (tt_tol){1e-5, xt == KW_BF16 ? 0x1p-7 : 1e-5}, "layer_norm");
        tt_free(&k);
    }
}

Test(layer_norm, reference_matches_double_precision) {
    tt_rng r = {16};
    const int64_t K = 513;
    tt_case k = {0};
    kw_tensor *x = tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(K), NULL, 2, 5, &r);
    kw_tensor *w = tt_tensor(&k, 2, KW_F32, 1, TT_DIMS(K), NULL, -2, 2, &r);
    kw_tensor *b = tt_tensor(&k, 3, KW_F32, 1, TT_DIMS(K), NULL, -2, 2, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_F32, 1, TT_DIMS(K), NULL, 0, 0, &r);
    k.c.fp[0] = 1e-5;
    tt_run(KW_OP_LAYER_NORM, KW_ISA_SCALAR, &k.c, 1);
    double mean = 0, var = 0;
    for (int64_t i = 0; i < K; i++) mean += tt_get(x, &i) / K;
    for (int64_t i = 0; i < K; i++) var += (tt_get(x, &i) - mean) * (tt_get(x, &i) - mean) / K;
    for (int64_t i = 0; i < K; i++) {
        const double want = (tt_get(x, &i) - mean) / sqrt(var + 1e-5) * tt_get(w, &i) + tt_get(b, &i);
        cr_expect_leq(fabs(tt_get(y, &i) - want), 1e-5, "y[%lld] = %.8g, want %.8g", (long long)i, tt_get(y, &i), want);
    }
    tt_free(&k);
}

Test(rms_norm, check_names_the_bad_slot) {
    tt_rng r = {17};
    tt_case k = {0};
    tt_tensor(&k, 1, KW_BF16, 2, TT_DIMS(2, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 2, KW_F32, 1, TT_DIMS(8), NULL, -1, 1, &r);
    tt_tensor(&k, 0, KW_BF16, 2, TT_DIMS(2, 8), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_RMS_NORM, &k.c, KW_ESHAPE, "rms_norm: y must have x's shape, dtype float32");
    k.c.ip[0] = 4;
    tt_expect_reject(KW_OP_RMS_NORM, &k.c, KW_EINVAL, "ip[0] must be a KW_NORM_ form");
    tt_free(&k);
    tt_tensor(&k, 1, KW_F32, 2, TT_DIMS(2, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 2, KW_F32, 1, TT_DIMS(7), NULL, -1, 1, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(2, 8), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_RMS_NORM, &k.c, KW_ESHAPE, "rms_norm: weight must be");
    tt_free(&k);
}
