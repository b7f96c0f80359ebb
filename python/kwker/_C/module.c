/* kwker._C — the CPython binding of kwker's C core. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kw_ops.h"
#include "kw_binding.h"
#include "kw_mem.h"
#include "kw_module.h"

static PyObject *cpu_isa(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(kw_isa_name(kw_cpu_isa()));
}

static PyObject *op_names(PyObject *self, PyObject *unused) {
    PyObject *names = PyList_New(KW_OP_COUNT);
    if (!names) return NULL;
    for (int i = 0; i < KW_OP_COUNT; i++) {
        PyObject *name = PyUnicode_FromString(kw_op_get((kw_op_id)i)->name);
        if (!name) {
            Py_DECREF(names);
            return NULL;
        }
        PyList_SET_ITEM(names, i, name);
    }
    return names;
}

/* The values of the ops' integer parameters (kw_ops.h), by name, so that Python
 * never repeats a C constant; oneDNN's crossovers as they are for this CPU. */
static PyObject *op_params(PyObject *self, PyObject *unused) {
    const int amx = kw_cpu_isa() >= KW_ISA_AMX, avx2 = kw_cpu_isa() < KW_ISA_AVX512,
              dnnl_bf16 = kw_dnnl_has_bf16_matmul();
    const struct {
        const char *name;
        int value;
    } params[] = {
        {"NORM_LLAMA", KW_NORM_LLAMA},
        {"NORM_GEMMA", KW_NORM_GEMMA},
        {"NORM_OLMO", KW_NORM_OLMO},
        {"ROPE_HALF", KW_ROPE_HALF},
        {"ROPE_INTERLEAVED", KW_ROPE_INTERLEAVED},
        {"GATHER_WRAP", KW_GATHER_WRAP},
        {"GELU_ERF", KW_GELU_ERF},
        {"GELU_TANH", KW_GELU_TANH},
        {"SOFTMAX_SAFE", KW_SOFTMAX_SAFE},
        {"WHERE_X_IF_TRUE", KW_WHERE_X_IF_TRUE},
        {"WHERE_X_IF_FALSE", KW_WHERE_X_IF_FALSE},
        {"DNNL_NEVER", KW_DNNL_NEVER},
        {"DNNL_MIN_M_F32", avx2 ? KW_DNNL_MIN_M_F32_AVX2 : amx ? KW_DNNL_MIN_M_F32_AMX : KW_DNNL_MIN_M_F32},
        {"BMM_MAX_M", KW_BMM_MAX_M},
        {"DNNL_MIN_M_BF16", !dnnl_bf16 ? KW_DNNL_NEVER : amx ? KW_DNNL_MIN_M_BF16_AMX : KW_DNNL_MIN_M_BF16},
        {"DNNL_MIN_M_F32_BF16_COPY", amx ? KW_DNNL_MIN_M_F32_BF16_COPY_AMX : KW_DNNL_MIN_M_F32_BF16_COPY},
#define KW__BINARY_ENTRY(id, name) {"BINARY_" #id, KW_BINARY_##id},
        KW_BINARY_OPS(KW__BINARY_ENTRY)
#undef KW__BINARY_ENTRY
#define KW__COMPARE_ENTRY(id, name) {"COMPARE_" #id, KW_COMPARE_##id},
        KW_COMPARE_OPS(KW__COMPARE_ENTRY)
#undef KW__COMPARE_ENTRY
#define KW__UNARY_ENTRY(id, name) {"UNARY_" #id, KW_UNARY_##id},
        KW_UNARY_OPS(KW__UNARY_ENTRY)
#undef KW__UNARY_ENTRY
    };
    PyObject *dict = PyDict_New();
    for (size_t i = 0; dict && i < sizeof params / sizeof *params; i++) {
        PyObject *value = PyLong_FromLong(params[i].value);
        if (!value || PyDict_SetItemString(dict, params[i].name, value) < 0) Py_CLEAR(dict);
        Py_XDECREF(value);
    }
    return dict;
}

static PyObject *linear_block(PyObject *self, PyObject *k) {
    const long long K = PyLong_AsLongLong(k);
    if (K == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(kw_linear_block(K));
}

static PyObject *bf16_exact(PyObject *self, PyObject *arg) {
    kw_tensor t;
    if (kw__torch_init() || kw__tensor_read(arg, "bf16_exact's argument", &t)) return NULL;
    int exact;
    Py_BEGIN_ALLOW_THREADS
    exact = kw_tensor_bf16_exact(&t);
    Py_END_ALLOW_THREADS
    if (exact == KW_EDTYPE)
        return PyErr_Format(PyExc_TypeError, "bf16_exact: the tensor must be float32, not %s", kw_dtype_name(t.dtype));
    if (exact < 0) return PyErr_Format(PyExc_ValueError, "bf16_exact: the tensor must be contiguous");
    return PyBool_FromLong(exact);
}

static Py_ssize_t memory_size(PyObject *arg) {
    const Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the size must be >= 0");
    return n;
}

static PyObject *weight_memory(PyObject *self, PyObject *arg) {
    const Py_ssize_t n = memory_size(arg);
    return n < 0 ? NULL : kw__memory_alloc(n);
}

static PyObject *weight_reserve(PyObject *self, PyObject *arg) {
    const Py_ssize_t n = memory_size(arg);
    return n < 0 ? NULL : kw__memory_reserve(n);
}

static PyObject *prefer_huge_pages(PyObject *self, PyObject *arg) {
    kw_tensor t;
    if (kw__torch_init() || kw__tensor_read(arg, "prefer_huge_pages' argument", &t)) return NULL;
    const int64_t extent = kw_tensor_extent(&t);
    size_t done = 0;
    if (extent > 0) {
        Py_BEGIN_ALLOW_THREADS
        done = kw_mem_prefer_huge(t.data, (size_t)extent);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromSize_t(done);
}

static PyObject *reads_tensors_fast(PyObject *self, PyObject *unused) {
    if (kw__torch_init()) return NULL;
    return PyBool_FromLong(kw__tensor_read_is_fast());
}

static PyMethodDef module_methods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS, "The best ISA kwker's kernels use on this CPU."},
    {"op_names", op_names, METH_NOARGS, "The names of kwker's native ops."},
    {"op_params", op_params, METH_NOARGS, "The values of the ops' integer parameters, by name."},
    {"linear_block", linear_block, METH_O,
     "linear_block(K) -> B: linear reads a weight of inner size K fastest stored K-blocked as\n"
     "[K/B, N, B] (w.view(N, K//B, B).transpose(0, 1).contiguous()); 0: as [N, K]."},
    {"weight_memory", weight_memory, METH_O,
     "weight_memory(nbytes) -> buffer: zeroed, 64-byte aligned memory for torch.frombuffer, on 2 MiB\n"
     "pages where the kernel gives them (weights streamed at 60 GB/s through 4 KiB pages miss the TLB)."},
    {"weight_reserve", weight_reserve, METH_O,
     "weight_reserve(nbytes) -> buffer: weight_memory's kind, faulted in by a thread of its own while the\n"
     "caller goes on (fresh memory can fault in at under 1 GB/s); .trim(keep) returns the unused tail."},
    {"prefer_huge_pages", prefer_huge_pages, METH_O,
     "prefer_huge_pages(t) -> bytes: backs the whole 2 MiB pages of t's memory with huge pages now\n"
     "(madvise MADV_HUGEPAGE + MADV_COLLAPSE; contents unchanged); 0 where the kernel refuses."},
    {"reads_tensors_fast", reads_tensors_fast, METH_NOARGS,
     "True when tensors are read through PyTorch's C shim (tens of ns), False when through their Python\n"
     "attributes (the shim was not found, or disagreed with Python on a probe tensor)."},
    {"bf16_exact", bf16_exact, METH_O,
     "bf16_exact(t) -> bool: every value of the contiguous float32 CPU tensor t is exactly a bfloat16\n"
     "value and none is NaN, so t.to(torch.bfloat16) loses nothing."},
    {"run_op", (PyCFunction)(void (*)(void))kw__run_op, METH_VARARGS | METH_KEYWORDS,
     "run_op(name, tensors, ip=(), fp=()) -> None: runs the native op `name` once on these tensors (its\n"
     "slots in order, None for an absent optional one; outputs written in place) and int and float\n"
     "parameters, on torch.get_num_threads() threads. The op's rules are checked first: PlanError\n"
     "(.code, the op's message) when it rejects the call, IndexError for an index out of range in the data."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module) {
    const char *problems = kw_cpu_env_problems();
    if (problems && PyErr_WarnFormat(PyExc_UserWarning, 1, "kwker: %s", problems) < 0) return -1;
    return kw__module_add_types(module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kwker._C",
    .m_doc = "kwker's native core: kernels, capture and replay.",
    .m_methods = module_methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__C(void) {
    return PyModuleDef_Init(&module_def);
}
