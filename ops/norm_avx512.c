/* The row normalisations built with avx512 flags (see norm_body.h). */
#include "norm_body.h"
