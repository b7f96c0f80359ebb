/* attention's blocks of query rows on AMX tiles: steps of several positions
 * (a prefill chunk, a verify step) with bf16 q, k and v (kw__attn_amx_fits).
 * The FMA kernel (attention_simd.c) spends two flops of f32 work per product;
 * one tile product (TDPBF16PS) takes 16 query rows × 32 of D against 16
 * positions, so a block here is 16 rows. Same arithmetic as the FMA kernel,
 * up to the order of each dot's sum: scores dot(q, k) in f32, times scale plus
 * the mask's bias; the softmax (attention_simd.h) in f32, its probabilities
 * rounded to bf16 before they multiply V, 1 / Σ p applied to the f32 sums, the
 * output rounded once. The tile unit treats bf16 denormals as zero.
 *
 * Per thread and cache head, the keys of the valid positions are laid out as
 * the B tiles of Q·Kᵀ (`kt`: per panel of 16 positions, D / 2 rows of the
 * positions' pairs of D, by 16 × 16 register transposes of 32-bit words), and
 * the values as the B tiles of P·V (`vpairs`: per step of 32 positions and 16
 * of Dv, 16 rows of pairs of positions). Per block: the scores panel by panel
 * into the f32 scores (which hold the mask's bias), the softmax row by row,
 * the probabilities as bf16 (the A tiles of P·V), then Dv in groups of four
 * tiles of sums. A thread loads the tile configuration on entry and releases
 * the tiles on exit, so its tile state is never live between kernels. */
#include "amx.h"
#include "attention_simd.h"

#define T_Q 4      /* Q·Kᵀ: 16 rows × 32 of D; the sums are tiles 0-3 (16 positions each), K's panels 5-7 */
#define T_P 4      /* P·V: 16 rows × 32 positions; the sums are tiles 0-3 (16 of Dv each) */
#define T_V 5      /* 16 pairs of positions × 16 of Dv */
#define ROWS KW__ATTN_ROWS_AMX

/* kt[((j / 16) · D / 2 + d / 2) · 16 + j % 16] = the pair (k[pos[j]][d], k[pos[j]][d + 1])
 * for even d, as one 32-bit word; zero for j in [n, np). */
static void pack_keys(const kw__attn *a, const char *k, const int32_t *pos, int64_t n, int64_t np, uint32_t *kt) {
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < np; j0 += 16) {
        const uint16_t *row[16];
        for (int t = 0; t < 16; t++)
            row[t] = j0 + t < n ? (const uint16_t *)k + pos[j0 + t] * a->ks[2] : NULL;
        for (int64_t d0 = 0; d0 < a->D; d0 += 32) {
            kw_v r[16]; /* 16 positions' 32 of D as 16 words, transposed to 16 pairs' 16 positions */
            for (int t = 0; t < 16; t++) r[t] = row[t] ? _mm512_loadu_ps(row[t] + d0) : zero;
            kw_v_transpose(r);
            uint32_t *panel = kt + (j0 / 16 * (a->D / 2) + d0 / 2) * 16;
            for (int p = 0; p < 16; p++) _mm512_storeu_ps(panel + p * 16, r[p]);
        }
    }
}

/* vpairs[((j / 32) · Dv / 16 + c) · 512 + (j % 32 / 2) · 32 + e · 2 + j % 2] = v[pos[j]][16 c + e];
 * zero for j in [n, np). */
static void pack_values(const kw__attn *a, const char *v, const int32_t *pos, int64_t n, int64_t np,
                        uint16_t *vpairs) {
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const int64_t chunks = a->Dv / 16;
    for (int64_t j = 0; j < np; j += 2) {
        const uint16_t *even = j < n ? (const uint16_t *)v + pos[j] * a->vs[2] : NULL;
        const uint16_t *odd = j + 1 < n ? (const uint16_t *)v + pos[j + 1] * a->vs[2] : NULL;
        uint16_t *dst = vpairs + j / 32 * chunks * 512 + j % 32 / 2 * 32;
        for (int64_t c = 0; c < chunks; c++) {
            const __m256i e = even ? _mm256_loadu_si256((const __m256i *)(even + c * 16)) : _mm256_setzero_si256();
            const __m256i o = odd ? _mm256_loadu_si256((const __m256i *)(odd + c * 16)) : _mm256_setzero_si256();
            _mm512_storeu_si512(dst + c * 512, _mm512_permutex2var_epi16(_mm512_castsi256_si512(e), interleave,
                                                                          _mm512_castsi256_si512(o)));
        }
    }
}

/* Tiles 0 .. C - 1, the sums of scores_group's and pv_group's C products at
 * once (C a constant at each call site: tile numbers are immediates), zeroed,
 * and stored 16 × 16 floats each. */
static inline __attribute__((always_inline)) void zero_sums(const int C) {
    if (C > 0) _tile_zero(0);
    if (C > 1) _tile_zero(1);
    if (C > 2) _tile_zero(2);
    if (C > 3) _tile_zero(3);
}

static inline __attribute__((always_inline)) void store_sums(float sums[4][16 * 16], const int C) {
    if (C > 0) _tile_stored(0, sums[0], 64);
    if (C > 1) _tile_stored(1, sums[1], 64);
    if (C > 2) _tile_stored(2, sums[2], 64);
    if (C > 3) _tile_stored(3, sums[3], 64);
}

/* scores[t · np + j] = dot(q_t, k[pos[j]]) · scale + scores[t · np + j] (the
 * mask's bias) for rows t < rows and the C panels of 16 positions from j (C a
 * constant at each call site: tile numbers are immediates), each panel into a
 * tile of sums of its own, so that no product waits on the one before (one
 * tile for every panel chained them: 17 % of Whisper-tiny's attention over
 * 1500 positions waited there, perf). */
static inline __attribute__((always_inline)) void scores_group(const kw__attn *a, const uint16_t *q,
                                                               const uint32_t *kt, int64_t np, int64_t j,
                                                               int64_t rows, float *scores, const int C) {
    const int64_t half_d = a->D / 2;
    const uint32_t *panels = kt + j / 16 * half_d * 16;
    zero_sums(C);
    for (int64_t d0 = 0; d0 < a->D; d0 += 32) {
        _tile_loadd(T_Q, q + d0, a->D * 2);
#define KW__QK_PANEL(c, tk)                                                \
    if (C > c) {                                                           \
        _tile_loadd(tk, panels + ((c) * half_d + d0 / 2) * 16, 64);         \
        _tile_dpbf16ps(c, T_Q, tk);                                        \
    }
        KW__QK_PANEL(0, 5)
        KW__QK_PANEL(1, 6)
        KW__QK_PANEL(2, 7)
        KW__QK_PANEL(3, 5)
#undef KW__QK_PANEL
    }
    float sums[4][16 * 16] __attribute__((aligned(64)));
    store_sums(sums, C);
    const kw_v scale = kw_v_set1(a->scale);
    for (int64_t t = 0; t < rows; t++)
        for (int c = 0; c < C; c++) {
            float *s = scores + t * np + j + c * 16;
            kw_v_storeu(s, kw_v_fmadd(kw_v_loadu(sums[c] + t * 16), scale, kw_v_loadu(s)));
        }
}

/* scores_group over positions [j0, j1), four panels at a time. */
static void scores_block(const kw__attn *a, const uint16_t *q, const uint32_t *kt, int64_t np, int64_t j0,
                         int64_t j1, int64_t rows, float *scores) {
    for (int64_t j = j0; j < j1; j += 64) {
        switch (KW__MIN(4, (j1 - j) / 16)) {
        case 1: scores_group(a, q, kt, np, j, rows, scores, 1); break;
        case 2: scores_group(a, q, kt, np, j, rows, scores, 2); break;
        case 3: scores_group(a, q, kt, np, j, rows, scores, 3); break;
        default: scores_group(a, q, kt, np, j, rows, scores, 4); break;
        }
    }
}

/* Sums of P·V for chunks c0 .. c0 + C - 1 of 16 of Dv (C a constant at each
 * call site: tile numbers are immediates) over positions [j0, j1), then out row
 * t = inv[t] · sums, for rows t < rows. */
static inline __attribute__((always_inline)) void pv_group(const kw__attn *a, const uint16_t *probs,
                                                           const uint16_t *vpairs, int64_t np, int64_t j0, int64_t j1,
                                                           int64_t c0, const float *inv, int64_t rows,
                                                           const int64_t *oo, const int C) {
    const int64_t chunks = a->Dv / 16;
    zero_sums(C);
    for (int64_t j = j0; j < j1; j += 32) {
        _tile_loadd(T_P, probs + j, np * 2);
        const uint16_t *step = vpairs + (j / 32 * chunks + c0) * 512;
#define KW__PV_CHUNK(c)                        \
    if (C > c) {                               \
        _tile_loadd(T_V, step + (c) * 512, 64); \
        _tile_dpbf16ps(c, T_P, T_V);           \
    }
        KW__PV_CHUNK(0)
        KW__PV_CHUNK(1)
        KW__PV_CHUNK(2)
        KW__PV_CHUNK(3)
#undef KW__PV_CHUNK
    }
    float sums[4][16 * 16] __attribute__((aligned(64)));
    store_sums(sums, C);
    for (int64_t t = 0; t < rows; t++)
        for (int c = 0; c < C; c++)
            kw_v_st(a->o, oo[t] + (c0 + c) * 16, a->ot, kw_v_mul(kw_v_loadu(sums[c] + t * 16), kw_v_set1(inv[t])));
}

/* The block of rows r0 .. r0 + ROWS - 1 of cache head kh of batch b, over the n
 * positions in w->pos whose keys and values w->kt and w->vpairs hold. Only the
 * span of positions some row keeps is computed, in steps of 32. */
static void block(const kw__attn *a, const kw__attn_scratch *w, int64_t b, int64_t kh, int64_t r0, int64_t n) {
    const int64_t np = kw__attn_pad(n), rows = KW__MIN(ROWS, a->L * a->G - r0);
    uint16_t *q = (uint16_t *)w->qf; /* the block's queries as stored: the A tiles of Q·Kᵀ */
    int64_t oo[ROWS], lo = n, hi = 0;
    int keeps[ROWS] = {0};
    float inv[ROWS];
    for (int64_t t = 0; t < ROWS; t++) { /* zeros past the block's rows */
        int64_t i, h;
        block_row(a, kh, r0 + t, &i, &h);
        if (t < rows)
            memcpy(q + t * a->D, (const uint16_t *)a->q + b * a->qs[0] + h * a->qs[1] + i * a->qs[2], (size_t)a->D * 2);
        else
            memset(q + t * a->D, 0, (size_t)a->D * 2);
    }
    block_biases(a, w, b, kh, r0, rows, n, np, oo, keeps, &lo, &hi);
    const int64_t j0 = lo / 32 * 32, j1 = KW__MIN(np, kw__attn_pad(hi));
    if (j0 < j1) {
        scores_block(a, q, (const uint32_t *)w->kt, np, j0, j1, rows, w->scores);
        for (int64_t t = 0; t < ROWS; t++) {
            uint16_t *p = w->probs + t * np;
            if (t >= rows) {
                memset(p + j0, 0, (size_t)(j1 - j0) * 2);
                continue;
            }
            float *s = w->scores + t * np;
            const float sum = softmax_unnormalised(s + j0, j1 - j0, a->vt);
            inv[t] = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int64_t j = j0; j < j1; j += 16) /* bf16 values already: exact */
                _mm256_storeu_si256((__m256i *)(p + j), kw__narrow_bf16(kw_v_loadu(s + j)));
        }
        const int64_t chunks = a->Dv / 16;
        for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
            switch (KW__MIN(4, chunks - c0)) {
            case 1: pv_group(a, w->probs, w->vpairs, np, j0, j1, c0, inv, rows, oo, 1); break;
            case 2: pv_group(a, w->probs, w->vpairs, np, j0, j1, c0, inv, rows, oo, 2); break;
            case 3: pv_group(a, w->probs, w->vpairs, np, j0, j1, c0, inv, rows, oo, 3); break;
            default: pv_group(a, w->probs, w->vpairs, np, j0, j1, c0, inv, rows, oo, 4); break;
            }
        }
    }
    block_unkept(a, w, b, kh, r0, rows, keeps);
}

void kw__attention_blocks_amx(const kw__attn *a, int64_t u0, int64_t u1, void *work) {
    const kw__attn_scratch w = kw__attn_carve(a, work);
    int64_t cur_b = -1, cur_kh = -1, n = 0;
    kw__amx_load_full_tiles();
    for (int64_t u = u0; u < u1; u++) {
        int64_t b, kh, r0;
        kw__attn_block_of(a, u, &b, &kh, &r0);
        if (b != cur_b) n = scan_union(a, b, &w), cur_b = b, cur_kh = -1;
        if (kh != cur_kh) {
            const int64_t np = kw__attn_pad(n);
            pack_keys(a, (const char *)((const uint16_t *)a->k + b * a->ks[0] + kh * a->ks[1]), w.pos, n, np,
                      (uint32_t *)w.kt);
            pack_values(a, (const char *)((const uint16_t *)a->v + b * a->vs[0] + kh * a->vs[1]), w.pos, n, np,
                        w.vpairs);
            cur_kh = kh;
        }
        block(a, &w, b, kh, r0, n);
    }
    _tile_release();
}
