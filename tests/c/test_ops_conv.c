/* depthwise_conv2d: every variant against the scalar reference over random
 * geometries (strides, paddings, dilations, channel counts that are and are not
 * multiples of a vector, padded pixels, weights in two layouts, with and without
 * a bias), the reference against double precision, and each rejection.
 *
 * Tolerances. The variants sum the same f32 products in the same order as the
 * reference, with fused multiply-adds: up to 49 terms of |x·w| <= 1, sums of
 * either sign, f32 atol 2e-5 with rtol 1e-5; a bf16 output one bf16 ulp more
 * (rtol 2^-7). */
#include <criterion/criterion.h>
#include <math.h>

#include "kw_ops_impl.h"
#include "test_ops_util.h"

/* Slots y 0, x 1, w 2, b 3; ip stride h, w, padding h, w, dilation h, w. */
enum { Y, X, WT, B };

/* [N, C, H, W] in channels-last memory, each pixel's channels padded to Cp. */
static kw_tensor *channels_last(tt_case *k, int slot, kw_dtype dt, int64_t N, int64_t C, int64_t H, int64_t W,
                                int64_t Cp, double lo, double hi, tt_rng *r) {
    return tt_tensor(k, slot, dt, 4, TT_DIMS(N, C, H, W), TT_DIMS(H * W * Cp, 1, W * Cp, Cp), lo, hi, r);
}

static int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
    return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

typedef struct geometry {
    int64_t N, C, H, W, KH, KW, sh, sw, ph, pw, dh, dw;
} geometry;

/* A call over random values; the weight [C, 1, KH, KW] contiguous, or stored
 * [KH, KW, C] (a permuted view) when `taps_outer`. */
static void make_call(tt_case *k, const geometry *g, kw_dtype xt, kw_dtype wt, int bias, int taps_outer,
                      int64_t pad, tt_rng *r) {
    const int64_t OH = out_size(g->H, g->KH, g->sh, g->ph, g->dh), OW = out_size(g->W, g->KW, g->sw, g->pw, g->dw);
    channels_last(k, X, xt, g->N, g->C, g->H, g->W, g->C + pad, -1, 1, r);
    channels_last(k, Y, xt, g->N, g->C, OH, OW, g->C + pad, 0, 0, r);
    const int64_t *ws = taps_outer ? TT_DIMS(1, 1, g->KW * g->C, g->C) : NULL;
    tt_tensor(k, WT, wt, 4, TT_DIMS(g->C, 1, g->KH, g->KW), ws, -1, 1, r);
    if (bias) tt_tensor(k, B, wt, 1, TT_DIMS(g->C), NULL, -1, 1, r);
    const int64_t ip[6] = {g->sh, g->sw, g->ph, g->pw, g->dh, g->dw};
    for (int i = 0; i < 6; i++) k->c.ip[i] = ip[i];
}

static geometry random_geometry(tt_rng *r) {
    static const int64_t Cs[] = {1, 5, 16, 17, 40, 96};
    static const int64_t Ks[] = {1, 3, 5, 7};
    for (;;) {
        geometry g = {.N = tt_int(r, 1, 2), .C = Cs[tt_int(r, 0, 5)], .H = tt_int(r, 1, 13), .W = tt_int(r, 1, 21),
                      .KH = Ks[tt_int(r, 0, 3)], .KW = Ks[tt_int(r, 0, 3)], .sh = tt_int(r, 1, 2),
                      .sw = tt_int(r, 1, 2), .ph = tt_int(r, 0, 3), .pw = tt_int(r, 0, 3), .dh = tt_int(r, 1, 2),
                      .dw = tt_int(r, 1, 2)};
        if (out_size(g.H, g.KH, 1, g.ph, g.dh) >= 1 && out_size(g.W, g.KW, 1, g.pw, g.dw) >= 1) return g;
    }
}

Test(depthwise_conv2d, every_variant_matches_the_reference) {
    tt_rng r = {71};
    static const kw_dtype fdt[] = {KW_F32, KW_BF16};
    for (int trial = 0; trial < 120; trial++) {
        const geometry g = random_geometry(&r);
        const kw_dtype xt = fdt[trial % 2], wt = fdt[trial / 2 % 2];
        tt_case k = {0};
        make_call(&k, &g, xt, wt, trial % 3 != 0, trial % 5 == 0, tt_int(&r, 0, 3), &r);
        tt_check_variants(KW_OP_DEPTHWISE_CONV2D, &k, (tt_tol){2e-5, xt == KW_BF16 ? 0x1p-7 : 1e-5}, "depthwise_conv2d");
        tt_free(&k);
    }
}

/* ConvNeXt's geometry (7 × 7, padding 3, 96 channels over 56 columns: seven
 * blocks of eight columns in registers) and MobileNet's strided 3 × 3. */
Test(depthwise_conv2d, model_geometries_match_the_reference) {
    tt_rng r = {72};
    const geometry gs[] = {{1, 96, 9, 56, 7, 7, 1, 1, 3, 3, 1, 1}, {2, 144, 12, 28, 3, 3, 2, 2, 1, 1, 1, 1}};
    for (int i = 0; i < 2; i++)
        for (int bf = 0; bf < 2; bf++) {
            tt_case k = {0};
            make_call(&k, &gs[i], bf ? KW_BF16 : KW_F32, bf ? KW_BF16 : KW_F32, 1, 0, 0, &r);
            tt_check_variants(KW_OP_DEPTHWISE_CONV2D, &k, (tt_tol){2e-5, bf ? 0x1p-7 : 1e-5}, "model geometry");
            tt_free(&k);
        }
}

Test(depthwise_conv2d, reference_matches_double_precision) {
    tt_rng r = {73};
    for (int trial = 0; trial < 12; trial++) {
        const geometry g = random_geometry(&r);
        tt_case k = {0};
        make_call(&k, &g, KW_F32, KW_F32, trial % 2, trial % 3 == 0, 1, &r);
        tt_run(KW_OP_DEPTHWISE_CONV2D, KW_ISA_SCALAR, &k.c, 2);
        const kw_tensor *y = &k.c.t[Y], *x = &k.c.t[X], *w = &k.c.t[WT], *b = &k.c.t[B];
        for (int64_t n = 0; n < g.N; n++)
            for (int64_t c = 0; c < g.C; c++)
                for (int64_t oh = 0; oh < y->shape[2]; oh++)
                    for (int64_t ow = 0; ow < y->shape[3]; ow++) {
                        double want = b->data ? tt_get(b, &c) : 0;
                        for (int64_t kh = 0; kh < g.KH; kh++)
                            for (int64_t kw = 0; kw < g.KW; kw++) {
                                const int64_t ih = oh * g.sh - g.ph + kh * g.dh, iw = ow * g.sw - g.pw + kw * g.dw;
                                if (ih >= 0 && ih < g.H && iw >= 0 && iw < g.W)
                                    want += tt_get(x, (int64_t[]){n, c, ih, iw}) * tt_get(w, (int64_t[]){c, 0, kh, kw});
                            }
                        const double got = tt_get(y, (int64_t[]){n, c, oh, ow});
                        cr_assert_leq(fabs(got - want), 2e-5 + 1e-5 * fabs(want),
                                      "trial %d: y[%lld, %lld, %lld, %lld] = %.9g, want %.9g", trial, (long long)n,
                                      (long long)c, (long long)oh, (long long)ow, got, want);
                    }
        tt_free(&k);
    }
}

Test(depthwise_conv2d, rejects_what_it_does_not_compute) {
    tt_rng r = {74};
    const geometry g = {1, 8, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1};
    tt_case k = {0};
    make_call(&k, &g, KW_F32, KW_F32, 1, 0, 0, &r);
    tt_run(KW_OP_DEPTHWISE_CONV2D, KW_ISA_SCALAR, &k.c, 1); /* accepted as made */

    kw_call c = k.c;
    c.t[X].stride[1] = 36, c.t[X].stride[2] = 6, c.t[X].stride[3] = 1; /* NCHW */
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &c, KW_ESHAPE, "x must be float32 or bfloat16 [N, C, H, W] in channels-last");
    c = k.c;
    c.t[WT].shape[1] = 2; /* groups of two channels */
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &c, KW_ESHAPE, "w must be float32 or bfloat16 [C = 8, 1, KH, KW]");
    c = k.c;
    c.t[Y].shape[3] = 5;
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &c, KW_ESHAPE, "y must be float32 [1, 8, 6, 6] in channels-last");
    c = k.c;
    c.t[Y].dtype = KW_BF16;
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &c, KW_ESHAPE, "y must be float32");
    c = k.c;
    c.t[B].shape[0] = 7;
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &c, KW_ESHAPE, "b must be absent or float32 or bfloat16 [8]");
    c = k.c;
    c.ip[4] = 0;
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &c, KW_EINVAL, "strides and dilations in [1, 65536]");
    c = k.c;
    c.ip[0] = 1 << 20; /* far past any image: bounded before the geometry's arithmetic */
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &c, KW_EINVAL, "strides and dilations in [1, 65536]");
    c = k.c;
    c.ip[2] = 0, c.ip[4] = 4; /* a dilated 3 × 3 spans 9 rows of 6 */
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &c, KW_ESHAPE, "smaller than the kernel's span");
    tt_free(&k);

    /* Rows of 160000 columns under 7 taps: a ring of 7 padded rows would need
     * 72 MB of scratch a thread. */
    const geometry wide = {1, 1, 7, 160000, 7, 1, 1, 1, 0, 0, 1, 1};
    tt_case kw = {0};
    make_call(&kw, &wide, KW_F32, KW_F32, 0, 0, 0, &r);
    tt_expect_reject(KW_OP_DEPTHWISE_CONV2D, &kw.c, KW_ESHAPE, "bytes of scratch a thread, more than");
    tt_free(&kw);
}
