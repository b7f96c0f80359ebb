/* kwker._C.Watch: a tensor's memory watched for writes (runtime/kw_watch.h),
 * for the weights kwker copies. The watch keeps the tensor's storage alive (a
 * detached alias), so the memory is not freed and handed to someone else while
 * it is read-only, and it remembers the tensor's address and layout, so that
 * `param.data = other` is told apart from the same memory, and its exact Python
 * type, as Dynamo's tensor guard would. One thing frees the memory under the
 * alias: `untyped_storage().resize_()` (FSDP's gather resizes to 0 and back),
 * which gives the storage, the alias's too, new memory; the tensor then moved()
 * and a refresh watches it afresh. Where the new memory lands at the old
 * address (munmap, then mmap), it is not read-only: a write to it is seen only
 * by the comparison of the partial pages at its ends. */
#include <errno.h>

#include "kw_binding.h"
#include "kw_watch.h"

typedef struct WatchObject {
    PyObject_HEAD
    kw_watch *w;     /* NULL for a tensor of zero bytes: nothing to watch */
    PyObject *alias; /* tensor.detach() */
    PyTypeObject *type; /* type(tensor) */
    kw_tensor t;     /* the address and layout watched */
    uint64_t current_at; /* the epoch at which the tensor was last seen current (kw__watch_epoch_next) */
} WatchObject;

static uint64_t epoch;

static void seen_current(WatchObject *self) { self->current_at = ++epoch; }

uint64_t kw__watch_epoch_next(void) { return ++epoch; }

int kw__watch_current_since(PyObject *watch, uint64_t since) { return ((WatchObject *)watch)->current_at > since; }

static int same_layout(const kw_tensor *a, const kw_tensor *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d]) return 0;
    return 1;
}

int kw__watch_moved(PyObject *watch, PyObject *tensor) {
    if (!PyObject_TypeCheck(watch, &kw__WatchType)) {
        PyErr_Format(PyExc_TypeError, "expected a kwker._C.Watch, not %.100s", Py_TYPE(watch)->tp_name);
        return -1;
    }
    WatchObject *self = (WatchObject *)watch;
    if (Py_TYPE(tensor) != self->type) return KW__WATCH_REMADE;
    kw_tensor now;
    if (kw__tensor_read_quick(tensor, &now) && kw__tensor_read(tensor, "a watched tensor", &now)) return -1;
    if (!same_layout(&now, &self->t)) return KW__WATCH_REMADE;
    return now.data != self->t.data ? KW__WATCH_RELOCATED : 0;
}

const kw_watch *kw__watch_memory(PyObject *watch) { return ((WatchObject *)watch)->w; }

int kw__watch_changed(PyObject *watch, PyObject *tensor) {
    const int moved = kw__watch_moved(watch, tensor);
    if (moved) return moved;
    const kw_watch *w = kw__watch_memory(watch);
    return w && kw_watch_changed(w);
}

void kw__watch_prefetch(PyObject *watch) {
    const WatchObject *self = (const WatchObject *)watch;
    __builtin_prefetch(&self->w);
    if (self->w) kw_watch_prefetch(self->w);
}

static PyObject *watch_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"tensor", NULL};
    PyObject *tensor;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O:Watch", names, &tensor) || kw__torch_init()) return NULL;
    kw_tensor t;
    if (kw__tensor_read(tensor, "Watch's tensor", &t)) return NULL;
    const int64_t extent = kw_tensor_extent(&t);
    if (extent < 0) return PyErr_Format(PyExc_ValueError, "Watch: the tensor has negative strides");
    WatchObject *self = (WatchObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->t = t;
    seen_current(self);
    self->type = (PyTypeObject *)Py_NewRef(Py_TYPE(tensor));
    self->alias = PyObject_CallMethod(tensor, "detach", NULL);
    if (!self->alias) {
        Py_DECREF(self);
        return NULL;
    }
    if (extent > 0 && !(self->w = kw_watch_new(t.data, (size_t)extent))) {
        const int err = errno;
        Py_DECREF(self);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static PyObject *watch_rearm(PyObject *self_, PyObject *unused) {
    WatchObject *self = (WatchObject *)self_;
    if (self->w && kw_watch_rearm(self->w)) return PyErr_SetFromErrno(PyExc_OSError);
    seen_current(self);
    Py_RETURN_NONE;
}

static PyObject *watch_invalidate(PyObject *self_, PyObject *unused) {
    WatchObject *self = (WatchObject *)self_;
    if (self->w) kw_watch_invalidate(self->w);
    Py_RETURN_NONE;
}

static PyObject *watch_matches(PyObject *self, PyObject *tensor) {
    const int changed = kw__watch_changed(self, tensor);
    if (!changed) seen_current((WatchObject *)self);
    return changed < 0 ? NULL : PyBool_FromLong(!changed);
}

static PyObject *watch_moved(PyObject *self, PyObject *tensor) {
    const int moved = kw__watch_moved(self, tensor);
    return moved < 0 ? NULL : PyBool_FromLong(moved);
}

static PyObject *watch_get_changed(PyObject *self_, void *closure) {
    WatchObject *self = (WatchObject *)self_;
    return PyBool_FromLong(self->w && kw_watch_changed(self->w));
}

static PyObject *watch_get_size(PyObject *self_, void *which) {
    WatchObject *self = (WatchObject *)self_;
    if (!self->w) return PyLong_FromLong(0);
    return PyLong_FromSize_t(which ? kw_watch_protected_bytes(self->w) : kw_watch_bytes(self->w));
}

static PyObject *watch_get_tensor(PyObject *self, void *closure) { return Py_NewRef(((WatchObject *)self)->alias); }

static PyObject *watch_get_type(PyObject *self, void *closure) {
    return Py_NewRef((PyObject *)((WatchObject *)self)->type);
}

static void watch_dealloc(PyObject *self_) {
    WatchObject *self = (WatchObject *)self_;
    kw_watch_free(self->w); /* writable again before the storage can go */
    Py_XDECREF(self->alias);
    Py_XDECREF(self->type);
    Py_TYPE(self_)->tp_free(self_);
}

static PyObject *watch_handler_check(PyObject *unused, PyObject *unused2) {
    if (kw_watch_handler_check()) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef watch_methods[] = {
    {"handler_check", watch_handler_check, METH_NOARGS | METH_STATIC,
     "handler_check(): put kwker's SIGSEGV handler, which sees the writes into watched memory, back in\n"
     "front of one installed after it (faulthandler.enable() called late), as a plan's call does."},
    {"rearm", watch_rearm, METH_NOARGS,
     "rearm(): watch afresh from now on. Copy the memory only after this: a write in between is then seen."},
    {"invalidate", watch_invalidate, METH_NOARGS,
     "invalidate(): report changed until the next rearm(): the copy made since the last one is not whole."},
    {"moved", watch_moved, METH_O,
     "moved(tensor) -> bool: tensor is not at the watched address with the watched layout and Python type. The\n"
     "watched alias cannot tell: it shares the storage, whose memory untyped_storage().resize_() replaces."},
    {"matches", watch_matches, METH_O,
     "matches(tensor) -> bool: tensor has the watched address and layout, and the memory was not written\n"
     "since the watch was made or rearmed (which the watch notes: a plan's call tells a write by another thread\n"
     "after its refresh saw the tensor current from a copy the refresh left stale)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef watch_getset[] = {
    {"changed", watch_get_changed, NULL, "The memory may have been written since the watch was made or rearmed.",
     NULL},
    {"nbytes", watch_get_size, NULL, "Bytes watched.", NULL},
    {"protected_bytes", watch_get_size, NULL,
     "Bytes made read-only (whole pages); the rest, at the ends, is compared on each check.", (void *)1},
    {"tensor", watch_get_tensor, NULL, "The watched tensor (a detached alias, which keeps its storage alive).",
     NULL},
    {"type", watch_get_type, NULL, "The watched tensor's exact Python type (the alias is a plain Tensor).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject kw__WatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kwker._C.Watch",
    .tp_doc = "Watch(tensor): notices any write to the tensor's memory from now on (runtime/kw_watch.h): its\n"
              "whole pages are made read-only and re-opened by a fault handler at the first write; the\n"
              "partial pages at its ends are compared. A system call writing into a watched page fails\n"
              "with EFAULT. The watch ends (and the memory is writable again) when the object dies.",
    .tp_basicsize = sizeof(WatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = watch_new,
    .tp_dealloc = watch_dealloc,
    .tp_methods = watch_methods,
    .tp_getset = watch_getset,
};
