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

size_t kw_op_prep_size(kw_op_id id) {
    const kw_op_info *info = kw_op_get(id);
    return info && info->prep_size ? info->prep_size : 1;
}

int kw_op_prepare(kw_op_id id, kw_call *c, kw_isa isa, void *prep, char *msg, size_t len) {
    const kw_op_info *info = kw_op_get(id);
    if (msg && len) msg[0] = '\0';
    if (!info) return KW_EINVAL;
    memset(prep, 0, kw_op_prep_size(id));
    c->prep = prep;
    return info->prepare ? info->prepare(c, isa, prep, msg, len) : 0;
}
