/* Counting over the few values of a mixture of experts' routing: how many
 * token-expert pairs each expert has (histc) and where each expert's rows end
 * (cumsum). Scalar kernels: the tensors hold a few values per token.
 *
 * histc:  y[b] = how many x fall in bin b of `bins` equal bins over [min, max]
 *         (fp[0], fp[1], min < max) — torch.histc on float32: bin
 *         (int)((x - min) * bins / (max - min)) in float32 arithmetic, as
 *         PyTorch computes it, x == max in the last bin, x outside [min, max]
 *         (or NaN) in none. One thread counts.
 * cumsum: y[..., i] = x[..., 0] + ... + x[..., i] along the last dim, x of y's
 *         dtype (int32, int64 or float32; x may be y itself): integers summed in
 *         int64 and stored wrapping, float32 in double, as PyTorch's CPU kernel
 *         does. Threads split the rows. */
#include <math.h>

#include "kw_ops_impl.h"

/* ---- histc: slots y [bins] (float32), x [...] (float32, contiguous); fp[0] min, fp[1] max ---- */

static int histc_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *x = &c->t[1];
    if (!kw__present(x) || x->dtype != KW_F32 || !kw__is_contiguous(x))
        return kw__fail(msg, len, KW_EDTYPE, "histc: x must be contiguous float32 (got %s)", kw__shape(x).s);
    if (!kw__present(y) || y->dtype != KW_F32 || y->ndim != 1 || y->shape[0] < 1 || !kw__is_contiguous(y))
        return kw__fail(msg, len, KW_ESHAPE, "histc: y must be contiguous float32 [bins] with bins >= 1 (got %s)",
                        kw__shape(y).s);
    const float lo = (float)c->fp[0], hi = (float)c->fp[1];
    if (!(lo < hi) || !isfinite((hi - lo) * (float)y->shape[0]))
        return kw__fail(msg, len, KW_EINVAL,
                        "histc: min (fp[0]) must be below max (fp[1]), both finite as float32 with (max - min) * bins "
                        "finite (got %g, %g)",
                        c->fp[0], c->fp[1]);
    return 0;
}

static void histc_kernel(const kw_call *c, int ith, int nth) {
    (void)nth;
    if (ith) return;
    const float *x = c->t[1].data, lo = (float)c->fp[0], hi = (float)c->fp[1];
    float *y = c->t[0].data;
    const int64_t bins = c->t[0].shape[0], n = kw__numel(&c->t[1]);
    for (int64_t b = 0; b < bins; b++) y[b] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        if (!(x[i] >= lo && x[i] <= hi)) continue;
        const float b = (x[i] - lo) * (float)bins / (hi - lo); /* in [0, bins] for a range prepare accepts */
        y[b < (float)bins ? (int64_t)b : bins - 1] += 1.0f;
    }
}

const kw_op_info kw_op_info_histc = {
    .name = "histc",
    .n_tensors = 2,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .n_fp = 2,
    .prepare = histc_prepare,
    .kernel = histc_kernel,
};

/* ---- cumsum: slots y [..., N], x [..., N] (y's dtype: int32, int64 or float32) ---- */

static int cumsum_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *x = &c->t[1];
    int64_t rows, rs, xrows, xrs;
    if (!kw__present(y) || (y->dtype != KW_I32 && y->dtype != KW_I64 && y->dtype != KW_F32) ||
        !kw__rows_of(y, &rows, &rs))
        return kw__fail(msg, len, KW_EDTYPE, "cumsum: y must be int32, int64 or float32 with contiguous rows (got %s)",
                        kw__shape(y).s);
    if (!kw__present(x) || x->dtype != y->dtype || !kw__rows_of(x, &xrows, &xrs) || xrows != rows ||
        kw__last(x) != kw__last(y))
        return kw__fail(msg, len, KW_ESHAPE, "cumsum: x must have y's dtype and shape %s with contiguous rows (got %s)",
                        kw__shape(y).s, kw__shape(x).s);
    return 0;
}

static void cumsum_kernel(const kw_call *c, int ith, int nth) {
    const kw_tensor *y = &c->t[0], *x = &c->t[1];
    const int64_t n = kw__last(y);
    int64_t rows, rs, xrs, r0, r1;
    kw__rows_of(y, &rows, &rs);
    kw__rows_of(x, &rows, &xrs);
    kw__split(rows, 1, ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const char *xr = kw__ptr(x, r * xrs);
        char *yr = kw__ptr(y, r * rs);
        int64_t isum = 0;
        double fsum = 0.0;
        for (int64_t i = 0; i < n; i++) switch (y->dtype) {
            case KW_I32: ((int32_t *)yr)[i] = (int32_t)(uint32_t)(uint64_t)(isum += ((const int32_t *)xr)[i]); break;
            case KW_I64: ((int64_t *)yr)[i] = isum = (int64_t)((uint64_t)isum + (uint64_t)((const int64_t *)xr)[i]); break;
            default: ((float *)yr)[i] = (float)(fsum += ((const float *)xr)[i]); break;
            }
    }
}

const kw_op_info kw_op_info_cumsum = {
    .name = "cumsum",
    .n_tensors = 2,
    .arg = {{"y", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .prepare = cumsum_prepare,
    .kernel = cumsum_kernel,
    .in_place = 1, /* x[i] is read before y[i] is stored (the lowering converts x into y, then sums y) */
};
