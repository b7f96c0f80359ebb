/* conv.h — private to depthwise_conv2d: a prepared call as a struct (conv.c
 * fills it once; the kernel binds each replay's data pointers), run over a
 * range of work items by the ISA variant prepare picked. An item is one output
 * row (n, oh) of one block of KW__CONV_CB channels; items are numbered by image,
 * then block, then row. A block reads 32 or 64 bytes of each pixel, so the
 * blocks' passes over an image read its input again: image by image it stays
 * in L2. ConvNeXt-tiny at batch 8 in bf16, its plan's profile: the first
 * stage's 7 × 7s 1.9-2.3 → 1.3-1.6 ms a call against blocks outermost, all 18
 * 13.5 → 11.1 ms. */
#ifndef KW_CONV_H
#define KW_CONV_H

#include "kw_ops_impl.h"

/* Channels an item covers: one AVX-512 vector, two AVX2 ones. */
#define KW__CONV_CB 16
/* Output columns the vector kernel keeps in registers at once. A row's last
 * block runs whole, over zeros past the input, its extra sums never stored:
 * rows of 7 and 14 columns (ConvNeXt's last stages) would otherwise go one
 * column at a time, each tap waiting on the one before. */
#define KW__CONV_COLS 8

typedef struct kw__conv kw__conv;

struct kw__conv {
    int64_t N, C, H, W, OH, OW, KH, KW;
    int64_t sh, sw, ph, pw, dh, dw; /* stride, padding, dilation */
    int64_t xs[3], ys[3];           /* element strides of N, H, W (C's is 1) */
    int64_t wsc, wsh, wsw;          /* the weight's strides of C, KH, KW */
    int64_t bs;                     /* the bias's stride */
    int64_t OWr;                    /* OW rounded up to whole blocks of KW__CONV_COLS */
    int64_t Wp;                     /* a padded input row: (OWr - 1)·sw + (KW - 1)·dw + 1 columns */
    char *y;
    const char *x, *w, *b;
    kw_dtype yt, xt, wt, bt;
    void (*run)(const kw__conv *p, void *work, int64_t i0, int64_t i1);
};

static inline int64_t kw__conv_blocks(const kw__conv *p) { return (p->C + KW__CONV_CB - 1) / KW__CONV_CB; }

static inline int64_t kw__conv_items(const kw__conv *p) { return kw__conv_blocks(p) * p->N * p->OH; }

/* Item i as its image, channel block and output row. */
static inline void kw__conv_item(const kw__conv *p, int64_t i, int64_t *cb, int64_t *n, int64_t *oh) {
    const int64_t blocks = kw__conv_blocks(p);
    *oh = i % p->OH;
    *cb = i / p->OH % blocks;
    *n = i / (p->OH * blocks);
}

/* The taps' weights and the bias of channel block cb as f32, [KH·KW + 1][KW__CONV_CB]
 * (the bias last, 0 where there is none; lanes past C are 0): read once per
 * block from the weight in any layout and dtype. */
void kw__conv_gather_weights(const kw__conv *p, int64_t cb, float *wt);

/* The padded input rows the vector kernel keeps: the span of one output row's taps. */
static inline int64_t kw__conv_ring_rows(const kw__conv *p) { return p->dh * (p->KH - 1) + 1; }

/* Per-thread scratch: every channel block's gathered weights (each gathered at
 * the first item of the call that needs it), a ring of padded input rows, one
 * row of sums (OWr columns), each KW__CONV_CB floats a column; then the input
 * row each ring slot holds, and which blocks' weights are gathered. */
static inline size_t kw__conv_work_size(const kw__conv *p) {
    const int64_t R = kw__conv_ring_rows(p), blocks = kw__conv_blocks(p);
    return (size_t)(blocks * (p->KH * p->KW + 1) + R * p->Wp + p->OWr) * KW__CONV_CB * sizeof(float) +
           (size_t)R * sizeof(int64_t) + (size_t)blocks;
}

KW__VARIANTS(void, kw__depthwise_conv2d_rows, (const kw__conv *p, void *work, int64_t i0, int64_t i1))

#endif
