#include <string.h>

#include "kw_ops.h"

#define KW_OP(id, name) extern const kw_op_info kw_op_info_##name;
#include "ops.def"
#undef KW_OP

static const kw_op_info *const op_table[KW_OP_COUNT] = {
#define KW_OP(id, name) [KW_OP_##id] = &kw_op_info_##name,
#include "ops.def"
#undef KW_OP
};

const kw_op_info *kw_op_get(kw_op_id id) {
    return (unsigned)id < KW_OP_COUNT ? op_table[id] : NULL;
}

int kw_op_find(const char *name) {
    for (int i = 0; i < KW_OP_COUNT; i++)
        if (strcmp(op_table[i]->name, name) == 0) return i;
    return -1;
}

kw_kernel_fn kw_op_kernel(kw_op_id id, kw_isa isa) {
    const kw_op_info *info = kw_op_get(id);
    if (!info) return NULL;
    for (int i = (int)isa; i >= 0; i--)
        if (info->kernel[i]) return info->kernel[i];
    return NULL;
}
