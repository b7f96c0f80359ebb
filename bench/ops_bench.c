/* ops_bench — what kwker's kernels and pool reach on this machine, printed as
 * one JSON object (bench/ops.py builds and runs it; see bench/README.md).
 *
 *   ops_bench [--threads N] [--quick] [--read-only | --attention | --linear]
 *
 * read_gbs       read bandwidth: the pool's threads each stream their slice of a
 *                2 GiB buffer (far beyond any L3); the faster of 32- and 64-byte
 *                loads.
 * gemv           M = 1 linear over a Llama-3.2-1B-shaped set of weights of more
 *                than 1 GiB (lm_head and 5 layers' q, k, v, o, gate, up, down),
 *                all in one pool run with a barrier after each, as a decode step
 *                runs them, in the layout capture gives them (down is K-blocked,
 *                see kw_linear_block); GB/s of weights and the fraction of
 *                read_gbs. Read and GEMV passes alternate within each repeat.
 * barrier_us     per op: an empty kernel and a barrier, at 1 and all threads.
 * attention_us   decode attention, Llama-3.2-1B heads (32 q, 8 kv, D 64, bf16),
 *                128 valid positions in caches of S = 256 and S = 4096.
 * attention_steps_us  attention of steps of L = 1, 5, 8 and 128 positions,
 *                SmolLM2-360M's heads (15 q, 5 kv, D 64), f32 and bf16, causal,
 *                ending at 512 of 1024 cached positions (--attention: only these).
 * attention_encoder_us  ViT-base's attention at batch 8 (12 heads of 64, 197
 *                positions, no mask), f32 and bf16 (--attention too).
 * dnnl_crossover linear vs matmul_dnnl over one layer's gate/up/down for M rows:
 *                f32, f32 x with linear on a bf16 copy (dnnl on f32), and bf16
 *                (matmul_dnnl's times null where oneDNN makes no bf16 matmul: linear's
 *                alone) (--linear: only these).
 * ops_us         other decode-sized ops, each with its barrier.
 * Every time is the median over repeats. Progress goes to stderr. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kw_mem.h"
#include "kw_ops.h"
#include "kw_pool.h"

static int g_quick;
static int g_threads = 1; /* the pool's: calls are prepared for it, as a plan's */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double minimum(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++) m = v[i] < m ? v[i] : m;
    return m;
}

/* Median seconds of `reps` timed kw_pool_run calls after one warm-up. */
static double time_runs(kw_pool *pool, kw_task_fn fn, void *arg, int reps) {
    double t[64];
    kw_pool_run(pool, fn, arg);
    for (int i = 0; i < reps; i++) {
        const double t0 = now_s();
        kw_pool_run(pool, fn, arg);
        t[i] = now_s() - t0;
    }
    return median(t, reps);
}

static void *alloc_or_die(size_t bytes) {
    void *p = kw_mem_alloc(bytes);
    if (!p) {
        fprintf(stderr, "ops_bench: cannot allocate %zu bytes\n", bytes);
        exit(1);
    }
    return p;
}

/* Distinct bytes on every page (identical pages may be merged by the kernel or
 * the hypervisor, and then a "1 GiB" buffer is one page in cache). Each 32-bit
 * word is 0x3c??3c?? with random low bits: a normal float read as f32 or as two
 * bf16, never a NaN or denormal. */
typedef struct fill_job {
    uint32_t *p;
    size_t words;
} fill_job;

static void fill_task(void *arg, int ith, int nth) {
    const fill_job *j = arg;
    const size_t lo = j->words * (size_t)ith / (size_t)nth, hi = j->words * (size_t)(ith + 1) / (size_t)nth;
    uint64_t s = 0x9e3779b97f4a7c15ull * (lo + 1);
    for (size_t i = lo; i < hi; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        j->p[i] = 0x3c003c00u | ((uint32_t)s & 0x007f007fu);
    }
}

static void fill(kw_pool *pool, void *p, size_t bytes) {
    fill_job j = {p, bytes / 4};
    kw_pool_run(pool, fill_task, &j);
}

static kw_tensor tensor2(void *data, kw_dtype dt, int64_t rows, int64_t cols) {
    return (kw_tensor){.data = data, .dtype = dt, .ndim = 2, .shape = {rows, cols}, .stride = {cols, 1}};
}

/* ---- read bandwidth ---- */

typedef struct read_job {
    const char *buf;
    size_t bytes;
    int zmm; /* 64-byte loads, else 32-byte ones */
    volatile uint64_t sink[64 * 8];
} read_job;

__attribute__((target("avx512f"))) static uint64_t read_avx512(const char *p, size_t n) {
    __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
    for (size_t i = 0; i + 256 <= n; i += 256) {
        a = _mm512_xor_si512(a, _mm512_load_si512(p + i));
        b = _mm512_xor_si512(b, _mm512_load_si512(p + i + 64));
        c = _mm512_xor_si512(c, _mm512_load_si512(p + i + 128));
        d = _mm512_xor_si512(d, _mm512_load_si512(p + i + 192));
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d)));
}

__attribute__((target("avx2"))) static uint64_t read_avx2(const char *p, size_t n) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)(p + i)));
        b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(p + i + 32)));
        c = _mm256_xor_si256(c, _mm256_load_si256((const __m256i *)(p + i + 64)));
        d = _mm256_xor_si256(d, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
    return (uint64_t)(_mm256_extract_epi64(x, 0) ^ _mm256_extract_epi64(x, 3));
}

static void read_task(void *arg, int ith, int nth) {
    read_job *j = arg;
    const size_t share = j->bytes / (size_t)nth / 256 * 256;
    const char *p = j->buf + share * (size_t)ith;
    j->sink[ith * 8] = j->zmm ? read_avx512(p, share) : read_avx2(p, share);
}

/* The read bandwidth alone (--read-only), for benchmarks that compare against it
 * in their own run (bench/decode.py): median GB/s of the faster load width. */
static double read_bandwidth(kw_pool *pool, int reps) {
    read_job *rj = calloc(1, sizeof *rj);
    rj->bytes = (size_t)1 << 31;
    rj->buf = alloc_or_die(rj->bytes);
    fill(pool, (void *)rj->buf, rj->bytes);
    double t[2][64], best = 0;
    const int widths = kw_cpu_isa() >= KW_ISA_AVX512 ? 2 : 1;
    for (int r = -1; r < reps; r++)
        for (int z = 0; z < widths; z++) {
            rj->zmm = z;
            const double t0 = now_s();
            kw_pool_run(pool, read_task, rj);
            if (r >= 0) t[z][r] = now_s() - t0;
        }
    for (int z = 0; z < widths; z++) {
        const double gbs = (double)rj->bytes / median(t[z], reps) / 1e9;
        best = gbs > best ? gbs : best;
    }
    kw_mem_free((void *)rj->buf, rj->bytes);
    free(rj);
    return best;
}

/* Prepares c for this CPU as a plan would (its preparation is never freed: a
 * benchmark's calls live as long as the process). */
static void check_call(kw_op_id op, kw_call *c) {
    char msg[256];
    c->n_threads = g_threads;
    if (kw_op_prepare(op, c, kw_cpu_isa(), alloc_or_die(kw_op_prep_size(op)), msg, sizeof msg)) {
        fprintf(stderr, "ops_bench: %s\n", msg);
        exit(1);
    }
}

static size_t work_of(kw_op_id op, const kw_call *c) {
    const kw_op_info *info = kw_op_get(op);
    return info->work_size ? (info->work_size(c->prep) + 63) / 64 * 64 : 0;
}

/* ---- GEMV over a decode step's weights ---- */

#define MAX_MATS 64

typedef struct gemv_set {
    kw_pool *pool;
    int n;
    kw_call call[MAX_MATS];
    kw_kernel_fn fn;
    size_t bytes;
    void *work; /* every call's scratch: the largest work_size per thread */
    size_t work_bytes;
} gemv_set;

static void gemv_task(void *arg, int ith, int nth) {
    const gemv_set *s = arg;
    for (int i = 0; i < s->n; i++) {
        s->fn(&s->call[i], ith, nth);
        kw_pool_barrier(s->pool);
    }
}

typedef struct shape {
    int64_t n, k;
} shape;

/* lm_head, then per layer q, k, v, o, gate, up, down of Llama-3.2-1B. */
static int llama_shapes(shape *out, int layers) {
    static const shape layer[] = {{2048, 2048}, {512, 2048}, {512, 2048}, {2048, 2048},
                                  {8192, 2048}, {8192, 2048}, {2048, 8192}};
    int n = 0;
    out[n++] = (shape){128256, 2048};
    for (int l = 0; l < layers; l++)
        for (int i = 0; i < 7; i++) out[n++] = layer[i];
    return n;
}

typedef struct weights {
    char *mem;
    size_t bytes;
    float *x, *y; /* activations (f32-sized, also read as bf16) and outputs */
} weights;

/* One allocation holds every matrix back to back: f32 needs twice the bf16 bytes. */
static gemv_set make_gemv_set(const weights *w, const shape *sh, int n, kw_dtype wt, kw_dtype at, kw_pool *pool) {
    gemv_set s = {.pool = pool, .n = n};
    char *p = w->mem;
    for (int i = 0; i < n; i++) {
        kw_call *c = &s.call[i];
        memset(c, 0, sizeof *c);
        c->t[0] = tensor2(w->y, at, 1, sh[i].n);
        c->t[1] = tensor2(w->x, at, 1, sh[i].k);
        c->t[2] = tensor2(p, wt, sh[i].n, sh[i].k);
        const int64_t B = kw_linear_block(sh[i].k); /* the layout kwker's capture gives these weights */
        if (B) c->t[2] = (kw_tensor){p, wt, 3, {sh[i].k / B, sh[i].n, B}, {sh[i].n * B, B, 1}};
        const size_t b = (size_t)(sh[i].n * sh[i].k) * kw_dtype_size(wt);
        p += b;
        s.bytes += b;
        check_call(KW_OP_LINEAR, c);
        const size_t ws = work_of(KW_OP_LINEAR, c);
        if (ws > s.work_bytes) s.work_bytes = ws;
    }
    s.work = s.work_bytes ? alloc_or_die(s.work_bytes * (size_t)kw_pool_size(pool)) : NULL;
    for (int i = 0; i < n; i++) s.call[i].work = s.work, s.call[i].work_stride = s.work_bytes;
    s.fn = kw_op_get(KW_OP_LINEAR)->kernel;
    return s;
}

/* Read bandwidth and the three GEMV sets, one pass of each per repeat, so that a
 * change in what else the machine does hits all of them alike. The read is the
 * faster of 32- and 64-byte loads (on Zen 4 the 32-byte loop reads about 8 %
 * faster): every GEMV is compared with the best plain read. */
static void bandwidth(kw_pool *pool, const weights *w, const shape *sh, int n, FILE *out) {
    static const kw_dtype combos[3][2] = {{KW_BF16, KW_F32}, {KW_BF16, KW_BF16}, {KW_F32, KW_F32}};
    const int reps = g_quick ? 5 : 11, widths = kw_cpu_isa() >= KW_ISA_AVX512 ? 2 : 1;
    read_job *rj = calloc(1, sizeof *rj);
    rj->bytes = (size_t)1 << 31; /* 2 GiB: 64 times the L3 */
    rj->buf = alloc_or_die(rj->bytes);
    fill(pool, (void *)rj->buf, rj->bytes);
    gemv_set *sets = calloc(3, sizeof *sets);
    for (int ci = 0; ci < 3; ci++) {
        sets[ci] = make_gemv_set(w, sh, n, combos[ci][0], combos[ci][1], pool);
        for (int i = 0; i < n; i++) check_call(KW_OP_LINEAR, &sets[ci].call[i]);
    }
    double t_read[2][64], t_gemv[3][64];
    fprintf(stderr, "read bandwidth and gemv, %d repeats...\n", reps);
    for (int r = -1; r < reps; r++) { /* r = -1 warms up */
        for (int z = 0; z < widths; z++) {
            rj->zmm = z;
            const double t0 = now_s();
            kw_pool_run(pool, read_task, rj);
            if (r >= 0) t_read[z][r] = now_s() - t0;
        }
        for (int ci = 0; ci < 3; ci++) {
            const double t0 = now_s();
            kw_pool_run(pool, gemv_task, &sets[ci]);
            if (r >= 0) t_gemv[ci][r] = now_s() - t0;
        }
    }
    /* Medians are the figures; the best runs (fastest of each) show what the
     * kernels do when nothing else got in the way. */
    double read_gbs = 0, read_best = 0;
    for (int z = 0; z < widths; z++) {
        const double gbs = (double)rj->bytes / minimum(t_read[z], reps) / 1e9;
        const double med = (double)rj->bytes / median(t_read[z], reps) / 1e9;
        fprintf(stderr, "  read with %d-byte loads: %.1f GB/s (best %.1f)\n", z ? 64 : 32, med, gbs);
        read_gbs = med > read_gbs ? med : read_gbs;
        read_best = gbs > read_best ? gbs : read_best;
    }
    fprintf(out, ", \"read_gbs\": %.2f, \"read_gbs_best\": %.2f, \"gemv\": [", read_gbs, read_best);
    for (int ci = 0; ci < 3; ci++) {
        const double best = (double)sets[ci].bytes / minimum(t_gemv[ci], reps) / 1e9;
        const double t = median(t_gemv[ci], reps), gbs = (double)sets[ci].bytes / t / 1e9;
        fprintf(out, "%s{\"weights\": \"%s\", \"acts\": \"%s\", \"gbs\": %.2f, \"frac_of_read\": %.3f, \"bytes\": %zu, \"ms\": %.3f, \"gbs_best\": %.2f, \"frac_best\": %.3f}",
                ci ? ", " : "", kw_dtype_name(combos[ci][0]), kw_dtype_name(combos[ci][1]), gbs, gbs / read_gbs,
                sets[ci].bytes, t * 1e3, best, best / read_best);
        if (sets[ci].work) kw_mem_free(sets[ci].work, sets[ci].work_bytes * (size_t)kw_pool_size(pool));
    }
    fprintf(out, "]");
    free(sets);
    kw_mem_free((void *)rj->buf, rj->bytes);
    free(rj);
}

/* ---- per-op cost: a kernel and its barrier, `iters` times in one run ---- */

typedef struct loop_job {
    kw_pool *pool;
    kw_kernel_fn fn;
    const kw_call *call;
    int iters;
} loop_job;

static void loop_task(void *arg, int ith, int nth) {
    const loop_job *j = arg;
    for (int i = 0; i < j->iters; i++) {
        j->fn(j->call, ith, nth);
        kw_pool_barrier(j->pool);
    }
}

/* c: a call check_call prepared. */
static double per_op_us(kw_pool *pool, kw_op_id op, const kw_call *c, int iters) {
    kw_call call = *c;
    const size_t ws = work_of(op, c);
    call.work = ws ? alloc_or_die(ws * (size_t)kw_pool_size(pool)) : NULL;
    call.work_stride = ws;
    loop_job j = {pool, kw_op_get(op)->kernel, &call, iters};
    const double t = time_runs(pool, loop_task, &j, g_quick ? 5 : 11);
    if (call.work) kw_mem_free(call.work, ws * (size_t)kw_pool_size(pool));
    return t / iters * 1e6;
}

/* ---- attention: B 1, D 64, caches of S positions of which the first `valid`
 * are written; L query positions at the end of them, causal. ---- */

static void put(void *p, int64_t i, kw_dtype dt, float x) {
    if (dt == KW_BF16) {
        uint32_t u;
        memcpy(&u, &x, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = x;
    }
}

static double attention_us(kw_pool *pool, kw_dtype dt, int64_t Hq, int64_t Hkv, int64_t L, int64_t valid, int64_t S) {
    const int64_t D = 64;
    const size_t es = kw_dtype_size(dt), qbytes = (size_t)(Hq * L * D) * es, cache_bytes = (size_t)(Hkv * S * D) * es;
    char *q = alloc_or_die(qbytes), *o = alloc_or_die(qbytes), *k = alloc_or_die(cache_bytes), *v = alloc_or_die(cache_bytes);
    uint8_t *mask = alloc_or_die((size_t)(L * S));
    for (int64_t i = 0; i < Hq * L * D; i++) put(q, i, dt, 1.0f + (float)(i % 64) / 64);
    for (int64_t i = 0; i < Hkv * S * D; i++) put(k, i, dt, 1.0f + (float)(i % 97) / 97), put(v, i, dt, 1.0f);
    for (int64_t i = 0; i < L; i++)
        for (int64_t s = 0; s < S; s++) mask[i * S + s] = s <= valid - L + i;
    /* q and out as HF makes them: [B, L, Hq, D] memory viewed as [B, Hq, L, D] */
    kw_call c = {0};
    c.t[0] = (kw_tensor){o, dt, 4, {1, Hq, L, D}, {L * Hq * D, D, Hq * D, 1}};
    c.t[1] = (kw_tensor){q, dt, 4, {1, Hq, L, D}, {L * Hq * D, D, Hq * D, 1}};
    c.t[2] = (kw_tensor){k, dt, 4, {1, Hkv, S, D}, {Hkv * S * D, S * D, D, 1}};
    c.t[3] = (kw_tensor){v, dt, 4, {1, Hkv, S, D}, {Hkv * S * D, S * D, D, 1}};
    c.t[4] = (kw_tensor){mask, KW_BOOL, 4, {1, 1, L, S}, {L * S, L * S, S, 1}};
    c.fp[0] = 0.125;
    check_call(KW_OP_ATTENTION, &c);
    const double us = per_op_us(pool, KW_OP_ATTENTION, &c, (g_quick ? 2000 : 10000) / (int)(L * 4 + 10) + 1);
    kw_mem_free(q, qbytes);
    kw_mem_free(o, qbytes);
    kw_mem_free(k, cache_bytes);
    kw_mem_free(v, cache_bytes);
    kw_mem_free(mask, (size_t)(L * S));
    return us;
}

/* Steps of L = 1, 5, 8 and 128 positions, SmolLM2-360M's heads (15 q, 5 kv),
 * the last at 512 of 1024 cached positions. */
static void attention_steps(kw_pool *pool, FILE *out) {
    static const int64_t steps_L[] = {1, 5, 8, 128};
    fprintf(stderr, "attention steps...\n");
    fprintf(out, ", \"attention_steps_us\": [");
    for (int di = 0; di < 2; di++)
        for (int li = 0; li < 4; li++) {
            const kw_dtype dt = di ? KW_BF16 : KW_F32;
            const int64_t L = steps_L[li];
            fprintf(out, "%s{\"dtype\": \"%s\", \"L\": %lld, \"valid\": 512, \"us\": %.2f}", di || li ? ", " : "",
                    kw_dtype_name(dt), (long long)L, attention_us(pool, dt, 15, 5, L, 512, 1024));
        }
    fprintf(out, "]");
}

/* An encoder's attention, ViT-base's at batch 8: 12 heads of 64, 197 positions
 * attending to all 197 (no mask), q, k, v and out as [B, L, H, D] memory viewed
 * as [B, H, L, D], as the model's reshapes give them. */
static double attention_encoder_us(kw_pool *pool, kw_dtype dt) {
    const int64_t B = 8, H = 12, L = 197, D = 64, n = B * L * H * D;
    const size_t bytes = (size_t)n * kw_dtype_size(dt);
    char *t[4];
    for (int i = 0; i < 4; i++) t[i] = alloc_or_die(bytes);
    for (int64_t i = 0; i < n; i++)
        put(t[1], i, dt, (float)(i % 61) / 61 - 0.5f), put(t[2], i, dt, (float)(i % 97) / 97 - 0.5f),
            put(t[3], i, dt, (float)(i % 89) / 89);
    kw_call c = {0};
    for (int i = 0; i < 4; i++) c.t[i] = (kw_tensor){t[i], dt, 4, {B, H, L, D}, {L * H * D, D, H * D, 1}};
    c.fp[0] = 0.125;
    check_call(KW_OP_ATTENTION, &c);
    const double us = per_op_us(pool, KW_OP_ATTENTION, &c, g_quick ? 5 : 25);
    for (int i = 0; i < 4; i++) kw_mem_free(t[i], bytes);
    return us;
}

static void attention_encoder(kw_pool *pool, FILE *out) {
    fprintf(stderr, "attention of an encoder...\n");
    fprintf(out, ", \"attention_encoder_us\": {\"float32\": %.1f, \"bfloat16\": %.1f}", attention_encoder_us(pool, KW_F32),
            attention_encoder_us(pool, KW_BF16));
}

/* ---- linear vs matmul_dnnl for M rows over one layer's gate, up and down ---- */

typedef struct mm_job {
    kw_pool *pool;
    kw_kernel_fn fn;
    const kw_call *call; /* 3 calls */
} mm_job;

static void mm_task(void *arg, int ith, int nth) {
    mm_job *j = arg;
    for (int i = 0; i < 3; i++) {
        j->fn(&j->call[i], ith, nth);
        kw_pool_barrier(j->pool);
    }
}

/* linear over weights of dtype lin_wt (a bf16 copy of bf16-valued f32 weights
 * under f32 x) against matmul_dnnl over weights of x's dtype dt; linear alone
 * where oneDNN makes no such matmul (dnnl 0: its times are null). */
static void crossover(kw_pool *pool, kw_dtype dt, kw_dtype lin_wt, const char *key, const weights *w, int dnnl,
                      FILE *out) {
    static const int64_t Ms[] = {1, 2, 4, 5, 8, 16, 32, 64, 128};
    const int nm = g_quick ? 7 : 9;
    const shape sh[3] = {{8192, 2048}, {8192, 2048}, {2048, 8192}};
    double lin[9], dnn[9];
    int64_t cross = -1;
    for (int mi = 0; mi < nm; mi++) {
        const int64_t M = Ms[mi];
        kw_call plain[3], packed[3]; /* oneDNN reads [N, K]; linear the layout capture gives it */
        char *p = w->mem;
        size_t ws = 0;
        for (int i = 0; i < 3; i++) {
            kw_call *c = &plain[i];
            memset(c, 0, sizeof *c);
            c->t[0] = tensor2(w->y, dt, M, sh[i].n);
            c->t[1] = tensor2(w->x, dt, M, sh[i].k);
            c->t[2] = tensor2(p, dt, sh[i].n, sh[i].k);
            if (dnnl) check_call(KW_OP_MATMUL_DNNL, c);
            packed[i] = *c;
            packed[i].t[2].dtype = lin_wt;
            const int64_t B = kw_linear_block(sh[i].k);
            if (B) packed[i].t[2] = (kw_tensor){p, lin_wt, 3, {sh[i].k / B, sh[i].n, B}, {sh[i].n * B, B, 1}};
            check_call(KW_OP_LINEAR, &packed[i]);
            p += (size_t)(sh[i].n * sh[i].k) * kw_dtype_size(dt);
            const size_t s = work_of(KW_OP_LINEAR, &packed[i]), sd = dnnl ? work_of(KW_OP_MATMUL_DNNL, c) : 0;
            ws = s > ws ? s : ws;
            ws = sd > ws ? sd : ws;
        }
        ws = (ws + 63) / 64 * 64;
        void *work = ws ? alloc_or_die(ws * (size_t)kw_pool_size(pool)) : NULL;
        for (int i = 0; i < 3; i++)
            plain[i].work = packed[i].work = work, plain[i].work_stride = packed[i].work_stride = ws;
        const int reps = g_quick ? 3 : 5;
        mm_job j = {pool, kw_op_get(KW_OP_LINEAR)->kernel, packed};
        lin[mi] = time_runs(pool, mm_task, &j, reps) * 1e6;
        j = (mm_job){pool, kw_op_get(KW_OP_MATMUL_DNNL)->kernel, plain};
        dnn[mi] = dnnl ? time_runs(pool, mm_task, &j, reps) * 1e6 : -1;
        if (work) kw_mem_free(work, ws * (size_t)kw_pool_size(pool));
        if (dnnl && dnn[mi] < lin[mi] && cross < 0) cross = M;
        if (dnn[mi] >= lin[mi]) cross = -1; /* the crossover is where dnnl stays ahead */
        fprintf(stderr, "  %s M=%lld: linear %.0f us", key, (long long)M, lin[mi]);
        fprintf(stderr, dnnl ? ", dnnl %.0f us\n" : "\n", dnn[mi]);
    }
    fprintf(out, "\"%s\": {\"M\": [", key);
    for (int i = 0; i < nm; i++) fprintf(out, "%s%lld", i ? ", " : "", (long long)Ms[i]);
    fprintf(out, "], \"linear_us\": [");
    for (int i = 0; i < nm; i++) fprintf(out, "%s%.1f", i ? ", " : "", lin[i]);
    fprintf(out, "], \"dnnl_us\": [");
    for (int i = 0; i < nm; i++) fprintf(out, dnnl ? "%s%.1f" : "%snull", i ? ", " : "", dnn[i]);
    fprintf(out, "], \"crossover_m\": %lld}", (long long)cross);
}

/* ---- other decode-sized ops (Llama-3.2-1B, bf16) ---- */

static void decode_ops(kw_pool *pool, FILE *out) {
    const int iters = g_quick ? 500 : 2000;
    const size_t big = (size_t)128256 * 4;
    char *a = alloc_or_die(big), *b = alloc_or_die(big), *y = alloc_or_die(big), *w = alloc_or_die(big);
    int64_t *idx = alloc_or_die(64);
    fill(pool, a, big), fill(pool, b, big), fill(pool, w, big);
    kw_call c;
    double us;

    fprintf(out, "{");
    memset(&c, 0, sizeof c); /* rms_norm over the hidden state */
    c.t[0] = tensor2(y, KW_BF16, 1, 2048), c.t[1] = tensor2(a, KW_BF16, 1, 2048);
    c.t[2] = (kw_tensor){w, KW_BF16, 1, {2048}, {1}};
    c.fp[0] = 1e-5;
    check_call(KW_OP_RMS_NORM, &c);
    us = per_op_us(pool, KW_OP_RMS_NORM, &c, iters);
    fprintf(out, "\"rms_norm_2048\": %.3f", us);

    memset(&c, 0, sizeof c); /* add_rms_norm */
    c.t[0] = tensor2(y, KW_BF16, 1, 2048), c.t[1] = tensor2(b, KW_BF16, 1, 2048);
    c.t[2] = tensor2(a, KW_BF16, 1, 2048), c.t[3] = tensor2(a + 8192, KW_BF16, 1, 2048);
    c.t[4] = (kw_tensor){w, KW_BF16, 1, {2048}, {1}};
    c.fp[0] = 1e-5;
    check_call(KW_OP_ADD_RMS_NORM, &c);
    fprintf(out, ", \"add_rms_norm_2048\": %.3f", per_op_us(pool, KW_OP_ADD_RMS_NORM, &c, iters));

    memset(&c, 0, sizeof c); /* rotary on q: [1, 32, 1, 64] */
    c.t[0] = (kw_tensor){y, KW_BF16, 4, {1, 32, 1, 64}, {2048, 64, 64, 1}};
    c.t[1] = (kw_tensor){a, KW_BF16, 4, {1, 32, 1, 64}, {2048, 64, 64, 1}};
    c.t[2] = (kw_tensor){b, KW_BF16, 4, {1, 1, 1, 64}, {64, 64, 64, 1}};
    c.t[3] = (kw_tensor){w, KW_BF16, 4, {1, 1, 1, 64}, {64, 64, 64, 1}};
    check_call(KW_OP_ROTARY, &c);
    fprintf(out, ", \"rotary_q\": %.3f", per_op_us(pool, KW_OP_ROTARY, &c, iters));

    memset(&c, 0, sizeof c); /* silu_mul over the MLP */
    c.t[0] = tensor2(y, KW_BF16, 1, 8192), c.t[1] = tensor2(a, KW_BF16, 1, 8192), c.t[2] = tensor2(b, KW_BF16, 1, 8192);
    check_call(KW_OP_SILU_MUL, &c);
    fprintf(out, ", \"silu_mul_8192\": %.3f", per_op_us(pool, KW_OP_SILU_MUL, &c, iters));

    memset(&c, 0, sizeof c); /* the KV cache write of one position: [1, 8, 4096, 64] */
    char *cache = alloc_or_die((size_t)8 * 4096 * 64 * 2);
    idx[0] = 1234;
    c.t[0] = (kw_tensor){cache, KW_BF16, 4, {1, 8, 4096, 64}, {8 * 4096 * 64, 4096 * 64, 64, 1}};
    c.t[1] = (kw_tensor){a, KW_BF16, 4, {1, 8, 1, 64}, {512, 64, 64, 1}};
    c.t[2] = (kw_tensor){idx, KW_I64, 1, {1}, {1}};
    check_call(KW_OP_KV_WRITE, &c);
    fprintf(out, ", \"kv_write\": %.3f", per_op_us(pool, KW_OP_KV_WRITE, &c, iters));
    kw_mem_free(cache, (size_t)8 * 4096 * 64 * 2);
    fprintf(out, "}");
    kw_mem_free(a, big), kw_mem_free(b, big), kw_mem_free(y, big), kw_mem_free(w, big), kw_mem_free(idx, 64);
}

/* Every measure but dnnl_crossover, in the JSON's order. */
static void everything_but_linear(kw_pool *pool, kw_pool *solo, const weights *w, const shape *sh, int n, FILE *out) {
    bandwidth(pool, w, sh, n, out);

    fprintf(stderr, "barrier...\n");
    kw_call nop = {0};
    const int iters = g_quick ? 20000 : 100000;
    fprintf(out, ", \"barrier_us\": {\"1\": %.4f", per_op_us(solo, KW_OP_NOP, &nop, iters));
    if (kw_pool_size(pool) > 1)
        fprintf(out, ", \"%d\": %.4f", kw_pool_size(pool), per_op_us(pool, KW_OP_NOP, &nop, iters));
    fprintf(out, "}");

    fprintf(stderr, "attention...\n");
    const double a256 = attention_us(pool, KW_BF16, 32, 8, 1, 128, 256), a4096 = attention_us(pool, KW_BF16, 32, 8, 1, 128, 4096);
    fprintf(out, ", \"attention_us\": {\"S256\": %.3f, \"S4096\": %.3f}", a256, a4096);
    attention_steps(pool, out);
    attention_encoder(pool, out);

    fprintf(stderr, "decode ops...\n");
    fprintf(out, ", \"ops_us\": ");
    decode_ops(pool, out);
}

int main(int argc, char **argv) {
    int threads = 0, read_only = 0, attention_only = 0, linear_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            g_quick = 1;
        else if (!strcmp(argv[i], "--read-only"))
            read_only = 1;
        else if (!strcmp(argv[i], "--attention"))
            attention_only = 1;
        else if (!strcmp(argv[i], "--linear"))
            linear_only = 1;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: ops_bench [--threads N] [--quick] [--read-only | --attention | --linear]\n");
            return 2;
        }
    }
    if (threads < 1) threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    g_threads = threads;
    const char *problems = kw_cpu_env_problems();
    if (problems) fprintf(stderr, "ops_bench: %s\n", problems);
    kw_pool *pool = kw_pool_create(threads), *solo = kw_pool_create(1);
    FILE *out = stdout;
    if (read_only) {
        printf("{\"threads\": %d, \"read_gbs\": %.2f}\n", threads, read_bandwidth(pool, 7));
        return 0;
    }
    fprintf(out, "{\"threads\": %d, \"isa\": \"%s\", \"quick\": %s", threads, kw_isa_name(kw_cpu_isa()),
            g_quick ? "true" : "false");
    if (attention_only) {
        attention_steps(pool, out);
        attention_encoder(pool, out);
        fprintf(out, "}\n");
        return 0;
    }

    /* The weights: lm_head + 5 layers = 1.13 GB in bf16, 2.27 GB in f32. */
    shape sh[MAX_MATS];
    const int n = llama_shapes(sh, 5);
    weights w = {0};
    for (int i = 0; i < n; i++) w.bytes += (size_t)(sh[i].n * sh[i].k) * 4;
    w.mem = alloc_or_die(w.bytes);
    fill(pool, w.mem, w.bytes);
    w.x = alloc_or_die((size_t)128 * 8192 * 4);
    w.y = alloc_or_die((size_t)128 * 128256 * 4);
    for (int i = 0; i < 128 * 8192; i++) w.x[i] = 0.01f;
    if (!linear_only) everything_but_linear(pool, solo, &w, sh, n, out);

    fprintf(stderr, "linear vs matmul_dnnl...\n");
    fprintf(out, ", \"dnnl_crossover\": {");
    crossover(pool, KW_F32, KW_F32, "f32", &w, 1, out);
    fprintf(out, ", ");
    crossover(pool, KW_F32, KW_BF16, "f32 x, bf16 copy", &w, 1, out);
    fprintf(out, ", ");
    /* no bf16 matmul in oneDNN below AVX-512: linear's times alone */
    crossover(pool, KW_BF16, KW_BF16, "bf16", &w, kw_dnnl_has_bf16_matmul(), out);
    fprintf(out, "}}\n");

    kw_mem_free(w.mem, w.bytes);
    kw_mem_free(w.x, (size_t)128 * 8192 * 4);
    kw_mem_free(w.y, (size_t)128 * 128256 * 4);
    kw_pool_destroy(pool);
    kw_pool_destroy(solo);
    return 0;
}
