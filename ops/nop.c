/* An op that does nothing: it measures dispatch and barrier cost. */
#include "kw_ops.h"

static void nop_kernel(const kw_call *c, int ith, int nth) {
    (void)c, (void)ith, (void)nth;
}

const kw_op_info kw_op_info_nop = {
    .name = "nop",
    .n_tensors = 0,
    .kernel = nop_kernel,
};
