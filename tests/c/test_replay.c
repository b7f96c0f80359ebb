/* runtime/: replaying a plan equals calling its kernels one by one; fallbacks,
 * per-call pointers, busy plans, profiling; two plans replayed at once from two
 * threads. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kw_capture.h"
#include "kw_ops.h"

enum { M = 3, K = 8, H = 48, N = 16 };

/* x [M, K] -> fc1 (w1 [H, K]) -> h [M, H] -> relu (a fallback, in place) ->
 * fc2 (w2 [N, H]) -> out [M, N]. */
typedef struct mlp {
    float w1[H * K], w2[N * H];
    kw_plan *plan;
} mlp;

static void fill(float *p, int n, unsigned seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = (float)((seed >> 9) % 2001) / 1000.0f - 1.0f;
    }
}

static kw_tensor tensor2(void *data, int64_t rows, int64_t cols) {
    return (kw_tensor){.data = data, .dtype = KW_F32, .ndim = 2, .shape = {rows, cols}, .stride = {cols, 1}};
}

static int relu(void *user, kw_tensor *views, int n) {
    (void)user;
    if (n != 1) return 1;
    float *h = views[0].data;
    for (int64_t i = 0; i < views[0].shape[0] * views[0].shape[1]; i++) h[i] = h[i] > 0 ? h[i] : 0;
    return 0;
}

static void run_linear(float *y, const float *x, const float *w, int64_t m, int64_t k, int64_t n) {
    kw_call c = {.t = {tensor2(y, m, n), tensor2((void *)x, m, k), tensor2((void *)w, n, k)}};
    void *prep = malloc(kw_op_prep_size(KW_OP_LINEAR));
    cr_assert_eq(kw_op_prepare(KW_OP_LINEAR, &c, kw_cpu_isa(), prep, NULL, 0), 0);
    kw_op_get(KW_OP_LINEAR)->kernel(&c, 0, 1);
    free(prep);
}

/* The same program as the plan, one kernel call at a time. */
static void reference(const mlp *m, const float *x, float *out, int with_relu) {
    float h[M * H];
    run_linear(h, x, m->w1, M, K, H);
    if (with_relu) {
        kw_tensor t = tensor2(h, M, H);
        relu(NULL, &t, 1);
    }
    run_linear(out, h, m->w2, M, H, N);
}

static int view2(kw_builder *b, int buf, int64_t rows, int64_t cols) {
    const int64_t shape[2] = {rows, cols};
    return kw_builder_view(b, buf, KW_F32, 2, shape, NULL, 0);
}

static void mlp_init(mlp *m, unsigned seed, int with_relu, kw_fallback_fn fallback, int n_threads) {
    fill(m->w1, H * K, seed);
    fill(m->w2, N * H, seed + 1);
    kw_builder *b = kw_builder_create();
    const int x = kw_builder_input(b, "x", sizeof(float) * M * K);
    const int out = kw_builder_output(b, "out", sizeof(float) * M * N);
    const int w1 = kw_builder_constant(b, "w1", m->w1, sizeof m->w1);
    const int w2 = kw_builder_constant(b, "w2", m->w2, sizeof m->w2);
    const int h = kw_builder_arena(b, "h", sizeof(float) * M * H);
    const int vh = view2(b, h, M, H);
    const int fc1[3] = {vh, view2(b, x, M, K), view2(b, w1, H, K)};
    const int fc2[3] = {view2(b, out, M, N), vh, view2(b, w2, N, H)};
    kw_builder_op(b, KW_OP_LINEAR, fc1, 3, NULL, 0, NULL, 0);
    if (with_relu) kw_builder_fallback(b, fallback ? fallback : relu, NULL, &vh, "m", 1);
    kw_builder_op(b, KW_OP_LINEAR, fc2, 3, NULL, 0, NULL, 0);
    char msg[256];
    const kw_finish_opts o = {.n_threads = n_threads, .isa = -1};
    cr_assert_eq(kw_builder_finish(b, &o, &m->plan, msg, sizeof msg), 0, "%s", msg);
    kw_builder_destroy(b);
}

static void expect_replay_matches(mlp *m, kw_pool *pool, unsigned seed, int with_relu) {
    float x[M * K], out[M * N], ref[M * N];
    fill(x, M * K, seed);
    memset(out, 0xff, sizeof out);
    reference(m, x, ref, with_relu);
    void *slots[2] = {x, out};
    cr_assert_eq(kw_plan_replay(m->plan, pool, slots), 0);
    cr_assert_arr_eq(out, ref, sizeof out, "replay differs from the kernels called one by one");
}

Test(replay, equals_the_kernels_called_one_by_one_at_1_2_and_3_threads) {
    for (int nth = 1; nth <= 3; nth++) {
        kw_pool *pool = kw_pool_create(nth);
        mlp *m = calloc(1, sizeof *m);
        mlp_init(m, 7, 0, NULL, 3);
        for (unsigned call = 0; call < 5; call++) expect_replay_matches(m, pool, 100 + call, 0);
        kw_plan_destroy(m->plan);
        free(m);
        kw_pool_destroy(pool);
    }
}

Test(replay, a_fallback_runs_between_kernels) {
    kw_pool *pool = kw_pool_create(2);
    mlp *m = calloc(1, sizeof *m);
    mlp_init(m, 9, 1, NULL, 2);
    for (unsigned call = 0; call < 5; call++) expect_replay_matches(m, pool, 200 + call, 1);
    char *dump = kw_plan_dump(m->plan);
    cr_expect(strstr(dump, "fallback"));
    free(dump);
    kw_plan_destroy(m->plan);
    free(m);
    kw_pool_destroy(pool);
}

static int failing(void *user, kw_tensor *views, int n) {
    (void)user, (void)views, (void)n;
    return 1;
}

Test(replay, a_failing_fallback_stops_the_replay) {
    kw_pool *pool = kw_pool_create(2);
    mlp *m = calloc(1, sizeof *m);
    mlp_init(m, 9, 1, failing, 2);
    float x[M * K] = {0}, out[M * N];
    memset(out, 0x7f, sizeof out);
    void *slots[2] = {x, out};
    cr_expect_eq(kw_plan_replay(m->plan, pool, slots), KW_ECALLBACK);
    for (int i = 0; i < M * N; i++) cr_assert_eq(((unsigned *)out)[i], 0x7f7f7f7fu, "fc2 ran after the failure");
    kw_plan_destroy(m->plan);
    free(m);
    kw_pool_destroy(pool);
}

/* Two host steps in a row, the second failing: the threads that waited at the
 * first one's barrier once read its verdict from a flag that thread 0, already
 * through that barrier, had set for the second; they left, and thread 0 waited
 * for them at the second one's barrier forever. */
static int zeroing(void *user, kw_tensor *views, int n) {
    (void)user;
    for (int i = 0; i < n; i++) memset(views[i].data, 0, sizeof(float) * views[i].shape[0] * views[i].shape[1]);
    return 0;
}

Test(replay, a_host_step_failing_after_another_stops_every_thread, .timeout = 60) {
    kw_pool *pool = kw_pool_create(2);
    kw_builder *b = kw_builder_create();
    const int h = kw_builder_arena(b, "h", sizeof(float) * M * H);
    const int vh = view2(b, h, M, H);
    kw_builder_fallback(b, zeroing, NULL, &vh, "w", 1);
    kw_builder_fallback(b, failing, NULL, &vh, "m", 1);
    kw_plan *plan;
    char msg[256];
    const kw_finish_opts o = {.n_threads = 2, .isa = -1};
    cr_assert_eq(kw_builder_finish(b, &o, &plan, msg, sizeof msg), 0, "%s", msg);
    kw_builder_destroy(b);
    for (int call = 0; call < 2000; call++) cr_assert_eq(kw_plan_replay(plan, pool, NULL), KW_ECALLBACK);
    kw_plan_destroy(plan);
    kw_pool_destroy(pool);
}

/* ---- re-entry, binding, misuse -------------------------------------------- */

static kw_plan *reentry_plan;
static kw_pool *reentry_pool;
static int reentry_rc;

static int replay_again(void *user, kw_tensor *views, int n) {
    (void)views, (void)n;
    reentry_rc = kw_plan_replay(reentry_plan, reentry_pool, user);
    return 0;
}

Test(replay, a_plan_replayed_while_it_replays_is_busy) {
    kw_builder *b = kw_builder_create();
    const int x = kw_builder_input(b, "x", 4);
    const int64_t one[1] = {1};
    const int v = kw_builder_view(b, x, KW_F32, 1, one, NULL, 0);
    float xv = 0;
    void *slots[1] = {&xv};
    kw_builder_fallback(b, replay_again, slots, &v, "r", 1);
    cr_assert_eq(kw_builder_finish(b, NULL, &reentry_plan, NULL, 0), 0);
    reentry_pool = kw_pool_create(1);
    cr_expect_eq(kw_plan_replay(reentry_plan, reentry_pool, slots), 0);
    cr_expect_eq(reentry_rc, KW_EBUSY);
    cr_expect_eq(kw_plan_replay(reentry_plan, reentry_pool, slots), 0, "the busy flag is cleared after a replay");
    kw_plan_destroy(reentry_plan);
    kw_pool_destroy(reentry_pool);
    kw_builder_destroy(b);
}

/* Every call brings its own pointers: an input or output that moved is read and
 * written at its new address. */
Test(replay, each_call_binds_its_own_pointers) {
    static float w[N * K], out[2][N], x[2][K];
    fill(w, N * K, 3);
    fill(x[0], K, 4);
    fill(x[1], K, 5);
    kw_builder *b = kw_builder_create();
    const int bx = kw_builder_input(b, "x", sizeof x[0]);
    const int by = kw_builder_input(b, "out", sizeof out[0]);
    const int bw = kw_builder_constant(b, "w", w, sizeof w);
    const int v[3] = {view2(b, by, 1, N), view2(b, bx, 1, K), view2(b, bw, N, K)};
    kw_builder_op(b, KW_OP_LINEAR, v, 3, NULL, 0, NULL, 0);
    kw_plan *plan;
    const kw_finish_opts o = {.n_threads = 2, .isa = -1};
    cr_assert_eq(kw_builder_finish(b, &o, &plan, NULL, 0), 0);
    kw_pool *pool = kw_pool_create(2);
    for (int i = 0; i < 2; i++) {
        void *slots[2] = {x[i], out[i]};
        cr_expect_eq(kw_plan_replay(plan, pool, slots), 0);
        float ref[N];
        run_linear(ref, x[i], w, 1, K, N);
        cr_expect_arr_eq(out[i], ref, sizeof ref, "call %d", i);
    }
    void *null_input[2] = {NULL, out[0]};
    cr_expect_eq(kw_plan_replay(plan, pool, null_input), KW_EINVAL);
    kw_pool *big = kw_pool_create(3);
    void *right[2] = {x[0], out[0]};
    cr_expect_eq(kw_plan_replay(plan, big, right), KW_EINVAL, "a pool larger than the plan's threads");
    kw_pool_destroy(big);
    kw_pool_destroy(pool);
    kw_plan_destroy(plan);
    kw_builder_destroy(b);
}

/* A cache position out of range cannot raise inside a kernel: the row is
 * skipped, the replay answers KW_EINDEX, and the plan says which step met
 * which index. */
Test(replay, an_index_out_of_range_in_the_data_fails_the_replay_and_names_the_step) {
    enum { S = 6, D = 4 };
    static float cache[S * D], src[D];
    static int64_t pos;
    kw_builder *b = kw_builder_create();
    const int bc = kw_builder_input(b, "cache", sizeof cache), bs = kw_builder_input(b, "src", sizeof src),
              bp = kw_builder_input(b, "pos", sizeof pos);
    const int64_t cshape[4] = {1, 1, S, D}, sshape[4] = {1, 1, 1, D}, pshape[1] = {1};
    const int v[3] = {kw_builder_view(b, bc, KW_F32, 4, cshape, NULL, 0), kw_builder_view(b, bs, KW_F32, 4, sshape, NULL, 0),
                      kw_builder_view(b, bp, KW_I64, 1, pshape, NULL, 0)};
    const int step = kw_builder_op(b, KW_OP_KV_WRITE, v, 3, NULL, 0, NULL, 0);
    kw_builder_label(b, step, "k_write");
    kw_plan *plan;
    const kw_finish_opts o = {.n_threads = 2, .isa = -1};
    cr_assert_eq(kw_builder_finish(b, &o, &plan, NULL, 0), 0);
    kw_pool *pool = kw_pool_create(2);
    void *slots[3] = {cache, src, &pos};
    fill(src, D, 1);
    int got_step = -1;
    int64_t index = 0, size = 0;
    for (int64_t p = -1; p <= S; p++) {
        pos = p;
        const int bad = p < 0 || p >= S;
        cr_expect_eq(kw_plan_replay(plan, pool, slots), bad ? KW_EINDEX : 0, "pos %lld", (long long)p);
        cr_expect_eq(kw_plan_fault(plan, &got_step, &index, &size), bad);
        if (bad) cr_expect(got_step == step && index == p && size == S);
        if (!bad) cr_expect_arr_eq(cache + p * D, src, sizeof src);
    }
    kw_pool_destroy(pool);
    kw_plan_destroy(plan);
    kw_builder_destroy(b);
}

/* What a step computed past a skipped row must not reach the call's inputs
 * (PyTorch raises before it writes): a cache position out of range stops the
 * replay at the next barrier, here before the linear that reads the cache.
 * Every thread must stop at that same barrier (one that went on would wait
 * for the others forever): many replays, bad and good positions in turn, at
 * 1 and 2 threads, profiled and not. */
Test(replay, no_step_after_the_barrier_that_follows_a_reported_index_runs) {
    enum { S = 4, D = 4, N2 = 8 };
    static float cache[S * D], src[D], w[N2 * S * D], out[N2], ref[N2];
    static int64_t pos;
    fill(w, N2 * S * D, 7);
    for (int threads = 1; threads <= 2; threads++)
        for (int profiled = 0; profiled <= 1; profiled++) {
            kw_builder *b = kw_builder_create();
            const int bc = kw_builder_input(b, "cache", sizeof cache), bs = kw_builder_input(b, "src", sizeof src),
                      bp = kw_builder_input(b, "pos", sizeof pos), bo = kw_builder_input(b, "out", sizeof out),
                      bw = kw_builder_constant(b, "w", w, sizeof w);
            const int64_t cshape[4] = {1, 1, S, D}, sshape[4] = {1, 1, 1, D}, pshape[1] = {1};
            const int write[3] = {kw_builder_view(b, bc, KW_F32, 4, cshape, NULL, 0),
                                  kw_builder_view(b, bs, KW_F32, 4, sshape, NULL, 0),
                                  kw_builder_view(b, bp, KW_I64, 1, pshape, NULL, 0)};
            kw_builder_op(b, KW_OP_KV_WRITE, write, 3, NULL, 0, NULL, 0);
            const int read[3] = {view2(b, bo, 1, N2), view2(b, bc, 1, S * D), view2(b, bw, N2, S * D)};
            kw_builder_op(b, KW_OP_LINEAR, read, 3, NULL, 0, NULL, 0);
            kw_plan *plan;
            const kw_finish_opts o = {.n_threads = threads, .isa = -1};
            cr_assert_eq(kw_builder_finish(b, &o, &plan, NULL, 0), 0);
            kw_plan_set_profiling(plan, profiled);
            kw_pool *pool = kw_pool_create(threads);
            void *slots[4] = {cache, src, &pos, out};
            memset(cache, 0, sizeof cache);
            for (int i = 0; i < 400; i++) {
                const int bad = i % 2;
                pos = bad ? S + i % 3 : i / 2 % S;
                fill(src, D, (unsigned)i);
                memset(out, 0x7f, sizeof out);
                cr_assert_eq(kw_plan_replay(plan, pool, slots), bad ? KW_EINDEX : 0, "replay %d", i);
                if (bad) {
                    for (int j = 0; j < N2; j++)
                        cr_assert_eq(((unsigned *)out)[j], 0x7f7f7f7fu, "%d threads: the linear ran after the fault", threads);
                } else {
                    run_linear(ref, cache, w, 1, S * D, N2);
                    cr_assert_arr_eq(out, ref, sizeof ref, "replay %d", i);
                }
            }
            kw_pool_destroy(pool);
            kw_plan_destroy(plan);
            kw_builder_destroy(b);
        }
}

Test(replay, profiling_counts_replays_and_time_per_step) {
    kw_pool *pool = kw_pool_create(2);
    mlp *m = calloc(1, sizeof *m);
    mlp_init(m, 5, 1, NULL, 2);
    kw_plan_set_profiling(m->plan, 1);
    for (unsigned call = 0; call < 3; call++) expect_replay_matches(m, pool, 300 + call, 1);
    uint64_t runs;
    const uint64_t *ns = kw_plan_profile(m->plan, &runs);
    cr_expect_eq(runs, 3);
    cr_expect_gt(ns[0] + ns[1] + ns[2], 0);
    cr_expect_str_eq(kw_plan_step_name(m->plan, 1), "fallback");
    kw_plan_set_profiling(m->plan, 0);
    expect_replay_matches(m, pool, 400, 1);
    kw_plan_profile(m->plan, &runs);
    cr_expect_eq(runs, 0, "turning profiling off (and on) clears the counters");
    kw_plan_destroy(m->plan);
    free(m);
    kw_pool_destroy(pool);
}

/* ---- two plans, two threads ----------------------------------------------------- */

typedef struct worker {
    mlp *m;
    kw_pool *pool;
    unsigned seed;
    int failures;
} worker;

static void *replay_many(void *arg) {
    worker *w = arg;
    for (unsigned call = 0; call < 300; call++) {
        float x[M * K], out[M * N], ref[M * N];
        fill(x, M * K, w->seed + call);
        reference(w->m, x, ref, 1);
        void *slots[2] = {x, out};
        if (kw_plan_replay(w->m->plan, w->pool, slots) != 0 || memcmp(out, ref, sizeof out)) w->failures++;
    }
    return NULL;
}

static void two_plans_at_once(int shared_pool) {
    mlp *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    mlp_init(a, 11, 1, NULL, 2);
    mlp_init(b, 12, 1, NULL, 2);
    kw_pool *p1 = kw_pool_create(2), *p2 = shared_pool ? p1 : kw_pool_create(2);
    worker wa = {a, p1, 1000, 0}, wb = {b, p2, 2000, 0};
    pthread_t ta, tb;
    pthread_create(&ta, NULL, replay_many, &wa);
    pthread_create(&tb, NULL, replay_many, &wb);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    cr_expect_eq(wa.failures, 0);
    cr_expect_eq(wb.failures, 0);
    if (!shared_pool) kw_pool_destroy(p2);
    kw_pool_destroy(p1);
    kw_plan_destroy(a->plan);
    kw_plan_destroy(b->plan);
    free(a);
    free(b);
}

Test(replay, two_plans_on_two_pools_from_two_threads) { two_plans_at_once(0); }

Test(replay, two_plans_on_one_pool_from_two_threads) { two_plans_at_once(1); }
