/* linear_body.h — the GEMV / small-GEMM kernel, written once over simd.h and built
 * per ISA by linear_avx2.c, linear_avx512.c and linear_avx512bf16.c (the last adds
 * the vdpbf16ps path for bf16 activations with bf16 weights).
 *
 * A tile is one weight row × MB (<= 4) activation rows over the whole of K: each
 * weight vector is loaded once (bf16 widened exactly by vpmovzxwd and a shift)
 * and feeds MB FMAs. Rows are walked outer and activation blocks inner, so for
 * M > 4 a row is re-read from L1/L2, not from memory.
 *
 * What streams weights from DRAM fastest was measured here (Zen 4, 1 GiB of
 * bf16 rows of 2048, one thread, best of 12 interleaved runs, against a plain
 * read loop): one row at a time with two accumulators (U = 2) reads at 0.95 of
 * the read loop; four accumulators 0.75, eight 0.87; two or four rows sharing
 * the activation loads 0.5; software prefetch at 1-4 KiB ahead 0.6; widening by
 * shift-and-mask of 64-byte loads against rearranged activations (fewer
 * instructions, faster in L2) 0.6-0.8. So the tiles below use few accumulators
 * and let the hardware prefetchers follow one sequential stream. */
#include "linear.h"
#include "simd.h"

typedef void (*kw__tile_fn)(const float *x, int64_t xs, int64_t K, const char *w, float *out);

/* MB and U are constants at every call site (the wrappers below), so the
 * accumulators live in registers and the loops unroll: MB·U >= 3 chains of FMAs,
 * at most two weight loads per iteration. */
static inline __attribute__((always_inline)) void tile_f32x(const float *x, int64_t xs, int64_t K, const char *w,
                                                            kw_dtype wt, float *out, const int MB, const int U) {
    kw_v acc[4][4];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < MB; m++) acc[u][m] = kw_v_zero();
    int64_t k = 0;
    for (; k + U * KW_VW <= K; k += U * KW_VW)
        for (int u = 0; u < U; u++) {
            const kw_v wv = kw_v_ld(w, k + u * KW_VW, wt);
            for (int m = 0; m < MB; m++) acc[u][m] = kw_v_fmadd(wv, kw_v_loadu(x + m * xs + k + u * KW_VW), acc[u][m]);
        }
    for (; k < K; k += KW_VW) {
        const int64_t n = KW__MIN(KW_VW, K - k);
        const kw_v wv = kw_v_ldn(w, k, n, wt);
        for (int m = 0; m < MB; m++) acc[0][m] = kw_v_fmadd(wv, kw_v_loadn(x + m * xs + k, n), acc[0][m]);
    }
    for (int m = 0; m < MB; m++) {
        kw_v s = acc[0][m];
        for (int u = 1; u < U; u++) s = kw_v_add(s, acc[u][m]);
        out[m] = kw_v_reduce_add(s);
    }
}

#define KW__TILE(wname, wt, MB, U)                                                                        \
    static void tile_##wname##_##MB(const float *x, int64_t xs, int64_t K, const char *w, float *out) { \
        tile_f32x(x, xs, K, w, wt, out, MB, U);                                                           \
    }
#define KW__TILES(wname, wt)                                                                                 \
    KW__TILE(wname, wt, 1, 2) KW__TILE(wname, wt, 2, 2) KW__TILE(wname, wt, 3, 1) KW__TILE(wname, wt, 4, 1) \
    static const kw__tile_fn tiles_##wname[4] = {tile_##wname##_1, tile_##wname##_2, tile_##wname##_3,      \
                                                 tile_##wname##_4};
KW__TILES(f32, KW_F32)
KW__TILES(bf16, KW_BF16)

/* Stores MB dot products with weight row n, plus bias, rounding to y's dtype once. */
static void store_tile(const kw__lin *g, const float *out, int MB, int64_t n, int64_t m0, char *y, int64_t ys,
                       int64_t col) {
    const float bias = kw__lin_bias(g, n);
    for (int m = 0; m < MB; m++) kw__stf(y, (m0 + m) * ys + col, g->yt, out[m] + bias);
}

#if defined(__AVX512BF16__)
/* bf16 activations with bf16 weights: vdpbf16ps multiplies bf16 pairs exactly and
 * accumulates in f32 (flushing denormals), 32 products per instruction. */
static inline __attribute__((always_inline)) void tile_dp(const uint16_t *x, int64_t xs, int64_t K,
                                                          const uint16_t *w, float *out, const int MB, const int U) {
    __m512 acc[4][4];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < MB; m++) acc[u][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + U * 32 <= K; k += U * 32)
        for (int u = 0; u < U; u++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + u * 32);
            for (int m = 0; m < MB; m++)
                acc[u][m] = _mm512_dpbf16_ps(acc[u][m], wv, (__m512bh)_mm512_loadu_si512(x + m * xs + k + u * 32));
        }
    for (; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (K - k)) - 1);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
        for (int m = 0; m < MB; m++)
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * xs + k));
    }
    for (int m = 0; m < MB; m++) {
        __m512 s = acc[0][m];
        for (int u = 1; u < U; u++) s = _mm512_add_ps(s, acc[u][m]);
        out[m] = _mm512_reduce_add_ps(s);
    }
}

typedef void (*kw__tile_dp_fn)(const uint16_t *x, int64_t xs, int64_t K, const uint16_t *w, float *out);
#define KW__TILE_DP(MB, U)                                                                              \
    static void tile_dp_##MB(const uint16_t *x, int64_t xs, int64_t K, const uint16_t *w, float *out) { \
        tile_dp(x, xs, K, w, out, MB, U);                                                               \
    }
KW__TILE_DP(1, 2) KW__TILE_DP(2, 2) KW__TILE_DP(3, 1) KW__TILE_DP(4, 1)
static const kw__tile_dp_fn tiles_dp[4] = {tile_dp_1, tile_dp_2, tile_dp_3, tile_dp_4};

#endif

/* bf16 activations widened once into the thread's scratch (exact). */
static const float *widen_x(const kw__lin *g, float *dst) {
    for (int64_t m = 0; m < g->M; m++) {
        const uint16_t *src = (const uint16_t *)g->x + m * g->xs;
        float *d = dst + m * g->K;
        int64_t k = 0;
        for (; k + KW_VW <= g->K; k += KW_VW) kw_v_storeu(d + k, kw_v_load_bf16(src + k));
        if (k < g->K) kw_v_storen(d + k, kw_v_loadn_bf16(src + k, g->K - k), g->K - k);
    }
    return dst;
}

/* The MB dot products of weight row n's block kb with activation rows m0.. (the
 * f32 activations, or the bf16 ones for the vdpbf16ps path). */
static void block_dots(const kw__lin *g, const void *x, int64_t xs, int dp, int64_t kb, int64_t n, int64_t m0, int MB,
                       float *out) {
    const int64_t k0 = kb * g->kblk;
    const char *w = kw__lin_wrow(g, kb, n);
#if defined(__AVX512BF16__)
    if (dp) {
        tiles_dp[MB - 1]((const uint16_t *)x + m0 * xs + k0, xs, g->kblk, (const uint16_t *)w, out);
        return;
    }
#endif
    (void)dp;
    const kw__tile_fn *tiles = g->wt == KW_BF16 ? tiles_bf16 : tiles_f32;
    tiles[MB - 1]((const float *)x + m0 * xs + k0, xs, g->kblk, w, out);
}

void KW__ISA_NAME(kw__linear_rows)(const kw__lin *g, int64_t n0, int64_t n1, void *work) {
    const void *x = g->x;
    int64_t xs = g->xs;
#if defined(__AVX512BF16__)
    const int dp = g->xt == KW_BF16 && g->wt == KW_BF16;
#else
    const int dp = 0;
#endif
    char *scratch = (char *)work;
    if (g->xt == KW_BF16 && !dp) {
        x = widen_x(g, (float *)scratch);
        xs = g->K;
        scratch += ((size_t)(g->M * g->K) * sizeof(float) + 63) / 64 * 64;
    }
    float out[4];
    if (g->kblk == g->K) { /* one block: each row's sums go straight to y */
        for (int j = 0; j < g->n_out; j++) {
            int64_t s0, s1;
            char *y;
            if (!kw__lin_segment(g, j, n0, n1, &s0, &s1, &y)) continue;
            for (int64_t n = s0; n < s1; n++)
                for (int64_t m0 = 0; m0 < g->M; m0 += 4) {
                    const int MB = (int)KW__MIN(4, g->M - m0);
                    block_dots(g, x, xs, dp, 0, n, m0, MB, out);
                    store_tile(g, out, MB, n, m0, y, g->out[j].ys, n - s0);
                }
        }
        return;
    }
    /* K-blocked: block by block over all the thread's rows, so one block's
     * activations serve every row while they are in L1; partial sums per row. */
    float *acc = (float *)scratch;
    memset(acc, 0, (size_t)((n1 - n0) * g->M) * sizeof(float));
    for (int64_t kb = 0; kb < g->K / g->kblk; kb++)
        for (int64_t n = n0; n < n1; n++)
            for (int64_t m0 = 0; m0 < g->M; m0 += 4) {
                const int MB = (int)KW__MIN(4, g->M - m0);
                block_dots(g, x, xs, dp, kb, n, m0, MB, out);
                for (int m = 0; m < MB; m++) acc[(n - n0) * g->M + m0 + m] += out[m];
            }
    for (int j = 0; j < g->n_out; j++) {
        int64_t s0, s1;
        char *y;
        if (!kw__lin_segment(g, j, n0, n1, &s0, &s1, &y)) continue;
        for (int64_t n = s0; n < s1; n++) store_tile(g, acc + (n - n0) * g->M, (int)g->M, n, 0, y, g->out[j].ys, n - s0);
    }
}
