#include "kw_ops_impl.h"

size_t kw_dtype_size(kw_dtype dt) {
    switch (dt) {
#define KW__DTYPE_SIZE(id, name, size) \
    case KW_##id:                      \
        return (size);
        KW_DTYPES(KW__DTYPE_SIZE)
#undef KW__DTYPE_SIZE
    default:
        return 0;
    }
}

const char *kw_dtype_name(kw_dtype dt) {
    switch (dt) {
#define KW__DTYPE_NAME(id, name, size) \
    case KW_##id:                      \
        return #name;
        KW_DTYPES(KW__DTYPE_NAME)
#undef KW__DTYPE_NAME
    default:
        return "unknown";
    }
}

int kw_tensor_bf16_exact(const kw_tensor *t) {
    if (t->dtype != KW_F32) return KW_EDTYPE;
    if (!kw__is_contiguous(t)) return KW_EINVAL;
    const uint32_t *u = t->data;
    const int64_t n = kw__numel(t);
    uint32_t low = 0, nan = 0;
    for (int64_t i = 0; i < n; i++) { /* no early exit: the loop vectorises */
        low |= u[i] & 0xffffu;
        nan |= (u[i] & 0x7fffffffu) > 0x7f800000u;
    }
    return !low && !nan;
}

int64_t kw_tensor_extent(const kw_tensor *t) {
    int64_t last = 0, span;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return 0;
    for (int d = 0; d < t->ndim; d++)
        if (t->stride[d] < 0 || __builtin_mul_overflow(t->shape[d] - 1, t->stride[d], &span) ||
            __builtin_add_overflow(last, span, &last))
            return -1;
    if (__builtin_mul_overflow(last + 1, (int64_t)kw_dtype_size(t->dtype), &last)) return -1;
    return last;
}

const char *kw_strerror(int err) {
    switch (err) {
    case KW_OK:
        return "ok";
#define KW__ERROR_TEXT(id, code, text) \
    case KW_##id:                      \
        return text;
        KW_ERRORS(KW__ERROR_TEXT)
#undef KW__ERROR_TEXT
    default:
        return "unknown error";
    }
}
