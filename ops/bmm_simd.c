/* bmm over simd.h, built once per vector ISA (see KW__VARIANTS). */
#include "bmm.h"
#include "simd.h"

static inline kw_v ld(const char *p, int64_t i, int64_t n, kw_dtype dt) {
    return n - i >= KW_VW ? kw_v_ld(p, i, dt) : kw_v_ldn(p, i, n - i, dt);
}

/* acc[t] = a[b, i, :] · m[b, :, j0 + t] for t < n (n <= KW__BMM_COLS): KW_VW columns
 * at a time, each a vector of partial sums over k, summed across lanes at once. */
static void dot_columns(const kw__bmm *p, int64_t b, int64_t i, int64_t j0, int64_t n, float *acc) {
    const size_t esz = kw_dtype_size(p->dt);
    const char *arow = p->a + (size_t)(b * p->as[0] + i * p->as[1]) * esz;
    for (int64_t g = 0; g < n; g += KW_VW) {
        const int64_t cols = KW__MIN(KW_VW, n - g);
        const char *col[KW_VW];
        kw_v s[KW_VW];
        for (int t = 0; t < KW_VW; t++) {
            s[t] = kw_v_zero();
            col[t] = p->b + (size_t)(b * p->bs[0] + (j0 + g + KW__MIN(t, cols - 1)) * p->bs[2]) * esz;
        }
        for (int64_t k = 0; k < p->K; k += KW_VW) {
            const kw_v x = ld(arow, k, p->K, p->dt);
            for (int t = 0; t < cols; t++) s[t] = kw_v_fmadd(x, ld(col[t], k, p->K, p->dt), s[t]);
        }
        float sums[KW_VW];
        kw_v_storeu(sums, kw_v_reduce_add_lanes(s));
        memcpy(acc + g, sums, (size_t)cols * sizeof(float));
    }
}

/* acc[0 .. n) = Σ_k a[b, i, k] · m[b, k, j0 .. j0 + n), k in order. */
static void scale_rows(const kw__bmm *p, int64_t b, int64_t i, int64_t j0, int64_t n, float *acc) {
    enum { V = KW__BMM_COLS / KW_VW };
    const size_t esz = kw_dtype_size(p->dt);
    const char *arow = p->a + (size_t)(b * p->as[0] + i * p->as[1]) * esz;
    const char *m = p->b + (size_t)(b * p->bs[0] + j0) * esz;
    kw_v s[V];
    for (int v = 0; v < V; v++) s[v] = kw_v_zero();
    for (int64_t k = 0; k < p->K; k++) {
        const kw_v x = kw_v_set1(kw__ldf(arow, k * p->as[2], p->dt));
        const char *row = m + (size_t)(k * p->bs[1]) * esz;
        for (int v = 0; v < V && v * KW_VW < n; v++) s[v] = kw_v_fmadd(x, ld(row, v * KW_VW, n, p->dt), s[v]);
    }
    for (int v = 0; v < V && v * KW_VW < n; v++)
        if (n - v * KW_VW >= KW_VW)
            kw_v_storeu(acc + v * KW_VW, s[v]);
        else
            kw_v_storen(acc + v * KW_VW, s[v], n - v * KW_VW);
}

void KW__ISA_NAME(kw__bmm_units)(const kw__bmm *p, int64_t u0, int64_t u1) {
    float acc[KW__BMM_COLS];
    for (int64_t u = u0; u < u1; u++) {
        const int64_t row = u / p->chunks, j0 = u % p->chunks * KW__BMM_COLS, b = row / p->M, i = row % p->M;
        const int64_t n = KW__MIN(KW__BMM_COLS, p->N - j0);
        if (p->dot)
            dot_columns(p, b, i, j0, n, acc);
        else
            scale_rows(p, b, i, j0, n, acc);
        kw__bmm_store(p, b, i, j0, n, acc);
    }
}
