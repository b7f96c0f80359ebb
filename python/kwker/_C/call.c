/* kwker._C.run_op: one native op run alone (runtime/kw_call.h), on the pool of
 * torch.get_num_threads() threads: what kwker's ops do when PyTorch calls them
 * outside a plan (custom_ops.py). */
#include "kw_binding.h"
#include "kw_call.h"

int kw__parse_op_params(const char *name, PyObject *ip_obj, PyObject *fp_obj, kw__op_params *p) {
    if ((p->op = kw_op_find(name)) < 0) {
        kw__plan_error(KW_EINVAL, "no kwker op named '%s' (kwker._C.op_names() lists them)", name);
        return -1;
    }
    if ((p->n_ip = ip_obj ? kw__int64_seq(ip_obj, p->ip, KW_CALL_MAX_PARAMS, "ip") : 0) < 0) return -1;
    p->n_fp = 0;
    if (!fp_obj) return 0;
    PyObject *fast = PySequence_Fast(fp_obj, "fp");
    if (!fast) return -1;
    p->n_fp = (int)PySequence_Fast_GET_SIZE(fast);
    if (p->n_fp > KW_CALL_MAX_PARAMS) p->n_fp = -1, PyErr_SetString(PyExc_ValueError, "fp: at most 8 values");
    for (int i = 0; i < p->n_fp; i++)
        if ((p->fp[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i))) == -1.0 && PyErr_Occurred()) p->n_fp = -1;
    Py_DECREF(fast);
    return p->n_fp < 0 ? -1 : 0;
}

/* What a given tensor of no elements points at: torch gives it a NULL data
 * pointer, which the ops take for an absent optional tensor (kw__present), so
 * that an empty bias or mask would be left out where PyTorch refuses its shape.
 * Nothing is read through it. */
static _Alignas(64) const unsigned char no_elements[64];

/* The call's tensors (tensors: a tuple, which keeps them alive while the GIL is
 * released): each a CPU tensor or None (an absent optional one). */
static int read_tensors(PyObject *tensors, const char *op, kw_call *c) {
    const Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    if (n > KW_CALL_MAX_TENSORS) {
        PyErr_Format(PyExc_ValueError, "%s: at most %d tensors, got %zd", op, KW_CALL_MAX_TENSORS, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(tensors, i);
        if (t == Py_None) continue;
        char what[96];
        snprintf(what, sizeof what, "%s's tensor %zd", op, i);
        if (kw__tensor_read(t, what, &c->t[i])) return -1;
        if (!c->t[i].data) c->t[i].data = (void *)no_elements;
    }
    return 0;
}

/* Runs the call whose tensors were read (their owners kept alive by the caller). */
static PyObject *run(const char *name, const kw__op_params *p, kw_call *c) {
    memcpy(c->ip, p->ip, sizeof c->ip);
    memcpy(c->fp, p->fp, sizeof c->fp);
    /* Inside a plan's fallback this thread is its pool's thread 0, and the pool is
     * busy with that plan: the call runs on this thread alone. */
    kw_pool *pool = NULL;
    if (!kw__replaying()) {
        PyObject *n = PyObject_CallNoArgs(kw__t.get_num_threads);
        const long n_threads = n ? PyLong_AsLong(n) : -1;
        Py_XDECREF(n);
        if (n_threads == -1 && PyErr_Occurred()) return NULL;
        if (!(pool = kw__pool_get(n_threads >= 1 && n_threads <= 1024 ? (int)n_threads : 1))) return NULL;
    }
    kw_fault fault;
    char msg[512];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kw_call_run((kw_op_id)p->op, c, p->n_ip, p->n_fp, kw_cpu_isa(), pool, &fault, msg, sizeof msg);
    Py_END_ALLOW_THREADS
    if (rc == KW_EINDEX) return kw__index_error(name, fault.index, fault.size, "kwker._C.run_op");
    if (rc) return kw__plan_error(rc, "%s", msg[0] ? msg : kw_strerror(rc));
    Py_RETURN_NONE;
}

PyObject *kw__run_op(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"name", "tensors", "ip", "fp", NULL};
    const char *name;
    PyObject *seq, *ip_obj = NULL, *fp_obj = NULL;
    kw__op_params p;
    kw_call c = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|OO:run_op", names, &name, &seq, &ip_obj, &fp_obj) ||
        kw__torch_init() || kw__parse_op_params(name, ip_obj, fp_obj, &p))
        return NULL;
    PyObject *tensors = PySequence_Tuple(seq);
    if (!tensors) return NULL;
    PyObject *res = read_tensors(tensors, name, &c) ? NULL : run(name, &p, &c);
    Py_DECREF(tensors);
    return res;
}
