/* The elementwise ops built with avx512 flags (see eltwise_body.h). */
#include "eltwise_body.h"
