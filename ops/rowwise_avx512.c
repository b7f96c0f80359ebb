/* softmax and argmax built with avx512 flags (see rowwise_body.h). */
#include "rowwise_body.h"
