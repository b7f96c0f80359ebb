/* softmax, embedding, kv_write, attention: every variant against the
 * scalar reference, and the reference against hand-computed or double values.
 *
 * Tolerances. embedding and kv_write copy: exact. softmax and
 * attention differ from the reference by the vector expf (about 1 ulp) and the
 * order of f32 sums: f32 rtol 1e-5 with atol 2e-6 (sums of terms of either sign
 * can be near 0); bf16 outputs one bf16 ulp more (rtol 2^-7). Attention over a
 * bf16 cache rounds each probability to bf16 before it multiplies V, and a 1-ulp
 * difference in f32 can move that rounding by one bf16 ulp (2^-8 relative): with
 * |v| <= 2 the output may move by up to 2^-8 · 2 in the worst case, atol 8e-3. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>

#include "kw_ops_impl.h"
#include "test_ops_util.h"

static const tt_tol exact = {0, 0};
static const kw_dtype fdt[] = {KW_F32, KW_BF16};

/* ---- softmax: slots y 0, x 1 ---- */

Test(softmax, every_variant_matches_the_reference) {
    tt_rng r = {41};
    static const int64_t Ns[] = {1, 3, 16, 17, 100, 1000};
    for (int trial = 0; trial < 48; trial++) {
        const kw_dtype xt = fdt[trial % 2], yt = fdt[trial / 2 % 2];
        const int64_t N = Ns[tt_int(&r, 0, 5)], M = tt_int(&r, 1, 5);
        tt_case k = {0};
        kw_tensor *x = tt_padded(&k, 1, xt, 2, TT_DIMS(M, N), tt_int(&r, 0, 2), -20, 20, &r);
        tt_padded(&k, 0, yt, 2, TT_DIMS(M, N), tt_int(&r, 0, 2), 0, 0, &r);
        if (trial % 5 == 0) tt_set(x, (int64_t[]){0, N - 1}, -INFINITY);
        if (trial % 7 == 0) tt_set(x, (int64_t[]){M - 1, 0}, NAN);
        tt_check_variants(KW_OP_SOFTMAX, &k, (tt_tol){2e-6, yt == KW_BF16 ? 0x1p-7 : 1e-5}, "softmax");
        tt_free(&k);
    }
}

/* _safe_softmax: a row of -inf alone is zeros; a row with a NaN is NaN, as softmax's. */
Test(softmax, a_safe_softmax_gives_zeros_for_a_row_of_minus_inf_alone) {
    tt_rng r = {43};
    for (int trial = 0; trial < 8; trial++) {
        const kw_dtype xt = fdt[trial % 2], yt = fdt[trial / 2 % 2];
        const int64_t M = 4, N = trial / 4 ? 37 : 16;
        tt_case k = {0};
        kw_tensor *x = tt_padded(&k, 1, xt, 2, TT_DIMS(M, N), 1, -5, 5, &r);
        tt_padded(&k, 0, yt, 2, TT_DIMS(M, N), 1, 0, 0, &r);
        for (int64_t i = 0; i < N; i++) {
            tt_set(x, (int64_t[]){1, i}, -INFINITY);
            tt_set(x, (int64_t[]){2, i}, i == 3 ? NAN : -INFINITY);
            if (i % 2) tt_set(x, (int64_t[]){3, i}, -INFINITY);
        }
        k.c.ip[0] = KW_SOFTMAX_SAFE;
        tt_check_variants(KW_OP_SOFTMAX, &k, (tt_tol){2e-6, yt == KW_BF16 ? 0x1p-7 : 1e-5}, "safe softmax");
        const kw_tensor *y = &k.c.t[0];
        double sum0 = 0, sum3 = 0;
        for (int64_t i = 0; i < N; i++) {
            cr_assert_eq(tt_get(y, (int64_t[]){1, i}), 0.0, "trial %d: the row of -inf, [%lld]", trial, (long long)i);
            cr_assert(isnan(tt_get(y, (int64_t[]){2, i})), "trial %d: the row with a NaN, [%lld]", trial, (long long)i);
            sum0 += tt_get(y, (int64_t[]){0, i}), sum3 += tt_get(y, (int64_t[]){3, i});
        }
        cr_assert(fabs(sum0 - 1) < 0.02 && fabs(sum3 - 1) < 0.02, "trial %d: sums %g %g", trial, sum0, sum3);
        k.c.ip[0] = 2;
        tt_expect_reject(KW_OP_SOFTMAX, &k.c, KW_EINVAL, "ip[0] must be 0 or KW_SOFTMAX_SAFE (got 2)");
        tt_free(&k);
    }
}

Test(softmax, reference_matches_double_precision) {
    tt_rng r = {42};
    const int64_t N = 77;
    tt_case k = {0};
    kw_tensor *x = tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(N), NULL, -30, 30, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_F32, 1, TT_DIMS(N), NULL, 0, 0, &r);
    tt_run(KW_OP_SOFTMAX, KW_ISA_SCALAR, &k.c, 1);
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < N; i++) m = fmax(m, tt_get(x, &i));
    for (int64_t i = 0; i < N; i++) s += exp(tt_get(x, &i) - m);
    for (int64_t i = 0; i < N; i++) {
        const double want = exp(tt_get(x, &i) - m) / s;
        cr_expect_leq(fabs(tt_get(y, &i) - want), 4e-6 * want + 1e-30, "y[%lld] = %.9g, want %.9g", (long long)i,
                      tt_get(y, &i), want);
    }
    tt_free(&k);
}

/* ---- embedding: slots y 0, ids 1, table 2 ---- */

Test(embedding, gathers_rows_and_reports_bad_ids) {
    tt_rng r = {45};
    for (int trial = 0; trial < 8; trial++) {
        const kw_dtype tt = fdt[trial % 2], yt = fdt[trial / 2 % 2];
        const int64_t V = 50, D = 33;
        tt_case k = {0};
        kw_tensor *ids = tt_tensor(&k, 1, trial / 4 ? KW_I32 : KW_I64, 2, TT_DIMS(2, 3), NULL, 0, V - 1, &r);
        kw_tensor *tab = tt_padded(&k, 2, tt, 2, TT_DIMS(V, D), 3, -2, 2, &r);
        kw_tensor *y = tt_tensor(&k, 0, yt, 3, TT_DIMS(2, 3, D), NULL, 0, 0, &r);
        tt_set(ids, (int64_t[]){1, 2}, V); /* out of range */
        kw_fault fault = {0};
        k.c.fault = &fault;
        tt_check_variants(KW_OP_EMBEDDING, &k, exact, "embedding");
        cr_expect(atomic_load(&fault.reported));
        cr_expect(fault.index == V && fault.size == V);
        for (int64_t i = 0; i < 2; i++)
            for (int64_t j = 0; j < 3; j++)
                for (int64_t d = 0; d < D; d++) {
                    const double got = tt_get(y, (int64_t[]){i, j, d});
                    if (i == 1 && j == 2)
                        cr_expect(isnan(got));
                    else
                        cr_expect_eq(got, kw__round_to((float)tt_get(tab, (int64_t[]){(int64_t)tt_get(ids, (int64_t[]){i, j}), d}), yt));
                }
        tt_free(&k);
    }
}

/* Tensor indexing's reading (KW_GATHER_WRAP): ids in [-V, 0) count from the end;
 * below -V they are still out of range. */
Test(embedding, wraps_negative_ids_when_asked) {
    tt_rng r = {46};
    const int64_t V = 7, D = 5;
    const int64_t ids_v[] = {-1, -7, 0, 6, -8};
    tt_case k = {0};
    kw_tensor *ids = tt_tensor(&k, 1, KW_I64, 1, TT_DIMS(5), NULL, 0, 0, &r);
    kw_tensor *tab = tt_tensor(&k, 2, KW_F32, 2, TT_DIMS(V, D), NULL, -2, 2, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(5, D), NULL, 0, 0, &r);
    for (int64_t i = 0; i < 5; i++) tt_set(ids, (int64_t[]){i}, (double)ids_v[i]);
    k.c.ip[0] = KW_GATHER_WRAP;
    kw_fault fault = {0};
    k.c.fault = &fault;
    tt_run(KW_OP_EMBEDDING, kw_cpu_isa(), &k.c, 2);
    cr_expect(atomic_load(&fault.reported) && fault.index == -8 && fault.size == V);
    for (int64_t i = 0; i < 4; i++)
        for (int64_t d = 0; d < D; d++)
            cr_expect_eq(tt_get(y, (int64_t[]){i, d}), tt_get(tab, (int64_t[]){(ids_v[i] + V) % V, d}), "row %lld", (long long)i);
    k.c.ip[0] = 2;
    tt_expect_reject(KW_OP_EMBEDDING, &k.c, KW_EINVAL, "embedding: ip[0] must be 0 or KW_GATHER_WRAP");
    tt_free(&k);
}

/* ---- index_put: slots y 0 (modified), ids 1, src 2 ---- */

/* Repeated and negative ids against a serial loop; every thread count must leave
 * the last i's row where ids repeat. */
Test(index_put, writes_rows_in_place_the_last_repeat_winning) {
    tt_rng r = {47};
    static const kw_dtype dts[] = {KW_F32, KW_BF16, KW_I64, KW_I32};
    for (int trial = 0; trial < 16; trial++) {
        const kw_dtype dt = dts[trial % 4];
        const int64_t V = tt_int(&r, 1, 9), D = trial % 3 ? tt_int(&r, 1, 40) : 1, N = tt_int(&r, 1, 12);
        tt_case k = {0};
        kw_tensor *y = tt_padded(&k, 0, dt, 2, TT_DIMS(V, D), tt_int(&r, 0, 1) * 3, -50, 50, &r);
        kw_tensor *ids = tt_tensor(&k, 1, trial % 2 ? KW_I32 : KW_I64, 1, TT_DIMS(N), NULL, -V, V - 1, &r);
        kw_tensor *src = tt_padded(&k, 2, dt, 2, TT_DIMS(N, D), tt_int(&r, 0, 1) * 2, -50, 50, &r);
        double want[9][40];
        for (int64_t v = 0; v < V; v++)
            for (int64_t d = 0; d < D; d++) want[v][d] = tt_get(y, (int64_t[]){v, d});
        for (int64_t i = 0; i < N; i++) {
            const int64_t id = (int64_t)tt_get(ids, (int64_t[]){i});
            for (int64_t d = 0; d < D; d++) want[id < 0 ? id + V : id][d] = tt_get(src, (int64_t[]){i, d});
        }
        tt_check_variants(KW_OP_INDEX_PUT, &k, exact, "index_put");
        tt_run(KW_OP_INDEX_PUT, kw_cpu_isa(), &k.c, 2);
        for (int64_t v = 0; v < V; v++)
            for (int64_t d = 0; d < D; d++)
                cr_expect_eq(tt_get(y, (int64_t[]){v, d}), want[v][d], "trial %d: y[%lld, %lld]", trial, (long long)v,
                             (long long)d);
        tt_free(&k);
    }
}

Test(index_put, reports_an_id_out_of_range_and_names_bad_slots) {
    tt_rng r = {48};
    tt_case k = {0};
    kw_tensor *ids = tt_tensor(&k, 1, KW_I64, 1, TT_DIMS(3), NULL, 0, 3, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(4, 5), NULL, -1, 1, &r);
    tt_tensor(&k, 2, KW_F32, 2, TT_DIMS(3, 5), NULL, -1, 1, &r);
    tt_set(ids, (int64_t[]){1}, -5);
    kw_fault fault = {0};
    k.c.fault = &fault;
    tt_run(KW_OP_INDEX_PUT, kw_cpu_isa(), &k.c, 2);
    cr_expect(atomic_load(&fault.reported) && fault.index == -5 && fault.size == 4);
    tt_tensor(&k, 2, KW_BF16, 2, TT_DIMS(3, 5), NULL, -1, 1, &r);
    tt_expect_reject(KW_OP_INDEX_PUT, &k.c, KW_ESHAPE, "index_put: src must be [N, D] with N == 3, D == 5, y's dtype float32");
    tt_free(&k);
}

/* ---- histc: slots y 0, x 1; fp[0] min, fp[1] max (tests/python compares with torch.histc) ---- */

Test(histc, counts_each_bin_the_last_closed_and_skips_what_lies_outside) {
    tt_rng r = {49};
    tt_case k = {0};
    kw_tensor *x = tt_tensor(&k, 1, KW_F32, 2, TT_DIMS(2, 5), NULL, 0, 0, &r);
    kw_tensor *y = tt_tensor(&k, 0, KW_F32, 1, TT_DIMS(4), NULL, 9, 9, &r);
    const double v[10] = {0, 3, 3, 1.5, -0.1, 3.1, NAN, 2.9, 0.75, 0.74};
    for (int i = 0; i < 10; i++) tt_set(x, (int64_t[]){i / 5, i % 5}, v[i]);
    k.c.fp[0] = 0, k.c.fp[1] = 3;
    tt_check_variants(KW_OP_HISTC, &k, exact, "histc");
    tt_run(KW_OP_HISTC, kw_cpu_isa(), &k.c, 2);
    double got[4];
    for (int b = 0; b < 4; b++) got[b] = tt_get(y, (int64_t[]){b});
    /* bins of width 0.75: [0, .75) 0 and 0.74; [.75, 1.5) 0.75; [1.5, 2.25) 1.5; [2.25, 3] 2.9, 3, 3 */
    cr_expect(got[0] == 2 && got[1] == 1 && got[2] == 1 && got[3] == 3, "got %g %g %g %g", got[0], got[1], got[2],
              got[3]);
    k.c.fp[1] = 0;
    tt_expect_reject(KW_OP_HISTC, &k.c, KW_EINVAL, "histc: min (fp[0]) must be below max (fp[1])");
    tt_free(&k);
}

/* ---- cumsum: slots y 0, x 1 ---- */

Test(cumsum, sums_each_row_in_order_in_place_too) {
    tt_rng r = {50};
    static const kw_dtype dts[] = {KW_I32, KW_I64, KW_F32};
    for (int trial = 0; trial < 9; trial++) {
        const kw_dtype dt = dts[trial % 3];
        const int64_t R = tt_int(&r, 1, 4), N = tt_int(&r, 1, 30);
        tt_case k = {0};
        kw_tensor *x = tt_padded(&k, 1, dt, 2, TT_DIMS(R, N), tt_int(&r, 0, 1) * 3, -100, 100, &r);
        double want[4][30];
        for (int64_t i = 0; i < R; i++) {
            double sum = 0;
            for (int64_t j = 0; j < N; j++) want[i][j] = sum += tt_get(x, (int64_t[]){i, j});
        }
        if (trial < 6) {
            tt_tensor(&k, 0, dt, 2, TT_DIMS(R, N), NULL, 0, 0, &r);
            tt_check_variants(KW_OP_CUMSUM, &k, (tt_tol){0, 1e-6}, "cumsum");
        } else {
            tt_alias(&k, 0, 1); /* in place: run once, the rows summed over themselves */
        }
        tt_run(KW_OP_CUMSUM, kw_cpu_isa(), &k.c, 2);
        for (int64_t i = 0; i < R; i++)
            for (int64_t j = 0; j < N; j++)
                cr_expect_float_eq(tt_get(&k.c.t[0], (int64_t[]){i, j}), want[i][j], 1e-4, "trial %d", trial);
        tt_free(&k);
    }
    tt_case k = {0};
    tt_tensor(&k, 1, KW_F32, 1, TT_DIMS(4), NULL, 0, 1, &r);
    tt_tensor(&k, 0, KW_I32, 1, TT_DIMS(4), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_CUMSUM, &k.c, KW_ESHAPE, "cumsum: x must have y's dtype");
    tt_free(&k);
}

/* ---- kv_write: slots cache 0, src 1, pos 2 ---- */

Test(kv_write, writes_rows_at_positions_in_place) {
    tt_rng r = {46};
    for (int trial = 0; trial < 8; trial++) {
        const kw_dtype ct = fdt[trial % 2], st = fdt[trial / 2 % 2];
        const int64_t B = 2, H = 3, S = 11, D = 20, T = trial / 4 ? 4 : 1;
        tt_case k = {0};
        kw_tensor *cache = tt_padded(&k, 0, ct, 4, TT_DIMS(B, H, S, D), 2, -1, 1, &r);
        /* src as HF makes it: [B, T, H, D] memory viewed as [B, H, T, D] */
        kw_tensor *src = tt_tensor(&k, 1, st, 4, TT_DIMS(B, H, T, D), TT_DIMS(T * H * D, D, H * D, 1), -1, 1, &r);
        kw_tensor *pos = tt_tensor(&k, 2, KW_I64, 1, TT_DIMS(T), NULL, 0, 0, &r);
        const int64_t ps[4] = {5, 0, S, 10}; /* S is outside: skipped and reported */
        for (int64_t t = 0; t < T; t++) tt_set(pos, &t, ps[t]);
        kw_fault fault = {0};
        k.c.fault = &fault;
        tt_case before = {0};
        tt_tensor(&before, 0, ct, 1, TT_DIMS((int64_t)(k.bytes[0] / kw_dtype_size(ct))), NULL, 0, 0, &r);
        memcpy(before.mem[0], k.mem[0], k.bytes[0]);
        tt_check_variants(KW_OP_KV_WRITE, &k, exact, "kv_write");
        cr_expect_eq(atomic_load(&fault.reported), T > 2, "trial %d", trial);
        if (T > 2) cr_expect(fault.index == S && fault.size == S);
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t s = 0; s < S; s++) {
                    int64_t t = -1;
                    for (int64_t i = 0; i < T; i++)
                        if (ps[i] == s) t = i;
                    for (int64_t d = 0; d < D; d++) {
                        const double got = tt_get(cache, (int64_t[]){b, h, s, d});
                        kw_tensor old = *cache;
                        old.data = before.mem[0];
                        const double want = t >= 0 ? kw__round_to((float)tt_get(src, (int64_t[]){b, h, t, d}), ct)
                                                   : tt_get(&old, (int64_t[]){b, h, s, d});
                        cr_assert_eq(got, want, "[%lld,%lld,%lld,%lld]", (long long)b, (long long)h, (long long)s, (long long)d);
                    }
                }
        tt_free(&before);
        tt_free(&k);
    }
}

/* ---- kv_shift: slots cache 0, src 1 ---- */

Test(kv_shift, moves_every_row_up_one_and_writes_src_last_in_place) {
    tt_rng r = {47};
    for (int trial = 0; trial < 8; trial++) {
        const kw_dtype dt = fdt[trial % 2];
        /* one slice (a single KV head: columns split among threads), several, and S of 1 */
        const int64_t B = trial / 2 % 2 ? 2 : 1, H = trial / 2 % 2 ? 3 : 1, S = trial / 4 ? 9 : 1, D = 40;
        tt_case k = {0};
        kw_tensor *cache = tt_padded(&k, 0, dt, 4, TT_DIMS(B, H, S, D), 2, -1, 1, &r);
        kw_tensor *src = tt_tensor(&k, 1, dt, 4, TT_DIMS(B, H, 1, D), TT_DIMS(H * D, D, D, 1), -1, 1, &r);
        tt_case before = {0};
        tt_tensor(&before, 0, dt, 1, TT_DIMS((int64_t)(k.bytes[0] / kw_dtype_size(dt))), NULL, 0, 0, &r);
        memcpy(before.mem[0], k.mem[0], k.bytes[0]);
        tt_check_variants(KW_OP_KV_SHIFT, &k, exact, "kv_shift");
        kw_tensor old = *cache;
        old.data = before.mem[0];
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t s = 0; s < S; s++)
                    for (int64_t d = 0; d < D; d++) {
                        const double want = s + 1 < S ? tt_get(&old, (int64_t[]){b, h, s + 1, d})
                                                       : tt_get(src, (int64_t[]){b, h, 0, d});
                        cr_assert_eq(tt_get(cache, (int64_t[]){b, h, s, d}), want, "trial %d [%lld,%lld,%lld,%lld]",
                                     trial, (long long)b, (long long)h, (long long)s, (long long)d);
                    }
        if (S > 1) /* the padding after a row is left as it was */
            cr_assert_eq(memcmp((char *)k.mem[0] + D * kw_dtype_size(dt), (char *)before.mem[0] + D * kw_dtype_size(dt),
                                2 * kw_dtype_size(dt)), 0, "trial %d", trial);
        tt_free(&before);
        tt_free(&k);
    }
    tt_case k = {0};
    tt_tensor(&k, 0, KW_F32, 4, TT_DIMS(1, 1, 4, 8), TT_DIMS(32, 32, 4, 1), -1, 1, &r); /* rows overlap */
    tt_tensor(&k, 1, KW_F32, 4, TT_DIMS(1, 1, 1, 8), NULL, -1, 1, &r);
    tt_expect_reject(KW_OP_KV_SHIFT, &k.c, KW_ESHAPE, "kv_shift: cache must be");
    tt_free(&k);
    tt_case m = {0};
    tt_tensor(&m, 0, KW_F32, 4, TT_DIMS(1, 1, 4, 8), NULL, -1, 1, &r);
    tt_tensor(&m, 1, KW_BF16, 4, TT_DIMS(1, 1, 1, 8), NULL, -1, 1, &r);
    tt_expect_reject(KW_OP_KV_SHIFT, &m.c, KW_ESHAPE, "kv_shift: src must be");
    tt_free(&m);
    for (int empty = 0; empty < 2; empty++) { /* no heads, or no columns: fewer slices than threads, none to split */
        tt_case e = {0};
        tt_tensor(&e, 0, KW_F32, 4, TT_DIMS(1, empty ? 1 : 0, 4, empty ? 0 : 8), NULL, -1, 1, &r);
        tt_tensor(&e, 1, KW_F32, 4, TT_DIMS(1, empty ? 1 : 0, 1, empty ? 0 : 8), NULL, -1, 1, &r);
        for (int nth = 1; nth <= 3; nth++) tt_run(KW_OP_KV_SHIFT, kw_cpu_isa(), &e.c, nth);
        tt_free(&e);
    }
}

/* ---- attention: slots out 0, q 1, k_cache 2, v_cache 3, mask 4; fp[0] scale ---- */

enum mask_kind { MASK_NONE, MASK_BOOL, MASK_F32, MASK_BF16, MASK_KINDS };

/* L query positions; the mask has a row per batch (mask_b), per head (mask_h,
 * as T5's position bias) and per position (mask_l), or one for all. */
static void attention_case(tt_case *k, kw_dtype qt, kw_dtype ct, int64_t B, int64_t L, int64_t Hkv, int64_t G,
                           int64_t S, int64_t D, int64_t Dv, enum mask_kind mk, int mask_b, int mask_h, int mask_l,
                           tt_rng *r) {
    const int64_t Hq = Hkv * G;
    /* q and out as HF makes them: [B, L, Hq, D] memory viewed as [B, Hq, L, D] */
    tt_tensor(k, 1, qt, 4, TT_DIMS(B, Hq, L, D), TT_DIMS(L * Hq * D, D, Hq * D, 1), -2, 2, r);
    tt_tensor(k, 0, qt, 4, TT_DIMS(B, Hq, L, Dv), TT_DIMS(L * Hq * Dv, Dv, Hq * Dv, 1), 0, 0, r);
    tt_padded(k, 2, ct, 4, TT_DIMS(B, Hkv, S, D), tt_int(r, 0, 1) * 5, -2, 2, r);
    tt_padded(k, 3, ct, 4, TT_DIMS(B, Hkv, S, Dv), tt_int(r, 0, 1) * 5, -2, 2, r);
    k->c.fp[0] = 1 / sqrt((double)D);
    if (mk == MASK_NONE) return;
    const kw_dtype mt = mk == MASK_BOOL ? KW_BOOL : mk == MASK_F32 ? KW_F32 : KW_BF16;
    const int64_t mb = mask_b ? B : 1, mh = mask_h ? Hq : 1, ml = mask_l ? L : 1;
    kw_tensor *m = tt_tensor(k, 4, mt, 4, TT_DIMS(mb, mh, ml, S), NULL, 0, 0, r);
    const double drop = mk == MASK_F32 ? (tt_int(r, 0, 1) ? -INFINITY : -FLT_MAX) : -3.3895313892515355e38;
    for (int64_t b = 0; b < mb; b++)
        for (int64_t h = 0; h < mh; h++)
            for (int64_t i = 0; i < ml; i++)
                for (int64_t s = 0; s < S; s++) {
                    /* holes, position 0 always kept; causal past a random start when rows differ */
                    const int keep = s == 0 || (tt_int(r, 0, 2) != 0 && (!mask_l || s <= S - L + i));
                    tt_set(m, (int64_t[]){b, h, i, s},
                           mt == KW_BOOL ? keep : keep ? tt_uniform(r, -3, 1) * (s % 2) : drop);
                }
}

Test(attention, every_variant_matches_the_reference) {
    tt_rng r = {47};
    static const int64_t Gs[] = {1, 4, 5, 8, 9}, Ss[] = {1, 7, 64, 100, 300}, Ds[] = {8, 64, 72, 128, 256};
    static const int64_t Ls[] = {1, 1, 2, 5, 17};
    for (int trial = 0; trial < 80; trial++) {
        const kw_dtype qt = fdt[trial % 2], ct = fdt[trial / 2 % 2];
        const int64_t D = Ds[tt_int(&r, 0, 4)], Dv = trial % 5 ? D : Ds[tt_int(&r, 0, 4)], S = Ss[tt_int(&r, 0, 4)];
        const int64_t L = KW__MIN(S, Ls[tt_int(&r, 0, 4)]);
        tt_case k = {0};
        attention_case(&k, qt, ct, tt_int(&r, 1, 2), L, tt_int(&r, 1, 3), trial < 20 ? 4 : Gs[tt_int(&r, 0, 4)], S, D, Dv,
                       (enum mask_kind)(trial / 4 % MASK_KINDS), trial % 3 != 0, trial % 5 == 1, trial % 7 != 0, &r);
        tt_check_variants(KW_OP_ATTENTION, &k, (tt_tol){ct == KW_BF16 ? 8e-3 : 2e-6, qt == KW_BF16 ? 0x1p-7 : 1e-5},
                          "attention");
        tt_free(&k);
    }
}

/* Steps of prefill size with a bf16 query and cache, which run on AMX tiles
 * where the CPU has them (attention_amx.c: blocks of 16 rows): spans of several
 * panels of positions, query heads sharing a cache head (SmolLM2's 3), head
 * sizes whose Dv takes one group of four sum tiles, two, or a group and a part,
 * a cache of more positions than are valid, and rows the mask drops whole. */
Test(attention, prefill_sized_bf16_steps_match_the_reference) {
    tt_rng r = {53};
    static const int64_t shapes[][5] = {
        /* L, G, D, Dv, S */
        {128, 3, 64, 64, 300}, {33, 1, 128, 128, 130}, {16, 4, 64, 80, 64}, {40, 2, 256, 48, 200}, {6, 8, 32, 16, 45},
    };
    for (int trial = 0; trial < 10; trial++) {
        const int64_t *sh = shapes[trial % 5], L = sh[0], G = sh[1], D = sh[2], Dv = sh[3], S = sh[4];
        const enum mask_kind mk = (enum mask_kind)(trial % MASK_KINDS);
        tt_case k = {0};
        attention_case(&k, KW_BF16, KW_BF16, tt_int(&r, 1, 2), L, tt_int(&r, 1, 2), G, S, D, Dv, mk, 1, trial == 9, 1,
                       &r);
        if (mk != MASK_NONE && trial < 5) /* row L - 2 of the first batch keeps no position */
            for (int64_t s = 0; s < S; s++)
                tt_set(&k.c.t[4], (int64_t[]){0, 0, L - 2, s}, mk == MASK_BOOL ? 0 : -INFINITY);
        tt_check_variants(KW_OP_ATTENTION, &k, (tt_tol){8e-3, 0x1p-7}, "a bf16 step of prefill size");
        tt_free(&k);
    }
}

/* A row the mask drops whole is SDPA's: zeros where nothing is left (bool, or
 * -inf everywhere), else the softmax over the finite positions, where
 * dot · scale + mask rounds to the mask: the mean of V over the positions that
 * hold the row's largest mask value (HF's finfo.min padding rows). */
Test(attention, a_row_the_mask_drops_whole_is_sdpas) {
    tt_rng r = {48};
    const int64_t B = 2, Hkv = 2, G = 4, S = 40, D = 16;
    for (int trial = 0; trial < 4; trial++) {
        const int64_t L = trial % 2 ? 3 : 1; /* a block of rows, or one head at a time */
        const enum mask_kind mk = trial < 2 ? MASK_BOOL : MASK_F32;
        tt_case k = {0};
        attention_case(&k, KW_F32, KW_BF16, B, L, Hkv, G, S, D, D, mk, 1, 0, 1, &r);
        kw_tensor *m = &k.c.t[4];
        const int64_t i = L - 1; /* row (1, i) drops every position; for F32 so does (0, i) */
        for (int64_t s = 0; s < S; s++) {
            tt_set(m, (int64_t[]){1, 0, i, s}, mk == MASK_BOOL ? 0 : s == 5 ? -INFINITY : -FLT_MAX);
            if (mk == MASK_F32) tt_set(m, (int64_t[]){0, 0, i, s}, s == 7 ? -3.3895313892515355e38 : s == 9 ? -INFINITY : -FLT_MAX);
        }
        tt_check_variants(KW_OP_ATTENTION, &k, (tt_tol){8e-3, 1e-5}, "a row dropped whole");
        for (int64_t h = 0; h < Hkv * G; h++)
            for (int64_t d = 0; d < D; d++) {
                double mean = 0;
                for (int64_t s = 0; s < S; s++) mean += s == 5 ? 0 : tt_get(&k.c.t[3], (int64_t[]){1, h / G, s, d}) / (S - 1);
                const double got = tt_get(&k.c.t[0], (int64_t[]){1, h, i, d});
                cr_expect_float_eq(got, mk == MASK_BOOL ? 0.0 : mean, 1e-5, "trial %d [1,%lld,%lld,%lld]", trial,
                                   (long long)h, (long long)i, (long long)d);
                if (mk == MASK_F32) /* only position 7 holds the largest value */
                    cr_expect_float_eq(tt_get(&k.c.t[0], (int64_t[]){0, h, i, d}),
                                       tt_get(&k.c.t[3], (int64_t[]){0, h / G, 7, d}), 1e-6, "trial %d", trial);
            }
        tt_free(&k);
    }
}

/* SDPA in double with repeat_kv done explicitly, the mask applied as PyTorch does. */
Test(attention, reference_matches_double_precision) {
    tt_rng r = {49};
    for (int mk = 0; mk < MASK_KINDS; mk++) {
        const int64_t B = 2, L = 3, Hkv = 2, G = 3, S = 21, D = 10;
        tt_case k = {0};
        attention_case(&k, KW_F32, KW_F32, B, L, Hkv, G, S, D, D, (enum mask_kind)mk, 1, 1, 1, &r);
        tt_run(KW_OP_ATTENTION, KW_ISA_SCALAR, &k.c, 1);
        const kw_tensor *o = &k.c.t[0], *q = &k.c.t[1], *kc = &k.c.t[2], *vc = &k.c.t[3], *m = &k.c.t[4];
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < L; i++)
                for (int64_t h = 0; h < Hkv * G; h++) {
                    double s[21], mx = -INFINITY, sum = 0;
                    for (int64_t j = 0; j < S; j++) {
                        double dot = 0;
                        for (int64_t d = 0; d < D; d++)
                            dot += tt_get(q, (int64_t[]){b, h, i, d}) * tt_get(kc, (int64_t[]){b, h / G, j, d});
                        s[j] = dot * k.c.fp[0];
                        if (mk == MASK_BOOL && !tt_get(m, (int64_t[]){b, h, i, j})) s[j] = -INFINITY;
                        if (mk > MASK_BOOL) s[j] += tt_get(m, (int64_t[]){b, h, i, j});
                        mx = fmax(mx, s[j]);
                    }
                    for (int64_t j = 0; j < S; j++) sum += exp(s[j] - mx);
                    for (int64_t d = 0; d < D; d++) {
                        double want = 0;
                        for (int64_t j = 0; j < S; j++) want += exp(s[j] - mx) / sum * tt_get(vc, (int64_t[]){b, h / G, j, d});
                        cr_expect_leq(fabs(tt_get(o, (int64_t[]){b, h, i, d}) - want), 1e-5, "mask %d [%lld,%lld,%lld,%lld]",
                                      mk, (long long)b, (long long)h, (long long)i, (long long)d);
                    }
                }
        tt_free(&k);
    }
}

Test(attention, check_names_the_bad_slot) {
    tt_rng r = {50};
    tt_case k = {0};
    attention_case(&k, KW_F32, KW_BF16, 1, 1, 3, 1, 16, 8, 8, MASK_BOOL, 1, 0, 1, &r);
    k.c.t[1].shape[1] = 4; /* Hq not a multiple of Hkv */
    tt_expect_reject(KW_OP_ATTENTION, &k.c, KW_ESHAPE, "attention: k_cache must be");
    k.c.t[1].shape[1] = 3;
    k.c.t[4].shape[3] = 15;
    tt_expect_reject(KW_OP_ATTENTION, &k.c, KW_ESHAPE, "attention: mask must be");
    tt_free(&k);
}

/* ---- topk: slots values 0, indices 1, x 2; ip[0] largest, ip[1] sorted ----
 * Which of equal values PyTorch picks first is checked against torch.topk
 * (tests/python/test_decode_step.py); here, against a plain selection: the k
 * values are the k largest (smallest), each at its index, in order when sorted. */

static int ranks_above(double a, double b, int largest) { /* NaN above every number */
    if (isnan(a) || isnan(b)) return largest ? isnan(a) && !isnan(b) : !isnan(a) && isnan(b);
    return largest ? a > b : a < b;
}

Test(topk, keeps_the_k_largest_or_smallest_each_at_its_index) {
    tt_rng r = {51};
    for (int trial = 0; trial < 60; trial++) {
        const kw_dtype dt = fdt[trial % 2];
        const int largest = trial / 2 % 2, sorted = trial % 5 != 0, ties = trial % 3 == 0;
        const int64_t R = tt_int(&r, 1, 5), N = trial % 4 == 0 ? tt_int(&r, 64, 300) : tt_int(&r, 1, 40);
        const int64_t K = tt_int(&r, 1, KW__MIN(N, 6));
        tt_case k = {0};
        kw_tensor *x = tt_padded(&k, 2, dt, 2, TT_DIMS(R, N), tt_int(&r, 0, 1) * 3, ties ? -2 : -100, ties ? 2 : 100, &r);
        if (ties)
            for (int64_t i = 0; i < R; i++)
                for (int64_t j = 0; j < N; j++) tt_set(x, (int64_t[]){i, j}, round(tt_get(x, (int64_t[]){i, j})));
        if (trial % 7 == 0) tt_set(x, (int64_t[]){0, N / 2}, NAN);
        kw_tensor *y = tt_tensor(&k, 0, dt, 2, TT_DIMS(R, K), NULL, 0, 0, &r);
        kw_tensor *ids = tt_tensor(&k, 1, KW_I64, 2, TT_DIMS(R, K), NULL, 0, 0, &r);
        k.c.ip[0] = largest, k.c.ip[1] = sorted;
        tt_check_variants(KW_OP_TOPK, &k, exact, "topk");
        tt_run(KW_OP_TOPK, kw_cpu_isa(), &k.c, 2);
        for (int64_t i = 0; i < R; i++) {
            int taken[300] = {0};
            for (int64_t j = 0; j < K; j++) {
                const int64_t at = (int64_t)tt_get(ids, (int64_t[]){i, j});
                cr_assert(at >= 0 && at < N && !taken[at], "trial %d row %lld: index %lld", trial, (long long)i,
                          (long long)at);
                taken[at] = 1;
                const double v = tt_get(y, (int64_t[]){i, j}), xv = tt_get(x, (int64_t[]){i, at});
                cr_expect(v == xv || (isnan(v) && isnan(xv)), "trial %d: value %g at index %lld holds %g", trial, v,
                          (long long)at, xv);
                if (sorted && j > 0)
                    cr_expect(!ranks_above(v, tt_get(y, (int64_t[]){i, j - 1}), largest), "trial %d: out of order",
                              trial);
            }
            for (int64_t o = 0; o < N; o++) { /* nothing left out ranks above anything kept */
                if (taken[o]) continue;
                for (int64_t j = 0; j < K; j++)
                    cr_expect(!ranks_above(tt_get(x, (int64_t[]){i, o}), tt_get(y, (int64_t[]){i, j}), largest),
                              "trial %d row %lld: x[%lld] left out", trial, (long long)i, (long long)o);
            }
        }
        tt_free(&k);
    }
}

Test(topk, names_what_it_rejects) {
    tt_rng r = {52};
    tt_case k = {0};
    tt_tensor(&k, 2, KW_F32, 2, TT_DIMS(2, 8), NULL, -1, 1, &r);
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(2, 9), NULL, 0, 0, &r);
    tt_tensor(&k, 1, KW_I64, 2, TT_DIMS(2, 9), NULL, 0, 0, &r);
    k.c.ip[0] = 1;
    tt_expect_reject(KW_OP_TOPK, &k.c, KW_ESHAPE, "topk: k (values' last dim) must be in [1, n] with n == 8");
    tt_tensor(&k, 0, KW_F32, 2, TT_DIMS(2, 2), NULL, 0, 0, &r);
    tt_tensor(&k, 1, KW_I32, 2, TT_DIMS(2, 2), NULL, 0, 0, &r);
    tt_expect_reject(KW_OP_TOPK, &k.c, KW_ESHAPE, "indices (int64)");
    tt_tensor(&k, 2, KW_I64, 2, TT_DIMS(2, 8), NULL, -1, 1, &r);
    tt_expect_reject(KW_OP_TOPK, &k.c, KW_EDTYPE, "topk: x must be float32 or bfloat16");
    k.c.ip[1] = 2;
    tt_expect_reject(KW_OP_TOPK, &k.c, KW_EINVAL, "ip[1] (sorted) must be 0 or 1");
    tt_free(&k);
}

/* ---- sort: slots values 0, indices 1, x 2; ip[0] descending ---- */

Test(sort, orders_each_row_keeping_equal_values_in_their_order) {
    tt_rng r = {53};
    static const kw_dtype dts[] = {KW_F32, KW_BF16, KW_I64, KW_I32};
    for (int trial = 0; trial < 40; trial++) {
        const kw_dtype dt = dts[trial % 4];
        const int desc = trial / 4 % 2;
        const int64_t R = tt_int(&r, 1, 4), N = tt_int(&r, 1, trial % 3 ? 40 : 200);
        tt_case k = {0};
        kw_tensor *x = tt_padded(&k, 2, dt, 2, TT_DIMS(R, N), tt_int(&r, 0, 1) * 2, -3, 3, &r);
        if (dt == KW_F32 || dt == KW_BF16)
            for (int64_t i = 0; i < R; i++)
                for (int64_t j = 0; j < N; j++)
                    tt_set(x, (int64_t[]){i, j}, j % 9 == 4 ? NAN : round(tt_get(x, (int64_t[]){i, j})));
        kw_tensor *y = tt_tensor(&k, 0, dt, 2, TT_DIMS(R, N), NULL, 0, 0, &r);
        kw_tensor *ids = tt_tensor(&k, 1, KW_I64, 2, TT_DIMS(R, N), NULL, 0, 0, &r);
        k.c.ip[0] = desc;
        tt_check_variants(KW_OP_SORT, &k, exact, "sort");
        tt_run(KW_OP_SORT, kw_cpu_isa(), &k.c, 2);
        for (int64_t i = 0; i < R; i++) {
            int64_t want[200]; /* a stable insertion sort of the indices */
            for (int64_t j = 0; j < N; j++) {
                int64_t p = j;
                while (p > 0 && ranks_above(tt_get(x, (int64_t[]){i, j}), tt_get(x, (int64_t[]){i, want[p - 1]}), desc))
                    want[p] = want[p - 1], p--;
                want[p] = j;
            }
            for (int64_t j = 0; j < N; j++) {
                cr_expect_eq((int64_t)tt_get(ids, (int64_t[]){i, j}), want[j], "trial %d row %lld position %lld",
                             trial, (long long)i, (long long)j);
                const double v = tt_get(y, (int64_t[]){i, j}), xv = tt_get(x, (int64_t[]){i, want[j]});
                cr_expect(v == xv || (isnan(v) && isnan(xv)), "trial %d: values", trial);
            }
        }
        tt_free(&k);
    }
    tt_case e = {0}; /* rows of no values: nothing to order, and no scratch */
    tt_tensor(&e, 2, KW_F32, 2, TT_DIMS(3, 0), NULL, -3, 3, &r);
    tt_tensor(&e, 0, KW_F32, 2, TT_DIMS(3, 0), NULL, 0, 0, &r);
    tt_tensor(&e, 1, KW_I64, 2, TT_DIMS(3, 0), NULL, 0, 0, &r);
    for (int nth = 1; nth <= 3; nth++) tt_run(KW_OP_SORT, kw_cpu_isa(), &e.c, nth);
    tt_free(&e);
}

/* ---- bmm: slots y 0, a 1, b 2, c 3 (optional); fp[0] alpha, fp[1] beta ---- */

/* b row-contiguous (V), or column-contiguous (kᵀ: the transpose of [B, N, K] rows
 * with a gap after each); c absent, full, or one row broadcast over M (ALiBi's
 * [B·H, 1, S] bias) with a NaN in it when beta is 0 (ATen reads no c then). */
static void bmm_case(tt_case *k, kw_dtype dt, int64_t B, int64_t M, int64_t N, int64_t K, int columns, int c_kind,
                     double beta, tt_rng *r) {
    tt_padded(k, 1, dt, 3, TT_DIMS(B, M, K), tt_int(r, 0, 2), -2, 2, r);
    if (columns)
        tt_tensor(k, 2, dt, 3, TT_DIMS(B, K, N), TT_DIMS(N * (K + 3), 1, K + 3), -2, 2, r);
    else
        tt_padded(k, 2, dt, 3, TT_DIMS(B, K, N), tt_int(r, 0, 2), -2, 2, r);
    tt_padded(k, 0, dt, 3, TT_DIMS(B, M, N), tt_int(r, 0, 2), 0, 0, r);
    if (c_kind) {
        kw_tensor *c = c_kind == 1 ? tt_padded(k, 3, dt, 3, TT_DIMS(B, M, N), 1, -4, 4, r)
                                   : tt_tensor(k, 3, dt, 3, TT_DIMS(B, M, N), TT_DIMS(N, 0, 1), -4, 4, r);
        if (beta == 0) tt_set(c, (int64_t[]){0, 0, N - 1}, NAN);
    }
    k->c.fp[0] = tt_int(r, 0, 1) ? 1.0 : 0.125;
    k->c.fp[1] = beta;
}

Test(bmm, every_variant_matches_the_reference) {
    tt_rng r = {61};
    static const int64_t Ns[] = {1, 5, 16, 17, 64, 65, 130}, Ks[] = {1, 3, 16, 33, 64, 100};
    static const double betas[] = {0, 0.5, 1, -2};
    for (int trial = 0; trial < 96; trial++) {
        const kw_dtype dt = fdt[trial % 2];
        const int columns = trial / 2 % 2, c_kind = trial / 4 % 3;
        const int64_t N = Ns[tt_int(&r, 0, 6)], K = Ks[tt_int(&r, 0, 5)];
        tt_case k = {0};
        bmm_case(&k, dt, tt_int(&r, 1, 4), tt_int(&r, 1, 3), N, K, columns, c_kind, c_kind ? betas[trial / 12 % 4] : 0,
                 &r);
        /* sums of K products of either sign, in another order than the reference's */
        tt_check_variants(KW_OP_BMM, &k, (tt_tol){2e-6 * (double)K, dt == KW_BF16 ? 0x1p-7 : 1e-5}, "bmm");
        tt_free(&k);
    }
}

Test(bmm, reference_matches_double_precision) {
    tt_rng r = {62};
    for (int trial = 0; trial < 6; trial++) {
        const int64_t B = 2, M = 3, N = 37, K = 29;
        const double beta = (double[]){0, 1, -2}[trial % 3];
        tt_case k = {0};
        bmm_case(&k, KW_F32, B, M, N, K, trial % 2, trial % 3 ? 1 + trial % 2 : 1, beta, &r);
        tt_run(KW_OP_BMM, KW_ISA_SCALAR, &k.c, 1);
        const kw_tensor *y = &k.c.t[0], *a = &k.c.t[1], *m = &k.c.t[2], *c = &k.c.t[3];
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) {
                    double s = 0;
                    for (int64_t x = 0; x < K; x++) s += tt_get(a, (int64_t[]){b, i, x}) * tt_get(m, (int64_t[]){b, x, j});
                    const int64_t at[3] = {b, i, j};
                    const double want = k.c.fp[0] * s + (beta != 0 ? beta * tt_get(c, at) : 0.0);
                    cr_assert_leq(fabs(tt_get(y, at) - want), 1e-5 * (fabs(want) + 1), "trial %d y[%lld,%lld,%lld] = %.9g, want %.9g",
                                  trial, (long long)b, (long long)i, (long long)j, tt_get(y, at), want);
                }
        tt_free(&k);
    }
}

Test(bmm, check_names_the_bad_layout_or_dtype) {
    tt_rng r = {63};
    tt_case k = {0};
    bmm_case(&k, KW_F32, 2, 3, 5, 7, 0, 1, 1.0, &r);
    kw_tensor *y = &k.c.t[0], *m = &k.c.t[2], *c = &k.c.t[3];
    m->stride[2] = 2; /* neither rows nor columns contiguous */
    tt_expect_reject(KW_OP_BMM, &k.c, KW_ESHAPE, "b's rows, or b's columns and a's rows");
    m->stride[2] = 1, y->stride[2] = 3;
    tt_expect_reject(KW_OP_BMM, &k.c, KW_ESHAPE, "y's rows must be contiguous");
    y->stride[2] = 1, c->dtype = KW_BF16;
    tt_expect_reject(KW_OP_BMM, &k.c, KW_ESHAPE, "c must be y's shape and dtype");
    c->dtype = KW_F32, m->shape[1] = 6;
    tt_expect_reject(KW_OP_BMM, &k.c, KW_ESHAPE, "b must be [2, 7, N]");
    m->shape[1] = 7, y->dtype = KW_BF16;
    tt_expect_reject(KW_OP_BMM, &k.c, KW_ESHAPE, "y must be [2, 3, 5]");
    tt_free(&k);
}

/* SDPA adds the mask and takes the softmax over every position: a NaN anywhere in
 * a row's additive mask makes that row's output NaN, and only that row's. */
Test(attention, a_nan_in_the_mask_makes_its_row_nan) {
    tt_rng r = {49};
    const int64_t B = 1, Hkv = 2, G = 2, S = 40, D = 16;
    for (int trial = 0; trial < 4; trial++) {
        const int64_t L = trial % 2 ? 3 : 1; /* a block of rows, or one head at a time */
        const int nan_only = trial >= 2;     /* the row keeps nothing else */
        tt_case k = {0};
        attention_case(&k, KW_F32, trial >= 2 ? KW_BF16 : KW_F32, B, L, Hkv, G, S, D, D, MASK_F32, 1, 0, 1, &r);
        kw_tensor *m = &k.c.t[4];
        for (int64_t s = 0; nan_only && s < S; s++) tt_set(m, (int64_t[]){0, 0, L - 1, s}, -INFINITY);
        tt_set(m, (int64_t[]){0, 0, L - 1, S / 2}, NAN);
        tt_check_variants(KW_OP_ATTENTION, &k, (tt_tol){2e-6, 1e-5}, "attention with a NaN in the mask");
        const kw_tensor *o = &k.c.t[0];
        for (int64_t h = 0; h < Hkv * G; h++)
            for (int64_t i = 0; i < L; i++)
                for (int64_t d = 0; d < D; d++) {
                    const double v = tt_get(o, (int64_t[]){0, h, i, d});
                    cr_assert(i == L - 1 ? isnan(v) : isfinite(v), "trial %d out[0, %lld, %lld, %lld] = %g", trial,
                              (long long)h, (long long)i, (long long)d, v);
                }
        tt_free(&k);
    }
}
