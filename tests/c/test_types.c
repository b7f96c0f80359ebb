/* The shared vocabulary: dtype table, error texts, op registry, ISA detection, prefetch distance. */
#include <criterion/criterion.h>
#include <string.h>

#include "kw_ops.h"

Test(types, dtype_sizes_match_torch) {
    cr_expect_eq(kw_dtype_size(KW_F32), 4);
    cr_expect_eq(kw_dtype_size(KW_BF16), 2);
    cr_expect_eq(kw_dtype_size(KW_I64), 8);
    cr_expect_eq(kw_dtype_size(KW_BOOL), 1);
    cr_expect_str_eq(kw_dtype_name(KW_BF16), "bfloat16");
    cr_expect_eq(kw_dtype_size((kw_dtype)99), 0);
}

Test(types, every_error_has_its_own_text) {
    const int codes[] = {
#define CODE(id, code, text) code,
        KW_ERRORS(CODE)
#undef CODE
    };
    for (size_t i = 0; i < sizeof codes / sizeof *codes; i++) {
        cr_expect_str_neq(kw_strerror(codes[i]), "unknown error");
        for (size_t j = 0; j < i; j++) cr_expect_str_neq(kw_strerror(codes[i]), kw_strerror(codes[j]));
    }
    cr_expect_str_eq(kw_strerror(12345), "unknown error");
}

Test(registry, every_op_is_found_by_name_and_has_a_kernel) {
    for (int i = 0; i < KW_OP_COUNT; i++) {
        const kw_op_info *info = kw_op_get((kw_op_id)i);
        cr_assert_not_null(info);
        cr_expect_eq(kw_op_find(info->name), i, "op %s", info->name);
        cr_expect_not_null(info->kernel, "op %s has no kernel", info->name);
        cr_expect(info->prepare || !info->prep_size, "op %s has a preparation but nothing fills it", info->name);
    }
    cr_expect_eq(kw_op_find("no_such_op"), -1);
    cr_expect_null(kw_op_get(KW_OP_COUNT));
}

Test(cpu, detected_isa_agrees_with_the_compiler_builtin) {
    __builtin_cpu_init();
    const kw_isa isa = kw_cpu_isa();
    if (getenv("KWKER_ISA")) return; /* a cap makes the comparison meaningless */
    cr_expect_eq(isa >= KW_ISA_AVX2, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
    cr_expect_eq(isa >= KW_ISA_AVX512, __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"));
}

/* Criterion runs each test in its own process, so the environment read on the
 * first call is this test's. */
Test(cpu, prefetch_distance_by_vendor_rows_dtype_and_isa) {
    unsetenv("KWKER_PREFETCH");
    __builtin_cpu_init();
    const int intel = __builtin_cpu_is("intel"), below_avx512 = kw_cpu_isa() < KW_ISA_AVX512;
    const int64_t several = intel ? 4096 : below_avx512 ? 1024 : 4096;
    cr_expect_eq(kw_cpu_prefetch(1, KW_F32).bytes, intel ? 4096 : 0, "one row of f32 weights: Intel only");
    cr_expect_eq(kw_cpu_prefetch(1, KW_BF16).bytes, intel ? 4096 : below_avx512 ? 1024 : 0,
                 "one row of bf16 weights: Intel, and 1 KiB below AVX-512");
    cr_expect_eq(kw_cpu_prefetch(5, KW_F32).bytes, several, "several rows: every CPU");
    cr_expect_eq(kw_cpu_prefetch(5, KW_BF16).bytes, several, "several rows: every CPU");
}

Test(cpu, a_prefetch_setting_with_a_space_is_ignored_as_a_misspelt_isa_is) {
    setenv("KWKER_PREFETCH", " 64", 1); /* strtoll took it as 64 */
    __builtin_cpu_init();
    const int intel = __builtin_cpu_is("intel"), below_avx512 = kw_cpu_isa() < KW_ISA_AVX512;
    cr_expect_eq(kw_cpu_prefetch(5, KW_F32).bytes, intel ? 4096 : below_avx512 ? 1024 : 4096, "the default");
}

Test(cpu, prefetch_into_l2_only_on_intel) {
    unsetenv("KWKER_PREFETCH_L2");
    __builtin_cpu_init();
    const int intel = __builtin_cpu_is("intel");
    cr_expect_eq(kw_cpu_prefetch(1, KW_BF16).to_l2, intel);
    cr_expect_eq(kw_cpu_prefetch(8, KW_F32).to_l2, intel);
}

/* The ISA cap (KWKER_ISA) decides which kernels run, and so the distance. */
Test(cpu, prefetch_distance_follows_the_isa_cap) {
    unsetenv("KWKER_PREFETCH");
    setenv("KWKER_ISA", "avx2", 1);
    __builtin_cpu_init();
    const int intel = __builtin_cpu_is("intel");
    cr_expect_eq(kw_cpu_prefetch(1, KW_BF16).bytes, intel ? 4096 : 1024);
    cr_expect_eq(kw_cpu_prefetch(1, KW_F32).bytes, intel ? 4096 : 0);
    cr_expect_eq(kw_cpu_prefetch(2, KW_F32).bytes, intel ? 4096 : 1024);
}

Test(cpu, prefetch_distance_from_the_environment_for_every_row_count) {
    setenv("KWKER_PREFETCH", "1024", 1);
    cr_expect_eq(kw_cpu_prefetch(1, KW_F32).bytes, 1024);
    cr_expect_eq(kw_cpu_prefetch(8, KW_BF16).bytes, 1024);
}

Test(cpu, prefetch_cache_level_from_the_environment) {
    setenv("KWKER_PREFETCH_L2", "0", 1);
    cr_expect_eq(kw_cpu_prefetch(1, KW_BF16).to_l2, 0);
}

Test(cpu, prefetch_cache_level_not_0_or_1_in_the_environment_is_ignored) {
    setenv("KWKER_PREFETCH_L2", "yes", 1);
    __builtin_cpu_init();
    cr_expect_eq(kw_cpu_prefetch(1, KW_BF16).to_l2, __builtin_cpu_is("intel"));
}

Test(cpu, an_isa_cap_is_read_in_any_case) {
    setenv("KWKER_ISA", "AVX2", 1);
    cr_expect_leq(kw_cpu_isa(), KW_ISA_AVX2);
    cr_expect_null(kw_cpu_env_problems());
}

Test(cpu, settings_set_but_not_understood_are_named_for_the_warning) {
    setenv("KWKER_ISA", "avx-512", 1);
    setenv("KWKER_PREFETCH", "4k", 1);
    setenv("KWKER_PREFETCH_L2", "2", 1);
    const char *problems = kw_cpu_env_problems();
    cr_assert_not_null(problems);
    cr_expect_str_eq(problems, "KWKER_ISA=avx-512 is not one of scalar, avx2, avx512, avx512bf16, amx: ignored; "
                               "KWKER_PREFETCH=4k is not a count of bytes from 0 to 1048576: ignored; "
                               "KWKER_PREFETCH_L2=2 is not 0 or 1: ignored");
}

Test(cpu, settings_understood_or_empty_give_no_warning) {
    setenv("KWKER_ISA", "avx512bf16", 1);
    setenv("KWKER_PREFETCH", "1048576", 1);
    setenv("KWKER_PREFETCH_L2", "", 1);
    cr_expect_null(kw_cpu_env_problems());
}
