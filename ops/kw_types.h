/* kw_types.h — the vocabulary shared by ops/, runtime/, capture/ and the binding.
 *
 * A tensor reaches C as pointer, dtype, shape and strides (in elements), never as a
 * PyTorch object. A kernel call (kw_call) is a fixed-size record of tensors and scalar
 * parameters, so a plan is a flat array of them and the same record drives the scalar
 * reference, every ISA variant and the tests. */
#ifndef KW_TYPES_H
#define KW_TYPES_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define KW_MAX_DIMS 6
#define KW_CALL_MAX_TENSORS 10
#define KW_CALL_MAX_PARAMS 8

#define KW_DTYPES(X) \
    X(F32, float32, 4)  \
    X(BF16, bfloat16, 2) \
    X(F16, float16, 2)  \
    X(I64, int64, 8)    \
    X(I32, int32, 4)    \
    X(BOOL, bool, 1)    \
    X(U8, uint8, 1)

typedef enum kw_dtype {
#define KW__DTYPE_ENUM(id, name, size) KW_##id,
    KW_DTYPES(KW__DTYPE_ENUM)
#undef KW__DTYPE_ENUM
    KW_DTYPE_COUNT
} kw_dtype;

size_t kw_dtype_size(kw_dtype dt);
const char *kw_dtype_name(kw_dtype dt); /* torch's spelling: "float32", "bfloat16", ... */

/* Error codes, one X-macro as in libuv. Functions return 0 or a negative KW_E*. */
#define KW_ERRORS(X)                                              \
    X(EINVAL, -1, "invalid argument")                             \
    X(EDTYPE, -2, "unsupported dtype")                            \
    X(ESHAPE, -3, "shape mismatch")                               \
    X(EBOUNDS, -4, "view outside its buffer")                     \
    X(EUNINIT, -5, "arena buffer read before any op writes it")   \
    X(ENOMEM, -6, "out of memory")                                \
    X(EBUSY, -7, "plan is already being replayed")                \
    X(ESTATE, -8, "object is in the wrong state for this call")   \
    X(ECALLBACK, -9, "fallback callback failed")                  \
    X(EREADONLY, -10, "step writes a read-only buffer")           \
    X(EALIAS, -11, "written view partly overlaps another view")   \
    X(EINDEX, -12, "an index in the data is out of range")

typedef enum kw_error {
    KW_OK = 0,
#define KW__ERROR_ENUM(id, code, text) KW_##id = (code),
    KW_ERRORS(KW__ERROR_ENUM)
#undef KW__ERROR_ENUM
} kw_error;

const char *kw_strerror(int err);

typedef struct kw_tensor {
    void *data;           /* NULL with ndim == 0 marks an absent optional tensor */
    kw_dtype dtype;
    int ndim;
    int64_t shape[KW_MAX_DIMS];
    int64_t stride[KW_MAX_DIMS]; /* in elements, may be 0 (broadcast) */
} kw_tensor;

/* For a contiguous float32 tensor: 1 when every value is exactly a bfloat16
 * value (its low 16 bits are zero) and none is a NaN, so converting to bfloat16
 * keeps every value; else 0. KW_EDTYPE when t is not float32, KW_EINVAL when
 * it is not contiguous. */
int kw_tensor_bf16_exact(const kw_tensor *t);

/* Bytes from t's first element to past its last (0 when empty); strides must not
 * be negative. -1 when they are, or on overflow. */
int64_t kw_tensor_extent(const kw_tensor *t);

/* An index a kernel found out of range in its data (a cache position, a token
 * id), which PyTorch would raise an IndexError for. A kernel cannot raise: it
 * skips that row (nothing is read or written out of bounds) and reports it
 * here; the first report of a replay wins, and the replay then returns
 * KW_EINDEX. */
typedef struct kw_fault {
    atomic_int reported;
    const struct kw_call *call;
    int64_t index, size;
} kw_fault;

/* One kernel invocation. The op's kw_op_info says what each tensor slot and
 * parameter means. `work` is per-thread scratch: thread ith owns
 * [work + ith * work_stride, work + (ith + 1) * work_stride). `share`, when not
 * NULL, is KW_SHARE_BYTES of zeroed memory the call's threads share to hand
 * work out at run time (a replay zeroes it before each run); kernels that use
 * it split their work statically without it (linear takes a word per thread
 * for each panel of x, up to 16 words for two threads). `fault` is the plan's
 * (kw_fault). */
#define KW_SHARE_BYTES 256
typedef struct kw_call {
    kw_tensor t[KW_CALL_MAX_TENSORS];
    int64_t ip[KW_CALL_MAX_PARAMS];
    double fp[KW_CALL_MAX_PARAMS];
    void *work;
    size_t work_stride;
    void *share;
    kw_fault *fault;  /* where an index out of range is reported; NULL: nowhere */
    const void *prep; /* what the op's prepare made of this call (kw_op_info.prepare) */
    /* The threads a prepare may split the call for (a plan's); a kernel still
     * runs correctly on any other count (0: one). */
    int n_threads;
} kw_call;

/* Every thread of the pool calls the kernel with its own (ith, nth) and does its
 * part; kernels never wait for each other (claiming work through `share` is a
 * lock-free hand-out, never a wait). A kernel runs a prepared call: it reads
 * c->prep and the tensors' data pointers and checks nothing. */
typedef void (*kw_kernel_fn)(const kw_call *c, int ith, int nth);

#endif
