/* PyTorch as the binding sees it: a module imported on first use, tensors read
 * through their Python attributes, and tensors made over kwker's memory with
 * torch.frombuffer on a small buffer-protocol object that keeps the memory's
 * owner alive. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kw_binding.h"
#include "kw_mem.h"

kw__torch kw__t;
PyObject *kw__PlanError;

PyObject *kw__plan_error(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (!msg) return NULL;
    PyObject *exc = PyObject_CallOneArg(kw__PlanError, msg);
    Py_DECREF(msg);
    if (!exc) return NULL;
    PyObject *code_obj = PyLong_FromLong(code);
    if (code_obj && PyObject_SetAttrString(exc, "code", code_obj) == 0) PyErr_SetObject(kw__PlanError, exc);
    Py_XDECREF(code_obj);
    Py_DECREF(exc);
    return NULL;
}

static int intern(PyObject **slot, const char *s) {
    *slot = PyUnicode_InternFromString(s);
    return *slot ? 0 : -1;
}

static void shim_init(PyObject *torch);

static int get_attr(PyObject **slot, PyObject *obj, const char *name) {
    *slot = PyObject_GetAttrString(obj, name);
    return *slot ? 0 : -1;
}

int kw__torch_init(void) {
    if (kw__t.module) return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch) return -1;
    kw__torch t = {.module = torch};
    PyObject *tensor = NULL;
    int rc = get_attr(&tensor, torch, "Tensor");
    if (!rc && !PyType_Check(tensor)) {
        PyErr_SetString(PyExc_TypeError, "torch.Tensor is not a type");
        rc = -1;
    }
    t.tensor_type = (PyTypeObject *)tensor;
    for (int i = 0; i < KW_DTYPE_COUNT && !rc; i++) rc = get_attr(&t.dtype[i], torch, kw_dtype_name((kw_dtype)i));
    if (!rc) rc = get_attr(&t.empty_strided, torch, "empty_strided");
    if (!rc) rc = get_attr(&t.frombuffer, torch, "frombuffer");
    if (!rc) rc = get_attr(&t.get_num_threads, torch, "get_num_threads");
    if (!rc) {
        PyObject *c = NULL;
        rc = get_attr(&c, torch, "_C") || get_attr(&t.increment_version, c, "_increment_version");
        Py_XDECREF(c);
    }
    if (!rc && !(t.cpu = PyObject_CallMethod(torch, "device", "s", "cpu"))) rc = -1;
    if (!rc && !(t.kw_dtype_device = Py_BuildValue("(ss)", "dtype", "device"))) rc = -1;
    if (!rc) rc = intern(&t.s_dtype, "dtype") || intern(&t.s_shape, "shape") || intern(&t.s_stride, "stride") ||
                  intern(&t.s_data_ptr, "data_ptr") || intern(&t.s_is_cpu, "is_cpu") ||
                  intern(&t.s_as_strided, "as_strided") || intern(&t.s_storage_offset, "storage_offset") ||
                  intern(&t.s_version, "_version");
    if (rc) {
        /* Partly filled: the references leak, once, on a broken torch install. */
        Py_DECREF(torch);
        return -1;
    }
    kw__t = t;
    shim_init(torch);
    return 0;
}

int kw__dtype_from_py(PyObject *obj, kw_dtype *out) {
    for (int i = 0; i < KW_DTYPE_COUNT; i++)
        if (obj == kw__t.dtype[i] ||
            (PyUnicode_Check(obj) && PyUnicode_CompareWithASCIIString(obj, kw_dtype_name((kw_dtype)i)) == 0)) {
            *out = (kw_dtype)i;
            return 0;
        }
    PyErr_Format(PyExc_TypeError, "dtype %R is not one kwker supports (float32, bfloat16, float16, int64, "
                                  "int32, bool, uint8)", obj);
    return -1;
}

int kw__int64_seq(PyObject *seq, int64_t *out, int max, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > max) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: %zd entries, at most %d", what, n, max);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return (int)n;
}

PyObject *kw__int64_tuple(const int64_t *v, int n) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* ---- reading a tensor ----------------------------------------------------------------- */

/* Elements but no memory of its own: a wrapper subclass (TwoTensor, a quantized
 * weight made with _make_wrapper_subclass), whose values live in the tensors it
 * wraps. Its data pointer is NULL; nothing of kwker's may read through it. */
static int storageless(const kw_tensor *t) {
    return !t->data && kw_tensor_extent(t) != 0;
}

/* Through its Python attributes: about 1 µs a tensor (each attribute of a
 * torch.nn.Parameter first looks for a __torch_function__ override). Also
 * where every error message comes from. */
static int tensor_read_python(PyObject *t, const char *what, kw_tensor *out) {
    PyObject *is_cpu = PyObject_GetAttr(t, kw__t.s_is_cpu);
    if (!is_cpu) return -1;
    Py_DECREF(is_cpu);
    if (is_cpu != Py_True) {
        kw__plan_error(KW_EINVAL, "%s must be a CPU tensor", what);
        return -1;
    }
    PyObject *dtype = PyObject_GetAttr(t, kw__t.s_dtype);
    if (!dtype) return -1;
    const int bad = kw__dtype_from_py(dtype, &out->dtype);
    Py_DECREF(dtype);
    if (bad) return -1;
    PyObject *shape = PyObject_GetAttr(t, kw__t.s_shape);
    if (!shape) return -1;
    out->ndim = kw__int64_seq(shape, out->shape, KW_MAX_DIMS, what);
    Py_DECREF(shape);
    if (out->ndim < 0) return -1;
    PyObject *stride = PyObject_CallMethodNoArgs(t, kw__t.s_stride);
    if (!stride) return -1;
    const int n = kw__int64_seq(stride, out->stride, KW_MAX_DIMS, what);
    Py_DECREF(stride);
    if (n < 0) return -1;
    PyObject *ptr = PyObject_CallMethodNoArgs(t, kw__t.s_data_ptr);
    if (!ptr) return -1;
    out->data = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    if (out->data == NULL && PyErr_Occurred()) return -1;
    if (storageless(out)) {
        kw__plan_error(KW_EINVAL, "%s has no memory of its own (a tensor subclass wrapping others?)", what);
        return -1;
    }
    return 0;
}

/* Through PyTorch's stable C shim (torch/csrc/inductor/aoti_torch/c/shim.h, the
 * C ABI that AOTInductor's compiled models call; declared here, not included,
 * and looked up in the libtorch_cpu already loaded). It reads a tensor given an
 * AtenTensorHandle, which is an at::Tensor*; a torch.Tensor's Python object
 * holds its at::Tensor at a fixed offset (THPVariable.cdata). That offset is
 * found once, by looking for the TensorImpl pointer Tensor._cdata returns, and
 * every reading is checked against Python's on probe tensors; if anything
 * differs, tensors are read through Python instead. Tens of ns a tensor. */
typedef int32_t (*shim_get_ptr_fn)(void *tensor, void **out);
typedef int32_t (*shim_get_i64_fn)(void *tensor, int64_t *out);
typedef int32_t (*shim_get_i64s_fn)(void *tensor, int64_t **out);
typedef int32_t (*shim_get_i32_fn)(void *tensor, int32_t *out);

static struct {
    int ok;
    Py_ssize_t offset;  /* of the at::Tensor in a tensor's Python object */
    Py_ssize_t storage; /* of the StorageImpl pointer in a TensorImpl, for prefetching only; -1: not found */
    int32_t cpu;
    int32_t dtype_code[KW_DTYPE_COUNT];
    shim_get_ptr_fn data_ptr;
    shim_get_i64_fn dim;
    shim_get_i64s_fn sizes, strides;
    shim_get_i32_fn dtype, device_type;
} shim;

/* 0 on success; -1 when the shim cannot say, or reads a tensor without memory
 * of its own (the Python path then decides, or names the error). */
static int tensor_read_shim(PyObject *t, kw_tensor *out) {
    void *h = (char *)t + shim.offset;
    int64_t ndim, *sizes, *strides;
    int32_t dtype, device;
    if (shim.device_type(h, &device) || device != shim.cpu || shim.dtype(h, &dtype) || shim.dim(h, &ndim) ||
        ndim > KW_MAX_DIMS || shim.sizes(h, &sizes) || shim.strides(h, &strides) || shim.data_ptr(h, &out->data))
        return -1;
    int d = 0;
    while (d < KW_DTYPE_COUNT && shim.dtype_code[d] != dtype) d++;
    if (d == KW_DTYPE_COUNT) return -1;
    out->dtype = (kw_dtype)d;
    out->ndim = (int)ndim;
    memcpy(out->shape, sizes, (size_t)ndim * sizeof *sizes);
    memcpy(out->stride, strides, (size_t)ndim * sizeof *strides);
    return storageless(out) ? -1 : 0;
}

int kw__tensor_read_quick(PyObject *t, kw_tensor *out) {
    return shim.ok && PyObject_TypeCheck(t, kw__t.tensor_type) ? tensor_read_shim(t, out) : -1;
}

int kw__tensor_read(PyObject *t, const char *what, kw_tensor *out) {
    if (!PyObject_TypeCheck(t, kw__t.tensor_type)) {
        PyErr_Format(PyExc_TypeError, "%s must be a torch.Tensor, not %.100s", what, Py_TYPE(t)->tp_name);
        return -1;
    }
    if (shim.ok && tensor_read_shim(t, out) == 0) return 0;
    return tensor_read_python(t, what, out);
}

static int same_reading(const kw_tensor *a, const kw_tensor *b) {
    if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d]) return 0;
    return 1;
}

/* The shim agrees with Python on a probe: its offset found, its readings equal. */
static int shim_check(PyObject *probe) {
    PyObject *impl_obj = PyObject_GetAttrString(probe, "_cdata");
    void *impl = impl_obj ? PyLong_AsVoidPtr(impl_obj) : NULL;
    Py_XDECREF(impl_obj);
    if (!impl) return 0;
    Py_ssize_t at = -1;
    for (Py_ssize_t off = sizeof(PyObject); off < (Py_ssize_t)sizeof(PyObject) + 64 && at < 0; off += sizeof(void *))
        if (*(void **)((char *)probe + off) == impl) at = off;
    if (at < 0 || (shim.offset && at != shim.offset)) return 0;
    shim.offset = at;
    /* Where the TensorImpl keeps its storage: only ever used as a prefetch hint. */
    PyObject *storage = PyObject_CallMethod(probe, "untyped_storage", NULL);
    PyObject *storage_impl = storage ? PyObject_GetAttrString(storage, "_cdata") : NULL;
    void *simpl = storage_impl ? PyLong_AsVoidPtr(storage_impl) : NULL;
    Py_XDECREF(storage_impl);
    Py_XDECREF(storage);
    PyErr_Clear();
    Py_ssize_t found = -1;
    for (Py_ssize_t off = 0; simpl && off < 256 && found < 0; off += sizeof(void *))
        if (*(void **)((char *)impl + off) == simpl) found = off;
    if (found < 0 || (shim.storage && shim.storage != found))
        shim.storage = -1; /* not found, or not where the first probe had it */
    else if (!shim.storage)
        shim.storage = found;
    kw_tensor fast, slow;
    return tensor_read_shim(probe, &fast) == 0 && tensor_read_python(probe, "probe", &slow) == 0 &&
           same_reading(&fast, &slow);
}

static void *shim_symbol(void *lib, const char *name) { return lib ? dlsym(lib, name) : NULL; }

/* Called once torch is imported; failures leave shim.ok at 0, never an error. */
static void shim_init(PyObject *torch) {
    PyObject *file = PyObject_GetAttrString(torch, "__file__");
    const char *torch_init = file ? PyUnicode_AsUTF8(file) : NULL;
    char lib_path[4096] = "";
    if (torch_init) {
        const char *slash = strrchr(torch_init, '/');
        if (slash) snprintf(lib_path, sizeof lib_path, "%.*s/lib/libtorch_cpu.so", (int)(slash - torch_init), torch_init);
    }
    Py_XDECREF(file);
    PyErr_Clear();
    void *lib = lib_path[0] ? dlopen(lib_path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    shim.data_ptr = (shim_get_ptr_fn)shim_symbol(lib, "aoti_torch_get_data_ptr");
    shim.dim = (shim_get_i64_fn)shim_symbol(lib, "aoti_torch_get_dim");
    shim.sizes = (shim_get_i64s_fn)shim_symbol(lib, "aoti_torch_get_sizes");
    shim.strides = (shim_get_i64s_fn)shim_symbol(lib, "aoti_torch_get_strides");
    shim.dtype = (shim_get_i32_fn)shim_symbol(lib, "aoti_torch_get_dtype");
    shim.device_type = (shim_get_i32_fn)shim_symbol(lib, "aoti_torch_get_device_type");
    int32_t (*cpu)(void) = (int32_t(*)(void))shim_symbol(lib, "aoti_torch_device_type_cpu");
    static const char *const dtype_fns[KW_DTYPE_COUNT] = {
        [KW_F32] = "aoti_torch_dtype_float32", [KW_BF16] = "aoti_torch_dtype_bfloat16",
        [KW_F16] = "aoti_torch_dtype_float16", [KW_I64] = "aoti_torch_dtype_int64",
        [KW_I32] = "aoti_torch_dtype_int32",   [KW_BOOL] = "aoti_torch_dtype_bool",
        [KW_U8] = "aoti_torch_dtype_uint8",
    };
    int found = lib && shim.data_ptr && shim.dim && shim.sizes && shim.strides && shim.dtype && shim.device_type && cpu;
    for (int d = 0; found && d < KW_DTYPE_COUNT; d++) {
        int32_t (*code)(void) = (int32_t(*)(void))shim_symbol(lib, dtype_fns[d]);
        if (!code) found = 0;
        else shim.dtype_code[d] = code();
    }
    if (lib) dlclose(lib); /* RTLD_NOLOAD: only drops the reference this took */
    if (!found) return;
    shim.cpu = cpu();
    /* Probes: a strided view, a Parameter (a Python subclass), a bfloat16 scalar. */
    PyObject *globals = Py_BuildValue("{sOsO}", "t", torch, "__builtins__", PyEval_GetBuiltins());
    PyObject *probes = globals ? PyRun_String("[t.empty_strided((2, 3), (1, 2)), t.empty(5, 4)[1:, ::2], "
                                              "t.nn.Parameter(t.empty(7)), t.zeros((), dtype=t.bfloat16)]",
                                              Py_eval_input, globals, globals)
                               : NULL;
    Py_XDECREF(globals);
    int ok = probes != NULL && PyList_Check(probes);
    for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(probes); i++) ok = shim_check(PyList_GET_ITEM(probes, i));
    Py_XDECREF(probes);
    PyErr_Clear();
    shim.ok = ok;
}

int kw__tensor_read_is_fast(void) { return shim.ok; }

void kw__tensor_prefetch(PyObject *t, int round) {
    if (!shim.ok) return;
    const char *obj = (const char *)t + shim.offset;
    if (round == 0) {
        __builtin_prefetch(obj);
        return;
    }
    if (!PyObject_TypeCheck(t, kw__t.tensor_type)) return;
    const char *impl = *(const char *const *)obj;
    if (!impl) return;
    if (round == 1) {
        for (int line = 0; line < 4; line++) __builtin_prefetch(impl + 64 * line);
    } else if (shim.storage > 0) {
        __builtin_prefetch(*(const char *const *)(impl + shim.storage));
    }
}

/* ---- memory exported to torch.frombuffer ----------------------------------------- */

typedef struct MemoryObject {
    PyObject_HEAD
    PyObject *owner;
    void *ptr;
    Py_ssize_t len;
    kw_plan *plan;
    int owns_ptr;   /* from kw_mem_alloc or kw_mem_reserve: freed with the object */
    int populating; /* a thread faults it in (kw__memory_reserve) until done or stopped */
    atomic_int stop;
    pthread_t populater;
    pid_t populater_pid; /* a forked child has no such thread: it neither stops nor joins it */
} MemoryObject;

PyObject *kw__memory_new(PyObject *owner, void *ptr, Py_ssize_t len, kw_plan *plan) {
    MemoryObject *m = PyObject_New(MemoryObject, &kw__MemoryType);
    if (!m) return NULL;
    m->owner = Py_XNewRef(owner);
    m->ptr = ptr;
    m->len = len;
    m->plan = plan;
    m->owns_ptr = 0;
    m->populating = 0;
    atomic_init(&m->stop, 0);
    return (PyObject *)m;
}

/* An object that owns ptr (from kw_mem_alloc or kw_mem_reserve): freed with it. */
static MemoryObject *owning(void *ptr, Py_ssize_t len) {
    if (!ptr) return (MemoryObject *)PyErr_NoMemory();
    MemoryObject *m = (MemoryObject *)kw__memory_new(NULL, ptr, len, NULL);
    if (!m) {
        kw_mem_free(ptr, (size_t)len);
        return NULL;
    }
    m->owns_ptr = 1;
    return m;
}

PyObject *kw__memory_alloc(Py_ssize_t len) { return (PyObject *)owning(kw_mem_alloc((size_t)len), len); }

/* In steps of two huge pages: each holds the process's memory-map lock, which
 * the tracing thread's own allocations wait on; a trim or the object's end
 * also stops it between steps. */
#define KW__POPULATE_STEP ((size_t)4 << 20)
#define KW__POPULATE_MIN ((size_t)32 << 20) /* smaller blocks fault in at once */

static void *populate_main(void *arg) {
    MemoryObject *m = arg;
    for (size_t at = 0; at < (size_t)m->len && !atomic_load(&m->stop); at += KW__POPULATE_STEP) {
        const size_t left = (size_t)m->len - at;
        kw_mem_populate((char *)m->ptr + at, left < KW__POPULATE_STEP ? left : KW__POPULATE_STEP);
    }
    return NULL;
}

PyObject *kw__memory_reserve(Py_ssize_t len) {
    if ((size_t)len < KW__POPULATE_MIN) return kw__memory_alloc(len);
    MemoryObject *m = owning(kw_mem_reserve((size_t)len), len);
    if (!m) return NULL;
    /* Without the thread the pages fault in on first touch instead. */
    m->populating = pthread_create(&m->populater, NULL, populate_main, m) == 0;
    m->populater_pid = getpid();
    return (PyObject *)m;
}

static void stop_populating(MemoryObject *m) {
    if (!m->populating) return;
    m->populating = 0;
    if (m->populater_pid != getpid()) return;
    atomic_store(&m->stop, 1);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(m->populater, NULL);
    Py_END_ALLOW_THREADS
}

static PyObject *memory_trim(PyObject *self, PyObject *arg) {
    MemoryObject *m = (MemoryObject *)self;
    const Py_ssize_t keep = PyLong_AsSsize_t(arg);
    if (keep == -1 && PyErr_Occurred()) return NULL;
    if (keep < 0 || keep > m->len) return PyErr_Format(PyExc_ValueError, "trim: keep must be in [0, %zd]", m->len);
    stop_populating(m);
    if (m->owns_ptr) m->len = (Py_ssize_t)kw_mem_trim(m->ptr, (size_t)m->len, (size_t)keep);
    Py_RETURN_NONE;
}

static PyMethodDef memory_methods[] = {
    {"trim", memory_trim, METH_O,
     "trim(keep): stops faulting in and returns all but the first keep bytes (at least 2 MiB; smaller\n"
     "blocks stay whole) to the system; only tensors over the first keep bytes may exist."},
    {NULL, NULL, 0, NULL},
};

static void memory_dealloc(PyObject *self) {
    MemoryObject *m = (MemoryObject *)self;
    stop_populating(m);
    Py_XDECREF(m->owner);
    kw_plan_destroy(m->plan);
    if (m->owns_ptr) kw_mem_free(m->ptr, (size_t)m->len);
    PyObject_Free(self);
}

static int memory_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    MemoryObject *m = (MemoryObject *)self;
    return PyBuffer_FillInfo(view, self, m->ptr, m->len, 0, flags);
}

static PyBufferProcs memory_as_buffer = {.bf_getbuffer = memory_getbuffer};

PyTypeObject kw__MemoryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kwker._C._Memory",
    .tp_doc = "Memory owned by a plan or a tensor, lent to torch.frombuffer.",
    .tp_basicsize = sizeof(MemoryObject),
    .tp_dealloc = memory_dealloc,
    .tp_as_buffer = &memory_as_buffer,
    .tp_methods = memory_methods,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

static PyObject *empty_like_layout(const kw_tensor *t) {
    PyObject *shape = kw__int64_tuple(t->shape, t->ndim), *stride = kw__int64_tuple(t->stride, t->ndim), *r = NULL;
    if (shape && stride) {
        PyObject *args[4] = {shape, stride, kw__t.dtype[t->dtype], kw__t.cpu};
        r = PyObject_Vectorcall(kw__t.empty_strided, args, 2, kw__t.kw_dtype_device);
    }
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return r;
}

PyObject *kw__tensor_over(PyObject *owner, const kw_tensor *t) {
    const int64_t extent = kw_tensor_extent(t);
    if (extent < 0) return kw__plan_error(KW_EINVAL, "a view with negative strides cannot be a torch tensor");
    if (extent == 0) return empty_like_layout(t);
    PyObject *mem = kw__memory_new(owner, t->data, (Py_ssize_t)extent, NULL);
    if (!mem) return NULL;
    PyObject *kwnames = PyTuple_Pack(1, kw__t.s_dtype);
    PyObject *args[2] = {mem, kw__t.dtype[t->dtype]};
    PyObject *flat = kwnames ? PyObject_Vectorcall(kw__t.frombuffer, args, 1, kwnames) : NULL;
    Py_XDECREF(kwnames);
    Py_DECREF(mem);
    if (!flat) return NULL;
    PyObject *shape = kw__int64_tuple(t->shape, t->ndim), *stride = kw__int64_tuple(t->stride, t->ndim), *r = NULL;
    if (shape && stride) r = PyObject_CallMethodObjArgs(flat, kw__t.s_as_strided, shape, stride, NULL);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_DECREF(flat);
    return r;
}
