/* depthwise_conv2d: y = conv2d(x, w, b, stride, padding, dilation, groups = C)
 * for x and y in channels-last memory (each pixel's C channels contiguous), as
 * ConvNeXt's 7 × 7 depthwise convolutions run, its residual stream being
 * channels-last after its blocks' permutes. ATen hands these to oneDNN as
 * fallback steps, each wrapped and its result copied into the plan's memory,
 * about 0.2 ms a step over ConvNeXt-tiny's small maps; here the C
 * channels of a pixel are the vector lanes, and each tap is one multiply-add
 * per pixel. Sums are f32 (the weights and bias read as f32, whatever their
 * dtype), each rounded once into y's dtype, as oneDNN's bf16 convolution does;
 * the taps are summed in (kh, kw) order after the bias. */
#include "conv.h"

/* Bounds that keep the geometry's arithmetic far from overflow, and the
 * scratch (kw__conv_work_size) within reason: beyond them the convolution is
 * ATen's. */
#define KW__CONV_MAX_IP 65536
#define KW__CONV_MAX_WORK (64 << 20)

static int channels_last(const kw_tensor *t) { return t->shape[1] == 1 || t->stride[1] == 1; }

static int conv_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *x = &c->t[1], *w = &c->t[2], *b = &c->t[3];
    kw__conv *p = prep;
    if (!kw__present(x) || !kw__is_float(x->dtype) || x->ndim != 4 || !channels_last(x))
        return kw__fail(msg, len, KW_ESHAPE,
                        "depthwise_conv2d: x must be float32 or bfloat16 [N, C, H, W] in channels-last memory "
                        "(C's stride 1; got %s, C's stride %lld)",
                        kw__shape(x).s, x->ndim == 4 ? (long long)x->stride[1] : 0LL);
    p->N = x->shape[0], p->C = x->shape[1], p->H = x->shape[2], p->W = x->shape[3];
    if (!kw__present(w) || !kw__is_float(w->dtype) || w->ndim != 4 || w->shape[0] != p->C || w->shape[1] != 1 ||
        w->shape[2] < 1 || w->shape[3] < 1)
        return kw__fail(msg, len, KW_ESHAPE, "depthwise_conv2d: w must be float32 or bfloat16 [C = %lld, 1, KH, KW] (got %s)",
                        (long long)p->C, kw__shape(w).s);
    p->KH = w->shape[2], p->KW = w->shape[3];
    if (kw__present(b) && (!kw__is_float(b->dtype) || b->ndim != 1 || b->shape[0] != p->C))
        return kw__fail(msg, len, KW_ESHAPE, "depthwise_conv2d: b must be absent or float32 or bfloat16 [%lld] (got %s)",
                        (long long)p->C, kw__shape(b).s);
    for (int i = 0; i < 6; i++)
        if (c->ip[i] < (i == 2 || i == 3 ? 0 : 1) || c->ip[i] > KW__CONV_MAX_IP)
            return kw__fail(msg, len, KW_EINVAL,
                            "depthwise_conv2d: ip (stride h, w, padding h, w, dilation h, w) must have strides and "
                            "dilations in [1, 65536] and paddings in [0, 65536] (got %lld, %lld, %lld, %lld, %lld, %lld)",
                            (long long)c->ip[0], (long long)c->ip[1], (long long)c->ip[2], (long long)c->ip[3],
                            (long long)c->ip[4], (long long)c->ip[5]);
    p->sh = c->ip[0], p->sw = c->ip[1], p->ph = c->ip[2], p->pw = c->ip[3], p->dh = c->ip[4], p->dw = c->ip[5];
    const int64_t span_h = p->dh * (p->KH - 1) + 1, span_w = p->dw * (p->KW - 1) + 1;
    if (p->H + 2 * p->ph < span_h || p->W + 2 * p->pw < span_w)
        return kw__fail(msg, len, KW_ESHAPE, "depthwise_conv2d: the padded input %lld × %lld is smaller than the kernel's span %lld × %lld",
                        (long long)(p->H + 2 * p->ph), (long long)(p->W + 2 * p->pw), (long long)span_h, (long long)span_w);
    p->OH = (p->H + 2 * p->ph - span_h) / p->sh + 1;
    p->OW = (p->W + 2 * p->pw - span_w) / p->sw + 1;
    const int64_t want[4] = {p->N, p->C, p->OH, p->OW};
    int shape_ok = kw__present(y) && y->ndim == 4 && y->dtype == x->dtype && channels_last(y);
    for (int d = 0; shape_ok && d < 4; d++) shape_ok = y->shape[d] == want[d];
    if (!shape_ok)
        return kw__fail(msg, len, KW_ESHAPE,
                        "depthwise_conv2d: y must be %s [%lld, %lld, %lld, %lld] in channels-last memory (got %s)",
                        kw_dtype_name(x->dtype), (long long)p->N, (long long)p->C, (long long)p->OH, (long long)p->OW,
                        kw__shape(y).s);
    for (int d = 0; d < 3; d++) p->xs[d] = x->stride[d ? d + 1 : 0], p->ys[d] = y->stride[d ? d + 1 : 0];
    p->wsc = w->stride[0], p->wsh = w->stride[2], p->wsw = w->stride[3];
    p->bs = kw__present(b) ? b->stride[0] : 0;
    p->OWr = (p->OW + KW__CONV_COLS - 1) / KW__CONV_COLS * KW__CONV_COLS;
    p->Wp = (p->OWr - 1) * p->sw + span_w;
    p->yt = y->dtype, p->xt = x->dtype, p->wt = w->dtype, p->bt = kw__present(b) ? b->dtype : KW_F32;
    if (kw__conv_work_size(p) > KW__CONV_MAX_WORK)
        return kw__fail(msg, len, KW_ESHAPE,
                        "depthwise_conv2d: %lld channels over rows of %lld padded columns need %zu bytes of scratch a "
                        "thread, more than %d",
                        (long long)p->C, (long long)p->Wp, kw__conv_work_size(p), KW__CONV_MAX_WORK);
    p->run = KW__PICK(kw__depthwise_conv2d_rows, isa);
    return 0;
}

void kw__conv_gather_weights(const kw__conv *p, int64_t cb, float *wt) {
    const int64_t taps = p->KH * p->KW;
    for (int64_t j = 0; j < KW__CONV_CB; j++) {
        const int64_t ch = cb * KW__CONV_CB + j;
        float *tap = wt + j;
        for (int64_t kh = 0; kh < p->KH; kh++)
            for (int64_t kw = 0; kw < p->KW; kw++, tap += KW__CONV_CB)
                *tap = ch < p->C ? kw__ldf(p->w, ch * p->wsc + kh * p->wsh + kw * p->wsw, p->wt) : 0.0f;
        wt[taps * KW__CONV_CB + j] = ch < p->C && p->b ? kw__ldf(p->b, ch * p->bs, p->bt) : 0.0f;
    }
}

/* The reference: each output element's sum over the taps inside the input. */
void kw__depthwise_conv2d_rows_scalar(const kw__conv *p, void *work, int64_t i0, int64_t i1) {
    (void)work;
    for (int64_t i = i0; i < i1; i++) {
        int64_t cb, n, oh;
        kw__conv_item(p, i, &cb, &n, &oh);
        const int64_t c1 = KW__MIN(p->C, (cb + 1) * KW__CONV_CB);
        for (int64_t ch = cb * KW__CONV_CB; ch < c1; ch++)
            for (int64_t ow = 0; ow < p->OW; ow++) {
                float acc = p->b ? kw__ldf(p->b, ch * p->bs, p->bt) : 0.0f;
                for (int64_t kh = 0; kh < p->KH; kh++) {
                    const int64_t ih = oh * p->sh - p->ph + kh * p->dh;
                    if (ih < 0 || ih >= p->H) continue;
                    for (int64_t kw = 0; kw < p->KW; kw++) {
                        const int64_t iw = ow * p->sw - p->pw + kw * p->dw;
                        if (iw < 0 || iw >= p->W) continue;
                        acc += kw__ldf(p->x, n * p->xs[0] + ih * p->xs[1] + iw * p->xs[2] + ch, p->xt) *
                               kw__ldf(p->w, ch * p->wsc + kh * p->wsh + kw * p->wsw, p->wt);
                    }
                }
                kw__stf(p->y, n * p->ys[0] + oh * p->ys[1] + ow * p->ys[2] + ch, p->yt, acc);
            }
    }
}

static void conv_kernel(const kw_call *c, int ith, int nth) {
    kw__conv p = *(const kw__conv *)c->prep;
    int64_t i0, i1;
    p.y = c->t[0].data, p.x = c->t[1].data, p.w = c->t[2].data, p.b = c->t[3].data;
    kw__split(kw__conv_items(&p), 1, ith, nth, &i0, &i1);
    if (i0 < i1) p.run(&p, kw__work(c, ith), i0, i1);
}

static size_t conv_work(const void *prep) { return kw__conv_work_size(prep); }

/* Slots y [N, C, OH, OW], x [N, C, H, W] (both channels-last), w [C, 1, KH, KW],
 * b [C] (optional); ip stride h, w, padding h, w, dilation h, w. */
const kw_op_info kw_op_info_depthwise_conv2d = {
    .name = "depthwise_conv2d",
    .n_tensors = 4,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}, {"w", KW_READ, 0}, {"b", KW_READ, 1}},
    .n_ip = 6,
    .prepare = conv_prepare,
    .prep_size = sizeof(kw__conv),
    .work_size = conv_work,
    .kernel = conv_kernel,
};
