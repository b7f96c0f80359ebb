/* The linear kernels built with avx512bf16 flags (see linear_body.h). */
#include "linear_body.h"
