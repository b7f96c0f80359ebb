/* kwker._C.PlanBuilder: capture/'s builder driven from Python. Buffer and view
 * ids are the C builder's, and so are their tables; the Python side keeps only
 * what a call needs besides them (kw__program: each input's argument and
 * layout, each output's layout, the constants' tensors, fallbacks, returns). */
#include <stdint.h>

#include "kw_binding.h"
#include "kw_ops.h"

typedef struct BuilderObject {
    PyObject_HEAD
    kw_builder *b;
    kw__program *prog; /* NULL once finished */
} BuilderObject;

/* Zero-byte constants have no pointer of their own; they need a non-NULL one. */
static _Alignas(64) char empty_constant[64];

/* ---- the program tables ------------------------------------------------------------- */

void kw__program_free(kw__program *p) {
    if (!p) return;
    for (int i = 0; i < p->n_inputs; i++) {
        Py_XDECREF(p->inputs[i].name);
        Py_XDECREF(p->inputs[i].type);
        Py_XDECREF(p->inputs[i].shape_obj);
        Py_XDECREF(p->inputs[i].stride_obj);
    }
    for (int i = 0; i < p->n_outputs; i++) {
        Py_XDECREF(p->outputs[i].name);
        Py_XDECREF(p->outputs[i].shape_obj);
        Py_XDECREF(p->outputs[i].stride_obj);
    }
    for (int i = 0; i < p->n_fallbacks; i++) {
        Py_XDECREF(p->fallbacks[i].fn);
        Py_XDECREF(p->fallbacks[i].label);
        PyMem_Free(p->fallbacks[i].views);
    }
    Py_XDECREF(p->constants);
    PyMem_Free(p->inputs);
    PyMem_Free(p->outputs);
    PyMem_Free(p->fallbacks);
    PyMem_Free(p->returns);
    PyMem_Free(p->written);
    PyMem_Free(p);
}

int kw__program_traverse(kw__program *p, visitproc visit, void *arg) {
    if (!p) return 0;
    Py_VISIT(p->constants);
    for (int i = 0; i < p->n_fallbacks; i++) Py_VISIT(p->fallbacks[i].fn);
    return 0;
}

/* Room for one more entry of a table; -1 with MemoryError. Done before the C
 * builder call, so a failure cannot leave the two sides out of step. */
static int reserve(void **items, int n, int *cap, size_t size) {
    if (n < *cap) return 0;
    const int new_cap = *cap ? 2 * *cap : 16;
    void *p = PyMem_Realloc(*items, (size_t)new_cap * size);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *items = p;
    *cap = new_cap;
    return 0;
}

#define RESERVE(prog, table) reserve((void **)&(prog)->table, (prog)->n_##table, &(prog)->cap_##table, sizeof *(prog)->table)

static BuilderObject *open_builder(PyObject *self) {
    BuilderObject *b = (BuilderObject *)self;
    if (!b->prog) {
        kw__plan_error(KW_ESTATE, "the builder is already finished");
        return NULL;
    }
    return b;
}

static int fail(BuilderObject *b, int rc) {
    kw__plan_error(rc, "%s", kw_builder_error(b->b));
    return -1;
}

/* dtype, shape and strides (None: contiguous) as a layout; -1 with an exception. */
static int parse_layout(PyObject *dtype, PyObject *shape, PyObject *strides, kw_tensor *t) {
    *t = (kw_tensor){0};
    if (kw__dtype_from_py(dtype, &t->dtype)) return -1;
    if ((t->ndim = kw__int64_seq(shape, t->shape, KW_MAX_DIMS, "shape")) < 0) return -1;
    if (strides == Py_None) {
        int64_t expect = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            t->stride[d] = expect;
            expect *= t->shape[d] > 0 ? t->shape[d] : 1;
        }
        return 0;
    }
    const int n = kw__int64_seq(strides, t->stride, KW_MAX_DIMS, "strides");
    if (n < 0) return -1;
    if (n != t->ndim) {
        PyErr_Format(PyExc_ValueError, "%d strides for %d dims", n, t->ndim);
        return -1;
    }
    return 0;
}

static int64_t layout_bytes(const kw_tensor *t, const char *name) {
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0) {
            PyErr_Format(PyExc_ValueError, "'%s': negative size in dim %d", name, d);
            return -1;
        }
    const int64_t n = kw_tensor_extent(t);
    if (n < 0) PyErr_Format(PyExc_ValueError, "'%s': negative strides or a size that overflows", name);
    return n;
}

/* The replay slot capture gave a per-call buffer. */
static int buffer_slot(BuilderObject *self, int id) {
    kw_buffer_kind kind;
    int slot = -1;
    kw_builder_buffer(self->b, id, &kind, &slot);
    return slot;
}

/* ---- buffers ------------------------------------------------------------------------ */

static int add_input(BuilderObject *self, PyObject *name, const kw_tensor *t, PyObject *arg_obj, PyObject *type) {
    kw__program *prog = self->prog;
    const char *cname = PyUnicode_AsUTF8(name);
    if (!cname) return -1;
    const int64_t nbytes = layout_bytes(t, cname);
    if (nbytes < 0) return -1;
    long arg = prog->n_args;
    if (arg_obj != Py_None) {
        arg = PyLong_AsLong(arg_obj);
        if (arg == -1 && PyErr_Occurred()) return -1;
        if (arg < 0 || arg > (1 << 20)) {
            PyErr_Format(PyExc_ValueError, "input '%s': argument position %ld", cname, arg);
            return -1;
        }
    }
    if (RESERVE(prog, inputs)) return -1;
    PyObject *shape = kw__int64_tuple(t->shape, t->ndim), *stride = kw__int64_tuple(t->stride, t->ndim);
    if (!shape || !stride) goto error;
    const int id = kw_builder_input(self->b, cname, (size_t)nbytes);
    if (id < 0) {
        fail(self, id);
        goto error;
    }
    prog->inputs[prog->n_inputs++] = (kw__py_input){
        .name = Py_NewRef(name),
        .arg = (int)arg,
        .slot = buffer_slot(self, id),
        .type = (PyTypeObject *)Py_XNewRef(type),
        .t = *t,
        .shape_obj = shape,
        .stride_obj = stride,
    };
    if (arg + 1 > prog->n_args) prog->n_args = (int)arg + 1;
    return id;
error:
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return -1;
}

static PyObject *builder_input(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"name", "dtype", "shape", "strides", "arg", "type", NULL};
    PyObject *name, *dtype, *shape, *strides = Py_None, *arg = Py_None, *type = NULL;
    BuilderObject *self = open_builder(self_);
    if (!self || !PyArg_ParseTupleAndKeywords(args, kw, "UOO|O$OO!:input", names, &name, &dtype, &shape, &strides, &arg,
                                              &PyType_Type, &type))
        return NULL;
    kw_tensor t;
    if (parse_layout(dtype, shape, strides, &t)) return NULL;
    const int id = add_input(self, name, &t, arg, type);
    return id < 0 ? NULL : PyLong_FromLong(id);
}

static PyObject *builder_constant(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"tensor", "name", NULL};
    PyObject *tensor;
    const char *name = NULL;
    BuilderObject *self = open_builder(self_);
    if (!self || !PyArg_ParseTupleAndKeywords(args, kw, "O|z:constant", names, &tensor, &name)) return NULL;
    kw__program *prog = self->prog;
    kw_tensor t;
    if (kw__tensor_read(tensor, "constant", &t)) return NULL;
    if (!name) name = "constant";
    const int64_t nbytes = layout_bytes(&t, name);
    if (nbytes < 0) return NULL;
    const int id = kw_builder_constant(self->b, name, t.data ? t.data : empty_constant, (size_t)nbytes);
    if (id < 0) return fail(self, id), NULL;
    PyObject *key = PyLong_FromLong(id);
    const int bad = !key || PyDict_SetItem(prog->constants, key, tensor);
    if (bad) {
        Py_XDECREF(key);
        return NULL;
    }
    return key;
}

static PyObject *builder_arena(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"nbytes", "name", NULL};
    Py_ssize_t nbytes;
    const char *name = "arena";
    BuilderObject *self = open_builder(self_);
    if (!self || !PyArg_ParseTupleAndKeywords(args, kw, "n|z:arena", names, &nbytes, &name)) return NULL;
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "arena '%s': %zd bytes", name ? name : "", nbytes);
    const int id = kw_builder_arena(self->b, name ? name : "arena", (size_t)nbytes);
    if (id < 0) return fail(self, id), NULL;
    return PyLong_FromLong(id);
}

static PyObject *builder_output_buffer(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"name", "dtype", "shape", "strides", NULL};
    PyObject *name, *dtype, *shape, *strides = Py_None;
    BuilderObject *self = open_builder(self_);
    if (!self || !PyArg_ParseTupleAndKeywords(args, kw, "UOO|O:output_buffer", names, &name, &dtype, &shape, &strides))
        return NULL;
    kw__program *prog = self->prog;
    kw_tensor t;
    const char *cname = PyUnicode_AsUTF8(name);
    if (!cname || parse_layout(dtype, shape, strides, &t)) return NULL;
    const int64_t nbytes = layout_bytes(&t, cname);
    if (nbytes < 0 || RESERVE(prog, outputs)) return NULL;
    PyObject *shape_obj = kw__int64_tuple(t.shape, t.ndim), *stride_obj = kw__int64_tuple(t.stride, t.ndim);
    int id = -1;
    if (shape_obj && stride_obj) {
        id = kw_builder_output(self->b, cname, (size_t)nbytes);
        if (id < 0) fail(self, id);
    }
    if (id < 0) {
        Py_XDECREF(shape_obj);
        Py_XDECREF(stride_obj);
        return NULL;
    }
    prog->outputs[prog->n_outputs++] = (kw__py_output){
        .name = Py_NewRef(name),
        .slot = buffer_slot(self, id),
        .t = t,
        .shape_obj = shape_obj,
        .stride_obj = stride_obj,
    };
    return PyLong_FromLong(id);
}

/* ---- views and steps ------------------------------------------------------------------ */

static PyObject *builder_view(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"buffer", "dtype", "shape", "strides", "offset", NULL};
    int buffer;
    PyObject *dtype, *shape, *strides = Py_None;
    Py_ssize_t offset = 0;
    BuilderObject *self = open_builder(self_);
    if (!self || !PyArg_ParseTupleAndKeywords(args, kw, "iOO|On:view", names, &buffer, &dtype, &shape, &strides,
                                              &offset))
        return NULL;
    kw_tensor t;
    if (parse_layout(dtype, shape, strides, &t)) return NULL;
    if (offset < 0) return PyErr_Format(PyExc_ValueError, "view: byte offset %zd", offset);
    const int id = kw_builder_view(self->b, buffer, t.dtype, t.ndim, t.shape, t.stride, (size_t)offset);
    if (id < 0) return fail(self, id), NULL;
    return PyLong_FromLong(id);
}

static int parse_view_ids(PyObject *seq, int *out, int max, int allow_none, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int rc = (int)n;
    if (n > max) {
        PyErr_Format(PyExc_ValueError, "%s: %zd views, at most %d", what, n, max);
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc >= 0 && i < n; i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(fast, i);
        if (v == Py_None && allow_none) {
            out[i] = -1;
            continue;
        }
        const long id = PyLong_AsLong(v);
        if (id == -1 && PyErr_Occurred()) rc = -1;
        out[i] = (int)id;
    }
    Py_DECREF(fast);
    return rc;
}

static int label_step(BuilderObject *self, int step, PyObject *label) {
    if (label == Py_None) return 0;
    const char *text = PyUnicode_AsUTF8(label);
    if (!text) return -1;
    const int rc = kw_builder_label(self->b, step, text);
    return rc < 0 ? fail(self, rc) : 0;
}

/* An op step's arguments as given to op() and check_op(). */
typedef struct op_args {
    kw__op_params p;
    int n_views;
    int views[KW_CALL_MAX_TENSORS];
} op_args;

static int parse_op_args(const char *name, PyObject *views_obj, PyObject *ip_obj, PyObject *fp_obj, op_args *a) {
    if (kw__parse_op_params(name, ip_obj, fp_obj, &a->p)) return -1;
    a->n_views = parse_view_ids(views_obj, a->views, KW_CALL_MAX_TENSORS, 1, "op views");
    return a->n_views < 0 ? -1 : 0;
}

static PyObject *builder_op(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"name", "views", "ip", "fp", "label", NULL};
    const char *name;
    PyObject *views_obj, *ip_obj = NULL, *fp_obj = NULL, *label = Py_None;
    BuilderObject *self = open_builder(self_);
    op_args a;
    if (!self ||
        !PyArg_ParseTupleAndKeywords(args, kw, "sO|OO$O:op", names, &name, &views_obj, &ip_obj, &fp_obj, &label) ||
        parse_op_args(name, views_obj, ip_obj, fp_obj, &a))
        return NULL;
    const int step = kw_builder_op(self->b, a.p.op, a.views, a.n_views, a.p.ip, a.p.n_ip, a.p.fp, a.p.n_fp);
    if (step < 0) return fail(self, step), NULL;
    if (label_step(self, step, label)) return NULL;
    return PyLong_FromLong(step);
}

static PyObject *builder_check_op(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"name", "views", "ip", "fp", NULL};
    const char *name;
    PyObject *views_obj, *ip_obj = NULL, *fp_obj = NULL;
    BuilderObject *self = open_builder(self_);
    op_args a;
    if (!self || !PyArg_ParseTupleAndKeywords(args, kw, "sO|OO:check_op", names, &name, &views_obj, &ip_obj, &fp_obj) ||
        parse_op_args(name, views_obj, ip_obj, fp_obj, &a))
        return NULL;
    char msg[512];
    if (!kw_builder_check_op(self->b, a.p.op, a.views, a.n_views, a.p.ip, a.p.n_ip, a.p.fp, a.p.n_fp, msg, sizeof msg))
        Py_RETURN_NONE;
    return PyUnicode_FromString(msg);
}

/* A view a call hands to Python (returned, or a fallback's) can be a torch tensor. */
static int check_torch_view(BuilderObject *self, int view, const char *what) {
    int buffer;
    size_t offset;
    kw_tensor layout;
    if (kw_builder_view_layout(self->b, view, &buffer, &offset, &layout)) {
        PyErr_Format(PyExc_ValueError, "%s: no view %d", what, view);
        return -1;
    }
    if (kw_tensor_extent(&layout) < 0) {
        PyErr_Format(PyExc_ValueError, "%s: view %d has negative strides, which torch tensors cannot have", what,
                     view);
        return -1;
    }
    return 0;
}

/* The C step gets each view once, with the union of its accesses; the Python
 * function gets reads and writes as given (a view in both is one tensor). */
static int fallback_views(BuilderObject *self, const int *ids, int n_reads, int n, int *unique, char *access) {
    int n_unique = 0;
    for (int i = 0; i < n; i++) {
        if (check_torch_view(self, ids[i], "fallback")) return -1;
        const char a = i < n_reads ? KW_READ : KW_WRITE;
        int j = 0;
        while (j < n_unique && unique[j] != ids[i]) j++;
        if (j == n_unique) {
            unique[n_unique] = ids[i];
            access[n_unique++] = a;
        } else if (access[j] != a) {
            access[j] = KW_MODIFY;
        }
    }
    return n_unique;
}

static PyObject *builder_fallback(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"fn", "reads", "writes", "label", NULL};
    PyObject *fn, *reads_obj, *writes_obj, *label = Py_None;
    BuilderObject *self = open_builder(self_);
    if (!self || !PyArg_ParseTupleAndKeywords(args, kw, "OOO|$O:fallback", names, &fn, &reads_obj, &writes_obj, &label))
        return NULL;
    if (!PyCallable_Check(fn)) return PyErr_Format(PyExc_TypeError, "fallback: fn must be callable");
    kw__program *prog = self->prog;
    PyObject *reads = PySequence_Fast(reads_obj, "fallback reads"), *writes = NULL;
    int *ids = NULL, *unique = NULL;
    char *access = NULL;
    PyObject *result = NULL;
    if (!reads || !(writes = PySequence_Fast(writes_obj, "fallback writes"))) goto done;
    const int n_reads = (int)PySequence_Fast_GET_SIZE(reads), n = n_reads + (int)PySequence_Fast_GET_SIZE(writes);
    ids = PyMem_Malloc(sizeof(int) * (size_t)(n + 1));
    unique = PyMem_Malloc(sizeof(int) * (size_t)(n + 1));
    access = PyMem_Malloc((size_t)n + 1);
    if (!ids || !unique || !access) {
        PyErr_NoMemory();
        goto done;
    }
    if (parse_view_ids(reads, ids, n_reads, 0, "fallback reads") < 0 ||
        parse_view_ids(writes, ids + n_reads, n - n_reads, 0, "fallback writes") < 0)
        goto done;
    const int n_unique = fallback_views(self, ids, n_reads, n, unique, access);
    if (n_unique < 0 || RESERVE(prog, fallbacks)) goto done;
    if (label == Py_None) {
        label = PyObject_GetAttrString(fn, "__qualname__");
        if (!label || !PyUnicode_Check(label)) {
            PyErr_Clear();
            Py_XDECREF(label);
            label = PyUnicode_FromString("fallback");
            if (!label) goto done;
        }
    } else {
        Py_INCREF(label);
    }
    const int index = prog->n_fallbacks;
    const int step = kw_builder_fallback(self->b, kw__fallback_call, (void *)(intptr_t)index, unique, access, n_unique);
    if (step < 0) {
        Py_DECREF(label);
        fail(self, step);
        goto done;
    }
    prog->fallbacks[prog->n_fallbacks++] = (kw__py_fallback){
        .fn = Py_NewRef(fn), .label = label, .n_reads = n_reads, .n_writes = n - n_reads, .views = ids};
    ids = NULL;
    if (label_step(self, step, label)) goto done;
    result = PyLong_FromLong(step);
done:
    Py_XDECREF(reads);
    Py_XDECREF(writes);
    PyMem_Free(ids);
    PyMem_Free(unique);
    PyMem_Free(access);
    return result;
}

static PyObject *builder_output(PyObject *self_, PyObject *arg) {
    BuilderObject *self = open_builder(self_);
    if (!self) return NULL;
    const long view = PyLong_AsLong(arg);
    if (view == -1 && PyErr_Occurred()) return NULL;
    kw__program *prog = self->prog;
    if (check_torch_view(self, (int)view, "output")) return NULL;
    int buffer, slot;
    size_t offset;
    kw_tensor layout;
    kw_buffer_kind kind;
    kw_builder_view_layout(self->b, (int)view, &buffer, &offset, &layout);
    kw_builder_buffer(self->b, buffer, &kind, &slot);
    if (kind == KW_BUFFER_ARENA)
        return kw__plan_error(KW_EINVAL,
                              "output: view %ld lies in an arena buffer, which the next call reuses; "
                              "declare its memory with output_buffer()",
                              view);
    if (RESERVE(prog, returns)) return NULL;
    prog->returns[prog->n_returns] = (int)view;
    return PyLong_FromLong(prog->n_returns++);
}

/* finish's `written`: the argument indices whose tensors the plan writes in place. */
static int set_written(kw__program *prog, PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "finish: written must be a sequence of argument indices");
    if (!fast) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int *written = PyMem_Calloc((size_t)n + 1, sizeof *written);
    if (!written) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const long arg = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if ((arg == -1 && PyErr_Occurred()) || arg < 0 || arg >= prog->n_args) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "finish: written argument %ld, but the plan takes %d", arg, prog->n_args);
            PyMem_Free(written);
            Py_DECREF(fast);
            return -1;
        }
        written[i] = (int)arg;
    }
    Py_DECREF(fast);
    PyMem_Free(prog->written);
    prog->written = written, prog->n_written = (int)n;
    return 0;
}

static PyObject *builder_finish(PyObject *self_, PyObject *args, PyObject *kw) {
    static char *names[] = {"n_threads", "n_args", "barrier_every_step", "written", NULL};
    PyObject *threads_obj = Py_None, *n_args_obj = Py_None, *written_obj = Py_None;
    int barrier_every_step = 0;
    BuilderObject *self = open_builder(self_);
    if (!self || !PyArg_ParseTupleAndKeywords(args, kw, "|O$OpO:finish", names, &threads_obj, &n_args_obj,
                                              &barrier_every_step, &written_obj))
        return NULL;
    PyObject *threads = threads_obj == Py_None ? PyObject_CallNoArgs(kw__t.get_num_threads) : Py_NewRef(threads_obj);
    if (!threads) return NULL;
    const long n_threads = PyLong_AsLong(threads);
    Py_DECREF(threads);
    if (n_threads == -1 && PyErr_Occurred()) return NULL;
    kw__program *prog = self->prog;
    if (n_args_obj != Py_None) {
        const long n_args = PyLong_AsLong(n_args_obj);
        if (n_args == -1 && PyErr_Occurred()) return NULL;
        if (n_args < prog->n_args || n_args > (1 << 20))
            return PyErr_Format(PyExc_ValueError, "finish: n_args %ld, but an input reads argument %d", n_args,
                                prog->n_args - 1);
        prog->n_args = (int)n_args;
    }
    if (written_obj != Py_None && set_written(prog, written_obj)) return NULL;
    const kw_finish_opts o = {.n_threads = (int)(n_threads > 0 && n_threads <= 1024 ? n_threads : -1),
                              .barrier_every_step = barrier_every_step,
                              .isa = -1};
    kw_plan *plan;
    char msg[512];
    const int rc = kw_builder_finish(self->b, &o, &plan, msg, sizeof msg);
    if (rc) return kw__plan_error(rc, "%s", msg);
    self->prog = NULL;
    return kw__plan_new(plan, prog, o.n_threads);
}

/* ---- the type ------------------------------------------------------------------------ */

static PyObject *builder_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw)))
        return PyErr_Format(PyExc_TypeError, "PlanBuilder() takes no arguments");
    if (kw__torch_init()) return NULL;
    BuilderObject *self = (BuilderObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->b = kw_builder_create();
    self->prog = PyMem_Calloc(1, sizeof *self->prog);
    if (self->prog) self->prog->constants = PyDict_New();
    if (!self->b || !self->prog || !self->prog->constants) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static int builder_traverse(PyObject *self, visitproc visit, void *arg) {
    return kw__program_traverse(((BuilderObject *)self)->prog, visit, arg);
}

static int builder_clear(PyObject *self_) {
    BuilderObject *self = (BuilderObject *)self_;
    kw__program *prog = self->prog;
    self->prog = NULL;
    kw__program_free(prog);
    return 0;
}

static void builder_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    builder_clear(self);
    kw_builder_destroy(((BuilderObject *)self)->b);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef builder_methods[] = {
    {"input", (PyCFunction)(void (*)(void))builder_input, METH_VARARGS | METH_KEYWORDS,
     "input(name, dtype, shape, strides=None, *, arg=None, type=None) -> buffer id\n\n"
     "A per-call input: argument `arg` (default: the next position) must be a CPU tensor of exactly\n"
     "this dtype, shape and strides (strides of size-1 dims aside), and of exactly the Python type\n"
     "`type` when given (torch.Tensor, torch.nn.Parameter); its pointer is bound each call."},
    {"constant", (PyCFunction)(void (*)(void))builder_constant, METH_VARARGS | METH_KEYWORDS,
     "constant(tensor, name=None) -> buffer id\n\nRead-only memory at a fixed address; the plan keeps "
     "the tensor alive."},
    {"arena", (PyCFunction)(void (*)(void))builder_arena, METH_VARARGS | METH_KEYWORDS,
     "arena(nbytes, name=None) -> buffer id\n\nAn intermediate buffer placed in the plan's arena by "
     "liveness."},
    {"output_buffer", (PyCFunction)(void (*)(void))builder_output_buffer, METH_VARARGS | METH_KEYWORDS,
     "output_buffer(name, dtype, shape, strides=None) -> buffer id\n\n"
     "A tensor allocated fresh on every call (torch.empty_strided) that steps write into."},
    {"view", (PyCFunction)(void (*)(void))builder_view, METH_VARARGS | METH_KEYWORDS,
     "view(buffer, dtype, shape, strides=None, offset=0) -> view id\n\n"
     "A typed view `offset` bytes into a buffer; strides in elements (None: contiguous)."},
    {"op", (PyCFunction)(void (*)(void))builder_op, METH_VARARGS | METH_KEYWORDS,
     "op(name, views, ip=(), fp=(), *, label=None) -> step index\n\n"
     "A native kernel step; views[k] (a view id, or None for an absent optional tensor) goes to the\n"
     "op's tensor slot k; ip / fp are its int and float parameters."},
    {"check_op", (PyCFunction)(void (*)(void))builder_check_op, METH_VARARGS | METH_KEYWORDS,
     "check_op(name, views, ip=(), fp=()) -> None, or why the op would reject the step\n\n"
     "What op() with these arguments would meet at finish() from the op's own rules (its dtypes,\n"
     "shapes and parameters); adds nothing, so the caller may add a fallback step instead."},
    {"fallback", (PyCFunction)(void (*)(void))builder_fallback, METH_VARARGS | METH_KEYWORDS,
     "fallback(fn, reads, writes, *, label=None) -> step index\n\n"
     "A Python step: fn(reads, writes) is called with two tuples of torch tensors over the views'\n"
     "memory and must write its results into `writes` in place. It runs on the calling thread\n"
     "with the GIL while the pool waits; an exception aborts the call and is re-raised."},
    {"output", builder_output, METH_O,
     "output(view) -> index in the returned tuple\n\n"
     "Returns a view of an output buffer (a fresh tensor each call), an input or a constant."},
    {"finish", (PyCFunction)(void (*)(void))builder_finish, METH_VARARGS | METH_KEYWORDS,
     "finish(n_threads=None, *, n_args=None, barrier_every_step=False, written=None) -> Plan\n\n"
     "Validates and plans. n_threads defaults to torch.get_num_threads(); n_args (default: one past\n"
     "the last input's position) is how many positional arguments a call takes - arguments no input\n"
     "reads are ignored; written: the arguments the plan writes in place, whose version counters\n"
     "each call bumps. Raises PlanError naming the step and the problem."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject kw__PlanBuilderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kwker._C.PlanBuilder",
    .tp_doc = "PlanBuilder() - declare buffers, views and steps, then finish() into a Plan.",
    .tp_basicsize = sizeof(BuilderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = builder_new,
    .tp_dealloc = builder_dealloc,
    .tp_traverse = builder_traverse,
    .tp_clear = builder_clear,
    .tp_methods = builder_methods,
};
