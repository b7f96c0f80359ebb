/* The linear kernels built with avx2 flags (see linear_body.h). */
#include "linear_body.h"
