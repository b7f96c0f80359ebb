/* kw_binding.h — internal to the binding of capture/ and runtime/: the PyTorch
 * objects it uses (reached through Python attributes only, never C++ headers),
 * the Python-side description of a program, and the PlanBuilder and Plan types. */
#ifndef KW_BINDING_H
#define KW_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kw_capture.h"

/* ---- torch, imported on first use ------------------------------------------------ */

typedef struct kw__torch {
    PyObject *module;
    PyTypeObject *tensor_type;
    PyObject *dtype[KW_DTYPE_COUNT]; /* torch.float32, ... by kw_dtype */
    PyObject *empty_strided, *frombuffer, *get_num_threads, *cpu;
    PyObject *increment_version; /* torch._C._increment_version: autograd's count of in-place writes */
    PyObject *kw_dtype_device; /* ("dtype", "device"): keyword names for empty_strided */
    PyObject *s_dtype, *s_shape, *s_stride, *s_data_ptr, *s_is_cpu, *s_as_strided, *s_storage_offset, *s_version;
} kw__torch;

extern kw__torch kw__t;

int kw__torch_init(void); /* 0, or -1 with an exception set */

extern PyObject *kw__PlanError;
/* What a PlanError about an input that Dynamo's guards would have caught says
 * to do (kwker._C.GUARD_DROPPED, for the errors raised in Python). */
#define KW__GUARD_DROPPED                                                                                          \
    "With Dynamo's guards on, a changed input makes Dynamo compile again; this one reached the plan because its " \
    "guard was skipped (skip_guard_eval_unsafe) or dropped (kwker.guard_filter, which kwker.compile_config() "    \
    "installs): compile again (torch._dynamo.reset()), or keep every guard (options={'guard_filter_fn': None})"
/* Raises PlanError(message) with .code = code; returns NULL. */
PyObject *kw__plan_error(int code, const char *fmt, ...);

int kw__dtype_from_py(PyObject *obj, kw_dtype *out); /* torch.dtype or its name */

/* A sequence of at most `max` ints; returns its length or -1 with an exception. */
int kw__int64_seq(PyObject *seq, int64_t *out, int max, const char *what);
PyObject *kw__int64_tuple(const int64_t *v, int n);

/* dtype, shape, strides and data pointer of a CPU tensor of a dtype kwker
 * knows; -1 with an exception naming `what`. Tens of ns through PyTorch's C
 * shim where it was found and checked (kw__tensor_read_is_fast), else through
 * the tensor's Python attributes. */
int kw__tensor_read(PyObject *t, const char *what, kw_tensor *out);
int kw__tensor_read_is_fast(void);
/* The fast path alone: 0, or -1 (no exception) when it cannot say; then
 * kw__tensor_read gives the answer or the error. */
int kw__tensor_read_quick(PyObject *t, kw_tensor *out);

/* Before reading many tensors: round 0 prefetches each one's Python object,
 * round 1 its TensorImpl, round 2 its storage, so that the cache misses of all
 * of them overlap instead of following each other (a call reads some 400 cold
 * tensors right after a step streamed the weights). t must be a torch.Tensor
 * (checked by the caller) and each round must follow the one before for every
 * tensor. Any object may be given: only tensors are followed. */
void kw__tensor_prefetch(PyObject *t, int round);

/* A torch tensor over t->data with t's layout, keeping `owner` alive (and with
 * it the memory) for as long as the tensor lives. */
PyObject *kw__tensor_over(PyObject *owner, const kw_tensor *t);

/* A buffer-protocol object over [ptr, ptr + len) that keeps `owner` alive and,
 * when `plan` is given, destroys that plan (and so its arena) when it dies. */
PyObject *kw__memory_new(PyObject *owner, void *ptr, Py_ssize_t len, kw_plan *plan);
/* The same over len fresh zeroed bytes from kw_mem_alloc (2 MiB pages where the
 * kernel gives them), freed when the object dies. */
PyObject *kw__memory_alloc(Py_ssize_t len);
/* The same, except that from 32 MiB on a thread of its own faults the memory
 * in while the caller goes on; the object's trim(keep) returns the tail. */
PyObject *kw__memory_reserve(Py_ssize_t len);
extern PyTypeObject kw__MemoryType;

/* ---- what the Python side adds to a plan ------------------------------------------
 * Buffers and views are capture's: the binding reads them back (kw_builder_buffer,
 * kw_builder_view_layout, kw_plan_buffer, kw_plan_view) and keeps only what is
 * Python's own: which argument feeds each input and the layout it must have,
 * each fresh output's layout, the constants' tensors, the fallbacks' functions
 * and the views a call returns. */

typedef struct kw__py_input {
    PyObject *name;
    int arg, slot;
    PyTypeObject *type;               /* the tensor's exact Python type, checked on each call; NULL: any */
    kw_tensor t;                      /* dtype, shape, strides: checked on each call */
    PyObject *shape_obj, *stride_obj; /* the same as tuples, for messages */
} kw__py_input;

typedef struct kw__py_output {
    PyObject *name;
    int slot;
    kw_tensor t;
    PyObject *shape_obj, *stride_obj;
} kw__py_output;

typedef struct kw__py_fallback {
    PyObject *fn, *label;
    int n_reads, n_writes;
    int *views; /* view ids: reads then writes */
} kw__py_fallback;

typedef struct kw__program {
    kw__py_input *inputs;
    kw__py_output *outputs;
    kw__py_fallback *fallbacks;
    int *returns; /* view ids */
    /* The arguments the plan writes in place: their version counters are bumped
     * after every call, as PyTorch's in-place ops bump them, so that autograd
     * still refuses a tensor it saved and a native step has since written. */
    int *written;
    int n_inputs, n_outputs, n_fallbacks, n_returns, n_args, n_written;
    int cap_inputs, cap_outputs, cap_fallbacks, cap_returns;
    PyObject *constants; /* {buffer id: tensor}: kept alive, and the owners of views of them */
} kw__program;

void kw__program_free(kw__program *p);
int kw__program_traverse(kw__program *p, visitproc visit, void *arg);

/* ---- the types ------------------------------------------------------------------- */

extern PyTypeObject kw__PlanBuilderType;
extern PyTypeObject kw__PlanType;
extern PyTypeObject kw__CallLockType;
extern PyTypeObject kw__WatchType;

/* Non-zero when `tensor` is not the watch's memory, layout and Python type (kw__watch_moved's
 * value), or that memory was written since the watch was made or rearmed (1); 0; -1 with an exception. The
 * two halves: kw__watch_moved (the tensor, with the GIL) and
 * kw_watch_changed(kw__watch_memory(watch)) (the memory, any thread; NULL for a
 * tensor of zero bytes, which never changes). */
int kw__watch_changed(PyObject *watch, PyObject *tensor);
/* kw__watch_moved: 0 when `tensor` is the watch's memory, layout and Python type;
 * KW__WATCH_RELOCATED for the same type and layout at another address (a
 * `.data` swap another thread may make); KW__WATCH_REMADE for another type or
 * layout; -1 with an exception. */
enum { KW__WATCH_RELOCATED = 1, KW__WATCH_REMADE = 2 };
int kw__watch_moved(PyObject *watch, PyObject *tensor);
struct kw_watch;
const struct kw_watch *kw__watch_memory(PyObject *watch);
/* Watches count time in events (the GIL held): a watch made, armed again, or
 * found matching its tensor (Watch.matches) saw its tensor current then.
 * kw__watch_epoch_next() starts a new moment and returns it;
 * kw__watch_current_since(watch, t): the watch saw its tensor current after t. */
uint64_t kw__watch_epoch_next(void);
int kw__watch_current_since(PyObject *watch, uint64_t epoch);
/* Starts fetching what kw__watch_changed reads of the watch (see kw_watch_prefetch). */
void kw__watch_prefetch(PyObject *watch);

/* The host step every fallback of every plan runs: user is the fallback's index. */
int kw__fallback_call(void *user, kw_tensor *views, int n);

/* Takes the builder's plan and program (both owned by the result from then on). */
PyObject *kw__plan_new(kw_plan *plan, kw__program *prog, int n_threads);

/* The pool of n_threads threads, one per count and process, made on first use
 * (NULL with MemoryError); with the GIL held. */
kw_pool *kw__pool_get(int n_threads);
/* 1 while a plan replays on this thread (its fallbacks run here): its pool is busy. */
int kw__replaying(void);
/* IndexError for a kernel's index out of range, in PyTorch's words for the op;
 * `where` says which call. Returns NULL. */
PyObject *kw__index_error(const char *op, int64_t index, int64_t size, const char *where);

/* ---- an op's name and parameters, as PlanBuilder.op and run_op take them ---------- */
typedef struct kw__op_params {
    int op, n_ip, n_fp;
    int64_t ip[KW_CALL_MAX_PARAMS];
    double fp[KW_CALL_MAX_PARAMS];
} kw__op_params;

/* The op named `name` and the int (ip_obj) and float (fp_obj) parameter
 * sequences, either NULL for none; 0, or -1 with an exception. */
int kw__parse_op_params(const char *name, PyObject *ip_obj, PyObject *fp_obj, kw__op_params *p);

/* kwker._C.run_op (call.c). */
PyObject *kw__run_op(PyObject *self, PyObject *args, PyObject *kw);

#endif
