/* The binding's types and its exception, added to kwker._C. */
#include "kw_binding.h"

static int add_type(PyObject *module, PyTypeObject *type, const char *name) {
    if (PyType_Ready(type) < 0) return -1;
    return PyModule_AddObjectRef(module, name, (PyObject *)type);
}

int kw__module_add_types(PyObject *module) {
    if (!kw__PlanError) {
        kw__PlanError = PyErr_NewExceptionWithDoc(
            "kwker._C.PlanError",
            "A plan could not be built or called; .code is the kw_error code (kw_types.h), the message names the "
            "step or input.",
            PyExc_RuntimeError, NULL);
        if (!kw__PlanError) return -1;
    }
    if (PyModule_AddObjectRef(module, "PlanError", kw__PlanError) < 0) return -1;
    /* PlanError.code values: kwker._C.ESHAPE, ... */
#define KW__ADD_CODE(id, code, text) \
    if (PyModule_AddIntConstant(module, #id, code) < 0) return -1;
    KW_ERRORS(KW__ADD_CODE)
#undef KW__ADD_CODE
    if (PyModule_AddStringConstant(module, "GUARD_DROPPED", KW__GUARD_DROPPED) < 0) return -1;
    if (PyType_Ready(&kw__MemoryType) < 0) return -1;
    return add_type(module, &kw__PlanBuilderType, "PlanBuilder") || add_type(module, &kw__PlanType, "Plan") ||
                   add_type(module, &kw__CallLockType, "CallLock") || add_type(module, &kw__WatchType, "Watch")
               ? -1
               : 0;
}
