/* The elementwise ops built with avx2 flags (see eltwise_body.h). */
#include "eltwise_body.h"
