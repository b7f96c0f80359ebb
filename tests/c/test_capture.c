/* capture/: every validation failure has its own code and a message naming the
 * step; the arena planner never overlaps live buffers and is optimal on small
 * problems; barriers go exactly where a step depends on an earlier one. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kw_capture.h"
#include "kw_ops.h"
#include "kw_plan_impl.h"

static float weights[64 * 64];

static int view2(kw_builder *b, int buf, kw_dtype dt, int64_t rows, int64_t cols, size_t offset) {
    const int64_t shape[2] = {rows, cols};
    return kw_builder_view(b, buf, dt, 2, shape, NULL, offset);
}

static int linear(kw_builder *b, int y, int x, int w) {
    const int v[3] = {y, x, w};
    return kw_builder_op(b, KW_OP_LINEAR, v, 3, NULL, 0, NULL, 0);
}

static int finish(kw_builder *b, kw_plan **plan, char *msg, size_t len) {
    const kw_finish_opts o = {.n_threads = 2, .isa = -1};
    return kw_builder_finish(b, &o, plan, msg, len);
}

/* Expects finish to fail with `err` and a message containing each of `parts`. */
static void expect_failure(kw_builder *b, int err, const char *part1, const char *part2) {
    char msg[512];
    kw_plan *plan = (kw_plan *)1;
    const int rc = finish(b, &plan, msg, sizeof msg);
    cr_expect_eq(rc, err, "got %d (%s), message: %s", rc, kw_strerror(rc), msg);
    cr_expect_null(plan);
    cr_expect(strstr(msg, part1) != NULL, "message '%s' lacks '%s'", msg, part1);
    if (part2) cr_expect(strstr(msg, part2) != NULL, "message '%s' lacks '%s'", msg, part2);
    kw_builder_destroy(b);
}

/* x [4, 8] -> fc1 (arena h [4, 16]) -> fc2 -> out [4, 8]; pieces are then broken. */
typedef struct mlp {
    kw_builder *b;
    int x, w1, w2, h, out;
    int vx, vw1, vw2, vh, vout;
} mlp;

static mlp mlp_new(void) {
    mlp m = {.b = kw_builder_create()};
    m.x = kw_builder_input(m.b, "x", 4 * 8 * 4);
    m.w1 = kw_builder_constant(m.b, "w1", weights, 16 * 8 * 4);
    m.w2 = kw_builder_constant(m.b, "w2", weights + 128, 8 * 16 * 4);
    m.h = kw_builder_arena(m.b, "h", 4 * 16 * 4);
    m.out = kw_builder_output(m.b, "out", 4 * 8 * 4);
    m.vx = view2(m.b, m.x, KW_F32, 4, 8, 0);
    m.vw1 = view2(m.b, m.w1, KW_F32, 16, 8, 0);
    m.vw2 = view2(m.b, m.w2, KW_F32, 8, 16, 0);
    m.vh = view2(m.b, m.h, KW_F32, 4, 16, 0);
    m.vout = view2(m.b, m.out, KW_F32, 4, 8, 0);
    return m;
}

Test(capture, a_valid_program_finishes) {
    mlp m = mlp_new();
    cr_assert_eq(linear(m.b, m.vh, m.vx, m.vw1), 0);
    cr_assert_eq(linear(m.b, m.vout, m.vh, m.vw2), 1);
    kw_plan *plan;
    char msg[256];
    cr_assert_eq(finish(m.b, &plan, msg, sizeof msg), 0, "%s", msg);
    cr_expect_eq(kw_plan_n_steps(plan), 2);
    cr_expect_eq(kw_plan_n_slots(plan), 2); /* x, out */
    cr_expect_eq(kw_plan_slot_bytes(plan, 1), 4 * 8 * 4);
    cr_expect_eq(kw_plan_n_barriers(plan), 1);
    cr_expect_eq(kw_builder_view(m.b, m.x, KW_F32, 0, NULL, NULL, 0), KW_ESTATE);
    cr_expect_eq(finish(m.b, &plan, msg, sizeof msg), KW_ESTATE);
    kw_plan_destroy(plan);
    kw_builder_destroy(m.b);
}

Test(capture, the_op_check_rejects_a_shape_and_the_message_names_the_op) {
    mlp m = mlp_new();
    linear(m.b, m.vh, m.vx, m.vw1);
    linear(m.b, m.vout, m.vh, m.vw1); /* w1 is [16, 8]: K 8 != 16 */
    kw_builder_label(m.b, 1, "fc2");
    expect_failure(m.b, KW_ESHAPE, "op 1 (linear 'fc2')", "weight");
}

Test(capture, the_op_check_rejects_a_dtype) {
    mlp m = mlp_new();
    const int vh_bf16 = view2(m.b, m.h, KW_BF16, 4, 16, 0);
    linear(m.b, vh_bf16, m.vx, m.vw1); /* y must have x's dtype */
    expect_failure(m.b, KW_EDTYPE, "op 0 (linear)", "output 0");
}

Test(capture, a_missing_required_tensor_is_invalid) {
    mlp m = mlp_new();
    const int v[3] = {m.vh, -1, m.vw1};
    kw_builder_op(m.b, KW_OP_LINEAR, v, 3, NULL, 0, NULL, 0);
    expect_failure(m.b, KW_EINVAL, "op 0 (linear)", "'x' is required");
}

Test(capture, a_wrong_parameter_count_is_invalid) {
    kw_builder *b = kw_builder_create();
    const int64_t ip[1] = {3};
    kw_builder_op(b, KW_OP_NOP, NULL, 0, ip, 1, NULL, 0);
    expect_failure(b, KW_EINVAL, "op 0 (nop)", "parameters");
}

Test(capture, a_view_outside_its_buffer_is_out_of_bounds) {
    mlp m = mlp_new();
    cr_expect_eq(view2(m.b, m.x, KW_F32, 4, 8, 4), KW_EBOUNDS); /* one float too far */
    cr_expect(strstr(kw_builder_error(m.b), "outside buffer 'x'"));
    const int64_t shape[2] = {4, 8}, stride[2] = {16, 1}, negative[2] = {-8, 1};
    cr_expect_eq(kw_builder_view(m.b, m.x, KW_F32, 2, shape, stride, 0), KW_EBOUNDS); /* strides go past the end */
    cr_expect_eq(kw_builder_view(m.b, m.x, KW_F32, 2, shape, negative, 24 * 4), KW_EINVAL); /* PyTorch has none */
    const int64_t overlapping[2] = {1, 1};
    cr_expect_eq(kw_builder_view(m.b, m.x, KW_F32, 2, shape, overlapping, 0), 5); /* overlapping is fine */
    /* The first failure sticks: finish reports it. */
    expect_failure(m.b, KW_EBOUNDS, "outside buffer 'x'", NULL);
}

Test(capture, bad_declarations_are_refused_on_the_spot) {
    kw_builder *b = kw_builder_create();
    const int x = kw_builder_input(b, "x", 64);
    const int64_t neg[1] = {-1}, one[1] = {1};
    cr_expect_eq(kw_builder_view(b, 7, KW_F32, 1, one, NULL, 0), KW_EINVAL);
    cr_expect_eq(kw_builder_view(b, x, (kw_dtype)99, 1, one, NULL, 0), KW_EDTYPE);
    cr_expect_eq(kw_builder_view(b, x, KW_F32, KW_MAX_DIMS + 1, one, NULL, 0), KW_EINVAL);
    cr_expect_eq(kw_builder_view(b, x, KW_F32, 1, neg, NULL, 0), KW_ESHAPE);
    cr_expect_eq(kw_builder_view(b, x, KW_F32, 1, one, NULL, 2), KW_EINVAL); /* misaligned */
    cr_expect_eq(kw_builder_constant(b, "c", NULL, 4), KW_EINVAL);
    cr_expect_eq(kw_builder_op(b, KW_OP_COUNT, NULL, 0, NULL, 0, NULL, 0), KW_EINVAL);
    const int too_many[5] = {0, 0, 0, 0, 0};
    cr_expect_eq(kw_builder_op(b, KW_OP_LINEAR, too_many, 5, NULL, 0, NULL, 0), KW_EINVAL);
    const int bad[1] = {42};
    cr_expect_eq(kw_builder_fallback(b, NULL, NULL, bad, "r", 1), KW_EINVAL);
    cr_expect_eq(kw_builder_label(b, 3, "x"), KW_EINVAL);
    expect_failure(b, KW_EINVAL, "no buffer 7", NULL);
}

Test(capture, reading_an_arena_buffer_before_any_write_is_uninitialised) {
    mlp m = mlp_new();
    linear(m.b, m.vout, m.vh, m.vw2); /* h is never written */
    expect_failure(m.b, KW_EUNINIT, "op 0 (linear)", "reads arena buffer 'h'");
}

Test(capture, an_output_never_written_is_uninitialised) {
    mlp m = mlp_new();
    linear(m.b, m.vh, m.vx, m.vw1);
    expect_failure(m.b, KW_EUNINIT, "output 'out' is never written", NULL);
}

Test(capture, writing_a_constant_is_refused) {
    mlp m = mlp_new();
    const int v8 = view2(m.b, m.w2, KW_F32, 4, 16, 0);
    linear(m.b, v8, m.vx, m.vw1);
    expect_failure(m.b, KW_EREADONLY, "op 0 (linear)", "writes constant 'w2'");
}

Test(capture, a_written_view_partly_overlapping_a_read_view_is_aliasing) {
    kw_builder *b = kw_builder_create();
    const int buf = kw_builder_input(b, "xy", 16 * 4);
    const int w = kw_builder_constant(b, "w", weights, 8 * 8 * 4);
    const int vx = view2(b, buf, KW_F32, 1, 8, 0), vy = view2(b, buf, KW_F32, 1, 8, 16);
    linear(b, vy, vx, view2(b, w, KW_F32, 8, 8, 0));
    expect_failure(b, KW_EALIAS, "op 0 (linear)", "partly overlaps");
}

/* In place (the written view is the read one): elementwise ops only. */
Test(capture, only_an_elementwise_op_writes_over_its_input) {
    kw_builder *b = kw_builder_create();
    const int buf = kw_builder_input(b, "x", 8 * 4);
    const int w = kw_builder_constant(b, "w", weights, 8 * 8 * 4);
    const int vx = view2(b, buf, KW_F32, 1, 8, 0);
    linear(b, vx, vx, view2(b, w, KW_F32, 8, 8, 0));
    expect_failure(b, KW_EALIAS, "op 0 (linear)", "is written over");

    b = kw_builder_create();
    const int x = kw_builder_input(b, "x", 8 * 4), out = kw_builder_output(b, "out", 8 * 4);
    const int v = view2(b, x, KW_F32, 1, 8, 0), vo = view2(b, out, KW_F32, 1, 8, 0);
    const int add[3] = {v, v, v}, copy[2] = {vo, v};
    cr_assert_eq(kw_builder_op(b, KW_OP_BINARY, add, 3, (int64_t[]){KW_BINARY_ADD}, 1, (double[]){0}, 1), 0);
    cr_assert_eq(kw_builder_op(b, KW_OP_CONVERT, copy, 2, NULL, 0, NULL, 0), 1); /* the step's index */
    char msg[256];
    kw_plan *plan = NULL;
    cr_expect_eq(finish(b, &plan, msg, sizeof msg), 0, "%s", msg);
    kw_plan_destroy(plan);
    kw_builder_destroy(b);
}

Test(capture, fallback_access_rules_apply_too) {
    kw_builder *b = kw_builder_create();
    const int a = kw_builder_arena(b, "scratchpad", 64);
    const int64_t n[1] = {16};
    const int v = kw_builder_view(b, a, KW_F32, 1, n, NULL, 0);
    kw_builder_fallback(b, (kw_fallback_fn)1, NULL, &v, "m", 1);
    kw_builder_label(b, 0, "aten.cumsum");
    expect_failure(b, KW_EUNINIT, "op 0 (fallback 'aten.cumsum')", "reads arena buffer 'scratchpad'");
}

/* ---- the arena planner ---------------------------------------------------------- */

static int time_overlap(const kw_arena_item *a, const kw_arena_item *b) {
    return a->first <= b->last && b->first <= a->last;
}

static void expect_no_live_overlap(const kw_arena_item *it, int n, size_t total) {
    for (int i = 0; i < n; i++) {
        if (!it[i].size || it[i].first < 0) continue;
        cr_assert_eq(it[i].offset % 64, 0);
        cr_assert_leq(it[i].offset + it[i].size, total);
        for (int j = 0; j < i; j++)
            if (it[j].size && it[j].first >= 0 && time_overlap(&it[i], &it[j]))
                cr_assert(it[i].offset + it[i].size <= it[j].offset || it[j].offset + it[j].size <= it[i].offset,
                          "items %d and %d are live together and overlap", i, j);
    }
}

/* The smallest arena by exhaustive search over offsets (in 64-byte units). */
static int brute_best(const kw_arena_item *it, int n, int i, int *unit_off, int top, int best) {
    if (top >= best) return best;
    if (i == n) return top;
    const int size = (int)(it[i].size / 64);
    for (int off = 0; off + size < best; off++) {
        int ok = 1;
        for (int j = 0; j < i && ok; j++)
            if (time_overlap(&it[i], &it[j]))
                ok = off + size <= unit_off[j] || unit_off[j] + (int)(it[j].size / 64) <= off;
        if (!ok) continue;
        unit_off[i] = off;
        const int r = brute_best(it, n, i + 1, unit_off, top > off + size ? top : off + size, best);
        if (r < best) best = r;
    }
    return best;
}

Test(arena, small_problems_reach_the_brute_force_optimum) {
    srand(1);
    for (int round = 0; round < 300; round++) {
        const int n = 1 + rand() % 6;
        kw_arena_item it[6];
        int unit_off[6], sum = 0;
        for (int i = 0; i < n; i++) {
            const int a = rand() % 6, b = rand() % 6;
            it[i] = (kw_arena_item){.size = 64 * (size_t)(1 + rand() % 4), .first = a < b ? a : b, .last = a < b ? b : a};
            sum += (int)(it[i].size / 64);
        }
        const size_t total = kw_arena_plan(it, n);
        expect_no_live_overlap(it, n, total);
        const int best = brute_best(it, n, 0, unit_off, 0, sum + 1);
        cr_assert_eq(total, (size_t)best * 64, "round %d: planner %zu B, optimum %d B", round, total, best * 64);
    }
}

Test(arena, large_problems_never_overlap_live_buffers_and_reuse_memory) {
    srand(2);
    for (int round = 0; round < 50; round++) {
        const int n = 8 + rand() % 120;
        kw_arena_item *it = calloc((size_t)n, sizeof *it);
        size_t sum = 0;
        for (int i = 0; i < n; i++) {
            const int first = rand() % 200;
            it[i] = (kw_arena_item){.size = (size_t)(rand() % 5000), .first = first, .last = first + rand() % 10};
            if (rand() % 10 == 0) it[i].first = it[i].last = -1; /* unused */
            sum += (it[i].size + 63) / 64 * 64;
        }
        const size_t total = kw_arena_plan(it, n);
        expect_no_live_overlap(it, n, total);
        cr_expect_leq(total, sum);
        free(it);
    }
}

Test(arena, buffers_live_one_after_another_share_memory) {
    kw_arena_item it[3] = {{100, 0, 1, 0}, {100, 2, 3, 0}, {100, 1, 2, 0}};
    cr_expect_eq(kw_arena_plan(it, 3), 256);
    cr_expect_eq(it[0].offset, it[1].offset);
}

/* ---- barriers ------------------------------------------------------------------- */

/* A chain x -> a -> b: the second step reads the first's output. Then an
 * independent step reading x only: no barrier. */
Test(barriers, only_where_a_step_needs_an_earlier_ones_memory) {
    kw_builder *b = kw_builder_create();
    const int x = kw_builder_input(b, "x", 8 * 4);
    const int w = kw_builder_constant(b, "w", weights, 8 * 8 * 4);
    const int a1 = kw_builder_arena(b, "a1", 8 * 4), a2 = kw_builder_output(b, "a2", 8 * 4);
    const int a3 = kw_builder_output(b, "a3", 8 * 4);
    const int vx = view2(b, x, KW_F32, 1, 8, 0), vw = view2(b, w, KW_F32, 8, 8, 0);
    const int v1 = view2(b, a1, KW_F32, 1, 8, 0), v2 = view2(b, a2, KW_F32, 1, 8, 0);
    const int v3 = view2(b, a3, KW_F32, 1, 8, 0);
    linear(b, v1, vx, vw);
    linear(b, v3, vx, vw); /* independent of step 0 */
    linear(b, v2, v1, vw); /* needs step 0 */
    kw_plan *plan;
    char msg[256];
    cr_assert_eq(finish(b, &plan, msg, sizeof msg), 0, "%s", msg);
    cr_expect_eq(plan->steps[0].barrier, 0);
    cr_expect_eq(plan->steps[1].barrier, 0);
    cr_expect_eq(plan->steps[2].barrier, 1);
    cr_expect_eq(kw_plan_n_barriers(plan), 1);
    char *dump = kw_plan_dump(plan);
    cr_assert_not_null(dump);
    cr_expect(strstr(dump, "---- barrier"));
    cr_expect(strstr(dump, "a1"));
    cr_expect(strstr(dump, "float32[1, 8]"));
    free(dump);
    kw_plan_destroy(plan);
    kw_builder_destroy(b);
}

/* h1 dies at step 1 and h2 takes its bytes at step 2; step 2 does not read
 * step 1's output, but writing over memory step 1 still reads is a race. */
Test(barriers, memory_reused_by_the_arena_counts_as_a_dependency) {
    kw_builder *b = kw_builder_create();
    const int x = kw_builder_input(b, "x", 8 * 4);
    const int w = kw_builder_constant(b, "w", weights, 8 * 8 * 4);
    const int h1 = kw_builder_arena(b, "h1", 8 * 4), h2 = kw_builder_arena(b, "h2", 8 * 4);
    const int o1 = kw_builder_output(b, "o1", 8 * 4), o2 = kw_builder_output(b, "o2", 8 * 4);
    const int vx = view2(b, x, KW_F32, 1, 8, 0), vw = view2(b, w, KW_F32, 8, 8, 0);
    const int v1 = view2(b, h1, KW_F32, 1, 8, 0), v2 = view2(b, h2, KW_F32, 1, 8, 0);
    linear(b, v1, vx, vw);                          /* 0: h1 = x w */
    linear(b, view2(b, o1, KW_F32, 1, 8, 0), v1, vw); /* 1: o1 = h1 w (barrier) */
    linear(b, v2, vx, vw);                          /* 2: h2 = x w, over h1's bytes */
    linear(b, view2(b, o2, KW_F32, 1, 8, 0), v2, vw); /* 3 */
    kw_plan *plan;
    char msg[256];
    cr_assert_eq(finish(b, &plan, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(plan->buffers[h1].arena_offset, plan->buffers[h2].arena_offset);
    cr_expect_eq(plan->steps[1].barrier, 1);
    cr_expect_eq(plan->steps[2].barrier, 1);
    cr_expect_eq(plan->steps[3].barrier, 1);
    kw_plan_destroy(plan);
    kw_builder_destroy(b);
}

Test(barriers, the_debug_mode_puts_one_before_every_step) {
    kw_builder *b = kw_builder_create();
    for (int i = 0; i < 5; i++) kw_builder_op(b, KW_OP_NOP, NULL, 0, NULL, 0, NULL, 0);
    kw_plan *plan;
    char msg[256];
    const kw_finish_opts o = {.n_threads = 2, .barrier_every_step = 1, .isa = -1};
    cr_assert_eq(kw_builder_finish(b, &o, &plan, msg, sizeof msg), 0, "%s", msg);
    cr_expect_eq(kw_plan_n_barriers(plan), 4);
    kw_plan_destroy(plan);
    kw_builder_destroy(b);
}
