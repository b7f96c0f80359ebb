/* softmax and argmax built with avx2 flags (see rowwise_body.h). */
#include "rowwise_body.h"
