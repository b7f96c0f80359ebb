/* rotary built with avx512 flags (see rotary_body.h). */
#include "rotary_body.h"
