/* Row copies addressed by an index tensor; dtypes may differ (each element is
 * converted as .to() would). Copies of equal dtype are memcpy, which libc already
 * vectorises, so these ops have one portable kernel and no ISA variants. Threads
 * split rows.
 *
 * embedding: y[i, :] = table[ids[i], :]. An id outside [0, V) is reported (the
 *   replay then fails with KW_EINDEX, as PyTorch raises an IndexError) and its
 *   row filled with NaN. With ip[0] = KW_GATHER_WRAP an id in [-V, 0) counts
 *   from the end, as tensor indexing (table[ids]) reads it.
 * kv_write: cache[b, h, pos[t], :] = src[b, h, t, :] — Tensor.index_copy_(2, pos,
 *   src) on a static KV cache, in place. A position outside [0, S) is reported
 *   and skipped.
 * kv_shift: cache[b, h, :S-1, :] = cache[b, h, 1:, :]; cache[b, h, S-1, :] =
 *   src[b, h, 0, :] — a full sliding-window cache taking one position, in place
 *   (transformers writes it as roll(-1), a write of the last position and a copy
 *   back: three passes over the cache and a copy of it). Each thread moves its
 *   own columns of whole (b, h) slices, row after row upwards, so no thread
 *   reads a row another has already overwritten.
 * index_put: y[ids[i], :] = src[i, :] — Tensor.index_put_((ids,), src) with one
 *   index tensor, in place (a mixture of experts' inverse permutation). */
#include "kw_ops_impl.h"

static void copy_row(char *dst, kw_dtype dt, const char *src, kw_dtype st, int64_t n) {
    if (dt == st) {
        memcpy(dst, src, (size_t)n * kw_dtype_size(dt));
        return;
    }
    for (int64_t i = 0; i < n; i++) kw__stf(dst, i, dt, kw__ldf(src, i, st));
}

static int64_t ld_index(const kw_tensor *t, int64_t i) {
    return t->dtype == KW_I64 ? ((const int64_t *)t->data)[i] : ((const int32_t *)t->data)[i];
}

static int index_ok(const kw_tensor *t) {
    return kw__present(t) && (t->dtype == KW_I64 || t->dtype == KW_I32) && kw__is_contiguous(t);
}

/* ---- embedding: slots y [..., D], ids [...] (int64 or int32), table [V, D]; ip[0]: 0 or KW_GATHER_WRAP ---- */

/* The kernels read sizes and strides from the call itself: nothing to prepare. */
static int embedding_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *ids = &c->t[1], *tab = &c->t[2];
    int64_t rows, rs;
    if (c->ip[0] != 0 && c->ip[0] != KW_GATHER_WRAP)
        return kw__fail(msg, len, KW_EINVAL, "embedding: ip[0] must be 0 or KW_GATHER_WRAP (got %lld)", (long long)c->ip[0]);
    if (!index_ok(ids))
        return kw__fail(msg, len, KW_EDTYPE, "embedding: ids must be contiguous int64 or int32 (got %s)", kw__shape(ids).s);
    if (!kw__present(tab) || !kw__is_float(tab->dtype) || tab->ndim != 2 || (tab->shape[1] > 1 && tab->stride[1] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "embedding: table must be float32 or bfloat16 [V, D] with contiguous rows (got %s)",
                        kw__shape(tab).s);
    if (!kw__present(y) || !kw__is_float(y->dtype) || kw__last(y) != tab->shape[1] || !kw__rows_of(y, &rows, &rs) ||
        rows != kw__numel(ids) || y->ndim != ids->ndim + 1)
        return kw__fail(msg, len, KW_ESHAPE, "embedding: y must be float32 or bfloat16 [*ids.shape, %lld] with contiguous rows (got %s)",
                        (long long)tab->shape[1], kw__shape(y).s);
    return 0;
}

static void embedding_kernel(const kw_call *c, int ith, int nth) {
    const kw_tensor *y = &c->t[0], *ids = &c->t[1], *tab = &c->t[2];
    const int64_t V = tab->shape[0], D = tab->shape[1];
    int64_t rows, rs, r0, r1;
    kw__rows_of(y, &rows, &rs);
    kw__split(rows, 1, ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t given = ld_index(ids, r), id = given < 0 && c->ip[0] == KW_GATHER_WRAP ? given + V : given;
        char *dst = kw__ptr(y, r * rs);
        if (id < 0 || id >= V) {
            for (int64_t i = 0; i < D; i++) kw__stf(dst, i, y->dtype, NAN);
            kw__report_index(c, given, V);
        } else
            copy_row(dst, y->dtype, kw__ptr(tab, id * tab->stride[0]), tab->dtype, D);
    }
}

const kw_op_info kw_op_info_embedding = {
    .name = "embedding",
    .n_tensors = 3,
    .arg = {{"y", KW_WRITE, 0}, {"ids", KW_READ, 0}, {"table", KW_READ, 0}},
    .n_ip = 1,
    .prepare = embedding_prepare,
    .kernel = embedding_kernel,
};

/* ---- kv_write: slots cache [B, H, S, D] (modified), src [B, H, T, D], pos [T] ---- */

static int kv_write_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *cache = &c->t[0], *src = &c->t[1], *pos = &c->t[2];
    if (!kw__present(cache) || !kw__is_float(cache->dtype) || cache->ndim != 4 ||
        (cache->shape[3] > 1 && cache->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "kv_write: cache must be float32 or bfloat16 [B, H, S, D] with contiguous D (got %s)",
                        kw__shape(cache).s);
    if (!kw__present(src) || !kw__is_float(src->dtype) || src->ndim != 4 || src->shape[0] != cache->shape[0] ||
        src->shape[1] != cache->shape[1] || src->shape[3] != cache->shape[3] || (src->shape[3] > 1 && src->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "kv_write: src must be float32 or bfloat16 [B, H, T, D] matching cache %s (got %s)",
                        kw__shape(cache).s, kw__shape(src).s);
    if (!index_ok(pos) || kw__numel(pos) != src->shape[2] || pos->ndim != 1)
        return kw__fail(msg, len, KW_ESHAPE, "kv_write: pos must be contiguous int64 or int32 [T] with T == %lld (got %s)",
                        (long long)src->shape[2], kw__shape(pos).s);
    return 0;
}

static void kv_write_kernel(const kw_call *c, int ith, int nth) {
    const kw_tensor *cache = &c->t[0], *src = &c->t[1], *pos = &c->t[2];
    const int64_t H = src->shape[1], T = src->shape[2], S = cache->shape[2], D = cache->shape[3];
    int64_t r0, r1;
    kw__split(src->shape[0] * H * T, 1, ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r % T, h = r / T % H, b = r / (T * H), p = ld_index(pos, t);
        if (p < 0 || p >= S) {
            kw__report_index(c, p, S);
            continue;
        }
        copy_row(kw__ptr(cache, b * cache->stride[0] + h * cache->stride[1] + p * cache->stride[2]), cache->dtype,
                 kw__ptr(src, b * src->stride[0] + h * src->stride[1] + t * src->stride[2]), src->dtype, D);
    }
}

const kw_op_info kw_op_info_kv_write = {
    .name = "kv_write",
    .n_tensors = 3,
    .arg = {{"cache", KW_MODIFY, 0}, {"src", KW_READ, 0}, {"pos", KW_READ, 0}},
    .prepare = kv_write_prepare,
    .kernel = kv_write_kernel,
};

/* ---- kv_shift: slots cache [B, H, S, D] (modified), src [B, H, 1, D] ---- */

static int kv_shift_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *cache = &c->t[0], *src = &c->t[1];
    if (!kw__present(cache) || !kw__is_float(cache->dtype) || cache->ndim != 4 || cache->shape[2] < 1 ||
        (cache->shape[3] > 1 && cache->stride[3] != 1) || (cache->shape[2] > 1 && cache->stride[2] < cache->shape[3]))
        return kw__fail(msg, len, KW_ESHAPE,
                        "kv_shift: cache must be float32 or bfloat16 [B, H, S, D], S >= 1, with contiguous D and "
                        "rows that do not overlap (got %s)", kw__shape(cache).s);
    if (!kw__present(src) || src->dtype != cache->dtype || src->ndim != 4 || src->shape[0] != cache->shape[0] ||
        src->shape[1] != cache->shape[1] || src->shape[2] != 1 || src->shape[3] != cache->shape[3] ||
        (src->shape[3] > 1 && src->stride[3] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "kv_shift: src must be [B, H, 1, D] of cache %s's dtype with contiguous D (got %s)",
                        kw__shape(cache).s, kw__shape(src).s);
    return 0;
}

static void kv_shift_kernel(const kw_call *c, int ith, int nth) {
    const kw_tensor *cache = &c->t[0], *src = &c->t[1];
    const int64_t H = cache->shape[1], S = cache->shape[2], D = cache->shape[3], slices = cache->shape[0] * H;
    const size_t es = kw_dtype_size(cache->dtype);
    if (slices == 0 || D == 0) return; /* an empty cache has nothing to shift */
    /* Fewer slices than threads (one KV head): each slice's columns in parts. */
    const int64_t parts = slices >= nth ? 1 : KW__MIN((nth + slices - 1) / slices, (D + 15) / 16);
    const int64_t width = (D + parts - 1) / parts;
    int64_t u0, u1;
    kw__split(slices * parts, 1, ith, nth, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t b = u / parts / H, h = u / parts % H, d0 = u % parts * width, n = KW__MIN(width, D - d0);
        if (n <= 0) continue;
        char *row = kw__ptr(cache, b * cache->stride[0] + h * cache->stride[1] + d0);
        const int64_t step = cache->stride[2] * (int64_t)es;
        for (int64_t s = 0; s + 1 < S; s++, row += step) memcpy(row, row + step, (size_t)n * es);
        memcpy(row, kw__ptr(src, b * src->stride[0] + h * src->stride[1] + d0), (size_t)n * es);
    }
}

const kw_op_info kw_op_info_kv_shift = {
    .name = "kv_shift",
    .n_tensors = 2,
    .arg = {{"cache", KW_MODIFY, 0}, {"src", KW_READ, 0}},
    .prepare = kv_shift_prepare,
    .kernel = kv_shift_kernel,
};

/* ---- index_put: slots y [V, D] (modified), ids [N] (int64 or int32), src [N, D] ----
 * src has y's dtype, any dtype; ids in [-V, 0) count from the end; an id outside
 * [-V, V) is reported and its row skipped. Where ids repeat the last i wins, as
 * PyTorch's serial loop leaves it: threads split D, each going through i in order. */

static int index_put_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *ids = &c->t[1], *src = &c->t[2];
    if (!kw__present(y) || y->ndim != 2 || (y->shape[1] > 1 && y->stride[1] != 1))
        return kw__fail(msg, len, KW_ESHAPE, "index_put: y must be [V, D] with contiguous D (got %s)", kw__shape(y).s);
    if (!index_ok(ids) || ids->ndim != 1)
        return kw__fail(msg, len, KW_EDTYPE, "index_put: ids must be contiguous int64 or int32 [N] (got %s)",
                        kw__shape(ids).s);
    if (!kw__present(src) || src->dtype != y->dtype || src->ndim != 2 || src->shape[0] != ids->shape[0] ||
        src->shape[1] != y->shape[1] || (src->shape[1] > 1 && src->stride[1] != 1))
        return kw__fail(msg, len, KW_ESHAPE,
                        "index_put: src must be [N, D] with N == %lld, D == %lld, y's dtype %s and contiguous D (got %s)",
                        (long long)ids->shape[0], (long long)y->shape[1], kw_dtype_name(y->dtype), kw__shape(src).s);
    return 0;
}

static void index_put_kernel(const kw_call *c, int ith, int nth) {
    const kw_tensor *y = &c->t[0], *ids = &c->t[1], *src = &c->t[2];
    const int64_t V = y->shape[0], D = y->shape[1], N = src->shape[0];
    int64_t d0, d1;
    kw__split(D, 16, ith, nth, &d0, &d1);
    if (d0 >= d1) return;
    for (int64_t i = 0; i < N; i++) {
        const int64_t given = ld_index(ids, i), id = given < 0 ? given + V : given;
        if (id < 0 || id >= V) {
            kw__report_index(c, given, V);
            continue;
        }
        copy_row(kw__ptr(y, id * y->stride[0] + d0), y->dtype, kw__ptr(src, i * src->stride[0] + d0), y->dtype, d1 - d0);
    }
}

const kw_op_info kw_op_info_index_put = {
    .name = "index_put",
    .n_tensors = 3,
    .arg = {{"y", KW_MODIFY, 0}, {"ids", KW_READ, 0}, {"src", KW_READ, 0}},
    .prepare = index_put_prepare,
    .kernel = index_put_kernel,
};
