/* kwker._C.Plan: a finished plan, called like a function with torch tensors.
 *
 * A call, in order:
 * 1. waits for any other thread's call of the same plan to end (one call at a
 *    time: the per-call tables and the arena are the plan's own); a call from
 *    inside the plan's own call (a fallback, the refresh) raises instead;
 * 2. checks the plan's sources, the arguments kwker copied weights from (see
 *    plan.watch): each must still be the watched memory, with the watched
 *    layout, unwritten since. If one is not, refresh(args) brings the copies up
 *    to date or returns a new Plan, which this one adopts;
 * 3. checks every input it reads against the plan (a CPU tensor of its dtype,
 *    shape and strides) and binds its data pointer;
 * 4. allocates the fresh outputs, releases the GIL for the replay and returns
 *    the outputs. Fallback steps take the GIL back on the calling thread
 *    (thread 0 of the pool) for their Python call only.
 *
 * Threads: one kw_pool per thread count, per process, made on first use and
 * kept for the process's life (a forked child makes its own: the workers do not
 * survive fork). kw_pool_run serialises plans that share a pool. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kw_binding.h"
#include "kw_watch.h"

/* How a view becomes a torch tensor for a return or a fallback. */
typedef enum make_kind {
    MAKE_UNUSED,
    MAKE_FIXED,      /* a view of a constant or of the arena: made once */
    MAKE_WHOLE,      /* the input or output tensor itself */
    MAKE_AS_STRIDED, /* tensor.as_strided(shape, stride, storage_offset + offset) */
    MAKE_OVER,       /* a tensor over the bytes (another dtype, or an odd offset) */
} make_kind;

/* Decided once per view from the plan's own tables (kw_plan_view, kw_plan_buffer). */
typedef struct kw__make {
    make_kind kind;
    int output;        /* the view lies in an output buffer (else an input) */
    int index;         /* that output's or input's index in the program */
    size_t bytes;      /* from the buffer's start */
    kw_tensor layout;  /* MAKE_OVER */
    Py_ssize_t offset; /* elements, MAKE_AS_STRIDED */
    PyObject *shape, *stride;
} kw__make;

/* Everything a built plan owns. A Plan adopts a rebuilt plan's state whole. */
typedef struct kw__state {
    PyObject *memory; /* owns the kw_plan and its arena */
    kw_plan *plan;
    kw__program *prog;
    int n_threads;
    void **slots;          /* this call's pointers, by slot */
    PyObject **fresh;      /* this call's output tensors, by output */
    PyObject **fixed;      /* by view: a tensor made once (constant and arena views) */
    kw__make *make;        /* by view: how a returned or fallback view becomes a tensor */
    PyObject *sources;     /* list of (argument index, Watch), or NULL (see plan_watch) */
    PyObject *refresh;
    int n_src;             /* the list as read when set or refreshed */
    struct kw__watched {
        int arg;
        PyObject *watch; /* a reference of its own; NULL for a value */
        double value;    /* the float the plan was specialised on */
    } *src;
    const struct kw_watch **memories; /* room for n_src: this call's memories to check */
} kw__state;

/* What a plan holds for a whole call. Plans that read the same weight copies
 * share one (kwker.weights): a refresh packs a copy again in place, and must
 * not while another of those plans replays it on another thread. */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner; /* the thread holding it, 0 when none (read and written with the GIL) */
    unsigned long forks; /* `forks` when it was made or last taken */
} CallLockObject;

typedef struct PlanObject {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *weakrefs;
    kw__state *s;
    PyObject *call_lock;     /* a CallLock, held for a whole call; the plan's own, whatever state it adopts */
    unsigned long owner;     /* the thread inside a call, 0 when none (read and written with the GIL) */
    unsigned long forks;     /* `forks` when the plan was made or its last call began */
    PyObject *const *args;   /* this call's arguments */
    PyObject *exc_type, *exc_value, *exc_tb; /* a fallback's exception */
    int64_t timing_ns[5];    /* the last call: sources, inputs, outputs, replay, whole call */
} PlanObject;

/* The plan replaying on this thread: fallbacks find their plan here, and a
 * plan called from a fallback is refused (its pool would wait on itself). */
static _Thread_local PlanObject *replaying;

int kw__replaying(void) { return replaying != NULL; }

/* ---- pools ------------------------------------------------------------------------- */

#define MAX_POOL 1024
static kw_pool *pools[MAX_POOL + 1];

/* The forks this process's line has seen since kwker's first pool, and in a
 * child the thread that forked: the only one it has. A CallLock another thread
 * held at the fork (a generate() thread beside a forking DataLoader) is held
 * there for good. */
static unsigned long forks, forker;
/* Refreshes in progress (copies being packed again), counted with the GIL
 * held; in a child, those of its parent's threads stay counted: a later fork
 * then has every copy packed again too, which is never wrong. */
static int refreshing;

/* In a child: its parent's pools' threads are not there to run, and a refresh
 * in progress on another thread at the fork may have left a copy half packed:
 * then every copy is packed again before it is read (with PyTorch's ops: in a
 * child of a parent whose OpenMP threads ran, those hang unless the child runs
 * one thread, as DataLoader's workers do). */
static void after_fork_in_child(void) {
    memset(pools, 0, sizeof pools);
    forks++;
    forker = PyThread_get_thread_ident();
    if (refreshing) kw_watch_invalidate_all();
}

/* A lock or a plan stamped (its `forks`) before the last fork belongs, unless
 * the forking thread holds it, to a thread this child lacks, or to none yet (a
 * lock handed to a waiting thread that had not taken the GIL back to say so),
 * and is taken afresh. */
static int from_before_fork(unsigned long stamp, unsigned long owner) {
    return stamp != forks && !(owner && owner == forker);
}

/* Called with the GIL held, which is what makes the table safe. Every plan
 * gets its pool here before its first call, which registers the fork handler
 * before any CallLock can be taken. */
kw_pool *kw__pool_get(int n_threads) {
    static int atfork_registered;
    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_registered = 1;
    }
    if (!pools[n_threads]) pools[n_threads] = kw_pool_create(n_threads);
    if (!pools[n_threads]) PyErr_NoMemory();
    return pools[n_threads];
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- the state ----------------------------------------------------------------------- */

static void state_free(kw__state *s) {
    if (!s) return;
    for (int v = 0; s->plan && v < kw_plan_n_views(s->plan); v++) {
        if (s->fixed) Py_XDECREF(s->fixed[v]);
        if (s->make) {
            Py_XDECREF(s->make[v].shape);
            Py_XDECREF(s->make[v].stride);
        }
    }
    for (int i = 0; s->fresh && s->prog && i < s->prog->n_outputs; i++) Py_XDECREF(s->fresh[i]);
    for (int i = 0; i < s->n_src; i++) Py_XDECREF(s->src[i].watch);
    PyMem_Free(s->src);
    PyMem_Free(s->memories);
    Py_XDECREF(s->sources);
    Py_XDECREF(s->refresh);
    kw__program_free(s->prog);
    PyMem_Free(s->slots);
    PyMem_Free(s->fresh);
    PyMem_Free(s->fixed);
    PyMem_Free(s->make);
    Py_XDECREF(s->memory); /* the last reference destroys the kw_plan */
    PyMem_Free(s);
}

static int state_traverse(kw__state *s, visitproc visit, void *arg) {
    if (!s) return 0;
    Py_VISIT(s->memory);
    Py_VISIT(s->sources);
    Py_VISIT(s->refresh);
    for (int i = 0; i < s->n_src; i++) Py_VISIT(s->src[i].watch);
    for (int i = 0; s->fixed && s->plan && i < kw_plan_n_views(s->plan); i++) Py_VISIT(s->fixed[i]);
    return kw__program_traverse(s->prog, visit, arg);
}

/* ---- binding the inputs -------------------------------------------------------------- */

static PyObject *int64_tuple_or_none(const int64_t *v, int n) {
    PyObject *t = kw__int64_tuple(v, n);
    if (!t) PyErr_Clear();
    return t ? t : Py_NewRef(Py_None);
}

static int layout_error(const kw__py_input *in, int code, const char *what, PyObject *expected, PyObject *got) {
    kw__plan_error(code, "input '%U' (argument %d): expected %s %R, got %R. " KW__GUARD_DROPPED, in->name, in->arg,
                   what, expected, got);
    return -1;
}

/* Strides of size-1 dims do not matter (PyTorch is free to pick them), nor any
 * of an empty tensor. */
static int strides_match(const kw_tensor *want, const kw_tensor *got) {
    for (int d = 0; d < want->ndim; d++)
        if (want->shape[d] == 0) return 1;
    for (int d = 0; d < want->ndim; d++)
        if (want->shape[d] > 1 && got->stride[d] != want->stride[d]) return 0;
    return 1;
}

static int bind_input(kw__state *s, const kw__py_input *in, PyObject *arg) {
    if (in->type && Py_TYPE(arg) != in->type)
        return layout_error(in, KW_EINVAL, "type", (PyObject *)in->type, (PyObject *)Py_TYPE(arg));
    kw_tensor t;
    if (kw__tensor_read_quick(arg, &t)) {
        char what[160];
        snprintf(what, sizeof what, "input '%s' (argument %d)", PyUnicode_AsUTF8(in->name), in->arg);
        if (kw__tensor_read(arg, what, &t)) return -1;
    }
    if (t.dtype != in->t.dtype)
        return layout_error(in, KW_EDTYPE, "dtype", kw__t.dtype[in->t.dtype], kw__t.dtype[t.dtype]);
    int same_shape = t.ndim == in->t.ndim;
    for (int d = 0; same_shape && d < t.ndim; d++) same_shape = t.shape[d] == in->t.shape[d];
    if (!same_shape || !strides_match(&in->t, &t)) {
        const int shape_differs = !same_shape;
        PyObject *got = int64_tuple_or_none(shape_differs ? t.shape : t.stride, t.ndim);
        layout_error(in, KW_ESHAPE, shape_differs ? "shape" : "strides", shape_differs ? in->shape_obj : in->stride_obj,
                     got);
        Py_DECREF(got);
        return -1;
    }
    s->slots[in->slot] = t.data;
    return 0;
}

/* ---- sources --------------------------------------------------------------------------- */

/* Reads the sources list (set by plan_watch, changed by refresh) into s->src. */
static int read_sources(kw__state *s) {
    const Py_ssize_t n = PyList_GET_SIZE(s->sources);
    struct kw__watched *src = PyMem_Calloc((size_t)n + 1, sizeof *src);
    const struct kw_watch **memories = PyMem_Calloc((size_t)n + 1, sizeof *memories);
    if (!src || !memories) {
        PyMem_Free(src);
        PyMem_Free(memories);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(s->sources, i), *what;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 ||
            (!PyObject_TypeCheck((what = PyTuple_GET_ITEM(item, 1)), &kw__WatchType) && !PyFloat_Check(what))) {
            PyErr_SetString(PyExc_TypeError, "plan sources must be (argument index, Watch or float) pairs");
            break;
        }
        const long arg = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
        if (arg == -1 && PyErr_Occurred()) break;
        if (arg < 0 || arg >= s->prog->n_args) {
            PyErr_Format(PyExc_ValueError, "plan source: argument %ld out of range (the plan takes %d)", arg,
                         s->prog->n_args);
            break;
        }
        src[i] = PyFloat_Check(what) ? (struct kw__watched){(int)arg, NULL, PyFloat_AS_DOUBLE(what)}
                                     : (struct kw__watched){(int)arg, Py_NewRef(what), 0.0};
    }
    if (i < n) {
        while (i--) Py_XDECREF(src[i].watch);
        PyMem_Free(src);
        PyMem_Free(memories);
        return -1;
    }
    for (int j = 0; j < s->n_src; j++) Py_XDECREF(s->src[j].watch);
    PyMem_Free(s->src);
    PyMem_Free(s->memories);
    s->src = src;
    s->memories = memories;
    s->n_src = (int)n;
    return 0;
}

/* An argument the plan was specialised on (a float Dynamo made an input) that
 * now holds another value: 1; 0; -1 with an exception. Values are compared as
 * bits, as _Refresh does: a NaN is its own value (`!=` would call it changed on
 * every call), and -0.0 is not +0.0 (x * s keeps the sign). */
static int value_changed(PyObject *arg, double value) {
    const double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) return -1;
    return memcmp(&now, &value, sizeof now) != 0;
}

/* 1 when a source moved, changed layout or was written, or a value differs; 0;
 * -1 with an exception. */
/* The watched memories' checks (their end bytes compared: 4 KiB a weight),
 * split over the pool's threads. */
typedef struct memory_check {
    const struct kw_watch **w;
    int n;
    atomic_int changed;
} memory_check;

static void check_memories(void *arg, int ith, int nth) {
    memory_check *m = arg;
    for (int i = ith; i < m->n && !atomic_load_explicit(&m->changed, memory_order_relaxed); i += nth)
        if (kw_watch_changed(m->w[i])) atomic_store(&m->changed, 1);
}

static int sources_changed(kw__state *s, PyObject *const *args) {
    memory_check m = {.w = s->memories};
    for (int i = 0; i < s->n_src; i++) {
        const struct kw__watched *w = &s->src[i];
        const int changed = w->watch ? kw__watch_moved(w->watch, args[w->arg]) : value_changed(args[w->arg], w->value);
        if (changed) return changed;
        if (w->watch && kw__watch_memory(w->watch)) m.w[m.n++] = kw__watch_memory(w->watch);
    }
    kw_pool *pool = kw__pool_get(s->n_threads);
    if (!pool) return -1;
    Py_BEGIN_ALLOW_THREADS
    kw_pool_run(pool, check_memories, &m);
    Py_END_ALLOW_THREADS
    return atomic_load(&m.changed);
}

static PyObject *args_tuple(PyObject *const *args, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t && i < n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(args[i]));
    return t;
}

/* RACED when every source that differs was seen current after the last refresh
 * began, at epoch `since` (its watch made, armed again or matched since:
 * the refresh packed its copy, or found it fresh, and so did a rebuild), and
 * was then written, or moved to memory of the same type and layout, by
 * another thread. REMADE when one seen current was then replaced by a tensor
 * of another type or layout, which a refresh must see. 0 for any other
 * difference: a float input's value, a source that no refresh saw current
 * (kwker's own fault); -1 with an exception. */
enum { RACED = 1, REMADE };
static int changed_since_current(const kw__state *s, PyObject *const *args, uint64_t since) {
    int found = RACED; /* REMADE once a source is: kwker's own fault, found later, still wins */
    for (int i = 0; i < s->n_src; i++) {
        const struct kw__watched *w = &s->src[i];
        if (!w->watch) {
            const int changed = value_changed(args[w->arg], w->value);
            if (changed) return changed < 0 ? -1 : 0;
            continue;
        }
        const int moved = kw__watch_moved(w->watch, args[w->arg]);
        if (moved < 0) return -1;
        const struct kw_watch *m = kw__watch_memory(w->watch);
        if (!moved && !(m && kw_watch_changed(m))) continue;
        if (!kw__watch_current_since(w->watch, since)) return 0;
        if (moved == KW__WATCH_REMADE) found = REMADE;
    }
    return found;
}

/* One refresh(args): the copies packed again, or a rebuilt Plan that p adopts. 0; -1 with an exception. */
static int refresh_once(PlanObject *p, PyObject *const *args, Py_ssize_t nargs) {
    kw__state *s = p->s;
    PyObject *tuple = args_tuple(args, nargs);
    refreshing++;
    PyObject *r = tuple ? PyObject_CallOneArg(s->refresh, tuple) : NULL;
    refreshing--;
    Py_XDECREF(tuple);
    if (!r) return -1;
    if (PyObject_TypeCheck(r, &kw__PlanType)) {
        PlanObject *q = (PlanObject *)r;
        if (q == p || q->owner || !q->s || q->s->prog->n_args != s->prog->n_args) {
            Py_DECREF(r);
            kw__plan_error(KW_ESTATE, "refresh returned a plan that cannot replace this one");
            return -1;
        }
        p->s = q->s; /* the old state dies with q */
        q->s = s;
    } else if (r != Py_None) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "a plan's refresh must return None or a Plan");
        return -1;
    }
    Py_DECREF(r);
    return p->s->sources ? read_sources(p->s) : 0;
}

/* The sources are current once this returns 0: refresh(args) made them so, by
 * packing the copies again or by returning a rebuilt Plan that p adopts.
 * Sources still changed after two refreshes are kwker's own fault (a copy the
 * refresh did not bring up to date), raised, but for one case: another thread
 * writes a weight, or moves it (`param.data = other`), after the refresh saw
 * it current (a trainer, or a LoRA merge, beside a generating thread; one
 * that goes over every weight in turn is always after some). The copy then
 * holds the memory as it was at a moment of this call, as eager's reads of
 * memory another thread writes do, and the call goes on; the next call sees
 * the change and packs it again. Before, a source moved after the refresh, or
 * any change after a rebuild, was raised as kwker's fault: a thread that
 * swapped every weight in turn made each call of another raise. */
static int update_sources(PlanObject *p, PyObject *const *args, Py_ssize_t nargs) {
    if (kw_watch_handler_check()) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    uint64_t since = 0; /* the epoch at which the last refresh began */
    int rc = 0;
    for (int attempt = 0;; attempt++) {
        kw__state *s = p->s;
        if (!s->sources) break;
        const int changed = sources_changed(s, args);
        if (changed <= 0) {
            rc = changed;
            break;
        }
        if (attempt == 2) {
            const int raced = changed_since_current(s, args, since);
            if (raced == REMADE)
                kw__plan_error(KW_ESTATE, "a weight the plan copies was replaced by a tensor of another type or "
                                          "layout during the call, after its refresh (by another thread?)");
            else if (!raced)
                kw__plan_error(KW_ESTATE, "the plan's refresh left a copied weight out of date");
            rc = raced == RACED ? 0 : -1;
            break;
        }
        since = kw__watch_epoch_next();
        if (refresh_once(p, args, nargs)) {
            rc = -1;
            break;
        }
    }
    return rc;
}

/* ---- a call ------------------------------------------------------------------------ */

static void drop_fresh(kw__state *s) {
    for (int i = 0; i < s->prog->n_outputs; i++) Py_CLEAR(s->fresh[i]);
}

static int make_outputs(kw__state *s) {
    for (int i = 0; i < s->prog->n_outputs; i++) {
        const kw__py_output *o = &s->prog->outputs[i];
        PyObject *args[4] = {o->shape_obj, o->stride_obj, kw__t.dtype[o->t.dtype], kw__t.cpu};
        PyObject *t = PyObject_Vectorcall(kw__t.empty_strided, args, 2, kw__t.kw_dtype_device);
        if (!t) return -1;
        s->fresh[i] = t;
        kw_tensor out;
        if (kw__tensor_read_quick(t, &out) && kw__tensor_read(t, "an output", &out)) return -1;
        s->slots[o->slot] = out.data;
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
    const kw__state *s = p->s;
    const kw__program *prog = s->prog;
    const kw__make *m = &s->make[v];
    if (m->kind == MAKE_FIXED) return Py_NewRef(s->fixed[v]);
    PyObject *owner = m->output ? s->fresh[m->index] : p->args[prog->inputs[m->index].arg];
    if (m->kind == MAKE_WHOLE) return Py_NewRef(owner);
    if (m->kind == MAKE_AS_STRIDED) return as_strided(owner, m, m->output);
    kw_tensor bound = m->layout;
    bound.data = (char *)s->slots[m->output ? prog->outputs[m->index].slot : prog->inputs[m->index].slot] + m->bytes;
    return kw__tensor_over(owner, &bound);
}

static PyObject *make_returns(PlanObject *p) {
    const kw__program *prog = p->s->prog;
    PyObject *res = PyTuple_New(prog->n_returns);
    for (int r = 0; res && r < prog->n_returns; r++) {
        PyObject *t = view_tensor(p, prog->returns[r]);
        if (!t) Py_CLEAR(res);
        else PyTuple_SET_ITEM(res, r, t);
    }
    return res;
}

/* An index out of range raises IndexError, with PyTorch's words for the op. */
PyObject *kw__index_error(const char *op, int64_t index, int64_t size, const char *where) {
    if (op && !strcmp(op, "kv_write"))
        return PyErr_Format(PyExc_IndexError,
                            "index_copy_(): index %lld is out of bounds for dimension 2 with size %lld (%s: the cache "
                            "position is outside the static cache; the replay stopped there)",
                            (long long)index, (long long)size, where);
    if (op && !strcmp(op, "grouped_linear"))
        return PyErr_Format(PyExc_IndexError,
                            "grouped_linear: the experts' offsets must rise to at most the %lld rows of x, got %lld "
                            "after a larger one or past them (%s; nothing was computed)",
                            (long long)size - 1, (long long)index, where);
    return PyErr_Format(PyExc_IndexError, "index out of range in self: index %lld for size %lld (%s %s)",
                        (long long)index, (long long)size, where, op ? op : "?");
}

static PyObject *index_error(kw_plan *plan) {
    int step = -1;
    int64_t index, size;
    kw_plan_fault(plan, &step, &index, &size);
    const char *label = kw_plan_step_label(plan, step);
    char where[256];
    snprintf(where, sizeof where, "kwker step '%s'", label ? label : "");
    return kw__index_error(kw_plan_step_name(plan, step), index, size, where);
}

static PyObject *replay_failed(PlanObject *p, int rc) {
    if (p->exc_type) {
        PyErr_Restore(p->exc_type, p->exc_value, p->exc_tb);
        p->exc_type = p->exc_value = p->exc_tb = NULL;
        return NULL;
    }
    if (rc == KW_EINDEX) return index_error(p->s->plan);
    return kw__plan_error(rc, "replay failed: %s", kw_strerror(rc));
}

/* Every tensor a call checks is cold (the step before streamed the weights
 * through the caches): their misses are started together, a level of
 * indirection per round, before any is read. */
static void prefetch_checks(const kw__state *s, PyObject *const *args) {
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < s->prog->n_inputs; i++) kw__tensor_prefetch(args[s->prog->inputs[i].arg], round);
        for (int i = 0; i < s->n_src; i++) {
            kw__tensor_prefetch(args[s->src[i].arg], round);
            if (round == 0 && s->src[i].watch) kw__watch_prefetch(s->src[i].watch);
        }
    }
}

/* After a replay, failed or not (its steps may have written): what PyTorch's
 * in-place ops do to the tensors they write. 0, or -1 with an exception (kept
 * when one is set already). */
static int bump_versions(const kw__program *prog, PyObject *const *args) {
    if (!prog->n_written) return 0;
    PyObject *written = PyTuple_New(prog->n_written);
    for (int i = 0; written && i < prog->n_written; i++) PyTuple_SET_ITEM(written, i, Py_NewRef(args[prog->written[i]]));
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = written ? PyObject_CallOneArg(kw__t.increment_version, written) : NULL;
    Py_XDECREF(written);
    Py_XDECREF(r);
    if (type) PyErr_Restore(type, value, tb); /* the replay's error comes first */
    return r ? 0 : -1;
}

/* Steps 2-4 of a call, with the plan's lock held. */
static PyObject *call_locked(PlanObject *p, PyObject *const *args, Py_ssize_t nargs) {
    const int64_t t0 = now_ns();
    prefetch_checks(p->s, args);
    if (update_sources(p, args, nargs)) return NULL;
    const int64_t t_sources = now_ns();
    kw__state *s = p->s;
    const kw__program *prog = s->prog;
    for (int i = 0; i < prog->n_inputs; i++)
        if (bind_input(s, &prog->inputs[i], args[prog->inputs[i].arg])) return NULL;
    const int64_t t_inputs = now_ns();
    kw_pool *pool = kw__pool_get(s->n_threads);
    if (!pool || make_outputs(s)) {
        drop_fresh(s);
        return NULL;
    }
    p->args = args;
    replaying = p;
    int rc;
    const int64_t t1 = now_ns();
    Py_BEGIN_ALLOW_THREADS
    rc = kw_plan_replay(s->plan, pool, s->slots);
    Py_END_ALLOW_THREADS
    const int64_t t2 = now_ns();
    replaying = NULL;
    PyObject *res = rc ? replay_failed(p, rc) : make_returns(p);
    if (bump_versions(prog, args) && res) Py_CLEAR(res);
    p->args = NULL;
    drop_fresh(s);
    const int64_t t_end = now_ns();
    p->timing_ns[0] = t_sources - t0, p->timing_ns[1] = t_inputs - t_sources, p->timing_ns[2] = t1 - t_inputs;
    p->timing_ns[3] = t2 - t1, p->timing_ns[4] = t_end - t0;
    return res;
}

static PyObject *plan_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PlanObject *p = (PlanObject *)self;
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!p->s) return kw__plan_error(KW_ESTATE, "the plan was cleared");
    if (nargs != p->s->prog->n_args || (kwnames && PyTuple_GET_SIZE(kwnames)))
        return PyErr_Format(PyExc_TypeError, "the plan takes %d positional arguments (%zd given%s)",
                            p->s->prog->n_args, nargs, kwnames && PyTuple_GET_SIZE(kwnames) ? ", and keywords" : "");
    const unsigned long me = PyThread_get_thread_ident();
    CallLockObject *held = (CallLockObject *)p->call_lock;
    if (from_before_fork(held->forks, held->owner)) { /* first: the dead thread's id may be a new thread's */
        PyThread_type_lock fresh = PyThread_allocate_lock();
        if (!fresh) return PyErr_NoMemory();
        held->lock = fresh; /* the one perhaps held for good is left as it is */
        held->owner = 0;
        held->forks = forks;
    }
    if (from_before_fork(p->forks, p->owner)) { /* a call on such a thread: its replay never ends here */
        if (p->owner && p->s) { /* and the outputs it made, which it would have returned */
            kw_plan_forget_replay(p->s->plan);
            drop_fresh(p->s);
        }
        p->owner = 0;
        p->forks = forks;
    }
    if (p->owner == me || replaying)
        return kw__plan_error(KW_EBUSY, p->owner == me ? "the plan was called from inside its own call (a fallback "
                                                         "or its refresh)"
                                                       : "a plan cannot be called from another plan's fallback");
    CallLockObject *lock = (CallLockObject *)Py_NewRef(p->call_lock); /* the setter may swap it meanwhile */
    if (lock->owner == me) {
        Py_DECREF(lock);
        return kw__plan_error(KW_EBUSY, "a plan was called from inside the call of a plan that reads the same weight "
                                        "copies");
    }
    if (!PyThread_acquire_lock(lock->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS /* another thread's call: wait for it to end */
        PyThread_acquire_lock(lock->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    p->owner = lock->owner = me;
    p->forks = lock->forks = forks;
    PyObject *res = p->s ? call_locked(p, args, nargs) : kw__plan_error(KW_ESTATE, "the plan was cleared");
    p->owner = lock->owner = 0;
    PyThread_release_lock(lock->lock);
    Py_DECREF(lock);
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
    const int rc = call_fallback(p, &p->s->prog->fallbacks[(intptr_t)user]);
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

/* The input or output whose replay slot is `slot`: its index, and 1 for an output. */
static int slot_owner(const kw__program *prog, int slot, int *output) {
    for (int i = 0; i < prog->n_inputs; i++)
        if (prog->inputs[i].slot == slot) return *output = 0, i;
    for (int i = 0; i < prog->n_outputs; i++)
        if (prog->outputs[i].slot == slot) return *output = 1, i;
    return -1;
}

/* Decides once how view v becomes a tensor on each call: views of constants and
 * of the arena never move, so their tensors are made now. */
static int plan_view(kw__state *s, int v) {
    const kw__program *prog = s->prog;
    kw__make *m = &s->make[v];
    if (m->kind != MAKE_UNUSED) return 0;
    int buffer, slot;
    kw_buffer_kind kind;
    kw_tensor layout;
    if (kw_plan_view(s->plan, v, &buffer, &m->bytes, &layout) || kw_plan_buffer(s->plan, buffer, &kind, &slot)) {
        PyErr_Format(PyExc_SystemError, "kwker: the plan has no view %d", v);
        return -1;
    }
    m->layout = layout;
    if (kind == KW_BUFFER_CONSTANT || kind == KW_BUFFER_ARENA) {
        m->kind = MAKE_FIXED;
        layout.data = (char *)kw_plan_buffer_address(s->plan, buffer) + m->bytes;
        PyObject *owner = s->memory;
        if (kind == KW_BUFFER_CONSTANT) {
            PyObject *key = PyLong_FromLong(buffer);
            owner = key ? PyDict_GetItemWithError(prog->constants, key) : NULL;
            Py_XDECREF(key);
            if (!owner) return PyErr_Occurred() ? -1 : (PyErr_Format(PyExc_SystemError, "kwker: no tensor for constant %d", buffer), -1);
        }
        s->fixed[v] = kw__tensor_over(owner, &layout);
        return s->fixed[v] ? 0 : -1;
    }
    if ((m->index = slot_owner(prog, slot, &m->output)) < 0) {
        PyErr_Format(PyExc_SystemError, "kwker: replay slot %d has no input or output", slot);
        return -1;
    }
    const kw_tensor *whole = m->output ? &prog->outputs[m->index].t : &prog->inputs[m->index].t;
    const size_t es = kw_dtype_size(layout.dtype);
    if (!m->bytes && same_layout(&layout, whole)) {
        m->kind = MAKE_WHOLE;
    } else if (layout.dtype == whole->dtype && m->bytes % es == 0) {
        m->kind = MAKE_AS_STRIDED;
        m->offset = (Py_ssize_t)(m->bytes / es);
        m->shape = kw__int64_tuple(layout.shape, layout.ndim);
        m->stride = kw__int64_tuple(layout.stride, layout.ndim);
        if (!m->shape || !m->stride) return -1;
    } else {
        m->kind = MAKE_OVER;
    }
    return 0;
}

static int prepare(kw__state *s) {
    kw__program *prog = s->prog;
    s->slots = PyMem_Calloc((size_t)kw_plan_n_slots(s->plan) + 1, sizeof *s->slots);
    s->fresh = PyMem_Calloc((size_t)prog->n_outputs + 1, sizeof *s->fresh);
    const int n_views = kw_plan_n_views(s->plan);
    s->fixed = PyMem_Calloc((size_t)n_views + 1, sizeof *s->fixed);
    s->make = PyMem_Calloc((size_t)n_views + 1, sizeof *s->make);
    if (!s->slots || !s->fresh || !s->fixed || !s->make) {
        PyErr_NoMemory();
        return -1;
    }
    for (int f = 0; f < prog->n_fallbacks; f++)
        for (int e = 0; e < prog->fallbacks[f].n_reads + prog->fallbacks[f].n_writes; e++)
            if (plan_view(s, prog->fallbacks[f].views[e])) return -1;
    for (int r = 0; r < prog->n_returns; r++)
        if (plan_view(s, prog->returns[r])) return -1;
    return kw__pool_get(s->n_threads) ? 0 : -1;
}

PyObject *kw__plan_new(kw_plan *plan, kw__program *prog, int n_threads) {
    kw__state *s = PyMem_Calloc(1, sizeof *s);
    PyObject *memory = s ? kw__memory_new(NULL, kw_plan_arena(plan), (Py_ssize_t)kw_plan_arena_bytes(plan), plan)
                         : NULL;
    if (!memory) {
        PyMem_Free(s);
        kw_plan_destroy(plan);
        kw__program_free(prog);
        return s ? NULL : PyErr_NoMemory();
    }
    *s = (kw__state){.memory = memory, .plan = plan, .prog = prog, .n_threads = n_threads};
    PlanObject *p = (PlanObject *)kw__PlanType.tp_alloc(&kw__PlanType, 0);
    if (!p) {
        state_free(s);
        return NULL;
    }
    p->vectorcall = plan_call;
    p->s = s;
    p->forks = forks;
    if (!(p->call_lock = PyObject_CallNoArgs((PyObject *)&kw__CallLockType))) {
        Py_DECREF(p);
        return NULL;
    }
    if (prepare(s)) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static int plan_traverse(PyObject *self, visitproc visit, void *arg) {
    PlanObject *p = (PlanObject *)self;
    Py_VISIT(p->dict);
    return state_traverse(p->s, visit, arg);
}

/* The state goes whole: a call in progress holds its own reference to the
 * plan, so this never runs under one. */
static int plan_clear(PyObject *self) {
    PlanObject *p = (PlanObject *)self;
    Py_CLEAR(p->dict);
    kw__state *s = p->s;
    p->s = NULL;
    state_free(s);
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
    Py_XDECREF(p->call_lock);
    Py_TYPE(self)->tp_free(self);
}

/* ---- call locks ---------------------------------------------------------------------- */

static PyObject *call_lock_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs)))
        return PyErr_Format(PyExc_TypeError, "CallLock() takes no arguments");
    CallLockObject *l = (CallLockObject *)type->tp_alloc(type, 0);
    if (l && !(l->lock = PyThread_allocate_lock())) {
        Py_DECREF(l);
        return PyErr_NoMemory();
    }
    if (l) l->forks = forks;
    return (PyObject *)l;
}

static void call_lock_dealloc(PyObject *self) {
    CallLockObject *l = (CallLockObject *)self;
    if (l->lock) PyThread_free_lock(l->lock);
    Py_TYPE(self)->tp_free(self);
}

PyTypeObject kw__CallLockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kwker._C.CallLock",
    .tp_doc = "What a plan holds for a whole call (Plan.call_lock); plans that read the same weight copies share one.",
    .tp_basicsize = sizeof(CallLockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = call_lock_new,
    .tp_dealloc = call_lock_dealloc,
};

/* ---- introspection -------------------------------------------------------------------- */

/* The state of a plan that was not cleared, else NULL with PlanError. */
static kw__state *live_state(PyObject *self) {
    kw__state *s = ((PlanObject *)self)->s;
    if (!s) kw__plan_error(KW_ESTATE, "the plan was cleared");
    return s;
}

/* The Python side (arguments, returns) above the C listing. */
static PyObject *plan_dump(PyObject *self, PyObject *unused) {
    kw__state *s = live_state(self);
    if (!s) return NULL;
    kw__program *prog = s->prog;
    PyObject *lines = PyList_New(0), *line = NULL;
    if (!lines) return NULL;
#define ADD(expr)                                                   \
    if (!(line = (expr)) || PyList_Append(lines, line)) goto fail; \
    Py_CLEAR(line);
    ADD(PyUnicode_FromFormat("call: %d arguments, %d returns", prog->n_args, prog->n_returns));
    for (int i = 0; i < prog->n_inputs; i++) {
        const kw__py_input *in = &prog->inputs[i];
        ADD(PyUnicode_FromFormat("  argument %d: input '%U' %s %R strides %R -> slot %d", in->arg, in->name,
                                 kw_dtype_name(in->t.dtype), in->shape_obj, in->stride_obj, in->slot));
    }
    for (int r = 0; r < prog->n_returns; r++) {
        int buffer, slot;
        size_t offset;
        kw_tensor layout;
        kw_buffer_kind kind;
        kw_plan_view(s->plan, prog->returns[r], &buffer, &offset, &layout);
        kw_plan_buffer(s->plan, buffer, &kind, &slot);
        ADD(PyUnicode_FromFormat("  return %d: view %d of %s b%d + %zu%s", r, prog->returns[r],
                                 kw_buffer_kind_name(kind), buffer, offset,
                                 s->make[prog->returns[r]].kind == MAKE_WHOLE        ? " (the tensor itself)"
                                 : s->make[prog->returns[r]].kind == MAKE_AS_STRIDED ? " (as_strided)"
                                                                                     : ""));
    }
    if (s->sources) ADD(PyUnicode_FromFormat("  %zd sources of copied weights, watched", PyList_GET_SIZE(s->sources)));
    char *text = kw_plan_dump(s->plan);
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
    kw__state *s = live_state(self);
    if (!s) return NULL;
    if (!kw_plan_profiling(s->plan)) Py_RETURN_NONE;
    uint64_t runs;
    const uint64_t *ns = kw_plan_profile(s->plan, &runs);
    const int n = kw_plan_n_steps(s->plan);
    PyObject *steps = PyList_New(n);
    for (int i = 0; steps && i < n; i++) {
        const double total_us = (double)ns[i] / 1e3;
        PyObject *d = Py_BuildValue("{s:i,s:s,s:s,s:d,s:d}", "step", i, "op", kw_plan_step_name(s->plan, i), "label",
                                    kw_plan_step_label(s->plan, i), "total_us", total_us, "mean_us",
                                    runs ? total_us / (double)runs : 0.0);
        if (!d) Py_CLEAR(steps);
        else PyList_SET_ITEM(steps, i, d);
    }
    if (!steps) return NULL;
    return Py_BuildValue("{s:K,s:N}", "replays", (unsigned long long)runs, "steps", steps);
}

static PyObject *plan_get_profiling(PyObject *self, void *closure) {
    kw__state *s = live_state(self);
    return s ? PyBool_FromLong(kw_plan_profiling(s->plan)) : NULL;
}

static int plan_set_profiling(PyObject *self, PyObject *value, void *closure) {
    PlanObject *p = (PlanObject *)self;
    const int on = value ? PyObject_IsTrue(value) : 0;
    if (on < 0 || !live_state(self)) return -1;
    if (p->owner) {
        kw__plan_error(KW_EBUSY, "profiling cannot change while the plan is being called");
        return -1;
    }
    kw_plan_set_profiling(p->s->plan, on);
    return 0;
}

static PyObject *plan_get_int(PyObject *self, void *which) {
    kw__state *s = live_state(self);
    if (!s) return NULL;
    switch ((intptr_t)which) {
    case 0: return PyLong_FromLong(kw_plan_n_steps(s->plan));
    case 1: return PyLong_FromLong(kw_plan_n_barriers(s->plan));
    case 2: return PyLong_FromLong(kw_plan_n_threads(s->plan));
    case 3: return PyLong_FromSize_t(kw_plan_arena_bytes(s->plan));
    case 4: return PyLong_FromLong(s->prog->n_args);
    default: return PyLong_FromLong(s->prog->n_fallbacks);
    }
}

static PyObject *plan_get_last_call(PyObject *self, void *closure) {
    const int64_t *t = ((PlanObject *)self)->timing_ns;
    return Py_BuildValue("{s:d,s:d,s:d,s:d,s:d,s:d}", "sources_us", (double)t[0] / 1e3, "inputs_us", (double)t[1] / 1e3,
                         "outputs_us", (double)t[2] / 1e3, "check_us", (double)(t[0] + t[1] + t[2]) / 1e3, "replay_us",
                         (double)t[3] / 1e3, "call_us", (double)t[4] / 1e3);
}

static int set_add_long(PyObject *set, long v) {
    PyObject *n = PyLong_FromLong(v);
    const int err = !n || PySet_Add(set, n);
    Py_XDECREF(n);
    return err ? -1 : 0;
}

/* The arguments whose type and layout every call checks: the inputs it binds and
 * the sources of its weight copies (kwker.guards drops Dynamo's guards on these);
 * not the floats it was specialised on, whose value it checks. */
static PyObject *plan_get_checked_args(PyObject *self, void *closure) {
    kw__state *s = live_state(self);
    if (!s) return NULL;
    PyObject *set = PySet_New(NULL);
    for (int i = 0; set && i < s->prog->n_inputs; i++)
        if (set_add_long(set, s->prog->inputs[i].arg)) Py_CLEAR(set);
    for (int i = 0; set && i < s->n_src; i++)
        if (s->src[i].watch && set_add_long(set, s->src[i].arg)) Py_CLEAR(set);
    PyObject *res = set ? PyFrozenSet_New(set) : NULL;
    Py_XDECREF(set);
    return res;
}

static PyObject *plan_repr(PyObject *self) {
    kw__state *s = ((PlanObject *)self)->s;
    if (!s) return PyUnicode_FromString("<kwker._C.Plan: cleared>");
    return PyUnicode_FromFormat("<kwker._C.Plan: %d steps, %d barriers, %d threads, arena %zu B>",
                                kw_plan_n_steps(s->plan), kw_plan_n_barriers(s->plan), kw_plan_n_threads(s->plan),
                                kw_plan_arena_bytes(s->plan));
}

static PyObject *plan_watch(PyObject *self, PyObject *args) {
    PlanObject *p = (PlanObject *)self;
    PyObject *sources, *refresh;
    if (!PyArg_ParseTuple(args, "O!O:watch", &PyList_Type, &sources, &refresh) || !live_state(self)) return NULL;
    if (!PyCallable_Check(refresh)) return PyErr_Format(PyExc_TypeError, "watch: refresh must be callable");
    if (p->owner) return kw__plan_error(KW_EBUSY, "watch: the plan is being called");
    PyObject *old = p->s->sources;
    p->s->sources = Py_NewRef(sources);
    if (read_sources(p->s)) {
        Py_SETREF(p->s->sources, old);
        return NULL;
    }
    Py_XDECREF(old);
    Py_XSETREF(p->s->refresh, Py_NewRef(refresh));
    Py_RETURN_NONE;
}

static PyMethodDef plan_methods[] = {
    {"watch", plan_watch, METH_VARARGS,
     "watch(sources, refresh): sources is a list of (argument index, Watch) for the arguments kwker copied\n"
     "weights from, and of (argument index, float) for arguments the plan was specialised on. Before each\n"
     "call, if an argument is not its watch's memory and layout, or that memory was written, or it does not\n"
     "equal its float, refresh(args) is called with the call's arguments; it brings the copies and the list\n"
     "up to date and returns None, or returns a new Plan, whose state this plan then takes over."},
    {"dump", plan_dump, METH_NOARGS,
     "dump() -> str: arguments and returns, then buffers (kind, bytes, arena offset, live range) and steps\n"
     "(op, views, barriers, bytes read and written)."},
    {NULL, NULL, 0, NULL},
};

static PyObject *plan_get_call_lock(PyObject *self, void *closure) {
    return Py_NewRef(((PlanObject *)self)->call_lock);
}

static int plan_set_call_lock(PyObject *self, PyObject *value, void *closure) {
    PlanObject *p = (PlanObject *)self;
    if (!value || !PyObject_TypeCheck(value, &kw__CallLockType)) {
        PyErr_SetString(PyExc_TypeError, "a plan's call_lock must be a kwker._C.CallLock");
        return -1;
    }
    if (p->owner) { /* a call in progress holds the old one: another thread would enter beside it */
        kw__plan_error(KW_EBUSY, "a plan's call_lock cannot change during a call");
        return -1;
    }
    Py_SETREF(p->call_lock, Py_NewRef(value));
    return 0;
}

static PyGetSetDef plan_getset[] = {
    {"call_lock", plan_get_call_lock, plan_set_call_lock,
     "The CallLock held for a whole call: plans that read the same weight copies are given the same one. A\n"
     "rebuilt plan's state, taken over, leaves it as it is.",
     NULL},
    {"profiling", plan_get_profiling, plan_set_profiling,
     "Per-step timing on or off (setting it clears the counters). On, every step is followed by a barrier.", NULL},
    {"profile", plan_get_profile, NULL,
     "None when profiling is off, else {'replays': n, 'steps': [{'step', 'op', 'label', 'total_us', 'mean_us'}]}.",
     NULL},
    {"last_call", plan_get_last_call, NULL,
     "The last call's wall time in µs: 'sources_us' (the copies' sources checked, refreshed if need be),\n"
     "'inputs_us' (inputs checked and bound), 'outputs_us' (fresh outputs made), 'check_us' (the three),\n"
     "'replay_us', 'call_us' (the whole call, returns made too).",
     NULL},
    {"checked_args", plan_get_checked_args, NULL,
     "frozenset of the argument positions whose type, dtype, shape and strides every call checks (the\n"
     "inputs it binds, typed ones by their exact Python type) or whose memory it watches (the sources\n"
     "of its weight copies: moved, relaid or written, they are packed again).",
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
