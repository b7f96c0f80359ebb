/* attention.h — private to attention (attention of L query positions over a
 * static KV cache): a prepared call as a struct, filled once by attention.c and
 * run over a range of units of work by the ISA variant prepare picked. */
#ifndef KW_ATTENTION_H
#define KW_ATTENTION_H

#include "kw_ops_impl.h"

typedef struct kw__attn kw__attn;
typedef void (*kw__attn_fn)(const kw__attn *a, int64_t u0, int64_t u1, void *work);

/* Query rows per block: a block's scores and its P·V stay in registers on
 * AVX-512 (8 rows × 2 vectors) and on AVX2 (8 rows × 1); on AMX tiles, a tile's
 * 16 rows (attention_amx.c). */
#define KW__ATTN_ROWS 8
#define KW__ATTN_ROWS_AMX 16

/* A unit of work is, in a one-position step (kw__attention_heads), one query head
 * at one position, u = (b · L + i) · Hq + h; in a step of several positions
 * (kw__attention_blocks), a block of `rows` query rows of one cache head,
 * u = (b · Hkv + kh) · blocks + block, its rows r = i · G + g in order (position
 * i, head kh · G + g), so that a block holds neighbouring positions of all the
 * heads that read cache head kh. */
struct kw__attn {
    int64_t B, Hq, L, Hkv, G, S, D, Dv; /* G = Hq / Hkv query heads per cache head */
    int64_t blocks, units;              /* blocks 0: one unit per head */
    int64_t rows;                       /* query rows per block */
    int amx;                            /* blocks on AMX tiles (kw__attention_blocks_amx) */
    char *o;
    const char *q, *k, *v, *mask; /* mask NULL: every position is valid */
    int64_t os[3], qs[3];         /* strides of B, H and L */
    int64_t ks[3], vs[3];         /* strides of B, H and S */
    int64_t ms, mh, ml;           /* strides of the mask's B, H and L (0 when broadcast) */
    kw_dtype ot, qt, kt, vt, mt;
    float scale;
    kw__attn_fn run;
};

/* Positions padded to a multiple of 32: two AVX-512 vectors of scores. */
static inline int64_t kw__attn_pad(int64_t n) { return (n + 31) / 32 * 32; }

/* Scratch per thread: the valid positions (int32[S]) and, for blocks, the union
 * of the rows' valid positions as bits (uint32[S / 32]); the scores of a head or
 * a block's rows (f32[rows][S padded]), their queries widened (f32[rows][D]), a
 * head's output accumulators (f32[Dv]); for blocks, the cache head's keys
 * transposed (f32[D][S padded], in panels of positions: see pack_keys; on AMX
 * tiles bf16 pairs instead, in half of it). On AMX tiles also the block's
 * probabilities (bf16[rows][S padded]) and the cache head's values in pairs of
 * positions (bf16[S padded][Dv]); see attention_amx.c. */
typedef struct kw__attn_scratch {
    int32_t *pos;
    uint32_t *bits;
    float *scores, *qf, *acc, *kt;
    uint16_t *probs, *vpairs;
} kw__attn_scratch;

/* Offsets of the scratch's parts from a 64-byte aligned base; off[8] is the end. */
static inline void kw__attn_layout(const kw__attn *a, size_t off[9]) {
    const int64_t rows = a->blocks ? a->rows : 1, sp = kw__attn_pad(a->S);
    const int64_t n4[8] = {a->S, sp / 32, rows * sp, rows * a->D, a->Dv, a->blocks ? a->D * sp : 0,
                           a->amx ? rows * sp / 2 : 0, a->amx ? sp * a->Dv / 2 : 0};
    off[0] = 0;
    for (int i = 0; i < 8; i++) off[i + 1] = off[i] + ((size_t)n4[i] * 4 + 63) / 64 * 64;
}

static inline size_t kw__attn_work_size(const kw__attn *a) {
    size_t off[9];
    kw__attn_layout(a, off);
    return off[8] + 64;
}

static inline kw__attn_scratch kw__attn_carve(const kw__attn *a, void *work) {
    size_t off[9];
    kw__attn_layout(a, off);
    char *p = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    return (kw__attn_scratch){(int32_t *)(p + off[0]), (uint32_t *)(p + off[1]), (float *)(p + off[2]),
                              (float *)(p + off[3]), (float *)(p + off[4]), (float *)(p + off[5]),
                              (uint16_t *)(p + off[6]), (uint16_t *)(p + off[7])};
}

/* An additive mask value at or below bfloat16's finfo.min (so float32's min and
 * -inf too) gives exp() == 0 exactly: the position is excluded, never read. A
 * NaN is kept: its score is NaN, and so is the row's output, as in SDPA. */
#define KW__ATTN_MASKED (-3.38953139e38f)

static inline int kw__attn_keep(const kw__attn *a, const char *mrow, int64_t s) {
    if (a->mt == KW_BOOL) return ((const uint8_t *)mrow)[s] != 0;
    return !(kw__ldf(mrow, s, a->mt) <= KW__ATTN_MASKED);
}

static inline float kw__attn_bias(const kw__attn *a, const char *mrow, int64_t s) {
    return a->mask && a->mt != KW_BOOL ? kw__ldf(mrow, s, a->mt) : 0.0f;
}

/* Query head h at position i of batch b, whose mask row keeps no position:
 * written as SDPA on the CPU writes it (see attention.c). Scratch: the
 * scratch's scores (f32[S]) and acc (f32[Dv]). */
void kw__attn_unkept_row(const kw__attn *a, const kw__attn_scratch *w, int64_t b, int64_t i, int64_t h);

/* The mask row of query head h at position i of batch b. */
static inline const char *kw__attn_mask_row(const kw__attn *a, int64_t b, int64_t h, int64_t i) {
    return a->mask ? a->mask + (size_t)(b * a->ms + h * a->mh + i * a->ml) * kw_dtype_size(a->mt) : NULL;
}

/* Block u's batch, cache head and first row. */
static inline void kw__attn_block_of(const kw__attn *a, int64_t u, int64_t *b, int64_t *kh, int64_t *r0) {
    *b = u / (a->Hkv * a->blocks), *kh = u / a->blocks % a->Hkv, *r0 = u % a->blocks * a->rows;
}

KW__VARIANTS(void, kw__attention_heads, (const kw__attn *a, int64_t u0, int64_t u1, void *work))
KW__VARIANTS(void, kw__attention_blocks, (const kw__attn *a, int64_t u0, int64_t u1, void *work))

/* Blocks on AMX tiles: bf16 q, k and v, D a multiple of 32 and Dv of 16. */
static inline int kw__attn_amx_fits(const kw__attn *a) {
    return a->qt == KW_BF16 && a->kt == KW_BF16 && a->vt == KW_BF16 && a->D % 32 == 0 && a->Dv % 16 == 0;
}
void kw__attention_blocks_amx(const kw__attn *a, int64_t u0, int64_t u1, void *work);

#endif
