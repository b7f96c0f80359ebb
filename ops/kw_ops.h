/* kw_ops.h — the op registry: what each op is called, what its tensor slots
 * mean, what it accepts, how a call is prepared once and run every replay.
 * ops/README.md has the recipe for a new op. */
#ifndef KW_OPS_H
#define KW_OPS_H

#include "kw_types.h"

#define KW_ISAS(X)             \
    X(SCALAR, "scalar")        \
    X(AVX2, "avx2")            \
    X(AVX512, "avx512")        \
    X(AVX512BF16, "avx512bf16") \
    X(AMX, "amx")

typedef enum kw_isa {
#define KW__ISA_ENUM(id, name) KW_ISA_##id,
    KW_ISAS(KW__ISA_ENUM)
#undef KW__ISA_ENUM
    KW_ISA_COUNT
} kw_isa;

/* The best ISA this CPU and OS support (CPUID + XGETBV; for AMX, Linux's
 * permission to use tile data as well), capped by the environment variable
 * KWKER_ISA=<name> when set (in any case). AMX is AVX512-BF16 plus AMX-BF16 tiles: ops without
 * an AMX kernel run their AVX512-BF16 one there (KW__PICK). */
kw_isa kw_cpu_isa(void);
const char *kw_isa_name(kw_isa isa);

/* How the linear kernels prefetch the weight stream in software for `rows` rows
 * of x over weights of that dtype: how far ahead (bytes, 0 for none;
 * KWKER_PREFETCH=<bytes> when set, else by vendor, rows, dtype and ISA) and
 * into L2 only (prefetcht2) or L1 too (prefetcht0; KWKER_PREFETCH_L2=1 or 0
 * when set, else L2 on Intel). cpu.c says why. */
typedef struct kw_prefetch {
    int64_t bytes;
    int to_l2;
} kw_prefetch;
kw_prefetch kw_cpu_prefetch(int64_t rows, kw_dtype weights);

/* The KWKER_ISA, KWKER_PREFETCH and KWKER_PREFETCH_L2 values that are set but
 * not understood (a name or number out of range), which the two functions above
 * ignore, as one message; NULL when there are none. The binding warns with it. */
const char *kw_cpu_env_problems(void);

typedef enum kw_op_id {
#define KW_OP(id, name) KW_OP_##id,
#include "ops.def"
#undef KW_OP
    KW_OP_COUNT
} kw_op_id;

/* Values of the integer parameters (kw_call.ip) of ops that take a mode. Each
 * op's slots and parameters are listed where its kw_op_info is defined. */
enum { /* rms_norm, add_rms_norm ip[0]: how the weight scales x̂ = x.float() * rsqrt(mean(x²) + eps) */
    KW_NORM_LLAMA = 0, /* w * x̂.to(dtype) */
    KW_NORM_GEMMA = 1, /* (x̂ * (1 + w.float())).to(dtype) */
    KW_NORM_OLMO = 2,  /* (w.float() * x̂).to(dtype): OLMo 2's, Helium's */
    KW_NORM_FORMS
};
enum {
    KW_ROPE_HALF = 0,        /* rotary ip[0]: HF rotate_half, pairs (i, i + r/2) */
    KW_ROPE_INTERLEAVED = 1, /* rotary ip[0]: pairs (2i, 2i + 1) */
};
enum {
    KW_GATHER_WRAP = 1, /* embedding ip[0]: an id in [-V, 0) counts from the end (tensor indexing) */
};
enum {
    KW_GELU_ERF = 0, /* gelu ip[0]: approximate="none" */
    KW_GELU_TANH = 1 /* gelu ip[0]: approximate="tanh" */
};
enum {
    KW_SOFTMAX_SAFE = 1, /* softmax ip[0]: a row of -inf alone gives zeros, not NaN (aten._safe_softmax) */
};
enum {
    KW_WHERE_X_IF_TRUE = 0, /* where ip[0]: y = cond ? x : fp[0] */
    KW_WHERE_X_IF_FALSE = 1 /* where ip[0]: y = cond ? fp[0] : x */
};
#define KW_BINARY_OPS(X) \
    X(ADD, add)          \
    X(SUB, sub)          \
    X(MUL, mul)          \
    X(DIV, div)          \
    X(MAX, maximum)      \
    X(MIN, minimum)      \
    X(FLOOR_DIV, floor_divide)
/* compare: y (bool) = a (op) b */
#define KW_COMPARE_OPS(X) \
    X(EQ, eq)             \
    X(NE, ne)             \
    X(LT, lt)             \
    X(LE, le)             \
    X(GT, gt)             \
    X(GE, ge)
#define KW_UNARY_OPS(X) \
    X(COS, cos)         \
    X(SIN, sin)         \
    X(EXP, exp)         \
    X(TANH, tanh)       \
    X(SQRT, sqrt)       \
    X(RSQRT, rsqrt)     \
    X(SILU, silu)       \
    X(ABS, abs)         \
    X(SIGMOID, sigmoid) \
    X(LOG, log)         \
    X(FLOOR, floor)
typedef enum kw_unary_op { /* unary ip[0] */
#define KW__UNARY_ENUM(id, name) KW_UNARY_##id,
    KW_UNARY_OPS(KW__UNARY_ENUM)
#undef KW__UNARY_ENUM
    KW_UNARY_COUNT
} kw_unary_op;
typedef enum kw_binary_op { /* binary ip[0] */
#define KW__BINARY_ENUM(id, name) KW_BINARY_##id,
    KW_BINARY_OPS(KW__BINARY_ENUM)
#undef KW__BINARY_ENUM
    KW_BINARY_COUNT
} kw_binary_op;
typedef enum kw_compare_op { /* compare ip[0] */
#define KW__COMPARE_ENUM(id, name) KW_COMPARE_##id,
    KW_COMPARE_OPS(KW__COMPARE_ENUM)
#undef KW__COMPARE_ENUM
    KW_COMPARE_COUNT
} kw_compare_op;

/* linear and linear_multi read weights in PyTorch's [N, K] layout, or K-blocked:
 * [K / B, N, B], element [kb, n, j] = W[n, kb·B + j], made once at capture by
 * w.view(N, K // B, B).transpose(0, 1).contiguous(). Blocked, each block's slice
 * of the activations stays in L1 while the weights stream through it: with
 * [2048, 8192] weights and f32 activations (32 KiB, the whole L1) the plain
 * layout streamed at 0.35-0.38 of the read bandwidth here, the blocked one at
 * 0.7-0.8 (0.85-0.9 for [N, 2048] rows, which need no blocking).
 * kw_linear_block(K) is the B to use for inner size K, or 0 where [N, K] is as
 * fast. */
#define KW_LINEAR_BLOCK 2048
int64_t kw_linear_block(int64_t K);

/* A crossover no call reaches: linear at every M. */
#define KW_DNNL_NEVER INT32_MAX

/* Whether oneDNN makes a bf16 matmul on this CPU: Debian's 2.6 does from
 * AVX-512 on, and refuses one on an AVX2 CPU (a 2-vCPU Zen 3 EPYC), where
 * matmul_dnnl's prepare then fails and bf16 linears are linear's at every M. */
int kw_dnnl_has_bf16_matmul(void);

/* From this many rows of x on, matmul_dnnl (oneDNN) beat linear on the machine
 * kwker is developed on (2 Zen 4 cores; bench/ops.py, "dnnl_crossover" in
 * bench/README.md); below it use linear. f32 × bf16 has no oneDNN path: linear
 * at every M. */
enum {
    KW_DNNL_MIN_M_F32 = 4, /* f32 x, f32 weights */
    /* The same below AVX-512, where linear's tiles are 4 rows and oneDNN's f32
     * matmul is its AVX2 one: over one Llama-3.2-1B layer's gate/up/down (2-vCPU
     * Zen 3 EPYC, bench/ops.py's dnnl_crossover) linear took 7.6 ms against
     * 16.0 at M = 4, 12.2 against 14.1 at 8, 22.1 against 22.0 at 16, 42.2
     * against 26.7 at 32. */
    KW_DNNL_MIN_M_F32_AVX2 = 16,
    /* The same on an AMX CPU (an Intel Xeon; linear's AVX-512 kernel, since the
     * tiles take bf16 weights only), where oneDNN's matmul runs on the pool's
     * threads (matmul_dnnl): replayed q-token steps of SmolLM2-360M over float32
     * weights that are not bf16 values (2-vCPU Xeon, two processes each,
     * alternated): linear 58 ms against oneDNN's 78-82 at q = 4, 71-72 against
     * 88-93 at 8, 94 against 99-104 at 12, 110 against 104-110 at 16. */
    KW_DNNL_MIN_M_F32_AMX = 16,
    /* bf16 x, bf16 weights. Whole steps put the crossover higher than one
     * layer's MLP timed alone (8 rows, dnnl_crossover): replayed steps of q
     * positions (Zen 4, 2 threads), q = 8: SmolLM2-360M 29 ms with linear
     * against 60 with oneDNN, Llama-3.2-1B 109 against 186; q = 16: 48 against
     * 63 and 178 against 168. oneDNN's OpenMP threads also slow the ops
     * between its calls (add_rms_norm 0.1 ms a step with linear, 2.3-2.8 with
     * oneDNN). */
    KW_DNNL_MIN_M_BF16 = 16,
    /* f32 x over bf16-valued f32 weights, which linear reads as a bf16 copy (half
     * the bytes) and matmul_dnnl as stored; on a 2-vCPU Intel Xeon linear took
     * 15.2 ms against 17.3 at M = 16, 26.8 against 23.2 at M = 32. */
    KW_DNNL_MIN_M_F32_BF16_COPY = 32,
    /* On an AMX CPU linear runs its tile kernel (ops/linear_amx.c) over bf16
     * weights from KW_AMX_MIN_M_BF16 / _F32 rows of x (below), and oneDNN (2.6,
     * Debian's) never wins. On a 2-vCPU Xeon (bench/ops.py, Llama-3.2-1B's MLP,
     * 2 threads), bf16 x: linear 4.1-4.3 ms at M = 1 against 4.6-4.8 for the
     * AVX-512 kernel, 10.6-11.0 against 19.8-36.7 at M = 32; against oneDNN
     * 10.3-12.0 ms against 14.0-20.4 at M = 128, 18.3-21.2 against 21.1-23.2 at
     * 256. Past 512 rows, since linear takes x in panels that stay in L2
     * (kw__lin_panel_rows): ViT-base at batch 8 (1576 rows) spent 145 ms of its
     * bf16 plan in linears against 200 with oneDNN from 512 rows. f32 x over the
     * bf16 copy: 24.6-32.0 ms against oneDNN's 50.2-54.3 over the f32 weights
     * at 128, 117 / 125 against 178 / 181 at 512, and 9.8 ms against PyTorch's
     * f32 linear's 22.2 at 1576 rows of ViT-base's MLP. The lowering reads the
     * crossovers for the CPU it runs on (kwker._C.op_params). */
    KW_DNNL_MIN_M_BF16_AMX = KW_DNNL_NEVER,
    KW_DNNL_MIN_M_F32_BF16_COPY_AMX = KW_DNNL_NEVER,
    /* Over SmolLM2-360M's decode plan (rows of 960) the tile kernel lost at one
     * row: replays of 46-52 ms against 47-52 (bf16) and 63-64 against 45-48 (f32
     * x, three tile products a step), while it won at 5 and 8 rows in bf16
     * (58-62 against 72-74, 59-68 against 106-149) and was even in f32 at 5-8.
     * f32 x: replays of batched decode steps (three processes each, alternated,
     * same host), the vector kernel against the tiles: SmolLM2-360M at 8 rows
     * 57-68 ms against 60-84, at 12 rows 86-100 against 71-99; Llama-3.2-1B at
     * 8 rows 144-175 against 120-123, at 12 rows 206-260 against 130-139. So:
     * bf16 x from 2 rows, f32 x from 12 (8 would lose on the smaller model). */
    KW_AMX_MIN_M_BF16 = 2,
    KW_AMX_MIN_M_F32 = 12,
    /* bmm reads every column of b once per row of a: right for the decode
     * steps' one row (BLOOM's attention: a 24-layer BLOOM's replayed step,
     * medians of three, 59.9 ms natively against 77.4 with ATen's bmm as
     * fallback steps in fp32, 51.4 against 59.9 in bf16, Zen 4) and a verify
     * step's few, not a prefill chunk's hundred, where ATen's blocked GEMM
     * measured 2x faster (16 heads over 1024 positions, 128 rows). */
    KW_BMM_MAX_M = 8,
};

/* How an op touches a tensor slot; capture's liveness and validation read this. */
#define KW_READ 'r'
#define KW_WRITE 'w'
#define KW_MODIFY 'm' /* read and written in place (a KV cache) */

typedef struct kw_arg {
    const char *name;
    char access;   /* KW_READ, KW_WRITE or KW_MODIFY */
    char optional; /* may be absent (data == NULL, ndim == 0) */
} kw_arg;

typedef struct kw_op_info {
    const char *name;
    int n_tensors;
    kw_arg arg[KW_CALL_MAX_TENSORS];
    int n_ip, n_fp; /* how many of c->ip / c->fp the op reads */
    /* The op's rules and its preparation, in one place, run once when a plan is
     * finished: accepts or rejects the call's dtypes, shapes and parameters (on
     * rejection: KW_E* and a message naming the tensor and the problem) and fills
     * `prep` (prep_size bytes, zeroed) with everything the kernel needs besides
     * the data pointers: sizes, strides, modes, the variant for `isa` (the best
     * at or below it), primitives. Data pointers are only tested for absence. */
    int (*prepare)(const kw_call *c, kw_isa isa, void *prep, char *msg, size_t msg_len);
    size_t prep_size;
    void (*release)(void *prep);            /* frees what prepare made; NULL: nothing to free */
    size_t (*work_size)(const void *prep);  /* per-thread scratch bytes; NULL: none */
    int shares_work; /* hands work out through kw_call.share when it has one */
    /* A written slot may be the very view of a read one (add_, copy_): each
     * element is stored after the input elements it depends on at its index and
     * before it are loaded (the elementwise ops, cumsum). Elsewhere capture refuses it: a
     * matrix product or an attention over its own output would read what it
     * has already overwritten. */
    int in_place;
    kw_kernel_fn kernel; /* runs a prepared call; no error path */
} kw_op_info;

const kw_op_info *kw_op_get(kw_op_id id);
/* The op id for a name, or -1. */
int kw_op_find(const char *name);
/* Prepares c for `isa` into prep (kw_op_prep_size bytes, zeroed here) and points
 * c->prep at it: what capture does for each step, and tests and benchmarks for
 * the calls they run. 0 or KW_E* with the message. */
int kw_op_prepare(kw_op_id id, kw_call *c, kw_isa isa, void *prep, char *msg, size_t msg_len);
size_t kw_op_prep_size(kw_op_id id);

#endif
