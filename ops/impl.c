/* Helpers behind kw_ops_impl.h that are too large to inline. */
#include "kw_ops_impl.h"

int kw__rows_of(const kw_tensor *t, int64_t *rows, int64_t *row_stride) {
    if (t->ndim < 1 || (t->shape[t->ndim - 1] > 1 && t->stride[t->ndim - 1] != 1)) return 0;
    int64_t n = 1, rs = t->shape[t->ndim - 1], expect = -1;
    for (int d = t->ndim - 2; d >= 0; d--) {
        if (t->shape[d] == 1) continue;
        if (expect < 0)
            rs = t->stride[d];
        else if (t->stride[d] != expect)
            return 0;
        expect = t->stride[d] * t->shape[d];
        n *= t->shape[d];
    }
    *rows = n;
    *row_stride = rs;
    return 1;
}

int kw__is_contiguous(const kw_tensor *t) {
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return 1; /* no elements: any strides, as PyTorch's is_contiguous */
    int64_t expect = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->stride[d] != expect) return 0;
        expect *= t->shape[d];
    }
    return 1;
}

int kw__same_shape(const kw_tensor *a, const kw_tensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

kw__shape_text kw__shape(const kw_tensor *t) {
    kw__shape_text out;
    size_t n = 0;
    if (!t->data) {
        snprintf(out.s, sizeof out.s, "absent");
        return out;
    }
    n += (size_t)snprintf(out.s, sizeof out.s, "[");
    for (int d = 0; d < t->ndim && n < sizeof out.s; d++)
        n += (size_t)snprintf(out.s + n, sizeof out.s - n, d ? ", %lld" : "%lld", (long long)t->shape[d]);
    if (n < sizeof out.s) snprintf(out.s + n, sizeof out.s - n, "] %s", kw_dtype_name(t->dtype));
    return out;
}

int kw__fail(char *msg, size_t len, int err, const char *fmt, ...) {
    if (msg && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, len, fmt, ap);
        va_end(ap);
    }
    return err;
}

int kw__nd_init(kw__nd *nd, const kw_tensor *const *ops, int n_ops) {
    const kw_tensor *y = ops[0];
    int64_t shape[KW_MAX_DIMS], stride[KW__ND_MAX_OPS][KW_MAX_DIMS];
    if (y->ndim > KW_MAX_DIMS || n_ops > KW__ND_MAX_OPS) return 0;
    for (int k = 0; k < n_ops; k++) {
        const kw_tensor *t = ops[k];
        const int lead = y->ndim - t->ndim;
        if (lead < 0) return 0;
        for (int d = 0; d < y->ndim; d++) {
            const int td = d - lead;
            if (td < 0 || t->shape[td] == 1) {
                stride[k][d] = 0;
            } else if (t->shape[td] == y->shape[d]) {
                stride[k][d] = t->stride[td];
            } else {
                return 0;
            }
        }
    }
    memcpy(shape, y->shape, sizeof(int64_t) * (size_t)y->ndim);

    /* Walk y in its memory order: dims sorted by y's stride, outermost first
     * (stable, so a contiguous y keeps its order). A channels-last or transposed
     * y then steps by 1 along the inner dim, and operands in y's layout merge
     * with it (ConvNeXt's residual adds over [1, 96, 56, 56] channels-last: 1.1 ms
     * a strided element at a time, against a vector pass over one run). Each
     * element is computed alone, so the order changes no value. */
    for (int d = 1; d < y->ndim; d++)
        for (int e = d; e > 0 && stride[0][e - 1] < stride[0][e]; e--) {
            const int64_t n = shape[e];
            shape[e] = shape[e - 1], shape[e - 1] = n;
            for (int k = 0; k < n_ops; k++) {
                const int64_t s = stride[k][e];
                stride[k][e] = stride[k][e - 1], stride[k][e - 1] = s;
            }
        }

    /* Drop size-1 dims, then merge a dim into its inner neighbour wherever every
     * operand steps through both as one. */
    nd->n_ops = n_ops;
    nd->ndim = 0;
    nd->total = 1;
    for (int d = 0; d < y->ndim; d++) {
        nd->total *= shape[d];
        if (shape[d] == 1) continue;
        const int j = nd->ndim;
        int merge = j > 0;
        for (int k = 0; k < n_ops && merge; k++)
            merge = nd->stride[k][j - 1] == stride[k][d] * shape[d];
        if (merge) {
            nd->shape[j - 1] *= shape[d];
            for (int k = 0; k < n_ops; k++) nd->stride[k][j - 1] = stride[k][d];
        } else {
            nd->shape[j] = shape[d];
            for (int k = 0; k < n_ops; k++) nd->stride[k][j] = stride[k][d];
            nd->ndim++;
        }
    }
    if (nd->ndim == 0) {
        nd->ndim = 1;
        nd->shape[0] = 1;
        for (int k = 0; k < n_ops; k++) nd->stride[k][0] = 0;
    }
    nd->inner = nd->shape[nd->ndim - 1];
    if (nd->total == 0) nd->inner = 1;
    return 1;
}
