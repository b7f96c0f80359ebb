/* The row normalisations built with avx2 flags (see norm_body.h). */
#include "norm_body.h"
