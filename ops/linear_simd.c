/* The GEMV / small-GEMM kernel, written once over simd.h and built once per vector
 * ISA (see KW__VARIANTS); the AVX512-BF16 build adds the vdpbf16ps path for bf16
 * activations with bf16 weights.
 *
 * A tile is one weight row × MB (<= KW__MB_MAX) activation rows over one block of
 * K: each weight vector is loaded once and feeds MB FMAs. A run is the tile
 * inlined in a loop over up to KW__CHUNK consecutive rows; for M > KW__MB_MAX the
 * chunk's rows are re-read from L1/L2 per tile of activation rows, never from
 * memory. On AVX-512, bf16 weights have a second, wide tile for long rows of
 * several activation rows: three weight rows × MB (KW__WIDE_ROW_BYTES).
 *
 * Streaming weights from DRAM is limited per core by how many cache lines are in
 * flight, and so by the instructions (and the busiest port) per line. Measured
 * here (Zen 4, 2 threads, 1 GiB of rows, against a plain read loop, when the
 * machine reads at 60 GB/s): bf16 widened by vpmovzxwd + shift (a shuffle per 16
 * weights) read at 0.66 of the read loop for rows of 960 and 0.81 for 2560; the
 * same weights split without shuffles (below) 0.91 for both. One row at a time
 * with two accumulators beats more accumulators (four: 0.75), two rows at once
 * (0.5, two streams) and software prefetch (0.6), so the tiles let the hardware
 * prefetchers follow one sequential stream. Intel's prefetchers alone keep too
 * few lines in flight on that stream, so there each weight line is also
 * prefetched pf.bytes ahead (kw_cpu_prefetch; on other CPUs only where
 * each line takes longer to consume: several rows of x, or bf16 weights on
 * AVX2; cpu.c has the distances).
 *
 * bf16 weights are read 2·KW_VW at a time as KW_VW 32-bit pairs: shifting each
 * pair up by 16 gives the even weights as f32, masking off its low half the odd
 * ones. The activations are rearranged to match once per call (per thread, into
 * its scratch): in each group of 2·KW_VW, the KW_VW even elements then the KW_VW
 * odd ones, zero-padded to whole groups in every block of K (only to those:
 * past them, to kw__lin_block_padded, the scratch is not written). */
#include "linear.h"
#include "simd.h"

/* A run: the dot products of nrows consecutive weight rows (wb bytes apart) with
 * MB activation rows (xs elements apart), into out[r·MB + m]; pf as in kw__lin. */
typedef void (*kw__run_fn)(const void *x, int64_t xs, int64_t K, const char *w, int64_t wb, int64_t nrows,
                           kw_prefetch pf, float *out);

/* Asks for the weight line pf.bytes past p (which runs on into the next rows:
 * a run's rows are contiguous), into L2 only or L1 too (pf.to_l2). A hint: it
 * never faults, even past the end. */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *p, kw_prefetch pf) {
    if (pf.bytes && pf.to_l2)
        _mm_prefetch((const char *)p + pf.bytes, _MM_HINT_T2);
    else if (pf.bytes)
        _mm_prefetch((const char *)p + pf.bytes, _MM_HINT_T0);
}

/* MB (and U) are constants at every call site (the run wrappers below), so the
 * accumulators live in registers and the loops unroll. The bf16 pairs take two
 * accumulators per activation row: 8 rows fill 16 of AVX-512's 32 registers, 4
 * rows 8 of AVX2's 16. A tile's rows of one block of activations must also fit
 * in L1 (Zen 4's 32 KiB: KW__TILE_ACTS_BYTES), never fewer than 4 rows, the tile
 * these kernels had before. Measured over SmolLM2-360M's steps (Zen 4, 2
 * threads, calls interleaved): 5 rows as one tile (or 3 + 2) instead of 4 + 1
 * took 5-row bf16 steps from 49.6 to 27.5 ms; tiles of 8 bf16 rows made an 8-row
 * bf16 step 29 ms, where oneDNN took 60 (kw_ops.h). 8 rows of f32 (30 KiB) made
 * 8-row steps 58 ms against 46 with tiles of 4 while the weights had no
 * software prefetch for several rows, and 41.6 against 46.4 (41.3 / 48.7 in a
 * second run) with it (kw_cpu_prefetch). */
#if KW_VW == 16
#define KW__MB_MAX 8
#else
#define KW__MB_MAX 4
#endif
#define KW__TILE_ACTS_BYTES 32768
/* Where one block of an activation row is this many bytes or more, tiles of 3
 * rows or more are wide (tile_pairs3, tile_dp3): three weight rows at a time,
 * so that each activation vector is loaded once for three rows. A one-row tile
 * loads an activation vector per FMA (or per vdpbf16ps), and on long rows,
 * whose tile crowds L1 beside the weight stream, those loads are what the core
 * waits on. Measured (Zen 4, 2 threads, 32-100 MB of bf16 weights, variants
 * interleaved in one process, `ms`, one-row tiles → wide tiles of up to 8 rows):
 * f32 x, K = 2048: 5 rows 5.76 → 3.59 (3 + 2 one-row tiles before), 8 rows
 * 7.36 → 4.62; K = 5632: 5 rows 4.07 → 2.07, 8 rows 5.61 → 2.75; K = 1536: 5
 * rows 3.34 → 2.54; bf16 x, K = 2048: 5 rows 3.95 → 3.38, 8 rows 4.68 → 4.01;
 * K = 5632: 5 rows 5.08 → 2.89, 8 rows 4.12 → 2.31. Shorter rows lost: bf16 x
 * with K = 960 (1920 bytes) or 1536 0.77-1.05×, f32 x with K = 960 0.76-1.15×. */
#define KW__WIDE_ROW_BYTES 4096
/* U: independent accumulator chains per row, for one or two rows whose FMAs
 * would otherwise wait on each other. */
#define KW__UNROLL(MB) ((MB) <= 2 ? 2 : 1)
/* The same for bf16 pairs, whose even and odd sums are already two chains: on
 * AVX-512 two are what streams best (the header's four: 0.75). AVX2's vectors
 * carry half the weights per FMA, so two chains cover half the bytes per FMA
 * latency there; four (two pairs a step), measured on a Zen 3 EPYC (2 threads,
 * ops_bench's GEMV, the builds alternating, 6 runs each), read bf16 weights at
 * 0.83-0.91 of the read loop against 0.80-0.84 with f32 x, and 0.88-0.92
 * against 0.81-0.87 with bf16 x; over SmolLM2-360M's bf16 steps (9 generates
 * each, processes alternating) the replay's median went 28.5 → 27.1 ms. Eight
 * chains (3 runs) did no better than four. */
#define KW__PAIRS_UNROLL(MB) (KW_VW == 8 && (MB) <= 2 ? 2 : 1)

/* f32 weights: U chains per activation row, at most two weight loads per step. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t xs, int64_t K, const float *w,
                                                           kw_prefetch pf, float *out, const int MB, const int U) {
    kw_v acc[2][KW__MB_MAX];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < MB; m++) acc[u][m] = kw_v_zero();
    int64_t k = 0;
    for (; k + U * KW_VW <= K; k += U * KW_VW)
        for (int u = 0; u < U; u++) {
            prefetch_ahead(w + k + u * KW_VW, pf);
            const kw_v wv = kw_v_loadu(w + k + u * KW_VW);
            for (int m = 0; m < MB; m++) acc[u][m] = kw_v_fmadd(wv, kw_v_loadu(x + m * xs + k + u * KW_VW), acc[u][m]);
        }
    for (; k < K; k += KW_VW) {
        const int64_t n = KW__MIN(KW_VW, K - k);
        const kw_v wv = kw_v_loadn(w + k, n);
        for (int m = 0; m < MB; m++) acc[0][m] = kw_v_fmadd(wv, kw_v_loadn(x + m * xs + k, n), acc[0][m]);
    }
    for (int m = 0; m < MB; m++) {
        kw_v s = acc[0][m];
        for (int u = 1; u < U; u++) s = kw_v_add(s, acc[u][m]);
        out[m] = kw_v_reduce_add(s);
    }
}

/* One group of 2·KW_VW weights against MB rearranged activation rows. */
static inline __attribute__((always_inline)) void pairs_step(kw_vpair wv, const float *x, int64_t xs, kw_v *even,
                                                             kw_v *odd, const int MB) {
    const kw_v we = kw_vpair_even(wv), wo = kw_vpair_odd(wv);
    for (int m = 0; m < MB; m++) {
        even[m] = kw_v_fmadd(we, kw_v_loadu(x + m * xs), even[m]);
        odd[m] = kw_v_fmadd(wo, kw_v_loadu(x + m * xs + KW_VW), odd[m]);
    }
}

/* bf16 weights split into pairs against rearranged f32 activations (padded to
 * whole groups, so only the weights need a partial load). The main loop's loads
 * stay unconditional so that the compiler folds them into the shift and the
 * mask (two loads of one line): a single load feeding both read at 0.55 of the
 * read loop against 0.91. */
static inline __attribute__((always_inline)) void tile_pairs(const float *x, int64_t xs, int64_t K, const uint16_t *w,
                                                             kw_prefetch pf, float *out, const int MB, const int U) {
    kw_v even[2][KW__MB_MAX], odd[2][KW__MB_MAX];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < MB; m++) even[u][m] = odd[u][m] = kw_v_zero();
    int64_t k = 0;
    for (; k + U * 2 * KW_VW <= K; k += U * 2 * KW_VW)
        for (int u = 0; u < U; u++) {
            prefetch_ahead(w + k + u * 2 * KW_VW, pf);
            pairs_step(kw_vpair_load(w + k + u * 2 * KW_VW), x + k + u * 2 * KW_VW, xs, even[u], odd[u], MB);
        }
    for (; k < K; k += 2 * KW_VW) {
        const kw_vpair wv = k + 2 * KW_VW <= K ? kw_vpair_load(w + k) : kw_vpair_loadn(w + k, K - k);
        pairs_step(wv, x + k, xs, even[0], odd[0], MB);
    }
    for (int m = 0; m < MB; m++) {
        kw_v s = kw_v_add(even[0][m], odd[0][m]);
        for (int u = 1; u < U; u++) s = kw_v_add(s, kw_v_add(even[u][m], odd[u][m]));
        out[m] = kw_v_reduce_add(s);
    }
}

/* A wide tile (KW__WIDE_ROW_BYTES): three weight rows × MB rearranged
 * activation rows, one accumulator per (weight row, activation row). Each
 * row's lines are prefetched a tile (three rows) ahead, where the next tile
 * reads them, when the call prefetches at all (pf). */
static inline __attribute__((always_inline)) void pairs3_step(const uint16_t *w, int64_t wn, int64_t k, int64_t n,
                                                              kw_prefetch pf, const float *x, int64_t xs,
                                                              kw_v acc[3][KW__MB_MAX], const int MB) {
    kw_v we[3], wo[3];
    for (int r = 0; r < 3; r++) {
        const kw_vpair p = n == 2 * KW_VW ? kw_vpair_load(w + r * wn + k) : kw_vpair_loadn(w + r * wn + k, n);
        prefetch_ahead(w + r * wn + k, pf);
        we[r] = kw_vpair_even(p), wo[r] = kw_vpair_odd(p);
    }
    for (int m = 0; m < MB; m++) {
        const kw_v xe = kw_v_loadu(x + m * xs + k), xo = kw_v_loadu(x + m * xs + k + KW_VW);
        for (int r = 0; r < 3; r++) acc[r][m] = kw_v_fmadd(wo[r], xo, kw_v_fmadd(we[r], xe, acc[r][m]));
    }
}

/* Weight rows w, w + wn, w + 2·wn (wn elements apart), into out[r·MB + m]. */
static inline __attribute__((always_inline)) void tile_pairs3(const float *x, int64_t xs, int64_t K, const uint16_t *w,
                                                              int64_t wn, kw_prefetch pf, float *out, const int MB) {
    kw_v acc[3][KW__MB_MAX];
    for (int r = 0; r < 3; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = kw_v_zero();
    const kw_prefetch ahead = {pf.bytes ? 3 * wn * (int64_t)sizeof(uint16_t) : 0, pf.to_l2};
    int64_t k = 0;
    for (; k + 2 * KW_VW <= K; k += 2 * KW_VW) pairs3_step(w, wn, k, 2 * KW_VW, ahead, x, xs, acc, MB);
    if (k < K) pairs3_step(w, wn, k, K - k, ahead, x, xs, acc, MB);
    for (int r = 0; r < 3; r++)
        for (int m = 0; m < MB; m++) out[r * MB + m] = kw_v_reduce_add(acc[r][m]);
}

/* run_<family>_<MB>: KW__TILE_<family>(MB) over nrows rows; runs_<family>[MB - 1]. */
#define KW__RUN(family, MB)                                                                                 \
    static void run_##family##_##MB(const void *x, int64_t xs, int64_t K, const char *w, int64_t wb,         \
                                    int64_t nrows, kw_prefetch pf, float *out) {                                 \
        for (int64_t r = 0; r < nrows; r++) KW__TILE_##family(MB);                                           \
    }
#if KW__MB_MAX == 8
#define KW__RUNS(family)                                                                                    \
    KW__RUN(family, 1) KW__RUN(family, 2) KW__RUN(family, 3) KW__RUN(family, 4) KW__RUN(family, 5)         \
    KW__RUN(family, 6) KW__RUN(family, 7) KW__RUN(family, 8)                                                \
    static const kw__run_fn runs_##family[8] = {run_##family##_1, run_##family##_2, run_##family##_3,      \
                                                run_##family##_4, run_##family##_5, run_##family##_6,      \
                                                run_##family##_7, run_##family##_8};
#else
#define KW__RUNS(family)                                                                            \
    KW__RUN(family, 1) KW__RUN(family, 2) KW__RUN(family, 3) KW__RUN(family, 4)                    \
    static const kw__run_fn runs_##family[4] = {run_##family##_1, run_##family##_2, run_##family##_3, \
                                                run_##family##_4};
#endif

#define KW__TILE_f32(MB) \
    tile_f32((const float *)x, xs, K, (const float *)(w + r * wb), pf, out + r * MB, MB, KW__UNROLL(MB))
#define KW__TILE_pairs(MB) \
    tile_pairs((const float *)x, xs, K, (const uint16_t *)(w + r * wb), pf, out + r * MB, MB, KW__PAIRS_UNROLL(MB))
/* Three rows at a time while three are left, then one. */
#define KW__TILE_pairs3(MB)                                                                                       \
    if (r + 3 <= nrows) {                                                                                        \
        tile_pairs3((const float *)x, xs, K, (const uint16_t *)(w + r * wb), wb / 2, pf, out + r * MB, MB);      \
        r += 2;                                                                                                  \
    } else                                                                                                       \
        KW__TILE_pairs(MB)
KW__RUNS(f32)
KW__RUNS(pairs)
#if KW_VW == 16
KW__RUNS(pairs3)
#define KW__PAIRS3 runs_pairs3
#else /* AVX2's 16 registers do not hold 3·MB accumulators beside six weight vectors */
#define KW__PAIRS3 NULL
#endif

#if defined(__AVX512BF16__)
/* bf16 activations with bf16 weights: vdpbf16ps multiplies bf16 pairs exactly and
 * accumulates in f32 (flushing denormals), 32 products per instruction. */
static inline __attribute__((always_inline)) void tile_dp(const uint16_t *x, int64_t xs, int64_t K,
                                                          const uint16_t *w, kw_prefetch pf, float *out, const int MB,
                                                          const int U) {
    __m512 acc[2][KW__MB_MAX];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < MB; m++) acc[u][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + U * 32 <= K; k += U * 32)
        for (int u = 0; u < U; u++) {
            prefetch_ahead(w + k + u * 32, pf);
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

/* 32 elements (full) or the first ones in mask, of p. */
static inline __attribute__((always_inline)) __m512bh load_bf16_32(const uint16_t *p, __mmask32 mask, const int full) {
    return (__m512bh)(full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask, p));
}

/* The wide tile of tile_dp, as tile_pairs3 is of tile_pairs. */
static inline __attribute__((always_inline)) void dp3_step(const uint16_t *w, int64_t wn, int64_t k, __mmask32 mask,
                                                           kw_prefetch pf, const uint16_t *x, int64_t xs,
                                                           __m512 acc[3][KW__MB_MAX], const int MB, const int full) {
    __m512bh wv[3];
    for (int r = 0; r < 3; r++) {
        prefetch_ahead(w + r * wn + k, pf);
        wv[r] = load_bf16_32(w + r * wn + k, mask, full);
    }
    for (int m = 0; m < MB; m++) {
        const __m512bh xv = load_bf16_32(x + m * xs + k, mask, full);
        for (int r = 0; r < 3; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
    }
}

static inline __attribute__((always_inline)) void tile_dp3(const uint16_t *x, int64_t xs, int64_t K, const uint16_t *w,
                                                           int64_t wn, kw_prefetch pf, float *out, const int MB) {
    __m512 acc[3][KW__MB_MAX];
    for (int r = 0; r < 3; r++)
        for (int m = 0; m < MB; m++) acc[r][m] = _mm512_setzero_ps();
    const kw_prefetch ahead = {pf.bytes ? 3 * wn * (int64_t)sizeof(uint16_t) : 0, pf.to_l2};
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) dp3_step(w, wn, k, 0, ahead, x, xs, acc, MB, 1);
    if (k < K) dp3_step(w, wn, k, (__mmask32)((1u << (K - k)) - 1), ahead, x, xs, acc, MB, 0);
    for (int r = 0; r < 3; r++)
        for (int m = 0; m < MB; m++) out[r * MB + m] = _mm512_reduce_add_ps(acc[r][m]);
}
#define KW__TILE_dp(MB) \
    tile_dp((const uint16_t *)x, xs, K, (const uint16_t *)(w + r * wb), pf, out + r * MB, MB, KW__UNROLL(MB))
#define KW__TILE_dp3(MB)                                                                                        \
    if (r + 3 <= nrows) {                                                                                       \
        tile_dp3((const uint16_t *)x, xs, K, (const uint16_t *)(w + r * wb), wb / 2, pf, out + r * MB, MB);     \
        r += 2;                                                                                                 \
    } else                                                                                                      \
        KW__TILE_dp(MB)
KW__RUNS(dp)
KW__RUNS(dp3)
#endif

/* Activation row block [k0, k0 + n) (f32 or bf16) rearranged into dst, padded to
 * whole groups of 2·KW_VW with zeros (which meet zero weights). */
static void rearrange_block(const char *src, kw_dtype st, int64_t n, float *dst) {
    for (int64_t g = 0; g < n; g += 2 * KW_VW) {
        kw_v half[2];
        for (int h = 0; h < 2; h++) {
            const int64_t k = g + h * KW_VW, left = n - k;
            if (left <= 0)
                half[h] = kw_v_zero();
            else if (st == KW_BF16)
                half[h] = left >= KW_VW ? kw_v_load_bf16((const uint16_t *)src + k)
                                        : kw_v_loadn_bf16((const uint16_t *)src + k, left);
            else
                half[h] = left >= KW_VW ? kw_v_loadu((const float *)src + k) : kw_v_loadn((const float *)src + k, left);
        }
        kw_v even, odd;
        kw_v_deinterleave(half[0], half[1], &even, &odd);
        kw_v_storeu(dst + g, even);
        kw_v_storeu(dst + g + KW_VW, odd);
    }
}

#define KW__CHUNK 64 /* weight rows per run: their sums fit in a small stack buffer */

/* How a call's activations are read: the run families and where block kb of
 * activation row m starts. */
typedef struct kw__acts {
    const kw__run_fn *runs;
    const kw__run_fn *runs_wide; /* three weight rows a tile, for tiles of 3 rows or more; NULL: none */
    const char *x;
    int64_t xs;   /* row stride, elements */
    int64_t kbs;  /* block stride, elements */
    size_t esize; /* element bytes */
    int mb_max;   /* activation rows per tile, see tile_rows */
} kw__acts;

/* Wide tiles where one block of an activation row is KW__WIDE_ROW_BYTES or more;
 * then up to KW__MB_MAX rows a tile (a wide tile loads each activation vector
 * once for three weight rows, so L2 serves them, and every row more in a tile
 * is one pass less over the weights), else as many as KW__TILE_ACTS_BYTES holds
 * of one block (kbs elements a row, the rearranged pairs' padding included). */
static kw__acts with_tile_rows(kw__acts a) {
    if (a.kbs * (int64_t)a.esize < KW__WIDE_ROW_BYTES) a.runs_wide = NULL;
    a.mb_max = a.runs_wide ? KW__MB_MAX
                           : (int)KW__MAX(4, KW__MIN(KW__MB_MAX, KW__TILE_ACTS_BYTES / (a.kbs * (int64_t)a.esize)));
    return a;
}

static kw__acts acts_of(const kw__lin *g, void *work) {
#if defined(__AVX512BF16__)
    if (g->xt == KW_BF16 && g->wt == KW_BF16)
        return with_tile_rows((kw__acts){runs_dp, runs_dp3, g->x, g->xs, g->kblk, 2, 0});
#endif
    if (g->wt == KW_F32) return with_tile_rows((kw__acts){runs_f32, NULL, g->x, g->xs, g->kblk, 4, 0});
    const int64_t nb = g->K / g->kblk, bp = kw__lin_block_padded(g->kblk);
    return with_tile_rows((kw__acts){runs_pairs, KW__PAIRS3, work, nb * bp, bp, 4, 0});
}

void KW__ISA_NAME(kw__linear_acts)(const kw__lin *g, void *work) {
    const kw__acts a = acts_of(g, work);
    if (a.runs != runs_pairs) return;
    const size_t xsz = kw_dtype_size(g->xt);
    for (int64_t m = 0; m < g->M; m++)
        for (int64_t kb = 0; kb < g->K / g->kblk; kb++)
            rearrange_block(g->x + (size_t)(m * g->xs + kb * g->kblk) * xsz, g->xt, g->kblk,
                            (float *)work + m * a.xs + kb * a.kbs);
}

/* Rows in the tile of activation rows from m0: the M rows split into as few tiles
 * as KW__MB_MAX allows, of near-equal sizes (9 rows on AVX-512: 5 + 4, where a
 * tile of one row would cost about what one of eight does). */
static inline int tile_rows(int64_t M, int64_t m0, int mb_max) {
    const int64_t left = M - m0, tiles = (left + mb_max - 1) / mb_max;
    return (int)((left + tiles - 1) / tiles);
}

/* The dot products of weight rows [n, n + nr) (block kb) with activation rows
 * m0 .. m0 + MB - 1, into out[r·MB + m]. */
static void block_run(const kw__lin *g, const kw__acts *a, int64_t kb, int64_t n, int64_t nr, int64_t m0, int MB,
                      float *out) {
    const char *x = a->x + (size_t)(m0 * a->xs + kb * a->kbs) * a->esize;
    const kw__run_fn *runs = a->runs_wide && MB >= 3 ? a->runs_wide : a->runs;
    runs[MB - 1](x, a->xs, g->kblk, kw__lin_wrow(g, kb, n), g->ws * (int64_t)kw_dtype_size(g->wt), nr, g->pf, out);
}

/* Stores MB dot products with weight row n, plus bias, rounding to y's dtype once. */
static void store_tile(const kw__lin *g, const float *out, int MB, int64_t n, int64_t m0, char *y, int64_t ys,
                       int64_t col) {
    const float bias = kw__lin_bias(g, n);
    for (int m = 0; m < MB; m++) kw__stf(y, (m0 + m) * ys + col, g->yt, out[m] + bias);
}

/* Stores the sums of weight rows [n0, n1) with rows m0 .. m0 + mb - 1 of x,
 * acc[(n - n0)·mb + m], in whichever outputs they fall. */
static void store_sums(const kw__lin *g, const float *acc, int64_t n0, int64_t n1, int64_t m0, int64_t mb) {
    for (int j = 0; j < g->n_out; j++) {
        int64_t s0, s1;
        char *y;
        if (!kw__lin_segment(g, j, n0, n1, &s0, &s1, &y)) continue;
        for (int64_t n = s0; n < s1; n++) store_tile(g, acc + (n - n0) * mb, (int)mb, n, m0, y, g->out[j].ys, n - s0);
    }
}

/* Packed panels (KW__PANELS_MIN_M in linear.h), AVX2 only: 16 weight rows a
 * panel, two vectors of KW_VW. Word i·16 + j of a panel holds weight row
 * n + j's elements k0 + 2i and k0 + 2i + 1 of block kb, so that kw_vpair_even
 * / _odd of KW_VW words give KW_VW rows' weights at one even or odd k; zero
 * past nr rows and past the block. */
#if KW_VW == 8
_Static_assert(KW__PANEL_ROWS == 2 * KW_VW, "a panel's 16 words of one pair of K are two kw_vpair");
#define KW__PANEL_MR 6 /* rows of x a tile: 12 accumulators, two weight vectors, a broadcast */

/* The 8 × 8 words at src (rows src_bytes apart) transposed into dst (rows
 * dst_stride words apart). */
static inline void transpose8x8(const char *src, int64_t src_bytes, uint32_t *dst, int64_t dst_stride) {
    kw_v r[8];
    for (int i = 0; i < 8; i++) r[i] = kw_v_loadu((const float *)(src + i * src_bytes));
    kw_v_transpose(r);
    for (int i = 0; i < 8; i++) kw_v_storeu((float *)(dst + i * dst_stride), r[i]);
}

/* Elements [k0, k0 + len) of block kb of weight rows [n, n + nr) (len even). */
static void pack_panel(const kw__lin *g, int64_t kb, int64_t k0, int64_t len, int64_t n, int64_t nr, uint32_t *dst) {
    const int64_t whole = KW__MIN(len, g->kblk - k0) / 16 * 8; /* pairs in whole runs of 8 */
    for (int64_t j0 = 0; j0 < KW__PANEL_ROWS; j0 += 8) {
        if (j0 + 8 <= nr) /* the whole runs of 8 pairs of 8 rows, transposed */
            for (int64_t i0 = 0; i0 < whole; i0 += 8)
                transpose8x8(kw__lin_wrow(g, kb, n + j0) + (k0 + 2 * i0) * 2, g->ws * 2, dst + i0 * KW__PANEL_ROWS + j0,
                             KW__PANEL_ROWS);
        for (int64_t j = j0; j < j0 + 8; j++) { /* what is left of each row, one pair at a time */
            const uint16_t *w = j < nr ? (const uint16_t *)kw__lin_wrow(g, kb, n + j) : NULL;
            for (int64_t i = j0 + 8 <= nr ? whole : 0; i < len / 2; i++) {
                const int64_t k = k0 + 2 * i;
                uint32_t v = 0;
                if (w && k + 1 < g->kblk)
                    memcpy(&v, w + k, 4);
                else if (w && k < g->kblk)
                    v = w[k];
                dst[i * KW__PANEL_ROWS + j] = v;
            }
        }
    }
}

/* MR rearranged rows of x (xs floats apart, len of each: whole groups) times a
 * panel, into out[m·KW__PANEL_ROWS + j]. In a rearranged group of 2·KW_VW, pair
 * i's even element is at i and its odd one at KW_VW + i. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t xs, int64_t len,
                                                             const uint32_t *wp, float *out, const int MR) {
    kw_v acc[KW__PANEL_MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = kw_v_zero();
    for (int64_t g = 0; g < len; g += 2 * KW_VW)
        for (int i = 0; i < KW_VW; i++) {
            const uint16_t *p = (const uint16_t *)(wp + (g / 2 + i) * KW__PANEL_ROWS);
            const kw_vpair v0 = kw_vpair_load(p), v1 = kw_vpair_load(p + 2 * KW_VW);
            kw_v w0 = kw_vpair_even(v0), w1 = kw_vpair_even(v1);
            for (int m = 0; m < MR; m++) {
                const kw_v xb = kw_v_set1(x[m * xs + g + i]);
                acc[m][0] = kw_v_fmadd(w0, xb, acc[m][0]);
                acc[m][1] = kw_v_fmadd(w1, xb, acc[m][1]);
            }
            w0 = kw_vpair_odd(v0), w1 = kw_vpair_odd(v1);
            for (int m = 0; m < MR; m++) {
                const kw_v xb = kw_v_set1(x[m * xs + g + KW_VW + i]);
                acc[m][0] = kw_v_fmadd(w0, xb, acc[m][0]);
                acc[m][1] = kw_v_fmadd(w1, xb, acc[m][1]);
            }
        }
    for (int m = 0; m < MR; m++) {
        kw_v_storeu(out + m * KW__PANEL_ROWS, acc[m][0]);
        kw_v_storeu(out + m * KW__PANEL_ROWS + KW_VW, acc[m][1]);
    }
}

typedef void (*kw__panel_fn)(const float *x, int64_t xs, int64_t len, const uint32_t *wp, float *out);
#define KW__PANEL_TILE(MR)                                                                                     \
    static void panel_tile_##MR(const float *x, int64_t xs, int64_t len, const uint32_t *wp, float *out) {    \
        panel_tile(x, xs, len, wp, out, MR);                                                                   \
    }
KW__PANEL_TILE(1) KW__PANEL_TILE(2) KW__PANEL_TILE(3) KW__PANEL_TILE(4) KW__PANEL_TILE(5) KW__PANEL_TILE(6)
static const kw__panel_fn panel_tiles[KW__PANEL_MR] = {panel_tile_1, panel_tile_2, panel_tile_3,
                                                       panel_tile_4, panel_tile_5, panel_tile_6};

/* Weight rows [n0, n1) by every row of x into y: for each block of sums
 * (KW__PANEL_SUM_ROWS × KW__PANEL_SUM_M in linear.h), panel by panel and block
 * of K by block (KW__PANEL_K of one at a time). A block's activations are laid
 * out to whole groups of 2·KW_VW only; past them, to the padded kbs, the
 * scratch holds whatever was there (an attention step's -inf), which the zero
 * weights packed there would make NaN, so the panels stop at the groups. */
static void panel_rows(const kw__lin *g, const kw__acts *a, int64_t n0, int64_t n1, void *work) {
    float *acc = (float *)((char *)work + kw__lin_acts_bytes(g));
    uint32_t *wp = (uint32_t *)((char *)acc + kw__lin_partial_bytes(g));
    float out[KW__PANEL_MR * KW__PANEL_ROWS];
    const int64_t laid = (g->kblk + 2 * KW_VW - 1) / (2 * KW_VW) * (2 * KW_VW);
    for (int64_t nb0 = n0; nb0 < n1; nb0 += KW__PANEL_SUM_ROWS) {
        const int64_t nb1 = KW__MIN(n1, nb0 + KW__PANEL_SUM_ROWS);
        for (int64_t mb0 = 0; mb0 < g->M; mb0 += KW__PANEL_SUM_M) {
            const int64_t mb = KW__MIN(KW__PANEL_SUM_M, g->M - mb0);
            memset(acc, 0, (size_t)((nb1 - nb0) * mb) * sizeof(float));
            for (int64_t kb = 0; kb < g->K / g->kblk; kb++)
                for (int64_t n = nb0; n < nb1; n += KW__PANEL_ROWS) {
                    const int64_t nr = KW__MIN(KW__PANEL_ROWS, nb1 - n);
                    for (int64_t k0 = 0; k0 < laid; k0 += KW__PANEL_K) {
                        const int64_t len = KW__MIN(KW__PANEL_K, laid - k0);
                        pack_panel(g, kb, k0, len, n, nr, wp);
                        for (int64_t m0 = mb0, mr; m0 < mb0 + mb; m0 += mr) {
                            mr = KW__MIN(KW__PANEL_MR, mb0 + mb - m0);
                            panel_tiles[mr - 1]((const float *)a->x + m0 * a->xs + kb * a->kbs + k0, a->xs, len, wp,
                                                out);
                            for (int64_t j = 0; j < nr; j++)
                                for (int64_t m = 0; m < mr; m++)
                                    acc[(n + j - nb0) * mb + m0 - mb0 + m] += out[m * KW__PANEL_ROWS + j];
                        }
                    }
                }
            store_sums(g, acc, nb0, nb1, mb0, mb);
        }
    }
}
#endif

void KW__ISA_NAME(kw__linear_rows)(const kw__lin *g, int64_t n0, int64_t n1, void *work) {
    const kw__acts a = acts_of(g, work);
    float out[KW__CHUNK * KW__MB_MAX];
#if KW_VW == 8
    if (g->panels) {
        panel_rows(g, &a, n0, n1, work);
        return;
    }
#endif
    if (g->kblk == g->K) { /* one block: each row's sums go straight to y */
        for (int j = 0; j < g->n_out; j++) {
            int64_t s0, s1;
            char *y;
            if (!kw__lin_segment(g, j, n0, n1, &s0, &s1, &y)) continue;
            for (int64_t n = s0; n < s1; n += KW__CHUNK) {
                const int64_t nr = KW__MIN(KW__CHUNK, s1 - n);
                for (int64_t m0 = 0, MB; m0 < g->M; m0 += MB) {
                    MB = tile_rows(g->M, m0, a.mb_max);
                    block_run(g, &a, 0, n, nr, m0, MB, out);
                    for (int64_t r = 0; r < nr; r++)
                        store_tile(g, out + r * MB, MB, n + r, m0, y, g->out[j].ys, n + r - s0);
                }
            }
        }
        return;
    }
    /* K-blocked: block by block over the claimed rows, so one block's
     * activations serve every row while they are in L1; partial sums per row. */
    float *acc = (float *)((char *)work + kw__lin_acts_bytes(g));
    memset(acc, 0, (size_t)((n1 - n0) * g->M) * sizeof(float));
    for (int64_t kb = 0; kb < g->K / g->kblk; kb++)
        for (int64_t n = n0; n < n1; n += KW__CHUNK) {
            const int64_t nr = KW__MIN(KW__CHUNK, n1 - n);
            for (int64_t m0 = 0, MB; m0 < g->M; m0 += MB) {
                MB = tile_rows(g->M, m0, a.mb_max);
                block_run(g, &a, kb, n, nr, m0, MB, out);
                for (int64_t r = 0; r < nr; r++)
                    for (int m = 0; m < MB; m++) acc[(n + r - n0) * g->M + m0 + m] += out[r * MB + m];
            }
        }
    store_sums(g, acc, n0, n1, 0, g->M);
}
