/* linear.h — private to the linear family (linear, linear_multi, matmul_dnnl): one
 * prepared y = x·Wᵀ (+ bias) call as a plain struct, filled once by linear.c and
 * run over a range of weight rows by the ISA variant prepare picked. */
#ifndef KW_LINEAR_H
#define KW_LINEAR_H

#include "kw_ops_impl.h"

#define KW__LIN_MAX_OUT 4

typedef struct kw__lin_out {
    char *y;
    int64_t ys; /* row stride in elements */
    int64_t n;  /* this output's weight rows (its last dim) */
} kw__lin_out;

typedef struct kw__lin kw__lin;

/* Per ISA: `acts` lays out the activations in the thread's scratch (`work`, at
 * least kw__lin_work_size bytes) once per call, then `rows` computes weight rows
 * [n0, n1) of every output row, as many times as the thread claims rows. */
KW__VARIANTS(void, kw__linear_acts, (const kw__lin *g, void *work))
KW__VARIANTS(void, kw__linear_rows, (const kw__lin *g, int64_t n0, int64_t n1, void *work))
/* On AMX, for bf16 weights from KW_AMX_MIN_M_BF16 / _F32 rows of x (ops/linear_amx.c). */
void kw__linear_acts_amx(const kw__lin *g, void *work);
void kw__linear_rows_amx(const kw__lin *g, int64_t n0, int64_t n1, void *work);
void kw__linear_done_amx(const kw__lin *g);
/* On AMX, many rows of x over a small weight (kw__lin_amx_by_rows): the whole
 * call on this thread's claims of rows of x. */
void kw__linear_by_rows_amx(const kw__lin *g, uint64_t *share, int ith, int nth, void *work);

struct kw__lin {
    const char *x; /* M rows of K, row stride xs */
    int64_t xs, M, K;
    kw_dtype xt;
    /* Weight row n, elements [kb·kblk, (kb + 1)·kblk), starts at w + kb·wbs + n·ws:
     * [N, K] is one block (kblk = K); K-blocked weights are [K / kblk, N, kblk]. */
    const char *w;
    int64_t ws, wbs, kblk, n_total;
    kw_dtype wt;
    kw_prefetch pf; /* the weight stream's software prefetch (kw_cpu_prefetch of M and wt) */
    const char *b; /* bias [n_total], NULL when absent */
    int64_t bs;
    kw_dtype bt;
    kw_dtype yt;
    int slots;  /* the call's output slots before x: 1, or KW__LIN_MAX_OUT (linear_multi) */
    int n_out;  /* weight rows are split over the outputs given, in order */
    kw__lin_out out[KW__LIN_MAX_OUT];
    int amx_parts; /* on the AMX kernel, the bf16 parts x is split into (1 for bf16 x, 3 for f32); else 0 */
    int panels;    /* AVX2, bf16 weights, from KW__PANELS_MIN_M rows of x: packed panels (below) */
    void (*acts)(const kw__lin *g, void *work);
    void (*rows)(const kw__lin *g, int64_t n0, int64_t n1, void *work);
    void (*done)(const kw__lin *g); /* after a thread's last rows of a call; NULL: nothing to do */
};

/* The linear family's kernel body on a prepared call: binds this replay's data
 * pointers, claims rows and runs the ISA's tiles on them. */
void kw__linear_run(const kw_call *c, const kw__lin *prepared, int ith, int nth);

/* Rows are handed out in chunks of about 64 KiB of weights (whole groups of 16).
 * Thread t owns a static range of chunks and works through it from the front;
 * the last quarter of each range is contested: once a thread's own chunks are
 * gone it takes other threads' contested ones from the back, so a thread on a
 * slower core (at 60 GB/s one vCPU here streamed 10-20 % slower than the other)
 * leaves its last chunks to the faster one. Range t's contested counts (taken
 * from the front in the low 32 bits, from the back in the high) are share word
 * t, zero when none is taken; only the contested chunks touch the shared line. */
#define KW__LIN_SHARE_MAX (KW_SHARE_BYTES / 8)

/* On AMX, from two blocks of 16 rows of x with K in whole steps of 32, two
 * groups of weight rows take their products together (see linear_amx.c): rows
 * of x are padded to whole blocks, and chunks hold at least the two groups. */
static inline int kw__lin_amx_wide(const kw__lin *g) { return g->amx_parts && g->M > 16 && g->kblk % 32 == 0; }

static inline int64_t kw__lin_chunk_rows(const kw__lin *g) {
    const int64_t row_bytes = g->K * (int64_t)kw_dtype_size(g->wt);
    return KW__MAX(kw__lin_amx_wide(g) ? 32 : 16, (65536 / KW__MAX(row_bytes, 1)) / 16 * 16);
}

/* The next rows [*n0, *n1) for thread ith; 0 when every chunk is taken. *own
 * (zero at the start of the call) counts the thread's uncontested chunks done.
 * Without a share line (or with more threads than it has words) a thread does
 * its own range alone. */
static inline int kw__lin_claim(const kw__lin *g, uint64_t *share, int64_t *own, int ith, int nth, int64_t *n0,
                                int64_t *n1) {
    const int64_t rows = kw__lin_chunk_rows(g), chunks = (g->n_total + rows - 1) / rows;
    const int steal = share && nth > 1 && nth <= KW__LIN_SHARE_MAX;
    int64_t chunk = -1;
    for (int k = 0; k < (steal ? nth : 1) && chunk < 0; k++) {
        const int t = (ith + k) % nth;
        int64_t c0, c1;
        kw__split(chunks, 1, t, nth, &c0, &c1);
        const int64_t contested = steal ? (c1 - c0 + 3) / 4 : 0, mine = c1 - c0 - contested;
        if (k == 0 && *own < mine) {
            chunk = c0 + (*own)++;
            break;
        }
        if (!contested) continue;
        uint64_t old = __atomic_load_n(&share[t], __ATOMIC_RELAXED);
        for (;;) {
            const int64_t front = (int64_t)(old & 0xffffffffu), back = (int64_t)(old >> 32);
            if (front + back >= contested) break;
            if (__atomic_compare_exchange_n(&share[t], &old, old + (k ? 1ull << 32 : 1u), 1, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED)) {
                chunk = k ? c1 - 1 - back : c0 + mine + front;
                break;
            }
        }
    }
    if (chunk < 0) return 0;
    *n0 = chunk * rows;
    *n1 = KW__MIN(*n0 + rows, g->n_total);
    return 1;
}

/* A block of K in the rearranged activations, padded to whole groups of the
 * widest vector's 32 bf16. */
static inline int64_t kw__lin_block_padded(int64_t kblk) { return (kblk + 31) / 32 * 32; }

/* One part of x in the AMX kernel's B tiles: M rows (whole blocks of 16 when
 * wide) × every step of 32 along K (each block of K padded to whole steps) × 2 bf16. */
static inline size_t kw__lin_amx_part_bytes(const kw__lin *g) {
    const int64_t rows = kw__lin_amx_wide(g) ? (g->M + 15) / 16 * 16 : g->M;
    return (size_t)(rows * (g->K / g->kblk) * kw__lin_block_padded(g->kblk)) * 2;
}

static inline size_t kw__lin_acts_bytes(const kw__lin *g) {
    if (g->amx_parts) return ((size_t)g->amx_parts * kw__lin_amx_part_bytes(g) + 63) / 64 * 64;
    const int64_t floats = g->wt == KW_BF16 ? g->M * (g->K / g->kblk) * kw__lin_block_padded(g->kblk) : 0;
    return ((size_t)floats * sizeof(float) + 63) / 64 * 64;
}

/* The wide AMX kernel's sums between chunks of K: four 16 × 16 f32 tiles per
 * pair of blocks of x, after the activations in the thread's scratch. */
static inline size_t kw__lin_amx_sums_bytes(const kw__lin *g) {
    return kw__lin_amx_wide(g) ? (size_t)((g->M + 31) / 32) * 4 * 1024 : 0;
}

/* On AMX, a call runs x in panels of rows, each laid out and multiplied by
 * every weight row before the next (kw__linear_run): a panel's B tiles (every
 * part) take about 512 KiB, a quarter of L2 (2 MiB a core on the Xeons with
 * AMX), so that each chunk of weight rows finds them there beside its own
 * weights and sums. With all of x laid out at once, x past L2 came from L3 for
 * every chunk: ViT-base's MLP at batch 8 (1576 rows, 768 by 3072, bf16) took
 * 5.9-6.4 ms a call, against 4.0 in panels of 512 KiB, 4.4 of 256 KiB and 4.5
 * of 1 MiB (12 layers' weights in turn, 2-vCPU Xeon). Whole pairs of blocks of
 * 16, for the wide tiles; two pairs where they take at most 1 MiB: each chunk
 * of weight rows, loaded from memory by the first pair, then serves a second
 * from L1, where a panel of one pair streams the whole weight once for every
 * 32 rows. Llama-3.2-1B's down projection (8192 → 2048, bf16) at 128 rows took
 * 2.33-2.53 ms in panels of 64 rows against 2.99-3.08 in panels of 32, and 9.9-10.3
 * against 11.9-13.0 at 512 rows; f32 x's gate and up (2048 → 16384, three parts)
 * 8.9-9.4 against 9.4-9.5 at 128 (ops_bench, 2-vCPU Xeon, alternated). */
static inline int64_t kw__lin_panel_rows(const kw__lin *g) {
    if (!g->amx_parts) return g->M;
    const int64_t block_bytes = (int64_t)g->amx_parts * 16 * (g->K / g->kblk) * kw__lin_block_padded(g->kblk) * 2;
    const int64_t two_pairs = block_bytes * 4 <= (1 << 20) ? 4 : 2;
    return KW__MAX(two_pairs, (512 << 10) / block_bytes / 2 * 2) * 16;
}

/* Where panel p of x starts (panel `panels` ends at M): M split into as few
 * panels as kw__lin_panel_rows allows, each boundary p · M / panels rounded up
 * to whole pairs of blocks, so that the panels are of about equal rows where
 * that rounding allows (128 rows in panels of at most 96: 64 and 64, not 96
 * and 32; SmolLM2-360M's down projection, 2560 → 960 bf16, took 297-312 µs
 * against 314-335) and the last holds what is left (65 rows in panels of at
 * most 64: 64 and 1). Rounded up, no panel holds more than kw__lin_panel_rows.
 * No rows, no panel. */
static inline int64_t kw__lin_panels(const kw__lin *g) {
    const int64_t most = kw__lin_panel_rows(g);
    return g->M > 0 ? (g->M + most - 1) / most : 0;
}

static inline int64_t kw__lin_panel_start(const kw__lin *g, int64_t p) {
    const int64_t panels = kw__lin_panels(g);
    return KW__MIN(g->M, ((p * g->M + panels - 1) / panels + 31) / 32 * 32);
}

/* The weight in the AMX kernel's B tiles, for the product by rows of x: every
 * group of 16 weight rows × every step of 32 along K (each block of K padded to
 * whole steps) × 16 rows of K pairs × 16 weight rows. */
static inline size_t kw__lin_amx_packed_w_bytes(const kw__lin *g) {
    return (size_t)(g->n_total * (g->K / g->kblk) * kw__lin_block_padded(g->kblk)) * 2;
}

/* Many rows of x over a small weight run untransposed on AMX, Y = X·Wᵀ with
 * rows of x as the A tiles and the weight, laid out once a call in each
 * thread's scratch, as the B tiles (linear_amx.c): threads split the rows of x,
 * and neither x nor the sums are transposed. The transposed product lays out
 * x once a call for all weight rows (a cost that N amortizes) and transposes
 * every 16 × 16 tile of sums (one for every K / 32 tile products), so it loses
 * most where K or N is small. bf16, 2 threads on a 2-vCPU Xeon, by rows
 * against transposed, two runs each: ConvNeXt-tiny's first stage at batch 8
 * (25088 rows) 96 → 384 1.35-1.44 ms against 2.66-3.20 and 384 → 96
 * 1.08-1.13 against 2.66-2.80; Whisper-tiny's MLP at batch 8 (12000 rows, 384
 * → 1536) 6.4-6.6 against 9.3-10.0; f32 x (three parts) 384 → 96 5.4 against
 * 15.3. Each thread lays out the whole weight (K·N), which the transposes it
 * saves (about M / 2 · (K + N) a thread) must repay: 1536 → 384 took 0.20
 * ms by rows against 0.16 transposed at 256 rows, 0.32-0.34 against
 * 0.31-0.41 at 512, 0.79-0.87 against 0.94 at 1568; 192 → 768 0.047-0.049
 * against 0.054 already at 256. So from M · (K + N) >= 2 · K · N. It lost
 * where both K and N are 768 (0.95 against 0.90 ms at 768 rows: a pair of
 * groups' B tiles over the whole of K no longer fit L1 beside the A tiles),
 * and with a weight past L2 (768 → 3072 at 392 rows: 2.0 against 1.0 ms). */
#define KW__LIN_BY_ROWS_MIN_M 128
#define KW__LIN_BY_ROWS_MAX_KN 384      /* the smaller of K and N */
#define KW__LIN_BY_ROWS_MAX_W (3 << 19) /* the weight's bytes, 1.5 MiB of a 2 MiB L2 */
static inline int kw__lin_amx_by_rows(const kw__lin *g) {
    return g->amx_parts && g->M >= KW__LIN_BY_ROWS_MIN_M && g->M * (g->K + g->n_total) >= 2 * g->K * g->n_total &&
           KW__MIN(g->K, g->n_total) <= KW__LIN_BY_ROWS_MAX_KN && kw__lin_amx_packed_w_bytes(g) <= KW__LIN_BY_ROWS_MAX_W;
}

/* Its scratch: the packed weight, two blocks of x laid out (every part, when
 * they cannot be read in place) and four tiles of sums. */
static inline size_t kw__lin_amx_by_rows_bytes(const kw__lin *g) {
    const size_t block = (size_t)(16 * (g->K / g->kblk) * kw__lin_block_padded(g->kblk)) * 2;
    return kw__lin_amx_packed_w_bytes(g) + 2 * (size_t)g->amx_parts * block + 4 * 1024 + 128;
}

/* AVX2 has no bf16 dot product, and its tiles of one weight row × up to 4 rows
 * of x (linear_simd.c) load an activation vector for every two FMAs. From
 * KW__PANELS_MIN_M rows of bf16 weights a thread instead packs 16 weight rows
 * of one block of K at a time into its scratch as K pairs × 16 rows (8 × 8
 * transposes of the pairs), and multiplies that panel by every tile of 6 rows
 * of x as outer products: two weight vectors per pair of K, each broadcast of x
 * feeding two FMAs, the sums of 16 rows in registers with no reduction at the
 * end. bf16 is the only way there: oneDNN makes no bf16 matmul below AVX-512.
 * Measured on a Zen 3 EPYC (ops_bench --linear: Llama-3.2-1B's gate, up and
 * down, bf16, 2 threads, the two builds alternating, three runs each), ms,
 * panels against tiles: 16 rows 13.1-13.9 / 17.5-21.2, 32 rows 23.9-25.0 /
 * 34.9-48.9, 64 rows 44.9-49.0 / 68.7-96.8, 128 rows 86.3-92.5 / 137-249
 * (about 140 GFLOP/s, where oneDNN's f32 matmul over f32 weights took 83-98).
 * Below 16 rows the weights stream from memory and packing them costs more
 * than it saves: at 2-5 rows panels took twice the tiles' time, at 8 even. */
#define KW__PANELS_MIN_M 16
#define KW__PANEL_ROWS 16
/* A panel holds this much of a block of K, 16 KiB, so that it stays in L1
 * while every tile of x reads it. */
#define KW__PANEL_K 512

static inline int kw__lin_takes_panels(kw_isa isa, kw_dtype wt, int64_t M) {
    return isa == KW_ISA_AVX2 && wt == KW_BF16 && M >= KW__PANELS_MIN_M;
}

/* A thread's packed panel: KW__PANEL_ROWS weight rows × KW__PANEL_K of a block. */
static inline size_t kw__lin_packed_panel_bytes(const kw__lin *g) {
    return g->panels ? (size_t)(KW__PANEL_ROWS * KW__MIN(kw__lin_block_padded(g->kblk), KW__PANEL_K)) * 2 : 0;
}

/* Packed panels sum into a block of up to KW__PANEL_SUM_ROWS weight rows ×
 * KW__PANEL_SUM_M rows of x at a time, whatever M and the chunk's rows (a
 * chunk of a short K has thousands): 64 KiB. */
#define KW__PANEL_SUM_ROWS 64
#define KW__PANEL_SUM_M 256

/* The partial sums: for packed panels, one block of them; for K-blocked
 * weights, M × the rows of a thread's chunk, summed over the blocks of K. */
static inline size_t kw__lin_partial_bytes(const kw__lin *g) {
    if (g->panels) return (size_t)(KW__PANEL_SUM_ROWS * KW__MIN(g->M, KW__PANEL_SUM_M)) * sizeof(float);
    return g->kblk < g->K ? (size_t)(g->M * kw__lin_chunk_rows(g)) * sizeof(float) : 0;
}

/* A thread's scratch: the activations laid out, the AMX kernel's sums, the
 * partial sums, a packed panel. */
static inline size_t kw__lin_work_size(const kw__lin *g) {
    if (kw__lin_amx_by_rows(g)) return kw__lin_amx_by_rows_bytes(g);
    kw__lin panel = *g;
    panel.M = KW__MIN(g->M, kw__lin_panel_rows(g));
    return kw__lin_acts_bytes(&panel) + kw__lin_amx_sums_bytes(&panel) + kw__lin_partial_bytes(&panel) +
           kw__lin_packed_panel_bytes(&panel) + 128;
}

static inline const char *kw__lin_wrow(const kw__lin *g, int64_t kb, int64_t n) {
    return g->w + (size_t)(kb * g->wbs + n * g->ws) * kw_dtype_size(g->wt);
}

/* The part of weight rows [n0, n1) that lands in output j: rows [*s0, *s1) and
 * the address of y[0, *s0 - start of output j]. Returns 0 when empty. */
static inline int kw__lin_segment(const kw__lin *g, int j, int64_t n0, int64_t n1, int64_t *s0, int64_t *s1,
                                  char **y) {
    int64_t start = 0;
    for (int i = 0; i < j; i++) start += g->out[i].n;
    *s0 = KW__MAX(n0, start);
    *s1 = KW__MIN(n1, start + g->out[j].n);
    *y = g->out[j].y + (*s0 - start) * (int64_t)kw_dtype_size(g->yt);
    return *s0 < *s1;
}

/* Bias for weight row n as f32 (0 when absent), first cast to x's dtype as
 * F.linear(x, w, bias.to(x.dtype)) does. */
static inline float kw__lin_bias(const kw__lin *g, int64_t n) {
    return g->b ? kw__round_to(kw__ldf(g->b, n * g->bs, g->bt), g->xt) : 0.0f;
}

/* Prepares *g (zeroed) from a call whose slots are (outputs..., x, weight, bias);
 * `slots` outputs start at slot 0. Returns 0 or KW_E* with a message naming the
 * bad slot. */
int kw__lin_prepare(const kw_call *c, const char *op, int slots, kw_isa isa, kw__lin *g, char *msg, size_t len);

static inline size_t kw__lin_work(const void *prep) { return kw__lin_work_size(prep); }

#endif
