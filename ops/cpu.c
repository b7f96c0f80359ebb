/* Runtime ISA detection: the CPU must report the instructions (CPUID) and the OS
 * must save the vector state they use (XGETBV), else AVX-512 code faults. */
#include <cpuid.h>
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kw_ops.h"

static unsigned long long xgetbv0(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

/* AMX tile state is saved by the OS (XCR0 bits 17, 18), and Linux lets this
 * process use it: tile data is 8 KiB per thread, so Linux asks each process to
 * request it once (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a
 * tile instruction without it faults. */
static int amx_permitted(unsigned long long xcr0) {
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    if ((xcr0 & (3ull << 17)) != (3ull << 17)) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static kw_isa detect_isa(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return KW_ISA_SCALAR;
    const int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave) return KW_ISA_SCALAR;
    const unsigned long long xcr0 = xgetbv0();
    const int os_avx = (xcr0 & 0x6) == 0x6;     /* XMM and YMM state */
    const int os_avx512 = (xcr0 & 0xe6) == 0xe6; /* plus opmask and ZMM state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return KW_ISA_SCALAR;
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1,
              avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    const int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    unsigned int a1 = 0, b1, c1, d1;
    __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
    const int avx512bf16 = (a1 >> 5) & 1;

    if (!(os_avx && avx2 && fma && f16c)) return KW_ISA_SCALAR;
    if (!(os_avx512 && avx512f && avx512dq && avx512bw && avx512vl)) return KW_ISA_AVX2;
    if (!avx512bf16) return KW_ISA_AVX512;
    return amx_bf16 && amx_tile && amx_permitted(xcr0) ? KW_ISA_AMX : KW_ISA_AVX512BF16;
}

const char *kw_isa_name(kw_isa isa) {
    switch (isa) {
#define KW__ISA_NAME(id, name) \
    case KW_ISA_##id:          \
        return name;
        KW_ISAS(KW__ISA_NAME)
#undef KW__ISA_NAME
    default:
        return "unknown";
    }
}

/* The ISA of that name, in any case ("AVX2" is avx2), or -1. */
static int isa_named(const char *name) {
    for (int i = 0; i < KW_ISA_COUNT; i++)
        if (strcasecmp(name, kw_isa_name((kw_isa)i)) == 0) return i;
    return -1;
}

static kw_isa isa_cap_from_env(void) {
    const char *cap = getenv("KWKER_ISA");
    const int named = cap ? isa_named(cap) : -1;
    return named >= 0 ? (kw_isa)named : KW_ISA_COUNT - 1;
}

kw_isa kw_cpu_isa(void) {
    static int cached = -1; /* benign race: every thread computes the same value */
    if (cached < 0) {
        kw_isa hw = detect_isa(), cap = isa_cap_from_env();
        cached = hw < cap ? hw : cap;
    }
    return (kw_isa)cached;
}

static int is_intel(void) {
    unsigned int a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e; /* "GenuineIntel" */
}

/* A setting's value from the environment, -1 when unset or not an integer in
 * [0, max], written as digits alone (strtoll would skip a leading space, which
 * KWKER_ISA's names do not take either). */
static int64_t env_setting(const char *name, int64_t max) {
    const char *env = getenv(name);
    char *end;
    const long long v = env ? strtoll(env, &end, 10) : -1;
    return env && isdigit((unsigned char)*env) && !*end && v >= 0 && v <= max ? v : -1;
}

enum { PREFETCH_MAX_BYTES = 1 << 20 };

static char env_problems[512];

/* Appends "NAME=value is not <what>: ignored" to env_problems when the
 * variable is set (not empty) and was not understood. */
static void note_ignored(const char *name, int understood, const char *what) {
    const char *value = getenv(name);
    if (!value || !*value || understood) return;
    const size_t used = strlen(env_problems);
    snprintf(env_problems + used, sizeof env_problems - used, "%s%s=%.40s is not %s: ignored", used ? "; " : "",
             name, value, what);
}

static void find_env_problems(void) {
    char isas[96] = "one of", bytes[64];
    for (int i = 0; i < KW_ISA_COUNT; i++)
        snprintf(isas + strlen(isas), sizeof isas - strlen(isas), " %s%s", kw_isa_name((kw_isa)i),
                 i + 1 < KW_ISA_COUNT ? "," : "");
    snprintf(bytes, sizeof bytes, "a count of bytes from 0 to %d", PREFETCH_MAX_BYTES);
    const char *isa = getenv("KWKER_ISA");
    note_ignored("KWKER_ISA", isa && isa_named(isa) >= 0, isas);
    note_ignored("KWKER_PREFETCH", env_setting("KWKER_PREFETCH", PREFETCH_MAX_BYTES) >= 0, bytes);
    note_ignored("KWKER_PREFETCH_L2", env_setting("KWKER_PREFETCH_L2", 1) >= 0, "0 or 1");
}

const char *kw_cpu_env_problems(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, find_env_problems);
    return env_problems[0] ? env_problems : NULL;
}

/* Streaming weights row after row, one core keeps only so many lines in flight
 * on the hardware prefetchers alone. Measured with bench/ops_bench.c (GEMV over
 * 1.1 GB of Llama-3.2-1B-shaped bf16 weights, 2 threads): on a 2-vCPU Intel Xeon
 * (AVX512-BF16, AMX) the kernels read at 0.73-0.87 of the plain read loop without
 * software prefetch and at 0.94-1.09 with lines prefetched 2-8 KiB ahead (4 KiB
 * kept; f32 weights 0.86-0.97 -> 1.00-1.12); on Zen 4 software prefetch made
 * them slower (0.6 against 0.91), so other vendors get none for one row of x.
 * With several rows each weight line takes several times the arithmetic, and
 * there Zen 4's prefetchers fall behind too: over SmolLM2-360M's replayed steps
 * (2 threads, calls interleaved), lines 4 KiB ahead took q = 4 from 40.9 to
 * 31.4 ms (f32 x over bf16 copies), q = 5 from 42.7 to 35.5, q = 8 from 50.5 to
 * 43.9, and bf16 q = 5 from 32.6 to 28.2, q = 8 from 35.9 to 31.5 (1, 2 and
 * 16 KiB ahead measured no better). Below AVX-512 a bf16 weight line takes
 * twice the instructions of an AVX-512 one, and there one row of x falls behind
 * too: on a Zen 3 EPYC (AVX2, 2 threads, ops_bench's GEMV, the same process
 * alternating sets with and without), bf16 weights 1 KiB ahead read 6-10 %
 * faster over Llama-3.2-1B's shapes and 3-10 % over SmolLM2-360M's while the
 * host read at 28-45 GB/s, 5-16 % faster at 46 GB/s; 768 B did the same,
 * 512 B mixed, 1536 B 5-9 % slower, 2 and 4 KiB 15-20 % slower. f32 weights
 * lost 4-12 % with 1 KiB. With several rows of x 1 KiB beat 4 KiB there too
 * (SmolLM2-360M's shapes, 46 GB/s): bf16 weights at 2, 4, 5 and 8 rows 25-29,
 * 6-9, 8-10 and 4-8 % faster, f32 weights at 2, 4 and 5 rows 15-17 %.
 * Into which cache: on a 2-vCPU Intel Xeon (family 6 model 207, AMX, 23-34
 * GB/s read) prefetching into L2 only (prefetcht2) read the GEMV's weights at
 * 0.85 / 0.87 / 0.94 of the read loop (bf16 weights with f32 x, with bf16 x;
 * f32 weights; medians of 6 alternations, KWKER_PREFETCH_L2 1 and 0 in turn)
 * against 0.78 / 0.80 / 0.88 into L1 (prefetcht0), whose fill buffers the
 * demand loads need too; 8 KiB ahead did the same as 4, 16 and 32 KiB worse.
 * Other vendors keep L1, as measured there. */
kw_prefetch kw_cpu_prefetch(int64_t rows, kw_dtype weights) {
    /* -2: not read yet, -1: not set; benign races, as in kw_cpu_isa */
    static int64_t bytes_env = -2, l2_env = -2, intel = -1;
    if (bytes_env == -2) bytes_env = env_setting("KWKER_PREFETCH", PREFETCH_MAX_BYTES);
    if (l2_env == -2) l2_env = env_setting("KWKER_PREFETCH_L2", 1);
    if (intel < 0) intel = is_intel();
    int64_t bytes;
    if (bytes_env >= 0)
        bytes = bytes_env;
    else if (intel)
        bytes = 4096;
    else if (kw_cpu_isa() < KW_ISA_AVX512)
        bytes = rows > 1 || weights == KW_BF16 ? 1024 : 0;
    else
        bytes = rows > 1 ? 4096 : 0;
    return (kw_prefetch){bytes, (int)(l2_env >= 0 ? l2_env : intel)};
}
