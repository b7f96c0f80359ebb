/* attention built with avx2 flags (see attention_body.h). */
#include "attention_body.h"
