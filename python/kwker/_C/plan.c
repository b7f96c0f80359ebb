/* kwker._C.Plan: a finished plan, called like a function with torch tensors.
 *
 * A call checks every input against the plan (type, device, dtype, shape,
 * strides; a static input's address), allocates the fresh outputs, releases the
 * GIL for the replay and returns the outputs. Fallback steps take the GIL back
 * on the calling thread (thread 0 of the pool) for their Python call only.
 *
 * Threads: one kw_pool per thread count, per process, made on first use and
 * kept for the process's life (a forked child makes its own: the workers do not
 * survive fork). kw_pool_run serialises plans that share a pool. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "kw_binding.h"

typedef struct PlanObject {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *weakrefs;
    PyObject *memory; /* owns the kw_plan and its arena */
    kw_plan *plan;
    kw__program *prog;
    int n_threads, busy;
    void **slots;           /* this call's pointers, by slot */
    PyObject **fresh;       /* this call's output tensors, by output */
    PyObject **fixed;       /* by view: a tensor made once (constant and arena views) */
    struct kw__make *make;  /* by view: how a returned or fallback view becomes a tensor */
    int n_make;
    PyObject *const *args;  /* this call's arguments */
    int n_watched;          /* arguments whose in-place changes call on_change (see plan_watch_versions) */
    int *watched;
    int64_t *versions;      /* their tensor version counters when last seen */
    PyObject *on_change;
    PyObject *exc_type, *exc_value, *exc_tb; /* a fallback's exception */
} PlanObject;

/* How a view becomes a torch tensor for a return or a fallback. */
typedef enum make_kind {
    MAKE_UNUSED,
    MAKE_FIXED,      /* a view of a constant or of the arena: made once */
    MAKE_WHOLE,      /* the input or output tensor itself */
    MAKE_AS_STRIDED, /* tensor.as_strided(shape, stride, storage_offset + offset) */
    MAKE_OVER,       /* a tensor over the bytes (another dtype, or an odd offset) */
} make_kind;

typedef struct kw__make {
    make_kind kind;
    Py_ssize_t offset; /* elements, MAKE_AS_STRIDED */
    PyObject *shape, *stride;
} kw__make;

/* The plan replaying on this thread: fallbacks find their plan here, and a
 * plan called from a fallback is refused (its pool would wait on itself). */
static _Thread_local PlanObject *replaying;

/* ---- pools ------------------------------------------------------------------------- */

#define MAX_POOL 1024
static kw_pool *pools[MAX_POOL + 1];

static void forget_pools(void) { memset(pools, 0, sizeof pools); }

/* Called with the GIL held, which is what makes the table safe. */
static kw_pool *pool_get(int n_threads) {
    static int atfork_registered;
    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, forget_pools);
        atfork_registered = 1;
    }
    if (!pools[n_threads]) pools[n_threads] = kw_pool_create(n_threads);
    if (!pools[n_threads]) PyErr_NoMemory();
    return pools[n_threads];
}

/* ---- a call ------------------------------------------------------------------------ */

static PyObject *as_tuple(PyObject *seq) {
    PyObject *t = PySequence_Tuple(seq);
    if (!t) PyErr_Clear();
    return t ? t : Py_NewRef(seq);
}

static int layout_error(const kw__py_input *in, int code, const char *what, PyObject *expected, PyObject *got) {
    PyObject *got_tuple = as_tuple(got);
    kw__plan_error(code, "%s '%U' (argument %d): expected %s %R, got %R", in->is_static ? "static input" : "input",
                   in->name, in->arg, what, expected, got_tuple);
    Py_DECREF(got_tuple);
    return -1;
}

/* Strides of size-1 dims do not matter (PyTorch is free to pick them). */
static int strides_match(const kw__py_input *in, PyObject *got) {
    int64_t s[KW_MAX_DIMS];
    const int n = kw__int64_seq(got, s, KW_MAX_DIMS, "stride");
    if (n < 0) {
        PyErr_Clear();
        return 0;
    }
    for (int d = 0; d < in->t.ndim; d++)
        if (in->t.shape[d] == 0) return 1;
    for (int d = 0; d < in->t.ndim; d++)
        if (in->t.shape[d] > 1 && s[d] != in->t.stride[d]) return 0;
    return n == in->t.ndim;
}

static int check_layout(const kw__py_input *in, PyObject *t) {
    PyObject *is_cpu = PyObject_GetAttr(t, kw__t.s_is_cpu);
    if (!is_cpu) return -1;
    Py_DECREF(is_cpu);
    if (is_cpu != Py_True) {
        kw__plan_error(KW_EINVAL, "input '%U' (argument %d) must be a CPU tensor", in->name, in->arg);
        return -1;
    }
    PyObject *dtype = PyObject_GetAttr(t, kw__t.s_dtype);
    if (!dtype) return -1;
    Py_DECREF(dtype); /* dtypes are module-level singletons: identity is enough */
    if (dtype != kw__t.dtype[in->t.dtype]) return layout_error(in, KW_EDTYPE, "dtype", kw__t.dtype[in->t.dtype], dtype);
    PyObject *shape = PyObject_GetAttr(t, kw__t.s_shape);
    if (!shape) return -1;
    int eq = PyObject_RichCompareBool(shape, in->shape_obj, Py_EQ);
    if (eq <= 0) {
        if (eq == 0) layout_error(in, KW_ESHAPE, "shape", in->shape_obj, shape);
        Py_DECREF(shape);
        return -1;
    }
    Py_DECREF(shape);
    PyObject *stride = PyObject_CallMethodNoArgs(t, kw__t.s_stride);
    if (!stride) return -1;
    eq = PyObject_RichCompareBool(stride, in->stride_obj, Py_EQ);
    if (eq == 0 && !strides_match(in, stride)) layout_error(in, KW_ESHAPE, "strides", in->stride_obj, stride);
    Py_DECREF(stride);
    return PyErr_Occurred() ? -1 : 0;
}

static int bind_input(PlanObject *p, const kw__py_input *in, PyObject *t) {
    if (!PyObject_TypeCheck(t, kw__t.tensor_type)) {
        PyErr_Format(PyExc_TypeError, "input '%U' (argument %d) must be a torch.Tensor, not %.100s", in->name,
                     in->arg, Py_TYPE(t)->tp_name);
        return -1;
    }
    if ((!in->is_static || in->check_layout) && check_layout(in, t)) return -1;
    PyObject *ptr_obj = PyObject_CallMethodNoArgs(t, kw__t.s_data_ptr);
    if (!ptr_obj) return -1;
    void *ptr = PyLong_AsVoidPtr(ptr_obj);
    Py_DECREF(ptr_obj);
    if (!ptr && PyErr_Occurred()) return -1;
    if (in->is_static && ptr != in->expected) {
        kw__plan_error(KW_ESTATIC,
                       "static input '%U' (argument %d) is not the tensor the plan was built with: its data is at "
                       "%p, the plan's at %p (a new cache object needs a new plan)",
                       in->name, in->arg, ptr, in->expected);
        return -1;
    }
    p->slots[in->slot] = ptr;
    return 0;
}

static void drop_fresh(PlanObject *p) {
    for (int i = 0; i < p->prog->n_outputs; i++) Py_CLEAR(p->fresh[i]);
}

static int make_outputs(PlanObject *p) {
    for (int i = 0; i < p->prog->n_outputs; i++) {
        const kw__py_output *o = &p->prog->outputs[i];
        PyObject *args[4] = {o->shape_obj, o->stride_obj, kw__t.dtype[o->t.dtype], kw__t.cpu};
        PyObject *t = PyObject_Vectorcall(kw__t.empty_strided, args, 2, kw__t.kw_dtype_device);
        if (!t) return -1;
        p->fresh[i] = t;
        PyObject *ptr_obj = PyObject_CallMethodNoArgs(t, kw__t.s_data_ptr);
        if (!ptr_obj) return -1;
        p->slots[o->slot] = PyLong_AsVoidPtr(ptr_obj);
        Py_DECREF(ptr_obj);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* t.as_strided(shape, stride, t.storage_offset() + offset): the result shares
 * t's storage, as the graph's own view would. A fresh output's offset is 0. */
static PyObject *as_strided(PyObject *t, const kw__make *m, int is_output) {
    Py_ssize_t base = 0;
    if (!is_output) {
        PyObject *o = PyObject_CallMethodNoArgs(t, kw__t.s_storage_offset);
        if (!o) return NULL;
        base = PyLong_AsSsize_t(o);
        Py_DECREF(o);
        if (base == -1 && PyErr_Occurred()) return NULL;
    }
    PyObject *offset = PyLong_FromSsize_t(base + m->offset);
    if (!offset) return NULL;
    PyObject *res = PyObject_CallMethodObjArgs(t, kw__t.s_as_strided, m->shape, m->stride, offset, NULL);
    Py_DECREF(offset);
    return res;
}

/* The tensor view v stands for in this call, keeping its memory's owner alive. */
static PyObject *view_tensor(PlanObject *p, int v) {
    const kw__program *prog = p->prog;
    const kw__make *m = &p->make[v];
    if (m->kind == MAKE_FIXED) return Py_NewRef(p->fixed[v]);
    const kw__py_view *pv = &prog->views[v];
    const kw__py_buffer *b = &prog->buffers[pv->buffer];
    const int out = b->source == KW__SRC_OUTPUT;
    PyObject *owner = out ? p->fresh[b->index] : p->args[prog->inputs[b->index].arg];
    if (m->kind == MAKE_WHOLE) return Py_NewRef(owner);
    if (m->kind == MAKE_AS_STRIDED) return as_strided(owner, m, out);
    kw_tensor bound = pv->t;
    bound.data = (char *)p->slots[out ? prog->outputs[b->index].slot : prog->inputs[b->index].slot] + pv->offset;
    return kw__tensor_over(owner, &bound);
}

static PyObject *make_returns(PlanObject *p) {
    PyObject *res = PyTuple_New(p->prog->n_returns);
    for (int r = 0; res && r < p->prog->n_returns; r++) {
        PyObject *t = view_tensor(p, p->prog->returns[r]);
        if (!t) Py_CLEAR(res);
        else PyTuple_SET_ITEM(res, r, t);
    }
    return res;
}

static PyObject *replay_failed(PlanObject *p, int rc) {
    if (p->exc_type) {
        PyErr_Restore(p->exc_type, p->exc_value, p->exc_tb);
        p->exc_type = p->exc_value = p->exc_tb = NULL;
        return NULL;
    }
    return kw__plan_error(rc, "replay failed: %s", kw_strerror(rc));
}

static int64_t tensor_version(PyObject *t) {
    PyObject *v = PyObject_GetAttr(t, kw__t.s_version);
    const int64_t version = v ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    return version;
}

/* Calls on_change(args) when a watched argument was changed in place since the
 * last call (its version counter moved), then records the versions again. */
static int check_versions(PlanObject *p, PyObject *const *args, Py_ssize_t nargs) {
    int changed = 0;
    for (int i = 0; i < p->n_watched && !changed; i++) {
        const int64_t v = tensor_version(args[p->watched[i]]);
        if (v == -1 && PyErr_Occurred()) return -1;
        changed = v != p->versions[i];
    }
    if (!changed) return 0;
    PyObject *tuple = PyTuple_New(nargs);
    if (!tuple) return -1;
    for (Py_ssize_t i = 0; i < nargs; i++) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    PyObject *r = PyObject_CallOneArg(p->on_change, tuple);
    Py_DECREF(tuple);
    if (!r) return -1;
    Py_DECREF(r);
    for (int i = 0; i < p->n_watched; i++)
        if ((p->versions[i] = tensor_version(args[p->watched[i]])) == -1 && PyErr_Occurred()) return -1;
    return 0;
}

static PyObject *plan_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PlanObject *p = (PlanObject *)self;
    kw__program *prog = p->prog;
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!prog) return kw__plan_error(KW_ESTATE, "the plan was cleared");
    if (nargs != prog->n_args || (kwnames && PyTuple_GET_SIZE(kwnames)))
        return PyErr_Format(PyExc_TypeError, "the plan takes %d positional arguments (%zd given%s)", prog->n_args,
                            nargs, kwnames && PyTuple_GET_SIZE(kwnames) ? ", and keywords" : "");
    if (p->busy || replaying)
        return kw__plan_error(KW_EBUSY, p->busy ? "the plan is already being replayed (by another thread, or "
                                                  "this call comes from one of its own fallbacks)"
                                                : "a plan cannot be called from another plan's fallback");
    for (int i = 0; i < prog->n_inputs; i++)
        if (bind_input(p, &prog->inputs[i], args[prog->inputs[i].arg])) return NULL;
    if (p->n_watched && check_versions(p, args, nargs)) return NULL;
    kw_pool *pool = pool_get(p->n_threads);
    if (!pool || make_outputs(p)) {
        drop_fresh(p);
        return NULL;
    }
    p->busy = 1;
    p->args = args;
    replaying = p;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kw_plan_replay(p->plan, pool, p->slots);
    Py_END_ALLOW_THREADS
    replaying = NULL;
    PyObject *res = rc ? replay_failed(p, rc) : make_returns(p);
    p->busy = 0;
    p->args = NULL;
    drop_fresh(p);
    return res;
}

/* ---- fallbacks ---------------------------------------------------------------------- */

static int call_fallback(PlanObject *p, const kw__py_fallback *f) {
    const int n = f->n_reads + f->n_writes;
    PyObject *reads = PyTuple_New(f->n_reads), *writes = PyTuple_New(f->n_writes), *r = NULL;
    for (int e = 0; reads && writes && e < n; e++) {
        PyObject *t = view_tensor(p, f->views[e]);
        if (!t) goto done;
        PyTuple_SET_ITEM(e < f->n_reads ? reads : writes, e < f->n_reads ? e : e - f->n_reads, t);
    }
    if (reads && writes) r = PyObject_CallFunctionObjArgs(f->fn, reads, writes, NULL);
done:
    Py_XDECREF(reads);
    Py_XDECREF(writes);
    if (r) {
        Py_DECREF(r);
        return 0;
    }
    if (!p->exc_type) PyErr_Fetch(&p->exc_type, &p->exc_value, &p->exc_tb);
    PyErr_Clear();
    return -1;
}

/* The tensors come from the plan's own tables (the same memory as `views`). */
int kw__fallback_call(void *user, kw_tensor *views, int n) {
    (void)views, (void)n;
    PlanObject *p = replaying;
    PyGILState_STATE g = PyGILState_Ensure();
    const int rc = call_fallback(p, &p->prog->fallbacks[(intptr_t)user]);
    PyGILState_Release(g);
    return rc;
}

/* ---- creation ------------------------------------------------------------------------ */

static int same_layout(const kw_tensor *a, const kw_tensor *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d]) return 0;
    return 1;
}

/* Views of constants and of the arena never move: their tensors are made once. */
static int make_fixed(PlanObject *p, int v) {
    const kw__py_view *pv = &p->prog->views[v];
    const kw__py_buffer *b = &p->prog->buffers[pv->buffer];
    if (p->fixed[v] || (b->source != KW__SRC_CONST && b->source != KW__SRC_ARENA)) return 0;
    kw_tensor t = pv->t;
    t.data = (char *)kw_plan_buffer_address(p->plan, pv->buffer) + pv->offset;
    PyObject *owner = b->source == KW__SRC_CONST ? PyList_GET_ITEM(p->prog->constants, b->index) : p->memory;
    p->fixed[v] = kw__tensor_over(owner, &t);
    return p->fixed[v] ? 0 : -1;
}

/* Decides once how view v becomes a tensor on each call. */
static int plan_view(PlanObject *p, int v) {
    const kw__program *prog = p->prog;
    const kw__py_view *pv = &prog->views[v];
    const kw__py_buffer *b = &prog->buffers[pv->buffer];
    kw__make *m = &p->make[v];
    if (m->kind != MAKE_UNUSED) return 0;
    if (b->source != KW__SRC_OUTPUT && b->source != KW__SRC_INPUT) {
        m->kind = MAKE_FIXED;
        return make_fixed(p, v);
    }
    const kw_tensor *whole = b->source == KW__SRC_OUTPUT ? &prog->outputs[b->index].t : &prog->inputs[b->index].t;
    const size_t es = kw_dtype_size(pv->t.dtype);
    if (!pv->offset && same_layout(&pv->t, whole)) {
        m->kind = MAKE_WHOLE;
    } else if (pv->t.dtype == whole->dtype && pv->offset % es == 0) {
        m->kind = MAKE_AS_STRIDED;
        m->offset = (Py_ssize_t)(pv->offset / es);
        m->shape = kw__int64_tuple(pv->t.shape, pv->t.ndim);
        m->stride = kw__int64_tuple(pv->t.stride, pv->t.ndim);
        if (!m->shape || !m->stride) return -1;
    } else {
        m->kind = MAKE_OVER;
    }
    return 0;
}

static int prepare(PlanObject *p) {
    kw__program *prog = p->prog;
    p->slots = PyMem_Calloc((size_t)kw_plan_n_slots(p->plan) + 1, sizeof *p->slots);
    p->fresh = PyMem_Calloc((size_t)prog->n_outputs + 1, sizeof *p->fresh);
    p->fixed = PyMem_Calloc((size_t)prog->n_views + 1, sizeof *p->fixed);
    p->make = PyMem_Calloc((size_t)prog->n_views + 1, sizeof *p->make);
    if (!p->slots || !p->fresh || !p->fixed || !p->make) {
        PyErr_NoMemory();
        return -1;
    }
    p->n_make = prog->n_views;
    for (int f = 0; f < prog->n_fallbacks; f++)
        for (int e = 0; e < prog->fallbacks[f].n_reads + prog->fallbacks[f].n_writes; e++)
            if (plan_view(p, prog->fallbacks[f].views[e])) return -1;
    for (int r = 0; r < prog->n_returns; r++)
        if (plan_view(p, prog->returns[r])) return -1;
    return pool_get(p->n_threads) ? 0 : -1;
}

PyObject *kw__plan_new(kw_plan *plan, kw__program *prog, int n_threads) {
    PyObject *memory = kw__memory_new(NULL, kw_plan_arena(plan), (Py_ssize_t)kw_plan_arena_bytes(plan), plan);
    if (!memory) {
        kw_plan_destroy(plan);
        kw__program_free(prog);
        return NULL;
    }
    PlanObject *p = (PlanObject *)kw__PlanType.tp_alloc(&kw__PlanType, 0);
    if (!p) {
        Py_DECREF(memory);
        kw__program_free(prog);
        return NULL;
    }
    p->vectorcall = plan_call;
    p->memory = memory;
    p->plan = plan;
    p->prog = prog;
    p->n_threads = n_threads;
    if (prepare(p)) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static int plan_traverse(PyObject *self, visitproc visit, void *arg) {
    PlanObject *p = (PlanObject *)self;
    Py_VISIT(p->dict);
    Py_VISIT(p->memory);
    Py_VISIT(p->on_change);
    for (int i = 0; p->fixed && p->prog && i < p->prog->n_views; i++) Py_VISIT(p->fixed[i]);
    return kw__program_traverse(p->prog, visit, arg);
}

static int plan_clear(PyObject *self) {
    PlanObject *p = (PlanObject *)self;
    Py_CLEAR(p->dict);
    Py_CLEAR(p->on_change);
    p->n_watched = 0;
    for (int i = 0; p->fixed && p->prog && i < p->prog->n_views; i++) Py_CLEAR(p->fixed[i]);
    kw__program *prog = p->prog;
    p->prog = NULL;
    kw__program_free(prog);
    return 0;
}

static void plan_dealloc(PyObject *self) {
    PlanObject *p = (PlanObject *)self;
    PyObject_GC_UnTrack(self);
    if (p->weakrefs) PyObject_ClearWeakRefs(self);
    plan_clear(self);
    Py_XDECREF(p->exc_type);
    Py_XDECREF(p->exc_value);
    Py_XDECREF(p->exc_tb);
    PyMem_Free(p->slots);
    PyMem_Free(p->fresh);
    PyMem_Free(p->fixed);
    PyMem_Free(p->watched);
    PyMem_Free(p->versions);
    for (int v = 0; p->make && v < p->n_make; v++) {
        Py_XDECREF(p->make[v].shape);
        Py_XDECREF(p->make[v].stride);
    }
    PyMem_Free(p->make);
    Py_XDECREF(p->memory); /* the last reference destroys the kw_plan */
    Py_TYPE(self)->tp_free(self);
}

/* ---- introspection -------------------------------------------------------------------- */

static const char *source_name(int source) {
    switch (source) {
    case KW__SRC_INPUT: return "input";
    case KW__SRC_OUTPUT: return "output buffer";
    case KW__SRC_CONST: return "constant";
    default: return "arena";
    }
}

/* The Python side (arguments, returns) above the C listing. */
static PyObject *plan_dump(PyObject *self, PyObject *unused) {
    PlanObject *p = (PlanObject *)self;
    if (!p->prog) return kw__plan_error(KW_ESTATE, "the plan was cleared");
    kw__program *prog = p->prog;
    PyObject *lines = PyList_New(0), *line = NULL;
    if (!lines) return NULL;
#define ADD(expr)                                                   \
    if (!(line = (expr)) || PyList_Append(lines, line)) goto fail; \
    Py_CLEAR(line);
    ADD(PyUnicode_FromFormat("call: %d arguments, %d returns", prog->n_args, prog->n_returns));
    for (int i = 0; i < prog->n_inputs; i++) {
        const kw__py_input *in = &prog->inputs[i];
        ADD(PyUnicode_FromFormat("  argument %d: %s '%U' %s %R strides %R -> slot %d%s", in->arg,
                                 in->is_static ? "static input" : "input", in->name, kw_dtype_name(in->t.dtype),
                                 in->shape_obj, in->stride_obj, in->slot,
                                 in->is_static && !in->check_layout ? " (only its address is checked)" : ""));
    }
    for (int r = 0; r < prog->n_returns; r++) {
        const kw__py_view *v = &prog->views[prog->returns[r]];
        ADD(PyUnicode_FromFormat("  return %d: view %d of %s b%d + %zu%s", r, prog->returns[r],
                                 source_name(prog->buffers[v->buffer].source), v->buffer, v->offset,
                                 p->make[prog->returns[r]].kind == MAKE_WHOLE        ? " (the tensor itself)"
                                 : p->make[prog->returns[r]].kind == MAKE_AS_STRIDED ? " (as_strided)"
                                                                                     : ""));
    }
    char *text = kw_plan_dump(p->plan);
    if (!text) {
        PyErr_NoMemory();
        goto fail;
    }
    line = PyUnicode_FromString(text);
    free(text);
    if (!line || PyList_Append(lines, line)) goto fail;
    Py_CLEAR(line);
#undef ADD
    PyObject *sep = PyUnicode_FromString("\n"), *res = sep ? PyUnicode_Join(sep, lines) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(lines);
    return res;
fail:
    Py_XDECREF(line);
    Py_DECREF(lines);
    return NULL;
}

static PyObject *plan_get_profile(PyObject *self, void *closure) {
    PlanObject *p = (PlanObject *)self;
    if (!kw_plan_profiling(p->plan)) Py_RETURN_NONE;
    uint64_t runs;
    const uint64_t *ns = kw_plan_profile(p->plan, &runs);
    const int n = kw_plan_n_steps(p->plan);
    PyObject *steps = PyList_New(n);
    for (int i = 0; steps && i < n; i++) {
        const double total_us = (double)ns[i] / 1e3;
        PyObject *d = Py_BuildValue("{s:i,s:s,s:s,s:d,s:d}", "step", i, "op", kw_plan_step_name(p->plan, i), "label",
                                    kw_plan_step_label(p->plan, i), "total_us", total_us, "mean_us",
                                    runs ? total_us / (double)runs : 0.0);
        if (!d) Py_CLEAR(steps);
        else PyList_SET_ITEM(steps, i, d);
    }
    if (!steps) return NULL;
    return Py_BuildValue("{s:K,s:N}", "replays", (unsigned long long)runs, "steps", steps);
}

static PyObject *plan_get_profiling(PyObject *self, void *closure) {
    return PyBool_FromLong(kw_plan_profiling(((PlanObject *)self)->plan));
}

static int plan_set_profiling(PyObject *self, PyObject *value, void *closure) {
    PlanObject *p = (PlanObject *)self;
    const int on = value ? PyObject_IsTrue(value) : 0;
    if (on < 0) return -1;
    if (p->busy) {
        kw__plan_error(KW_EBUSY, "profiling cannot change while the plan is replaying");
        return -1;
    }
    kw_plan_set_profiling(p->plan, on);
    return 0;
}

static PyObject *plan_get_int(PyObject *self, void *which) {
    PlanObject *p = (PlanObject *)self;
    switch ((intptr_t)which) {
    case 0: return PyLong_FromLong(kw_plan_n_steps(p->plan));
    case 1: return PyLong_FromLong(kw_plan_n_barriers(p->plan));
    case 2: return PyLong_FromLong(kw_plan_n_threads(p->plan));
    case 3: return PyLong_FromSize_t(kw_plan_arena_bytes(p->plan));
    case 4: return PyLong_FromLong(p->prog ? p->prog->n_args : 0);
    default: return PyLong_FromLong(p->prog ? p->prog->n_fallbacks : 0);
    }
}

static PyObject *plan_repr(PyObject *self) {
    PlanObject *p = (PlanObject *)self;
    return PyUnicode_FromFormat("<kwker._C.Plan: %d steps, %d barriers, %d threads, arena %zu B>",
                                kw_plan_n_steps(p->plan), kw_plan_n_barriers(p->plan), kw_plan_n_threads(p->plan),
                                kw_plan_arena_bytes(p->plan));
}

static PyObject *plan_watch_versions(PyObject *self, PyObject *args) {
    PlanObject *p = (PlanObject *)self;
    PyObject *indices, *versions, *on_change;
    if (!PyArg_ParseTuple(args, "OOO:watch_versions", &indices, &versions, &on_change)) return NULL;
    if (!p->prog) return kw__plan_error(KW_ESTATE, "the plan was cleared");
    if (!PyCallable_Check(on_change)) return PyErr_Format(PyExc_TypeError, "watch_versions: on_change must be callable");
    PyObject *ind = PySequence_Fast(indices, "watch_versions: indices must be a sequence of ints");
    PyObject *ver = ind ? PySequence_Fast(versions, "watch_versions: versions must be a sequence of ints") : NULL;
    if (!ver) {
        Py_XDECREF(ind);
        return NULL;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(ind);
    int *watched = PyMem_Calloc((size_t)n + 1, sizeof *watched);
    int64_t *vers = PyMem_Calloc((size_t)n + 1, sizeof *vers);
    int bad = !watched || !vers;
    if (bad) PyErr_NoMemory();
    else if (PySequence_Fast_GET_SIZE(ver) != n) {
        PyErr_Format(PyExc_ValueError, "watch_versions: %zd indices but %zd versions", n, PySequence_Fast_GET_SIZE(ver));
        bad = 1;
    }
    for (Py_ssize_t i = 0; !bad && i < n; i++) {
        const long a = PyLong_AsLong(PySequence_Fast_GET_ITEM(ind, i));
        vers[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ver, i));
        if (PyErr_Occurred()) bad = 1;
        else if (a < 0 || a >= p->prog->n_args) {
            PyErr_Format(PyExc_ValueError, "watch_versions: argument %ld out of range (the plan takes %d)", a,
                         p->prog->n_args);
            bad = 1;
        }
        watched[i] = (int)a;
    }
    Py_DECREF(ind);
    Py_DECREF(ver);
    if (bad) {
        PyMem_Free(watched);
        PyMem_Free(vers);
        return NULL;
    }
    PyMem_Free(p->watched);
    PyMem_Free(p->versions);
    p->watched = watched, p->versions = vers, p->n_watched = (int)n;
    Py_XSETREF(p->on_change, Py_NewRef(on_change));
    Py_RETURN_NONE;
}

static PyMethodDef plan_methods[] = {
    {"watch_versions", plan_watch_versions, METH_VARARGS,
     "watch_versions(indices, versions, on_change): before a call runs, if the tensor version of any argument\n"
     "in indices differs from the one recorded (versions, then what the last check saw), on_change(args)\n"
     "is called with the call's arguments, e.g. to refresh a copy of a weight changed in place."},
    {"dump", plan_dump, METH_NOARGS,
     "dump() -> str: arguments and returns, then buffers (kind, bytes, arena offset, live range) and steps\n"
     "(op, views, barriers, bytes read and written)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef plan_getset[] = {
    {"profiling", plan_get_profiling, plan_set_profiling,
     "Per-step timing on or off (setting it clears the counters). On, every step is followed by a barrier.", NULL},
    {"profile", plan_get_profile, NULL,
     "None when profiling is off, else {'replays': n, 'steps': [{'step', 'op', 'label', 'total_us', 'mean_us'}]}.",
     NULL},
    {"n_steps", plan_get_int, NULL, "Steps in the plan.", (void *)0},
    {"n_barriers", plan_get_int, NULL, "Barriers one replay passes.", (void *)1},
    {"n_threads", plan_get_int, NULL, "Threads a replay runs on.", (void *)2},
    {"arena_bytes", plan_get_int, NULL, "Bytes of the arena (buffers and per-thread scratch).", (void *)3},
    {"n_args", plan_get_int, NULL, "Positional arguments a call takes.", (void *)4},
    {"n_fallbacks", plan_get_int, NULL, "Fallback (Python) steps.", (void *)5},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject kw__PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kwker._C.Plan",
    .tp_doc = "A replayable plan (from PlanBuilder.finish): plan(*tensors) -> tuple of tensors.",
    .tp_basicsize = sizeof(PlanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(PlanObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dictoffset = offsetof(PlanObject, dict),
    .tp_weaklistoffset = offsetof(PlanObject, weakrefs),
    .tp_dealloc = plan_dealloc,
    .tp_traverse = plan_traverse,
    .tp_clear = plan_clear,
    .tp_repr = plan_repr,
    .tp_methods = plan_methods,
    .tp_getset = plan_getset,
};
