/* The linear kernels built with avx512 flags (see linear_body.h). */
#include "linear_body.h"
