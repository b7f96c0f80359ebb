/* linear on AMX tiles, for bf16 weights with bf16 activations, or with f32
 * activations (a bf16 copy of bf16-valued f32 weights). The AVX-512 kernel pays
 * for each further row of x with more instructions per weight; one AMX tile
 * product (TDPBF16PS) takes 16 weight rows × 32 of K against up to 16 rows of x
 * at once, so its cost grows little from M = 1 to M = 16 (bench/ops.py on a
 * 2-vCPU Xeon; kw_ops.h has the rows from which it takes over, and why).
 *
 * The product is computed transposed, Yᵀ = W·Xᵀ: the weight rows are the A tile,
 * read in place from PyTorch's [N, K] layout (or K-blocked [K / B, N, B]) with
 * the row stride, so weights need no copy of their own (many rows of x over a
 * small weight take the product the other way round, at the end of this file);
 * x is rearranged once per call into the B tiles' pair layout (`acts`, into the thread's scratch): for
 * each block of up to 16 rows of x and each step of 32 along K, 16 rows of K
 * pairs × the block's rows of x. A step shorter than 32 at the end of a block of
 * K (K = 100: a step of 4) uses tiles configured that short; K must be even.
 *
 * f32 activations are split exactly into three bf16 parts, x = x1 + x2 + x3
 * (x1 = x's top 8 bits of significand, cut, x2 the top 8 of x - x1, x3 the
 * rest: 24 bits in three pieces of 8), and each part gets its own B tiles, all
 * summed into the same tile: every product of a bf16 weight with a part is
 * exact in f32, so the result is the f32 linear's up to summation order, as
 * with the AVX-512 kernel's widened weights. Cut, not rounded: a finite x
 * above bf16's largest value (3.39e38) rounded to an infinite part, and its
 * row's outputs were NaN. An infinite x is its first part (the rest zero). An
 * infinite weight's output is NaN where the f32 linear gives ±inf: a part of x
 * that is zero (every part past the first of a bf16-valued x) times it is NaN
 * in the tile product.
 *
 * Each group of 16 weight rows (kw__lin_claim hands out whole groups, and every
 * output of linear_multi must be whole groups) is multiplied block of x after
 * block of x, its A tiles reloaded from L1. From 17 rows of x with K in whole
 * steps of 32 (kw__lin_amx_wide), the tiles are wide instead: two groups against
 * two blocks of x (the last block padded with zero rows) in four C tiles, so that
 * each tile loaded serves two products, over chunks of K whose A tiles stay in
 * L1 (chunk_steps); Llama-3.2-1B's MLP at 128 rows of bf16 x took 9.5-10.2 ms
 * on a 2-vCPU Xeon against 18.7-19.5 block after block (bench/ops.py). The 16 ×
 * 16 sums are transposed in registers, biased and rounded to y's dtype a row of
 * x at a time. Sums are f32; the tile unit treats
 * denormal bf16 inputs as zero and flushes denormal products and sums (an f32
 * activation below 2^-110 or so loses its last part; where the products fall
 * under 2^-126, activations under about 1e-35, the outputs lose accuracy,
 * zeros from about 3e-38, where the f32 linear keeps denormals: README). A thread loads the tile configuration when it lays out x for a
 * call and releases the tiles after its last rows (`done`), so its tile state is
 * never live between kernels. */
#include <string.h>

#include "amx.h"
#include "linear.h"
#include "simd.h"

/* Tile registers. GCC's tile intrinsics paste their register numbers into the
 * instruction text, so they are macros, expanded through the wrappers below. */
#define T_C 0           /* sums, 16 weight rows × 16 rows of x */
#define T_A 1           /* 16 weight rows × 32 of K */
#define T_B 2           /* 16 K pairs × 16 rows of x */
#define T_A_TAIL 3      /* 16 weight rows × the last step's K */
#define T_B_TAIL 4      /* its K pairs × 16 rows of x */
#define T_C_PART 5      /* the same three for the last block of x, when it has fewer than 16 rows */
#define T_B_PART 6
#define T_B_TAIL_PART 7
/* Wide calls (kw__lin_amx_wide) configure all eight as full tiles instead: sums
 * of groups of weight rows 0, 1 against blocks of x 0, 1, two A and two B. */
#define W_C00 0
#define W_C01 1
#define W_C10 2
#define W_C11 3
#define W_A0 4
#define W_A1 5
#define W_B0 6
#define W_B1 7
#define ZERO(t) _tile_zero(t)
#define LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define STORE(t, p, stride) _tile_stored(t, p, stride)
#define DOT(c, a, b) _tile_dpbf16ps(c, a, b)

/* Steps along one block of K, and the K of the last (32 when there is no shorter one). */
static int64_t steps_per_block(const kw__lin *g) { return kw__lin_block_padded(g->kblk) / 32; }
static int tail_k(const kw__lin *g) { return g->kblk % 32 ? (int)(g->kblk % 32) : 32; }

/* Bytes from the start of part p's B tiles to x's block mb, step s of K block
 * kb; rows of a step are `width` rows of x × 2 bf16 (width · 4 bytes) apart.
 * Every block before the last has 16 rows of x; a part's tiles take
 * kw__lin_amx_part_bytes. */
static size_t packed_offset(const kw__lin *g, int p, int64_t mb, int64_t kb, int64_t s, int64_t width) {
    const int64_t steps = (g->K / g->kblk) * steps_per_block(g);
    return (size_t)p * kw__lin_amx_part_bytes(g) +
           (size_t)(mb * steps * 16 * 64 + (kb * steps_per_block(g) + s) * 16 * width * 4);
}

/* The tiles for this call's rows of x and step of K, on this thread. */
static void configure_tiles(const kw__lin *g) {
    const int64_t part = g->M % 16, tk = tail_k(g);
    if (kw__lin_amx_wide(g)) {
        kw__amx_load_full_tiles();
        return;
    }
    kw__amx_config cfg = {.palette = 1};
    kw__amx_set_tile(&cfg, T_C, 16, 64);
    kw__amx_set_tile(&cfg, T_A, 16, 64);
    kw__amx_set_tile(&cfg, T_B, 16, 64);
    kw__amx_set_tile(&cfg, T_A_TAIL, 16, (int)tk * 2);
    kw__amx_set_tile(&cfg, T_B_TAIL, (int)tk / 2, 64);
    if (part) {
        kw__amx_set_tile(&cfg, T_C_PART, 16, (int)part * 4);
        kw__amx_set_tile(&cfg, T_B_PART, 16, (int)part * 4);
        kw__amx_set_tile(&cfg, T_B_TAIL_PART, (int)tk / 2, (int)part * 4);
    }
    _tile_loadconfig(&cfg);
}

/* v's top 8 bits, the part of it a bf16 holds exactly: cut, not rounded, so
 * that a finite v near float's largest never rounds up to infinity (a rounded
 * part of 3.4e38 made every output of its row NaN where the f32 linear's are
 * finite). A NaN stays NaN (a cut could leave a NaN with a low payload inf). */
static inline kw_v top_part(kw_v v) {
    const kw_v cut = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xffff0000)));
    return _mm512_mask_mov_ps(cut, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}

/* What is left of v once its top part is taken: exact, so three parts hold
 * all 24 bits; zero after an infinite part (inf - inf would make the next
 * parts NaN where the f32 linear gives ±inf). */
static inline kw_v rest_after(kw_v v) {
    const kw_v rest = _mm512_sub_ps(v, top_part(v));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(rest, rest, _CMP_ORD_Q), rest);
}

/* The top parts of lo then hi as 32 bf16 (exact: kw__narrow_bf16 has nothing to round). */
static inline __m512i top_parts(kw_v lo, kw_v hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(kw__narrow_bf16(top_part(lo))), kw__narrow_bf16(top_part(hi)), 1);
}

/* Part p of x's row from xrow (element k0 of it) over one step of 32 along K,
 * as 16 K pairs: bf16 x as stored, f32 x split into top parts. */
static inline __m512i row_pairs(const kw__lin *g, const char *xrow, int p) {
    if (g->xt == KW_BF16) return _mm512_loadu_si512(xrow);
    kw_v lo = kw_v_loadu((const float *)xrow), hi = kw_v_loadu((const float *)xrow + 16);
    for (int q = 0; q < p; q++) lo = rest_after(lo), hi = rest_after(hi);
    return top_parts(lo, hi);
}

/* Block mb of x (16 rows, zeros past M), step s of K block kb: each part's 16
 * rows of pairs transposed in registers into the B tile's 16 rows of K pairs. */
static void lay_out_block(const kw__lin *g, char *work, int64_t mb, int64_t kb, int64_t s) {
    const size_t xsz = kw_dtype_size(g->xt);
    for (int p = 0; p < g->amx_parts; p++) {
        kw_v v[16];
        for (int64_t mi = 0; mi < 16; mi++) {
            const int64_t m = mb * 16 + mi;
            const char *xrow = g->x + (size_t)(m * g->xs + kb * g->kblk + s * 32) * xsz;
            v[mi] = m < g->M ? _mm512_castsi512_ps(row_pairs(g, xrow, p)) : kw_v_zero();
        }
        kw_v_transpose(v);
        char *tile = work + packed_offset(g, p, mb, kb, s, 16);
        for (int kp = 0; kp < 16; kp++) kw_v_storeu((float *)(tile + kp * 64), v[kp]);
    }
}

/* The three bf16 parts of an f32 x, as top_part and rest_after split a vector's. */
static inline void f32_parts(float x, uint16_t part[3]) {
    for (int p = 0; p < 3; p++) {
        uint32_t bits;
        memcpy(&bits, &x, sizeof bits);
        part[p] = isnan(x) ? kw__f32_to_bf16(x) : (uint16_t)(bits >> 16);
        x -= kw__bf16_to_f32(part[p]);
        if (isnan(x)) x = 0; /* as rest_after */
    }
}

/* The same for `width` rows of x, element by element: the last block of a
 * narrow call, and the short step that ends a block of K. */
static void lay_out_rows(const kw__lin *g, char *work, int64_t mb, int64_t width, int64_t kb, int64_t s) {
    const int64_t k0 = kb * g->kblk + s * 32, n = KW__MIN(32, g->kblk - s * 32);
    for (int64_t mi = 0; mi < width; mi++) {
        const int64_t m = mb * 16 + mi;
        uint16_t *step[3]; /* row m's first pair in this step's B tiles, per part */
        for (int p = 0; p < g->amx_parts; p++)
            step[p] = (uint16_t *)(work + packed_offset(g, p, mb, kb, s, width)) + mi * 2;
        for (int64_t kk = 0; kk < n; kk++) {
            const int64_t at = (kk / 2) * width * 2 + kk % 2;
            if (g->xt == KW_BF16) {
                step[0][at] = ((const uint16_t *)g->x)[m * g->xs + k0 + kk];
                continue;
            }
            uint16_t part[3];
            f32_parts(((const float *)g->x)[m * g->xs + k0 + kk], part);
            for (int p = 0; p < 3; p++) step[p][at] = part[p];
        }
    }
}

void kw__linear_acts_amx(const kw__lin *g, void *work) {
    configure_tiles(g);
    const int64_t steps = steps_per_block(g), wide = kw__lin_amx_wide(g);
    for (int64_t mb = 0; mb < (g->M + 15) / 16; mb++) {
        const int64_t width = wide ? 16 : KW__MIN(16, g->M - mb * 16);
        for (int64_t kb = 0; kb < g->K / g->kblk; kb++)
            for (int64_t s = 0; s < steps; s++)
                if (width == 16 && (s + 1) * 32 <= g->kblk)
                    lay_out_block(g, work, mb, kb, s);
                else
                    lay_out_rows(g, work, mb, width, kb, s);
    }
}

/* C[T_C or T_C_PART] = the sums for weight rows n.. n + 15 against block mb of x. */
static inline __attribute__((always_inline)) void group_block(const kw__lin *g, const char *packed, int64_t n,
                                                              int64_t mb, int part) {
    const int64_t width = part ? g->M % 16 : 16, steps = steps_per_block(g), nkb = g->K / g->kblk;
    const int64_t wstride = g->ws * 2, bstride = width * 4;
    const int tail = g->kblk % 32 != 0, parts = g->amx_parts;
    if (part) ZERO(T_C_PART);
    else ZERO(T_C);
    for (int64_t kb = 0; kb < nkb; kb++) {
        const char *w = kw__lin_wrow(g, kb, n);
        for (int64_t s = 0; s < steps; s++) {
            const int short_step = tail && s == steps - 1;
            if (short_step) LOAD(T_A_TAIL, w + s * 64, wstride);
            else LOAD(T_A, w + s * 64, wstride);
            for (int p = 0; p < parts; p++) {
                const char *b = packed + packed_offset(g, p, mb, kb, s, width);
                if (short_step && part) {
                    LOAD(T_B_TAIL_PART, b, bstride);
                    DOT(T_C_PART, T_A_TAIL, T_B_TAIL_PART);
                } else if (short_step) {
                    LOAD(T_B_TAIL, b, bstride);
                    DOT(T_C, T_A_TAIL, T_B_TAIL);
                } else if (part) {
                    LOAD(T_B_PART, b, bstride);
                    DOT(T_C_PART, T_A, T_B_PART);
                } else {
                    LOAD(T_B, b, bstride);
                    DOT(T_C, T_A, T_B);
                }
            }
        }
    }
}

/* Wide calls take K in chunks of steps: with bf16 x, 8 steps, so that the two
 * groups' A tiles for a chunk (2 × 16 weight rows × 256 bf16, 16 KiB) stay in L1
 * while every pair of blocks of x runs over them and only the B tiles come from
 * L2; with f32 x, whose three parts give each A tile three times the products,
 * 32 steps, so that the sums go to the thread's scratch and back a quarter as
 * often. Llama-3.2-1B's MLP at 128 rows (ops_bench --linear, 2-vCPU Xeon, two runs
 * each of 4, 8, 16 and 32 steps alternated): bf16 x 7.9-8.5 ms at 8 steps,
 * 7.9-8.5 at 4, 8.6-8.8 at 32, 8.9-9.2 at 16; f32 x 22.1-22.2 at 32 against
 * 26.0-26.2 at 8. */
static int64_t chunk_steps(const kw__lin *g) { return g->amx_parts == 1 ? 8 : 32; }

/* Wide: weight groups n (and n + 16 when `two`) against blocks mb (and mb + 1
 * when `pair`) of x over steps [s0, s1) of K block kb, adding to the four sums
 * in `tiles` (C00, C01, C10, C11; zeros when `first`). Each A and B tile loaded
 * serves two tile products. */
static inline __attribute__((always_inline)) void quad(const kw__lin *g, const char *packed, int64_t n, int64_t mb,
                                                       int64_t kb, int64_t s0, int64_t s1, float *tiles, int first,
                                                       const int two, const int pair) {
    const int64_t wstride = g->ws * 2;
    const size_t next_block = packed_offset(g, 0, 1, 0, 0, 16);
    const char *w0 = kw__lin_wrow(g, kb, n), *w1 = kw__lin_wrow(g, kb, n + 16);
    if (first) {
        ZERO(W_C00);
        if (pair) ZERO(W_C01);
        if (two) ZERO(W_C10);
        if (two && pair) ZERO(W_C11);
    } else {
        LOAD(W_C00, tiles, 64);
        if (pair) LOAD(W_C01, tiles + 256, 64);
        if (two) LOAD(W_C10, tiles + 512, 64);
        if (two && pair) LOAD(W_C11, tiles + 768, 64);
    }
    for (int64_t s = s0; s < s1; s++) {
        LOAD(W_A0, w0 + s * 64, wstride);
        if (two) LOAD(W_A1, w1 + s * 64, wstride);
        for (int p = 0; p < g->amx_parts; p++) {
            const char *b = packed + packed_offset(g, p, mb, kb, s, 16);
            LOAD(W_B0, b, 64);
            DOT(W_C00, W_A0, W_B0);
            if (two) DOT(W_C10, W_A1, W_B0);
            if (pair) {
                LOAD(W_B1, b + next_block, 64);
                DOT(W_C01, W_A0, W_B1);
                if (two) DOT(W_C11, W_A1, W_B1);
            }
        }
    }
    STORE(W_C00, tiles, 64);
    if (pair) STORE(W_C01, tiles + 256, 64);
    if (two) STORE(W_C10, tiles + 512, 64);
    if (two && pair) STORE(W_C11, tiles + 768, 64);
}

/* Weight rows n .. n + 15's biases, as kw__lin_bias gives them. */
static inline kw_v group_bias(const kw__lin *g, int64_t n) {
    if (!g->b) return kw_v_zero();
    if (g->bs == 1) return kw_v_round_to(kw_v_ld(g->b, n, g->bt), g->xt);
    float bias[16];
    for (int r = 0; r < 16; r++) bias[r] = kw__lin_bias(g, n + r);
    return kw_v_loadu(bias);
}

/* The sums of weight rows n .. n + 15 against 16 rows of x, biased, a row of x
 * each: from the transposed product's tile (weight row by row of x),
 * transposed in registers, or from the product by rows' (row of x by weight row). */
static inline void biased_rows(const kw__lin *g, const float *sums, int64_t n, int transposed, kw_v *v) {
    for (int r = 0; r < 16; r++) v[r] = kw_v_loadu(sums + r * 16);
    if (transposed) kw_v_transpose(v);
    const kw_v bias = group_bias(g, n);
    for (int r = 0; r < 16; r++) v[r] = kw_v_add(v[r], bias);
}

/* y for `rows` rows of x from m0 and weight rows n .. n + 15, from their sums;
 * with `next` (the sums of rows n + 16 .. n + 31), those too, as whole 64-byte
 * rows of bf16 y where both groups fall in one output. */
static void store_sums(const kw__lin *g, const float *sums, const float *next, int64_t n, int64_t m0, int64_t rows,
                       int transposed) {
    const int64_t width = next ? 32 : 16;
    int j = 0;
    int64_t s0, s1;
    char *y = NULL;
    while (!kw__lin_segment(g, j, n, n + width, &s0, &s1, &y)) j++;
    if (next && (s1 - s0 < 32 || g->yt != KW_BF16)) {
        store_sums(g, sums, NULL, n, m0, rows, transposed);
        store_sums(g, next, NULL, n + 16, m0, rows, transposed);
        return;
    }
    kw_v v[16], w[16];
    biased_rows(g, sums, n, transposed, v);
    if (next) {
        biased_rows(g, next, n + 16, transposed, w);
        for (int64_t mi = 0; mi < rows; mi++)
            _mm512_storeu_si512((uint16_t *)y + (m0 + mi) * g->out[j].ys, kw__narrow2_bf16(v[mi], w[mi]));
    } else {
        for (int64_t mi = 0; mi < rows; mi++) kw_v_st(y, (m0 + mi) * g->out[j].ys, g->yt, v[mi]);
    }
}

/* The transposed product's sums for block mb of x. */
static void store_block(const kw__lin *g, const float *sums, const float *next, int64_t n, int64_t mb) {
    store_sums(g, sums, next, n, mb * 16, KW__MIN(16, g->M - mb * 16), 1);
}

/* y for blocks mb and mb + 1 (when there is one) of weight rows n, n + 16 (when `two`). */
static void store_pair(const kw__lin *g, const float *sums, int64_t n, int64_t mb, int two) {
    const float *tiles = sums + mb / 2 * 1024;
    store_block(g, tiles, two ? tiles + 512 : NULL, n, mb);
    if (mb + 1 < (g->M + 15) / 16) store_block(g, tiles + 256, two ? tiles + 768 : NULL, n, mb + 1);
}

/* In the last chunk of K each pair of blocks' sums are stored after the next
 * pair's tile products are issued, so that the transposes run on the vector
 * units while the tile unit works: ViT-base's MLP at batch 8 took 3.4-3.5 ms a
 * call against 3.7 storing after every pair's products (2-vCPU Xeon). */
static void rows_wide(const kw__lin *g, int64_t n0, int64_t n1, const char *packed, float *sums) {
    const int64_t blocks = (g->M + 15) / 16, steps = steps_per_block(g), nkb = g->K / g->kblk;
    for (int64_t n = n0; n < n1; n += 32) {
        const int two = n + 16 < n1;
        for (int64_t kb = 0; kb < nkb; kb++)
            for (int64_t s0 = 0; s0 < steps; s0 += chunk_steps(g)) {
                const int64_t s1 = KW__MIN(steps, s0 + chunk_steps(g));
                const int first = kb == 0 && s0 == 0, last = kb == nkb - 1 && s1 == steps;
                for (int64_t mb = 0; mb < blocks; mb += 2) {
                    float *tiles = sums + mb / 2 * 1024;
                    if (mb + 1 < blocks && two) quad(g, packed, n, mb, kb, s0, s1, tiles, first, 1, 1);
                    else if (two) quad(g, packed, n, mb, kb, s0, s1, tiles, first, 1, 0);
                    else if (mb + 1 < blocks) quad(g, packed, n, mb, kb, s0, s1, tiles, first, 0, 1);
                    else quad(g, packed, n, mb, kb, s0, s1, tiles, first, 0, 0);
                    if (last && mb >= 2) store_pair(g, sums, n, mb - 2, two);
                }
            }
        store_pair(g, sums, n, (blocks - 1) / 2 * 2, two);
    }
}

void kw__linear_rows_amx(const kw__lin *g, int64_t n0, int64_t n1, void *work) {
    if (kw__lin_amx_wide(g)) {
        rows_wide(g, n0, n1, work, (float *)((char *)work + kw__lin_acts_bytes(g)));
        return;
    }
    const int64_t part = g->M % 16, full = g->M / 16;
    float sums[16][16];
    for (int64_t n = n0; n < n1; n += 16)
        for (int64_t mb = 0; mb <= full; mb++) {
            const int is_part = mb == full;
            if (is_part && !part) break;
            group_block(g, work, n, mb, is_part);
            if (is_part) STORE(T_C_PART, sums, 64);
            else STORE(T_C, sums, 64);
            store_block(g, &sums[0][0], NULL, n, mb);
        }
}

/* ---- The product by rows of x (kw__lin_amx_by_rows) ----
 * Y = X·Wᵀ: 16 rows of x × 32 of K are the A tile, read in place from bf16 x
 * whose blocks of K are whole steps, else laid out a block at a time (f32 x's
 * three parts, a block's K padded to whole steps, the rows past M zero); the
 * weight, 16 rows × a step of 32 as 16 rows of K pairs, is the B tile, laid
 * out once a call by each thread with work. Each tile of sums is a block of x's
 * rows by 16 weight rows, so it is stored as it is: no transpose of x or of y.
 * Two blocks of x against two groups of weight rows over the whole of K in
 * four C tiles, as the wide transposed tiles; the thread's weight (at most
 * KW__LIN_BY_ROWS_MAX_W) stays in its L2 while it works through its rows. */

/* Steps of 32 along the whole of K (each block padded to whole steps). */
static int64_t all_steps(const kw__lin *g) { return (g->K / g->kblk) * steps_per_block(g); }

/* The weight's B tiles: group n / 16, step t at packed + (n / 16 · all_steps + t) · 1 KiB. */
static void lay_out_weight(const kw__lin *g, char *packed) {
    const int64_t spb = steps_per_block(g);
    for (int64_t n = 0; n < g->n_total; n += 16)
        for (int64_t kb = 0; kb < g->K / g->kblk; kb++)
            for (int64_t s = 0; s < spb; s++) {
                const int64_t k = KW__MIN(32, g->kblk - s * 32); /* K of this step, even */
                const __mmask32 keep = (__mmask32)(k == 32 ? ~0u : (1u << k) - 1);
                kw_v v[16];
                for (int r = 0; r < 16; r++)
                    v[r] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(keep, kw__lin_wrow(g, kb, n + r) + s * 64));
                kw_v_transpose(v);
                char *tile = packed + (size_t)((n / 16 * all_steps(g) + kb * spb + s) * 1024);
                for (int kp = 0; kp < 16; kp++) kw_v_storeu((float *)(tile + kp * 64), v[kp]);
            }
}

/* Rows m0 .. m0 + 15 of x as A tiles: part p's step t at a[p] + t · 64, rows
 * *stride bytes apart; laid out into `into` (16 rows × all_steps × 64 bytes a
 * part) unless read in place. */
static void rows_of_x(const kw__lin *g, int64_t m0, char *into, const char *a[3], int64_t *stride) {
    const int64_t steps = all_steps(g), spb = steps_per_block(g);
    const size_t xsz = kw_dtype_size(g->xt);
    if (g->xt == KW_BF16 && g->kblk % 32 == 0 && m0 + 16 <= g->M) {
        a[0] = g->x + (size_t)(m0 * g->xs) * xsz;
        *stride = g->xs * 2;
        return;
    }
    *stride = steps * 64;
    char *dst[3];
    for (int p = 0; p < g->amx_parts; p++) a[p] = dst[p] = into + (size_t)p * 16 * steps * 64;
    for (int64_t mi = 0; mi < 16; mi++) {
        const int64_t m = m0 + mi;
        if (m >= g->M) {
            for (int p = 0; p < g->amx_parts; p++) memset(dst[p] + mi * *stride, 0, (size_t)*stride);
            continue;
        }
        const char *xrow = g->x + (size_t)(m * g->xs) * xsz;
        for (int64_t kb = 0; kb < g->K / g->kblk; kb++)
            for (int64_t s = 0; s < spb; s++) {
                const int64_t k0 = kb * g->kblk + s * 32, k = KW__MIN(32, g->kblk - s * 32);
                const size_t at = (size_t)(mi * *stride + (kb * spb + s) * 64);
                if (k == 32 && g->xt == KW_BF16) {
                    _mm512_storeu_si512(dst[0] + at, _mm512_loadu_si512(xrow + (size_t)k0 * 2));
                    continue;
                }
                if (k == 32) { /* the three parts in turn, as row_pairs splits them */
                    kw_v lo = kw_v_loadu((const float *)xrow + k0), hi = kw_v_loadu((const float *)xrow + k0 + 16);
                    for (int p = 0; p < 3; p++) {
                        _mm512_storeu_si512(dst[p] + at, top_parts(lo, hi));
                        lo = rest_after(lo), hi = rest_after(hi);
                    }
                    continue;
                }
                for (int64_t kk = 0; kk < 32; kk++) { /* the padding is zeros */
                    uint16_t part[3] = {0, 0, 0};
                    if (kk < k && g->xt == KW_BF16) part[0] = ((const uint16_t *)xrow)[k0 + kk];
                    else if (kk < k) f32_parts(((const float *)xrow)[k0 + kk], part);
                    for (int p = 0; p < g->amx_parts; p++) ((uint16_t *)(dst[p] + at))[kk] = part[p];
                }
            }
    }
}

/* Rows m0 .. m0 + 31 of x (those below M) by every weight row. */
static void by_rows_pair(const kw__lin *g, const char *packed, char *blocks, float *sums, int64_t m0) {
    const int64_t steps = all_steps(g), block_bytes = 16 * steps * 64 * g->amx_parts;
    const int pair = m0 + 16 < g->M;
    const char *a0[3], *a1[3];
    int64_t s0, s1;
    rows_of_x(g, m0, blocks, a0, &s0);
    if (pair) rows_of_x(g, m0 + 16, blocks + block_bytes, a1, &s1);
    for (int64_t n = 0; n < g->n_total; n += 32) {
        const int two = n + 16 < g->n_total;
        const char *b0 = packed + (size_t)(n / 16 * steps * 1024), *b1 = b0 + steps * 1024;
        ZERO(W_C00);
        if (two) ZERO(W_C01);
        if (pair) ZERO(W_C10);
        if (two && pair) ZERO(W_C11);
        for (int64_t t = 0; t < steps; t++) {
            LOAD(W_B0, b0 + t * 1024, 64);
            if (two) LOAD(W_B1, b1 + t * 1024, 64);
            for (int p = 0; p < g->amx_parts; p++) {
                LOAD(W_A0, a0[p] + t * 64, s0);
                DOT(W_C00, W_A0, W_B0);
                if (two) DOT(W_C01, W_A0, W_B1);
                if (pair) {
                    LOAD(W_A1, a1[p] + t * 64, s1);
                    DOT(W_C10, W_A1, W_B0);
                    if (two) DOT(W_C11, W_A1, W_B1);
                }
            }
        }
        STORE(W_C00, sums, 64);
        if (two) STORE(W_C01, sums + 256, 64);
        store_sums(g, sums, two ? sums + 256 : NULL, n, m0, KW__MIN(16, g->M - m0), 0);
        if (!pair) continue;
        STORE(W_C10, sums + 512, 64);
        if (two) STORE(W_C11, sums + 768, 64);
        store_sums(g, sums + 512, two ? sums + 768 : NULL, n, m0 + 16, KW__MIN(16, g->M - m0 - 16), 0);
    }
}

/* Pairs of blocks of x are claimed a few at a time from share word 0 (static
 * ranges without a share line), so that a thread on a slower core leaves the
 * last ones to the other. */
void kw__linear_by_rows_amx(const kw__lin *g, uint64_t *share, int ith, int nth, void *work) {
    const int64_t units = (g->M + 31) / 32, grab = KW__MAX(1, KW__MIN(4, units / (8 * nth)));
    char *packed = work, *blocks = packed + kw__lin_amx_packed_w_bytes(g);
    float *sums = (float *)(blocks + 2 * (size_t)g->amx_parts * 16 * all_steps(g) * 64);
    int64_t u0 = 0, u1 = 0;
    int laid_out = 0;
    if (!share) kw__split(units, 1, ith, nth, &u0, &u1);
    for (int first = 1;; first = 0) {
        if (share) {
            u0 = (int64_t)__atomic_fetch_add(share, (uint64_t)grab, __ATOMIC_RELAXED);
            u1 = KW__MIN(units, u0 + grab);
        } else if (!first) {
            break;
        }
        if (u0 >= u1) break;
        if (!laid_out) {
            kw__amx_load_full_tiles();
            lay_out_weight(g, packed);
            laid_out = 1;
        }
        for (int64_t u = u0; u < u1; u++) by_rows_pair(g, packed, blocks, sums, u * 32);
    }
    if (laid_out) _tile_release();
}

void kw__linear_done_amx(const kw__lin *g) { _tile_release(); }
