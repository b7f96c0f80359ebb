/* Orders along the last dim: a router's top experts (topk) and the order of the
 * token-expert pairs by expert (sort). Scalar kernels over a few values per
 * token; threads split the rows.
 *
 * topk: the k largest (ip[0] = 1) or smallest (0) of each row of x, with their
 *   indices, in exactly the order PyTorch's CPU kernel (at::native
 *   topk_impl_loop) gives them, ties included: it orders (value, index) pairs
 *   with libstdc++'s std::partial_sort when k * 64 <= n, else std::nth_element
 *   then (ip[1], sorted) std::sort of the first k - 1, comparing values alone
 *   (NaN above every number), so which of several equal values come first
 *   follows those algorithms' moves. They are reproduced here move for move
 *   (introselect, median-of-three pivot, unguarded partition, insertion sort,
 *   heap select) and checked against torch.topk on rows full of ties
 *   (tests/python/test_decode_step.py). bf16 values are compared as float32,
 *   as PyTorch does.
 * sort: each row of x in ascending (ip[0] = 0) or descending order with the
 *   indices it came from, equal values in their original order (a stable sort;
 *   NaN above every number). That is torch.sort(stable=True)'s order; its
 *   default unstable order agrees only where no two values of a row are equal,
 *   which the lowering must know before it uses this op for it. */
#include <math.h>

#include "kw_ops_impl.h"

typedef struct pair {
    float v;
    int64_t i;
} pair;

typedef struct order_prep {
    int64_t n, k; /* row length; how many topk keeps */
} order_prep;

_Static_assert(sizeof(pair) <= 2 * sizeof(int64_t), "a row's pairs fit where sort keeps two index arrays");

static size_t order_work(const void *prep) { return (size_t)((const order_prep *)prep)->n * 2 * sizeof(int64_t); }

/* ---- topk: slots values [..., k], indices [..., k] (int64), x [..., n]; ip[0] largest, ip[1] sorted ---- */

/* u before v, the larger first when high_first, NaN above every number; equal
 * values: neither (the comparator of topk_impl_loop and of PyTorch's sort). */
static inline int float_before(int high_first, float u, float v) {
    return high_first ? (isnan(u) && !isnan(v)) || u > v : (!isnan(u) && isnan(v)) || u < v;
}

static inline int before(int largest, pair a, pair b) { return float_before(largest, a.v, b.v); }

#define BEFORE(a, b) before(largest, (a), (b))

static inline void swap(pair *a, pair *b) {
    const pair t = *a;
    *a = *b;
    *b = t;
}

static int64_t floor_log2(int64_t n) { return 63 - __builtin_clzll((unsigned long long)n); }

/* libstdc++'s heap: __push_heap, __adjust_heap, __make_heap, __pop_heap. */
static void push_heap(int largest, pair *f, int64_t hole, int64_t top, pair v) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && BEFORE(f[parent], v)) {
        f[hole] = f[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    f[hole] = v;
}

static void adjust_heap(int largest, pair *f, int64_t hole, int64_t len, pair v) {
    const int64_t top = hole;
    int64_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (BEFORE(f[child], f[child - 1])) child--;
        f[hole] = f[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        f[hole] = f[child - 1];
        hole = child - 1;
    }
    push_heap(largest, f, hole, top, v);
}

static void make_heap(int largest, pair *f, int64_t len) {
    if (len < 2) return;
    for (int64_t parent = (len - 2) / 2;; parent--) {
        adjust_heap(largest, f, parent, len, f[parent]);
        if (parent == 0) return;
    }
}

static void pop_heap(int largest, pair *f, int64_t len, pair *result) {
    const pair v = *result;
    *result = f[0];
    adjust_heap(largest, f, 0, len, v);
}

/* __heap_select: the heap of [f, f + mid) ends up holding the mid first of [f, f + n). */
static void heap_select(int largest, pair *f, int64_t mid, int64_t n) {
    make_heap(largest, f, mid);
    for (int64_t i = mid; i < n; i++)
        if (BEFORE(f[i], f[0])) pop_heap(largest, f, mid, &f[i]);
}

static void sort_heap(int largest, pair *f, int64_t len) {
    while (len > 1) {
        len--;
        pop_heap(largest, f, len, &f[len]);
    }
}

/* __unguarded_linear_insert and __insertion_sort. */
static void linear_insert(int largest, pair *last) {
    const pair v = *last;
    pair *next = last - 1;
    while (BEFORE(v, *next)) {
        *last = *next;
        last = next--;
    }
    *last = v;
}

static void insertion_sort(int largest, pair *f, pair *l) {
    if (f == l) return;
    for (pair *i = f + 1; i != l; i++) {
        if (BEFORE(*i, *f)) {
            const pair v = *i;
            memmove(f + 1, f, (size_t)(i - f) * sizeof(pair));
            *f = v;
        } else {
            linear_insert(largest, i);
        }
    }
}

/* __move_median_to_first, __unguarded_partition, __unguarded_partition_pivot. */
static void median_to_first(int largest, pair *result, pair *a, pair *b, pair *c) {
    if (BEFORE(*a, *b)) {
        if (BEFORE(*b, *c)) swap(result, b);
        else if (BEFORE(*a, *c)) swap(result, c);
        else swap(result, a);
    } else if (BEFORE(*a, *c)) {
        swap(result, a);
    } else if (BEFORE(*b, *c)) {
        swap(result, c);
    } else {
        swap(result, b);
    }
}

static pair *partition_pivot(int largest, pair *f, pair *l) {
    median_to_first(largest, f, f + 1, f + (l - f) / 2, l - 1);
    pair *lo = f + 1, *hi = l;
    for (;;) {
        while (BEFORE(*lo, *f)) lo++;
        hi--;
        while (BEFORE(*f, *hi)) hi--;
        if (!(lo < hi)) return lo;
        swap(lo, hi);
        lo++;
    }
}

/* std::nth_element: __introselect with a depth limit of 2 log2(n). */
static void nth_element(int largest, pair *f, pair *nth, pair *l) {
    if (f == l || nth == l) return;
    int64_t depth = floor_log2(l - f) * 2;
    while (l - f > 3) {
        if (depth == 0) {
            heap_select(largest, f, nth + 1 - f, l - f);
            swap(f, nth);
            return;
        }
        depth--;
        pair *cut = partition_pivot(largest, f, l);
        if (cut <= nth) f = cut;
        else l = cut;
    }
    insertion_sort(largest, f, l);
}

/* std::sort: __introsort_loop (threshold 16, depth limit 2 log2(n)), then
 * __final_insertion_sort. */
enum { SORT_THRESHOLD = 16 };

static void introsort_loop(int largest, pair *f, pair *l, int64_t depth) {
    while (l - f > SORT_THRESHOLD) {
        if (depth == 0) {
            heap_select(largest, f, l - f, l - f);
            sort_heap(largest, f, l - f);
            return;
        }
        depth--;
        pair *cut = partition_pivot(largest, f, l);
        introsort_loop(largest, cut, l, depth);
        l = cut;
    }
}

static void std_sort(int largest, pair *f, pair *l) {
    if (f == l) return;
    introsort_loop(largest, f, l, floor_log2(l - f) * 2);
    if (l - f > SORT_THRESHOLD) {
        insertion_sort(largest, f, f + SORT_THRESHOLD);
        for (pair *i = f + SORT_THRESHOLD; i != l; i++) linear_insert(largest, i);
    } else {
        insertion_sort(largest, f, l);
    }
}

#undef BEFORE

/* Thread ith's rows [r0, r1) and the row strides of x, values and indices. */
typedef struct order_rows {
    int64_t r0, r1, xs, ys, is;
} order_rows;

static order_rows thread_rows(const kw_call *c, int ith, int nth) {
    order_rows o;
    int64_t rows;
    kw__rows_of(&c->t[2], &rows, &o.xs);
    kw__rows_of(&c->t[0], &rows, &o.ys);
    kw__rows_of(&c->t[1], &rows, &o.is);
    kw__split(rows, 1, ith, nth, &o.r0, &o.r1);
    return o;
}

static int rows_match(const kw_tensor *t, int64_t rows, int64_t last, int64_t *rs) {
    int64_t n;
    return kw__present(t) && kw__rows_of(t, &n, rs) && n == rows && kw__last(t) == last;
}

/* Both ops: values and indices [..., m], x [..., n] with the same leading dims,
 * x float32 or bfloat16 (sort: also int64 or int32), values of x's dtype. */
static int order_check(const kw_call *c, const char *op, int ints_too, int64_t m, char *msg, size_t len) {
    const kw_tensor *y = &c->t[0], *ids = &c->t[1], *x = &c->t[2];
    int64_t rows, rs;
    if (!kw__present(x) || !(kw__is_float(x->dtype) || (ints_too && (x->dtype == KW_I64 || x->dtype == KW_I32))) ||
        !kw__rows_of(x, &rows, &rs) || x->ndim < 1)
        return kw__fail(msg, len, KW_EDTYPE, "%s: x must be %s with contiguous rows (got %s)", op,
                        ints_too ? "float32, bfloat16, int64 or int32" : "float32 or bfloat16", kw__shape(x).s);
    if (y->dtype != x->dtype || y->ndim != x->ndim || !rows_match(y, rows, m, &rs) || ids->dtype != KW_I64 ||
        ids->ndim != x->ndim || !rows_match(ids, rows, m, &rs))
        return kw__fail(msg, len, KW_ESHAPE,
                        "%s: values (x's dtype) and indices (int64) must have x's leading dims and %lld in the last, "
                        "with contiguous rows (got %s, %s)",
                        op, (long long)m, kw__shape(y).s, kw__shape(ids).s);
    return 0;
}

static int topk_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    (void)isa;
    order_prep *p = prep;
    p->n = kw__last(&c->t[2]);
    p->k = kw__last(&c->t[0]);
    if ((c->ip[0] != 0 && c->ip[0] != 1) || (c->ip[1] != 0 && c->ip[1] != 1))
        return kw__fail(msg, len, KW_EINVAL, "topk: ip[0] (largest) and ip[1] (sorted) must be 0 or 1 (got %lld, %lld)",
                        (long long)c->ip[0], (long long)c->ip[1]);
    if (c->t[0].ndim < 1 || p->k < 1 || p->k > p->n)
        return kw__fail(msg, len, KW_ESHAPE, "topk: k (values' last dim) must be in [1, n] with n == %lld (got %s)",
                        (long long)p->n, kw__shape(&c->t[0]).s);
    return order_check(c, "topk", 0, p->k, msg, len);
}

static void topk_kernel(const kw_call *c, int ith, int nth) {
    const order_prep *p = c->prep;
    const kw_tensor *y = &c->t[0], *ids = &c->t[1], *x = &c->t[2];
    const int largest = (int)c->ip[0];
    const int64_t n = p->n, k = p->k;
    if (n == 0) return; /* empty rows: nothing to select, and no scratch */
    const order_rows o = thread_rows(c, ith, nth);
    pair *q = kw__work(c, ith);
    for (int64_t r = o.r0; r < o.r1; r++) {
        const char *xr = kw__ptr(x, r * o.xs);
        for (int64_t j = 0; j < n; j++) q[j] = (pair){kw__ldf(xr, j, x->dtype), j};
        if (k * 64 <= n) { /* std::partial_sort */
            heap_select(largest, q, k, n);
            sort_heap(largest, q, k);
        } else {
            nth_element(largest, q, q + k - 1, q + n);
            if (c->ip[1]) std_sort(largest, q, q + k - 1);
        }
        char *yr = kw__ptr(y, r * o.ys);
        int64_t *ir = (int64_t *)kw__ptr(ids, r * o.is);
        for (int64_t j = 0; j < k; j++) {
            kw__stf(yr, j, y->dtype, q[j].v);
            ir[j] = q[j].i;
        }
    }
}

const kw_op_info kw_op_info_topk = {
    .name = "topk",
    .n_tensors = 3,
    .arg = {{"values", KW_WRITE, 0}, {"indices", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .n_ip = 2,
    .prepare = topk_prepare,
    .prep_size = sizeof(order_prep),
    .work_size = order_work,
    .kernel = topk_kernel,
};

/* ---- sort: slots values [..., n], indices [..., n] (int64), x [..., n]; ip[0] descending ---- */

/* Element a before element b of the row in its order; equal values: neither. */
static int sorts_before(const char *xr, kw_dtype dt, int descending, int64_t a, int64_t b) {
    if (dt == KW_I64 || dt == KW_I32) {
        const int64_t u = dt == KW_I64 ? ((const int64_t *)xr)[a] : ((const int32_t *)xr)[a];
        const int64_t v = dt == KW_I64 ? ((const int64_t *)xr)[b] : ((const int32_t *)xr)[b];
        return descending ? u > v : u < v;
    }
    return float_before(descending, kw__ldf(xr, a, dt), kw__ldf(xr, b, dt));
}

static int sort_prepare(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    (void)isa;
    order_prep *p = prep;
    p->n = p->k = kw__last(&c->t[2]);
    if (c->ip[0] != 0 && c->ip[0] != 1)
        return kw__fail(msg, len, KW_EINVAL, "sort: ip[0] (descending) must be 0 or 1 (got %lld)", (long long)c->ip[0]);
    return order_check(c, "sort", 1, p->n, msg, len);
}

/* A bottom-up merge sort of the row's indices: stable, n log n, scratch 2n. */
static void sort_kernel(const kw_call *c, int ith, int nth) {
    const order_prep *p = c->prep;
    const kw_tensor *y = &c->t[0], *ids = &c->t[1], *x = &c->t[2];
    const int desc = (int)c->ip[0];
    const int64_t n = p->n;
    if (n == 0) return; /* empty rows: nothing to order, and no scratch */
    const order_rows o = thread_rows(c, ith, nth);
    int64_t *const work = kw__work(c, ith);
    const size_t esz = kw_dtype_size(x->dtype);
    for (int64_t r = o.r0; r < o.r1; r++) {
        const char *xr = kw__ptr(x, r * o.xs);
        int64_t *a = work, *b = work + n;
        for (int64_t j = 0; j < n; j++) a[j] = j;
        for (int64_t w = 1; w < n; w *= 2) {
            for (int64_t lo = 0; lo < n; lo += 2 * w) {
                const int64_t mid = KW__MIN(lo + w, n), hi = KW__MIN(lo + 2 * w, n);
                int64_t i = lo, j = mid, o = lo;
                while (i < mid && j < hi) b[o++] = sorts_before(xr, x->dtype, desc, a[j], a[i]) ? a[j++] : a[i++];
                while (i < mid) b[o++] = a[i++];
                while (j < hi) b[o++] = a[j++];
            }
            int64_t *t = a;
            a = b;
            b = t;
        }
        char *yr = kw__ptr(y, r * o.ys);
        int64_t *ir = (int64_t *)kw__ptr(ids, r * o.is);
        for (int64_t j = 0; j < n; j++) {
            memcpy(yr + (size_t)j * esz, xr + (size_t)a[j] * esz, esz);
            ir[j] = a[j];
        }
    }
}

const kw_op_info kw_op_info_sort = {
    .name = "sort",
    .n_tensors = 3,
    .arg = {{"values", KW_WRITE, 0}, {"indices", KW_WRITE, 0}, {"x", KW_READ, 0}},
    .n_ip = 1,
    .prepare = sort_prepare,
    .prep_size = sizeof(order_prep),
    .work_size = order_work,
    .kernel = sort_kernel,
};
