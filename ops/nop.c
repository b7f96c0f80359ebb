/* An op that does nothing: it measures dispatch and barrier cost, and stands for
 * empty_like (memory whose contents are undefined): its optional slot counts as
 * written, so the steps after it may read that memory (capture refuses a read of
 * memory no step has written). */
#include "kw_ops.h"

static void nop_kernel(const kw_call *c, int ith, int nth) {
    (void)c, (void)ith, (void)nth;
}

const kw_op_info kw_op_info_nop = {
    .name = "nop",
    .n_tensors = 1,
    .arg = {{"y", KW_WRITE, 1}},
    .kernel = nop_kernel,
};
