/* binary, silu_mul, gelu and convert over simd.h, built once per vector ISA (see
 * KW__VARIANTS). Vector code runs where y's inner stride is 1 and each input's
 * is 1 or 0 (broadcast), and for binary and convert also where one input is
 * transposed against y (tiles_share); other layouts, integer dtypes and f16 go
 * to the scalar references in eltwise.c. */
#include "eltwise.h"
#include "simd.h"

/* n (<= KW_VW) elements of an input at element offset o + i, inner stride s (0 or 1). */
static inline kw_v ldv(const void *p, int64_t o, int64_t i, int64_t n, int64_t s, kw_dtype dt) {
    if (!s) return kw_v_set1(kw__ldf(p, o, dt));
    return n == KW_VW ? kw_v_ld(p, o + i, dt) : kw_v_ldn(p, o + i, n, dt);
}

static inline void stv(void *p, int64_t o, int64_t n, kw_dtype dt, kw_v v) {
    if (n == KW_VW)
        kw_v_st(p, o, dt, v);
    else
        kw_v_stn(p, o, n, dt, v);
}

/* Inner strides: 1 for y, 0 or 1 for each input, float dtypes only. */
static int vector_ok(const kw__ew *e) {
    const int last = e->nd.ndim - 1;
    if (!kw__is_float(e->yt) || !kw__is_float(e->at) || (e->b && !kw__is_float(e->bt))) return 0;
    if (e->nd.stride[0][last] != 1 && e->nd.inner > 1) return 0;
    for (int k = 1; k < e->nd.n_ops; k++)
        if (e->nd.stride[k][last] > 1 || e->nd.stride[k][last] < 0) return 0;
    return 1;
}

static inline kw_v binary_v(int op, kw_v a, kw_v b) {
    switch (op) {
    case KW_BINARY_ADD: return kw_v_add(a, b);
    case KW_BINARY_SUB: return kw_v_sub(a, b);
    case KW_BINARY_MUL: return kw_v_mul(a, b);
    case KW_BINARY_DIV: return kw_v_div(a, b);
    /* b first: equal values (-0.0 and +0.0) give a, as clamp and relu keep x */
    case KW_BINARY_MAX: return kw_v_nan_or(a, b, kw_v_max(b, a));
    default: return kw_v_nan_or(a, b, kw_v_min(b, a));
    }
}

static int transposed_dim(const kw__ew *e, int k);
static void tiles_share(const kw__ew *e, int k, int p, int binary, int ith, int nth);

void KW__ISA_NAME(kw__binary_share)(const kw__ew *e, int ith, int nth) {
    if (!vector_ok(e)) {
        int k = 1, p = transposed_dim(e, 1);
        if (p < 0) k = 2, p = transposed_dim(e, 2);
        if (p >= 0)
            tiles_share(e, k, p, 1, ith, nth);
        else
            kw__binary_share_scalar(e, ith, nth);
        return;
    }
    const int last = e->nd.ndim - 1;
    const int64_t sa = e->nd.stride[1][last], sb = e->b ? e->nd.stride[2][last] : 0;
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3] = {0}, n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i += KW_VW) {
            const int64_t m = KW__MIN(KW_VW, n - i);
            const kw_v a = ldv(e->a, off[1], i, m, sa, e->at);
            const kw_v b = e->b ? ldv(e->b, off[2], i, m, sb, e->bt) : kw_v_set1((float)e->scalar);
            stv(e->y, off[0] + i, m, e->yt, binary_v(e->mode, a, b));
        }
}

void KW__ISA_NAME(kw__silu_mul_share)(const kw__ew *e, int ith, int nth) {
    if (!vector_ok(e)) {
        kw__silu_mul_share_scalar(e, ith, nth);
        return;
    }
    const int last = e->nd.ndim - 1;
    const int64_t sa = e->nd.stride[1][last], sb = e->nd.stride[2][last];
    const kw_v one = kw_v_set1(1.0f), neg = kw_v_set1(-0.0f);
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i += KW_VW) {
            const int64_t m = KW__MIN(KW_VW, n - i);
            const kw_v g = ldv(e->a, off[1], i, m, sa, e->at), u = ldv(e->b, off[2], i, m, sb, e->bt);
            const kw_v silu = kw_v_div(g, kw_v_add(one, kw_v_exp(kw_v_xor(g, neg))));
            stv(e->y, off[0] + i, m, e->yt, kw_v_mul(kw_v_round_to(silu, e->at), u));
        }
}

/* erf: simd.h's. tanh: 0.5·x·(1 + tanh(u)) = x·sigmoid(2u), which keeps its
 * relative accuracy where 1 + tanh(u) cancels. */
static inline kw_v gelu_v(kw_v x, int mode) {
    if (mode == KW_GELU_ERF) return kw_v_gelu_erf(x);
    const kw_v cube = kw_v_mul(kw_v_mul(x, x), x);
    const kw_v u = kw_v_mul(kw_v_set1(0.79788456080286536f), kw_v_add(x, kw_v_mul(kw_v_set1(0.044715f), cube)));
    return kw_v_div(x, kw_v_add(kw_v_set1(1.0f), kw_v_exp(kw_v_mul(u, kw_v_set1(-2.0f)))));
}

void KW__ISA_NAME(kw__gelu_mul_share)(const kw__ew *e, int ith, int nth) {
    if (!vector_ok(e)) {
        kw__gelu_mul_share_scalar(e, ith, nth);
        return;
    }
    const int last = e->nd.ndim - 1;
    const int64_t sa = e->nd.stride[1][last], sb = e->nd.stride[2][last];
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[3], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i += KW_VW) {
            const int64_t m = KW__MIN(KW_VW, n - i);
            const kw_v g = ldv(e->a, off[1], i, m, sa, e->at), u = ldv(e->b, off[2], i, m, sb, e->bt);
            stv(e->y, off[0] + i, m, e->yt, kw_v_mul(kw_v_round_to(gelu_v(g, e->mode), e->at), u));
        }
}

/* One input walked to y: gelu passes each vector through gelu_v, convert stores it
 * as loaded (the load and store do the dtype change). */
static inline void map1_share(const kw__ew *e, int ith, int nth, int apply_gelu) {
    const int64_t sa = e->nd.stride[1][e->nd.ndim - 1];
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    int64_t off[2], n;
    while (kw__nd_next(&e->nd, &it, off, &n))
        for (int64_t i = 0; i < n; i += KW_VW) {
            const int64_t m = KW__MIN(KW_VW, n - i);
            const kw_v x = ldv(e->a, off[1], i, m, sa, e->at);
            stv(e->y, off[0] + i, m, e->yt, apply_gelu ? gelu_v(x, e->mode) : x);
        }
}

void KW__ISA_NAME(kw__gelu_share)(const kw__ew *e, int ith, int nth) {
    if (!vector_ok(e)) {
        kw__gelu_share_scalar(e, ith, nth);
        return;
    }
    map1_share(e, ith, nth, 1);
}

/* The dim p along which input k (1 or 2) steps by 1 where its stride along y's
 * rows is neither 0 nor 1: a transpose made contiguous (T5's position bias,
 * [L, L, H] permuted to [1, H, L, L]), or a sum of two layouts (Whisper's
 * residual adds: the stream in its convolution's [C, T] memory, each layer's
 * output [T, C]). -1 unless y's rows are contiguous, every dtype is a float one
 * and the other input, if any, runs along y's rows (inner stride 0 or 1). */
static int transposed_dim(const kw__ew *e, int k) {
    const int last = e->nd.ndim - 1, other = 3 - k;
    if (!kw__is_float(e->yt) || !kw__is_float(e->at) || (e->b && !kw__is_float(e->bt)) || last < 1 ||
        e->nd.total == 0 || e->nd.stride[0][last] != 1 || k >= e->nd.n_ops)
        return -1;
    const int64_t sx = e->nd.stride[k][last];
    if (sx == 0 || sx == 1) return -1;
    if (other < e->nd.n_ops && (e->nd.stride[other][last] < 0 || e->nd.stride[other][last] > 1)) return -1;
    for (int p = 0; p < last; p++)
        if (e->nd.stride[k][p] == 1 && e->nd.shape[p] > 1) return p;
    return -1;
}

/* y in KW_VW × KW_VW tiles of (p, last): input k read by KW_VW vector loads
 * along p, transposed in registers, instead of a strided load per element; the
 * other input, if any, along y's rows. binary: y = a (op) b, else y = x
 * (convert). Threads split the tiles' rows: the other dims times p's tiles. */
static void tiles_share(const kw__ew *e, int k, int p, int binary, int ith, int nth) {
    const int last = e->nd.ndim - 1, other = 3 - k, has_other = other < e->nd.n_ops;
    const void *x = k == 1 ? e->a : e->b, *w = k == 1 ? e->b : e->a;
    const kw_dtype xt = k == 1 ? e->at : e->bt, wt = k == 1 ? e->bt : e->at;
    const int64_t np = e->nd.shape[p], nj = e->nd.shape[last], p_tiles = (np + KW_VW - 1) / KW_VW;
    const int64_t sx = e->nd.stride[k][last], syp = e->nd.stride[0][p];
    const int64_t swp = has_other ? e->nd.stride[other][p] : 0, swj = has_other ? e->nd.stride[other][last] : 0;
    int64_t u0, u1;
    kw__split(e->nd.total / (np * nj) * p_tiles, 1, ith, nth, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        int64_t rest = u / p_tiles, yo = 0, xo = 0, wo = 0;
        for (int d = last - 1; d >= 0; d--) { /* the other dims' index, p's and last's left out */
            if (d == p) continue;
            const int64_t idx = rest % e->nd.shape[d];
            rest /= e->nd.shape[d];
            yo += idx * e->nd.stride[0][d], xo += idx * e->nd.stride[k][d];
            if (has_other) wo += idx * e->nd.stride[other][d];
        }
        const int64_t p0 = u % p_tiles * KW_VW, pn = KW__MIN(KW_VW, np - p0);
        yo += p0 * syp, xo += p0, wo += p0 * swp;
        for (int64_t j0 = 0; j0 < nj; j0 += KW_VW) {
            const int64_t jn = KW__MIN(KW_VW, nj - j0);
            kw_v r[KW_VW];
            for (int t = 0; t < KW_VW; t++) r[t] = t < jn ? kw_v_ldn(x, xo + (j0 + t) * sx, pn, xt) : kw_v_zero();
            kw_v_transpose(r);
            for (int t = 0; t < pn; t++) {
                kw_v v = r[t];
                if (binary) {
                    const kw_v o = has_other ? ldv(w, wo + t * swp, j0, jn, swj, wt) : kw_v_set1((float)e->scalar);
                    v = k == 1 ? binary_v(e->mode, v, o) : binary_v(e->mode, o, v);
                }
                stv(e->y, yo + t * syp + j0, jn, e->yt, v);
            }
        }
    }
}

/* At most 64 bytes from x to y. */
static inline void move_short(char *y, const char *x, size_t bytes) {
#if defined(__AVX512BW__)
    const __mmask64 m = bytes == 64 ? ~0ull : (1ull << bytes) - 1;
    _mm512_mask_storeu_epi8(y, m, _mm512_maskz_loadu_epi8(m, x));
#else
    memcpy(y, x, bytes);
#endif
}

/* A copy within one dtype, x's rows contiguous as y's: the bytes as they are
 * (Whisper's heads made contiguous, runs of 64 bf16: 0.18 ms a [6, 1500, 64]
 * copy through f32 vectors). Runs of at most 64 bytes are walked a dim at a
 * time, the walk stepping over the dim outside them: a convolution's patches
 * copied into rows (ConvNeXt's stem, runs of 4 values) spent its time
 * stepping the walk once per run. */
static void copy_share(const kw__ew *e, int ith, int nth) {
    const size_t size = kw_dtype_size(e->yt), run = (size_t)e->nd.inner * size;
    const int last = e->nd.ndim - 1;
    int64_t off[2], n;
    if (last >= 1 && run <= 64) {
        kw__nd outer = e->nd; /* the walk without the runs' dim */
        outer.ndim = last;
        outer.inner = outer.shape[last - 1];
        outer.total = e->nd.total / e->nd.inner;
        const int64_t sy = outer.stride[0][last - 1], sx = outer.stride[1][last - 1];
        kw__nd_it it = kw__nd_share(&outer, ith, nth);
        while (kw__nd_next(&outer, &it, off, &n))
            for (int64_t i = 0; i < n; i++)
                move_short(e->y + (size_t)(off[0] + i * sy) * size, e->a + (size_t)(off[1] + i * sx) * size, run);
        return;
    }
    kw__nd_it it = kw__nd_share(&e->nd, ith, nth);
    while (kw__nd_next(&e->nd, &it, off, &n))
        memcpy(e->y + (size_t)off[0] * size, e->a + (size_t)off[1] * size, (size_t)n * size);
}

void KW__ISA_NAME(kw__convert_share)(const kw__ew *e, int ith, int nth) {
    if (vector_ok(e)) {
        if (e->at == e->yt && e->nd.stride[1][e->nd.ndim - 1] == 1)
            copy_share(e, ith, nth);
        else
            map1_share(e, ith, nth, 0);
        return;
    }
    const int p = transposed_dim(e, 1);
    if (p >= 0)
        tiles_share(e, 1, p, 0, ith, nth);
    else
        kw__convert_share_scalar(e, ith, nth);
}
