/* kw_ops.h — the op registry: what each kernel is called, what its tensor slots
 * mean, what it accepts, and which ISA variants exist. A new op is one line in
 * ops.def, one kw_op_info in its own source file, and its kernels. */
#ifndef KW_OPS_H
#define KW_OPS_H

#include "kw_types.h"

#define KW_ISAS(X)             \
    X(SCALAR, "scalar")        \
    X(AVX2, "avx2")            \
    X(AVX512, "avx512")        \
    X(AVX512BF16, "avx512bf16")

typedef enum kw_isa {
#define KW__ISA_ENUM(id, name) KW_ISA_##id,
    KW_ISAS(KW__ISA_ENUM)
#undef KW__ISA_ENUM
    KW_ISA_COUNT
} kw_isa;

/* The best ISA this CPU and OS support (CPUID + XGETBV), capped by the
 * environment variable KWKER_ISA=<name> when set. */
kw_isa kw_cpu_isa(void);
const char *kw_isa_name(kw_isa isa);

typedef enum kw_op_id {
#define KW_OP(id, name) KW_OP_##id,
#include "ops.def"
#undef KW_OP
    KW_OP_COUNT
} kw_op_id;

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
    /* Accepts or rejects a call's dtypes, shapes and parameters; on rejection
     * writes a message naming the tensor and the problem and returns KW_E*. */
    int (*check)(const kw_call *c, char *msg, size_t msg_len);
    /* Per-thread scratch bytes; NULL when the op needs none. */
    size_t (*work_size)(const kw_call *c);
    kw_kernel_fn kernel[KW_ISA_COUNT]; /* NULL where no variant for that ISA */
} kw_op_info;

const kw_op_info *kw_op_get(kw_op_id id);
/* The op id for a name, or -1. */
int kw_op_find(const char *name);
/* The best variant at or below `isa`; the scalar reference always exists. */
kw_kernel_fn kw_op_kernel(kw_op_id id, kw_isa isa);

#endif
