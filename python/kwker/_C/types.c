#include "kw_module.h"

int kw__module_add_types(PyObject *module) {
    (void)module;
    return 0;
}
