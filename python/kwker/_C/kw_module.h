/* Internal to the binding: each Python type lives in its own file and is added
 * to the module here. */
#ifndef KW_MODULE_H
#define KW_MODULE_H

#include <Python.h>

int kw__module_add_types(PyObject *module); /* 0 or -1 with an exception set */

#endif
