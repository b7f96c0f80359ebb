/* rotary built with avx2 flags (see rotary_body.h). */
#include "rotary_body.h"
