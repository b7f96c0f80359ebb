/* attention built with avx512 flags (see attention_body.h). */
#include "attention_body.h"
