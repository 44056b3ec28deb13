/* xpool._core: the CPython binding (the Allocation and Allocator types, argument parsing, module init); see
 * _core.h for the layers. */
#include "_core.h"

#include <structmember.h>
#include <string.h>

/* ------------------------------------------------------------------ arguments */

static PyObject *py_zero;

/* A non-negative int argument as uint64, or an error naming it: PyArg's "K" would take -1 as 2**64-1. */
static int u64_arg(PyObject *o, unsigned long long *out, const char *name)
{
    PyObject *n = PyNumber_Index(o);
    if (!n) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", name, Py_TYPE(o)->tp_name);
        return 0;
    }
    int negative = PyObject_RichCompareBool(n, py_zero, Py_LT);
    unsigned long long v = negative ? 0 : PyLong_AsUnsignedLongLong(n);
    Py_DECREF(n);
    if (negative < 0) return 0;
    if (negative || PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be an int in [0, 2**64), got %R", name, o);
        return 0;
    }
    *out = v;
    return 1;
}

static int u64_limit(PyObject *o, void *out) { return u64_arg(o, out, "limit"); }
static int u64_keep(PyObject *o, void *out) { return u64_arg(o, out, "keep"); }
static int u64_ptr(PyObject *o, void *out) { return u64_arg(o, out, "ptr"); }
static int u64_stream_lookup(PyObject *o, void *out) { return u64_arg(o, out, "stream_lookup"); }

/* A stream handle: an int in [0, 2**63).  Negative values are the pool's per-thread keys, never a handle. */
static int stream_arg(PyObject *o, void *out)
{
    PyObject *n = PyBool_Check(o) ? NULL : PyNumber_Index(o);
    long long v = n ? PyLong_AsLongLong(n) : -1;
    Py_XDECREF(n);
    if (v < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "stream must be a stream handle, an int in [0, 2**63), got %.100s %R",
                     Py_TYPE(o)->tp_name, o);
        return 0;
    }
    *(long long *)out = v;
    return 1;
}

/* The request's size, the one check on Allocator.allocate's path (Pool.allocate passes it on as given):
 * an int (not a bool) in [0, XP_MAX_REQUEST], else a ValueError naming nbytes. */
static int nbytes_arg(PyObject *o, void *out)
{
    PyObject *n = PyBool_Check(o) ? NULL : PyNumber_Index(o);
    if (!n) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "nbytes must be an integer number of bytes, got %.100s %R",
                     Py_TYPE(o)->tp_name, o);
        return 0;
    }
    int negative = PyObject_RichCompareBool(n, py_zero, Py_LT);
    if (negative) {
        if (negative > 0) PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %R", n);
        Py_DECREF(n);
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(n);
    if (PyErr_Occurred() || v > XP_MAX_REQUEST) {   /* past 2**64, or past any device */
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "nbytes=%R is larger than any device (max %zu)", n,
                     (size_t)XP_MAX_REQUEST);
        Py_DECREF(n);
        return 0;
    }
    Py_DECREF(n);
    *(size_t *)out = (size_t)v;
    return 1;
}

/* ------------------------------------------------------------------ settings */

/* This module, whose Settings attribute xpool/settings.py sets to its Settings class: the package that loaded
 * this build (under whatever name: xlab.builds loads two side by side) says which class it trusts. */
static PyObject *core_module;

static const char *const scheme_names[XP_SCHEMES] = {"segments", "seed", "expandable"};
static const XpScheme *const scheme_ops[XP_SCHEMES] = {&xp_segments, &xp_seed, &xp_expandable};

/* settings.<name> as an unsigned integer, or -1 with an error. */
static int read_u64(PyObject *settings, const char *name, unsigned long long *out)
{
    PyObject *v = PyObject_GetAttrString(settings, name);
    if (!v) return -1;
    int ok = u64_arg(v, out, name);
    Py_DECREF(v);
    return ok ? 0 : -1;
}

/* settings.scheme's index in scheme_names, or -1 with an error. */
static int read_scheme(PyObject *settings)
{
    PyObject *v = PyObject_GetAttrString(settings, "scheme");
    if (!v) return -1;
    const char *s = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
    int i = XP_SCHEMES;
    while (s && i-- > 0 && strcmp(s, scheme_names[i])) ;
    if (!s || i < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "settings.scheme: unknown value %R", v);
        i = -1;
    }
    Py_DECREF(v);
    return i;
}

/* Reads what the core needs of a resolved xpool.Settings (every field was checked when it was made);
 * *timeline: the events its timeline keeps. */
static int read_settings(Allocator *self, PyObject *settings, unsigned long long *timeline)
{
    PyObject *settings_type = PyObject_GetAttrString(core_module, "Settings");
    if (!settings_type) return -1;
    int is = PyObject_IsInstance(settings, settings_type);
    Py_DECREF(settings_type);
    if (is <= 0) {
        if (!is) PyErr_Format(PyExc_TypeError, "settings must be an xpool.Settings (of the package that loaded "
                              "this core), got %R", (PyObject *)Py_TYPE(settings));
        return -1;
    }
    unsigned long long k = 1, limit = 0;
    int scheme = read_scheme(settings);
    if (scheme < 0 || (scheme == XP_SCHEME_SEED && read_u64(settings, "classes_per_doubling", &k) < 0) ||
        read_u64(settings, "timeline", timeline) < 0)
        return -1;
    PyObject *lim = PyObject_GetAttrString(settings, "limit");   /* bytes (int), or a share (float) */
    if (!lim) return -1;
    double fraction = PyFloat_Check(lim) ? PyFloat_AsDouble(lim) : 0;
    int ok = PyFloat_Check(lim) || u64_arg(lim, &limit, "limit");
    Py_DECREF(lim);
    if (!ok) return -1;
    self->scheme = scheme;
    self->ops = scheme_ops[scheme];
    self->k = (unsigned)k;
    self->default_limit = limit;
    self->default_fraction = fraction;
    Py_INCREF(settings);
    Py_XSETREF(self->settings, settings);
    return 0;
}

/* ------------------------------------------------------------------ Allocation: a block as a Python object */

typedef struct {
    PyObject_HEAD
    Allocator *owner;
    uintptr_t ptr;          /* 0 once released */
    size_t size;
    size_t requested;
    intptr_t stream;
    int device;
} Allocation;

static PyTypeObject AllocationType;

/* xp_free's answer: -1 and 1 with an exception set; 0, and 2 for a block of the parent process
 * released in a fork()ed child (nothing to give back), without. */
static int allocation_release(Allocation *self)
{
    if (!self->ptr) return 0;
    uintptr_t ptr = self->ptr;
    self->ptr = 0;
    int holds_ref;
    int r = xp_free(self->owner, self->device, ptr, &holds_ref);
    if (holds_ref) Py_DECREF(self->owner);   /* not ours (a CuPy block's); self still holds owner */
    return r;
}

static void Allocation_dealloc(Allocation *self)
{
    if (self->ptr) {
        /* the object may die while an exception propagates (int(pool.allocate(n))): keep it */
        PyObject *in_flight = PyErr_GetRaisedException();
        int r = allocation_release(self);
        /* not WriteUnraisable(self): self is already dead, a repr of it would resurrect it */
        if (r == -1 || r == 1) PyErr_WriteUnraisable(NULL);
        if (in_flight) PyErr_SetRaisedException(in_flight);
    }
    Py_XDECREF(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Allocation_release(Allocation *self, PyObject *unused)
{
    int r = allocation_release(self);
    if (r == -1 || r == 1) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Allocation_repr(Allocation *self)
{
    char buf[200];
    snprintf(buf, sizeof buf, "<xpool Allocation 0x%zx requested=%zu size=%zu device=%d stream=0x%zx%s>",
             (size_t)self->ptr, self->requested, self->size, self->device, (size_t)self->stream,
             self->ptr ? "" : " released");
    return PyUnicode_FromString(buf);
}

static PyMemberDef Allocation_members[] = {
    {"ptr", T_ULONGLONG, offsetof(Allocation, ptr), READONLY, "device address (0 once released)"},
    {"size", T_PYSSIZET, offsetof(Allocation, size), READONLY, "class size in bytes"},
    {"requested", T_PYSSIZET, offsetof(Allocation, requested), READONLY, "bytes asked for"},
    {"stream", T_PYSSIZET, offsetof(Allocation, stream), READONLY, "stream it was handed out on"},
    {"device", T_INT, offsetof(Allocation, device), READONLY, "device it belongs to"},
    {NULL}
};

static PyMethodDef Allocation_methods[] = {
    {"release", (PyCFunction)Allocation_release, METH_NOARGS,
     "Give the block back to its pool now (idempotent)."},
    {NULL}
};

static PyTypeObject AllocationType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xpool._core.Allocation",
    .tp_basicsize = sizeof(Allocation),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A block handed out by an Allocator; given back when released or collected.",
    .tp_dealloc = (destructor)Allocation_dealloc,
    .tp_repr = (reprfunc)Allocation_repr,
    .tp_members = Allocation_members,
    .tp_methods = Allocation_methods,
};

/* ------------------------------------------------------------------ the Allocator's life */

static int timeline_resize(Allocator *self, Py_ssize_t cap);

/* Allocator(backend, error_factory, settings, stream_lookup=0, device_count=64): settings is a resolved
 * xpool.Settings; stream_lookup the address of `intptr_t fn(int device)` giving a device's current stream (0:
 * stream 0); device_count the backend's devices (Pool asks backend.device_count() once). */
static int Allocator_init(Allocator *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"backend", "error_factory", "settings", "stream_lookup", "device_count", NULL};
    PyObject *backend, *factory, *settings;
    unsigned long long stream_fn = 0, timeline = 0;
    int n_devices = XP_MAX_DEVICES;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O&i", kwlist, &backend, &factory, &settings,
                                     u64_stream_lookup, &stream_fn, &n_devices))
        return -1;
    if (n_devices < 0 || n_devices > XP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device_count must be in [0, %d], got %d", XP_MAX_DEVICES, n_devices);
        return -1;
    }
    if (self->backend) {   /* its pools were made for the first settings */
        PyErr_SetString(PyExc_RuntimeError, "an Allocator is set up once");
        return -1;
    }
    if (read_settings(self, settings, &timeline) < 0) return -1;
    if (self->scheme == XP_SCHEME_EXPANDABLE && xp_vm_open(self, backend) < 0) return -1;
    Py_INCREF(backend); Py_XSETREF(self->backend, backend);
    Py_INCREF(factory); Py_XSETREF(self->error_factory, factory);
    self->tells_capture = PyObject_HasAttrString(backend, "capturing");
    self->tells_alive = PyObject_HasAttrString(backend, "stream_alive");
    self->stream_fn = (stream_fn_t)(uintptr_t)stream_fn;
    self->n_devices = n_devices;
    return timeline ? timeline_resize(self, (Py_ssize_t)timeline) : 0;
}

static PyObject *Allocator_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Allocator *self = (Allocator *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    pthread_mutex_init(&self->registry_lock, NULL);
    pthread_mutex_init(&self->debug_lock, NULL);
    pthread_mutex_init(&self->tl.lock, NULL);
    pthread_mutex_init(&self->pin_lock, NULL);
    pthread_cond_init(&self->pin_cv, NULL);
    self->debug_hook = NULL;
    for (int i = 0; i < XP_MAX_DEVICES; i++) atomic_init(&self->pools[i], NULL);
    return (PyObject *)self;
}

static void pool_destroy(DevicePool *pool)
{
    for (size_t i = 0; i < pool->live.cap; i++) {
        Block *b = pool->live.slots[i];
        if (b && b != TOMBSTONE) free(b);
    }
    for (size_t i = 0; i < pool->bins.cap; i++) {
        Bin *bin = pool->bins.slots[i];
        if (!bin) continue;
        for (Block *b = bin->top, *n; b; b = n) { n = b->next; free(b); }
        free(bin);
    }
    seg_destroy(&pool->segs);
    if (pool->vm) {   /* the ranges' own memory only: no op is called (a fork()ed child's copy, too) */
        xe_destroy(pool->vm);
        free(pool->vm);
    }
    free(pool->streams);
    free(pool->live.slots);
    free(pool->bins.slots);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

/* An Allocator is freed only when nothing references it: every Allocation holds
 * a reference and CuPy's CFunctionAllocator holds one through its owner, so no
 * block can be in use here.  Cached blocks are given back to the backend. */
static void Allocator_dealloc(Allocator *self)
{
    PyObject *in_flight = PyErr_GetRaisedException();   /* the backend's frees must not lose it */
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    for (int d = 0; d < XP_MAX_DEVICES; d++) {
        DevicePool *pool = atomic_load(&self->pools[d]);
        if (pool) {
            /* a block whose free fails now is lost to the process: nothing is left to retry it */
            XpGil g = XP_GIL_HELD;
            g.may_drop = 0;   /* a dealloc keeps the GIL */
            if (self->backend && self->ops->release(self, pool, 1, 0, 0, 1, &g) < 0) PyErr_WriteUnraisable(NULL);
            pool_destroy(pool);
        }
        for (DevicePool *p = self->forked_pools[d], *older; p; p = older) {   /* our copies only */
            older = p->older;
            pool_destroy(p);
        }
    }
    if (in_flight) PyErr_SetRaisedException(in_flight);
    free(self->tl.buf);
    Py_XDECREF(self->backend);
    Py_XDECREF(self->error_factory);
    Py_XDECREF(self->settings);
    Py_XDECREF(self->debug_hook);
    Py_XDECREF(self->vmm_capsule);   /* last: the pools' pages went back through its ops */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* In a child made by fork() the parent's device memory is not ours to use or free: forget every pool without touching
 * the backend, and make the locks new (one may have been held by a parent thread that does not exist here). */
static PyObject *Allocator_forget_after_fork(Allocator *self, PyObject *unused)
{
    pthread_mutex_init(&self->registry_lock, NULL);
    pthread_mutex_init(&self->debug_lock, NULL);
    pthread_mutex_init(&self->tl.lock, NULL);
    pthread_mutex_init(&self->pin_lock, NULL);   /* no check or unmap of the parent's threads runs here */
    pthread_cond_init(&self->pin_cv, NULL);
    self->pins = self->unmapping = 0;
    for (int d = 0; d < XP_MAX_DEVICES; d++) {
        /* kept, not freed: the parent's blocks may die here, and only those may be forgotten */
        DevicePool *pool = atomic_load(&self->pools[d]);
        if (pool) {
            pool->older = self->forked_pools[d];
            self->forked_pools[d] = pool;
            atomic_store(&self->pools[d], NULL);
        }
        for (DevicePool *p = self->forked_pools[d]; p; p = p->older) pthread_mutex_init(&p->lock, NULL);
    }
    self->tl.count = 0;
    self->forked = 1;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ allocating and freeing */

static PyObject *Allocator_allocate(Allocator *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nbytes", "device", "stream", NULL};
    size_t n;
    int device = 0;
    long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|iO&", kwlist, nbytes_arg, &n, &device, stream_arg, &stream) ||
        xp_check_device(self, device) < 0)
        return NULL;
    Block *b = xp_alloc(self, device, stream_key((intptr_t)stream), n, ORIGIN_PYTHON);
    if (!b) return NULL;
    Allocation *a = PyObject_New(Allocation, &AllocationType);
    if (!a) {
        int holds_ref;
        PyObject *exc = PyErr_GetRaisedException();
        if (xp_free(self, device, b->ptr, &holds_ref) != 0) PyErr_Clear();
        PyErr_SetRaisedException(exc);
        return NULL;
    }
    Py_INCREF(self);
    a->owner = self; a->ptr = b->ptr; a->size = b->size; a->requested = n;
    a->stream = (intptr_t)stream; a->device = device;   /* the handle asked for (the key is the pool's own) */
    return (PyObject *)a;
}

static PyObject *Allocator_free_ptr(Allocator *self, PyObject *args)
{
    int device, holds_ref;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "iO&", &device, u64_ptr, &ptr)) return NULL;
    int r = xp_free(self, device, (uintptr_t)ptr, &holds_ref);
    if (holds_ref) Py_DECREF(self);   /* a CuPy block's reference; the caller holds self */
    if (r == -1 || r == 1) return NULL;
    Py_RETURN_NONE;
}

/* (param, malloc, free) addresses for cupy.cuda.memory.CFunctionAllocator */
static PyObject *Allocator_cfunctions(Allocator *self, PyObject *unused)
{
    return Py_BuildValue("(KKK)", (unsigned long long)(uintptr_t)self,
                         (unsigned long long)(uintptr_t)&cupy_malloc,
                         (unsigned long long)(uintptr_t)&cupy_free);
}

/* ------------------------------------------------------------------ statistics, limits, giving back */

/* The pool of a device argument: made on first use when `create`, else NULL (no exception) if none. */
static DevicePool *pool_arg(Allocator *self, int device, int create)
{
    if (xp_check_device(self, device) < 0) return NULL;
    return create ? pool_get(self, device) : pool_lookup(self, device);
}

static PyObject *Allocator_stats(Allocator *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
    DevicePool *pool = pool_arg(self, device, 1);
    if (!pool) return NULL;
    pthread_mutex_lock(&pool->lock);
    Stats s = pool->st;
    uint64_t limit = pool->limit;
    pthread_mutex_unlock(&pool->lock);
#define K(x) (unsigned long long)(x)
    return Py_BuildValue(
        "{s:i,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
        "device", device, "requests", K(s.requests), "hits", K(s.hits), "misses", K(s.misses),
        "device_mallocs", K(s.device_mallocs), "device_frees", K(s.device_frees),
        "device_maps", K(s.device_maps), "device_unmaps", K(s.device_unmaps),
        "frees", K(s.frees), "oom_recoveries", K(s.oom_recoveries), "oom_errors", K(s.oom_errors),
        "blocks_in_use", K(s.blocks_in_use), "blocks_cached", K(s.blocks_cached),
        "bytes_in_use", K(s.bytes_in_use), "bytes_requested", K(s.bytes_requested),
        "bytes_cached", K(s.bytes_cached), "bytes_reserved", K(reserved(&s)),
        "bytes_pending", K(s.bytes_pending), "bytes_releasing", K(s.bytes_releasing),
        "peak_bytes_in_use", K(s.peak_bytes_in_use),
        "peak_bytes_requested", K(s.peak_bytes_requested),
        "peak_bytes_reserved", K(s.peak_bytes_reserved), "limit", K(limit),
        "bytes_in_use_cupy", K(s.bytes_in_use - s.bytes_in_use_by[ORIGIN_TORCH] - s.bytes_in_use_by[ORIGIN_PYTHON]),
        "bytes_in_use_torch", K(s.bytes_in_use_by[ORIGIN_TORCH]),
        "bytes_in_use_python", K(s.bytes_in_use_by[ORIGIN_PYTHON]));
#undef K
}

static PyObject *Allocator_devices(Allocator *self, PyObject *unused)
{
    PyObject *out = PyList_New(0);
    for (int d = 0; out && d < XP_MAX_DEVICES; d++) {
        if (!atomic_load(&self->pools[d])) continue;
        PyObject *v = PyLong_FromLong(d);
        if (!v || PyList_Append(out, v) < 0) { Py_XDECREF(v); Py_CLEAR(out); break; }
        Py_DECREF(v);
    }
    return out;
}

/* reset_peaks(device): the peak gauges to the current levels. */
static PyObject *Allocator_reset_peaks(Allocator *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
    DevicePool *pool = pool_arg(self, device, 0);
    if (PyErr_Occurred()) return NULL;
    if (pool) {
        pthread_mutex_lock(&pool->lock);
        pool->st.peak_bytes_in_use = pool->st.bytes_in_use;
        pool->st.peak_bytes_requested = pool->st.bytes_requested;
        pool->st.peak_bytes_reserved = reserved(&pool->st);
        pthread_mutex_unlock(&pool->lock);
    }
    Py_RETURN_NONE;
}

/* release(device, stream=None, keep=0): give cached blocks back to the device
 * until at most `keep` bytes stay cached; only the given stream's when one is named. */
static PyObject *Allocator_release(Allocator *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "stream", "keep", NULL};
    int device;
    PyObject *stream = Py_None;
    unsigned long long keep = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|OO&", kwlist, &device, &stream, u64_keep, &keep))
        return NULL;
    DevicePool *pool = pool_arg(self, device, 0);
    if (PyErr_Occurred()) return NULL;
    if (!pool) return PyLong_FromLong(0);
    long long s = 0;
    if (stream != Py_None && !stream_arg(stream, &s)) return NULL;
    XpGil g = XP_GIL_HELD;
    long long n = xp_release(self, pool, stream == Py_None, stream_key((intptr_t)s), keep, 1, &g);
    xp_gil_end(&g);
    return n < 0 ? NULL : PyLong_FromLongLong(n);
}

static PyObject *Allocator_set_limit(Allocator *self, PyObject *args)
{
    int device;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "iO&", &device, u64_limit, &limit)) return NULL;
    DevicePool *pool = pool_arg(self, device, 1);
    if (!pool) return NULL;
    pthread_mutex_lock(&pool->lock);
    pool->limit = limit;
    pthread_mutex_unlock(&pool->lock);
    Py_RETURN_NONE;
}

/* vm_range(device, ptr) -> (base, nbytes) of the scheme expandable's address range holding ptr, or None. */
static PyObject *Allocator_vm_range(Allocator *self, PyObject *args)
{
    int device;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "iO&", &device, u64_ptr, &ptr) || xp_check_device(self, device) < 0) return NULL;
    uintptr_t base;
    size_t bytes;
    if (!xp_vm_range_of(self, device, (uintptr_t)ptr, &base, &bytes)) Py_RETURN_NONE;
    return Py_BuildValue("(Kn)", (unsigned long long)base, (Py_ssize_t)bytes);
}

/* pin_pages(on): while pinned, scheme expandable unmaps nothing (Pool.check reads live blocks meanwhile). */
static PyObject *Allocator_pin_pages(Allocator *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    xp_pin_pages(self, on);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ listing blocks */

typedef struct { Block *out; size_t n, cap; } CopyOut;

static int copy_free_range(Block *b, void *arg)
{
    CopyOut *c = arg;
    if (c->n >= c->cap) return 1;
    c->out[c->n++] = *b;
    return 0;
}

/* The blocks of one device, in use (live) or cached, as a list of infos:
 * copied under the lock, turned into Python objects after it. */
static PyObject *list_blocks(Allocator *self, PyObject *args, int live)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
    DevicePool *pool = pool_arg(self, device, 0);
    if (PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0);
    if (!out || !pool) return out;
    pthread_mutex_lock(&pool->lock);
    size_t n = 0, cap = live ? pool->live.used : pool->st.blocks_cached;
    Block *copy = cap ? malloc(cap * sizeof(Block)) : NULL;
    if (live) {
        /* a block whose debug hook is still running is not handed out yet: no canary to check */
        for (size_t i = 0; copy && i < pool->live.cap; i++) {
            Block *b = pool->live.slots[i];
            if (b && b != TOMBSTONE && b->handed_out) copy[n++] = *b;
        }
    } else {
        for (size_t i = 0; copy && i < pool->bins.cap; i++) {
            Bin *bin = pool->bins.slots[i];
            for (Block *b = bin ? bin->top : NULL; b && n < cap; b = b->next) copy[n++] = *b;
        }
        CopyOut c = {copy, n, cap};
        if (copy) seg_each_free(&pool->segs, copy_free_range, &c);
        n = c.n;
    }
    pthread_mutex_unlock(&pool->lock);
    if (cap && !copy) { Py_DECREF(out); return PyErr_NoMemory(); }
    for (size_t i = 0; i < n; i++) {
        PyObject *info = block_info(&copy[i], copy[i].requested);
        if (!info || PyList_Append(out, info) < 0) { Py_XDECREF(info); Py_CLEAR(out); break; }
        Py_DECREF(info);
    }
    free(copy);
    return out;
}

static PyObject *Allocator_live_blocks(Allocator *self, PyObject *args) { return list_blocks(self, args, 1); }
static PyObject *Allocator_cached_blocks(Allocator *self, PyObject *args) { return list_blocks(self, args, 0); }

/* (live table slots, live entries, bin table slots) of one device: the tables' memory, for tests */
static PyObject *Allocator_table_sizes(Allocator *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
    DevicePool *pool = pool_arg(self, device, 0);
    if (!pool) return PyErr_Occurred() ? NULL : Py_BuildValue("(nnn)", 0, 0, 0);
    pthread_mutex_lock(&pool->lock);
    size_t live_cap = pool->live.cap, live_used = pool->live.used, bins_cap = pool->bins.cap;
    pthread_mutex_unlock(&pool->lock);
    return Py_BuildValue("(nnn)", (Py_ssize_t)live_cap, (Py_ssize_t)live_used, (Py_ssize_t)bins_cap);
}

/* Nodes of the whole-free-segment index that the searches for segments to give back have visited on one
 * device (Note [Whole free segments]): the cost of those searches as a count, for tests and benchmarks. */
static PyObject *Allocator_release_scan_visits(Allocator *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
    DevicePool *pool = pool_arg(self, device, 0);
    if (!pool) return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    pthread_mutex_lock(&pool->lock);
    uint64_t visits = pool->segs.whole_visits;
    pthread_mutex_unlock(&pool->lock);
    return PyLong_FromUnsignedLongLong(visits);
}

/* ------------------------------------------------------------------ timeline and debug mode */

/* A new ring of `cap` events (0: off), the old events dropped. */
static int timeline_resize(Allocator *self, Py_ssize_t cap)
{
    if (cap < 0) { PyErr_SetString(PyExc_ValueError, "capacity must be >= 0"); return -1; }
    Event *buf = cap ? calloc((size_t)cap, sizeof(Event)) : NULL;
    if (cap && !buf) {
        PyErr_Format(PyExc_MemoryError, "xpool: a timeline of %zd events needs %zu bytes, which this "
                     "process cannot have", cap, (size_t)cap * sizeof(Event));
        return -1;
    }
    pthread_mutex_lock(&self->tl.lock);
    Event *old = self->tl.buf;
    self->tl.buf = buf; self->tl.cap = (size_t)cap; self->tl.count = 0;
    atomic_store(&self->tl.on, buf != NULL);
    pthread_mutex_unlock(&self->tl.lock);
    free(old);
    return 0;
}

/* timeline_events() -> (bytes of the events in time order, events dropped) */
static PyObject *Allocator_timeline_events(Allocator *self, PyObject *unused)
{
    pthread_mutex_lock(&self->tl.lock);
    size_t cap = self->tl.cap;
    uint64_t count = self->tl.count;
    size_t n = count < cap ? (size_t)count : cap;
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(Event)));
    if (bytes) {
        Event *dst = (Event *)PyBytes_AS_STRING(bytes);
        size_t first = count <= cap ? 0 : (size_t)(count % cap);
        for (size_t i = 0; i < n; i++) dst[i] = self->tl.buf[(first + i) % cap];
    }
    pthread_mutex_unlock(&self->tl.lock);
    if (!bytes) return NULL;
    return Py_BuildValue("(NK)", bytes, (unsigned long long)(count - n));
}

static PyObject *Allocator_set_debug(Allocator *self, PyObject *args)
{
    PyObject *hook;
    Py_ssize_t tail;
    if (!PyArg_ParseTuple(args, "On", &hook, &tail)) return NULL;
    if (tail < 0 || tail > XP_MAX_DEBUG_TAIL) {
        PyErr_Format(PyExc_ValueError, "debug_tail must be in [0, %d]", XP_MAX_DEBUG_TAIL);
        return NULL;
    }
    set_hook(self, hook, (size_t)tail);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the type */

static PyObject *Allocator_get_k(Allocator *self, void *closure) { return PyLong_FromUnsignedLong(self->k); }
static PyObject *Allocator_get_scheme(Allocator *A, void *c) { return PyUnicode_FromString(scheme_names[A->scheme]); }
static PyObject *Allocator_get_settings(Allocator *A, void *c) { return Py_NewRef(A->settings ? A->settings : Py_None); }
static PyObject *Allocator_get_tail(Allocator *self, void *closure)
{
    size_t tail;
    Py_XDECREF(debug_snapshot(self, &tail));
    return PyLong_FromSize_t(tail);
}
static PyObject *Allocator_get_hook(Allocator *self, void *closure)
{
    size_t tail;
    PyObject *hook = debug_snapshot(self, &tail);
    return hook ? hook : Py_NewRef(Py_None);
}

static PyGetSetDef Allocator_getset[] = {
    {"classes_per_doubling", (getter)Allocator_get_k, NULL, "size classes per doubling above 1 MiB (scheme seed)"},
    {"scheme", (getter)Allocator_get_scheme, NULL, "'segments', 'seed' or 'expandable': how blocks are made"},
    {"settings", (getter)Allocator_get_settings, NULL, "the xpool.Settings it was made with"},
    {"debug_tail", (getter)Allocator_get_tail, NULL, "canary bytes added to each request in debug mode"},
    {"debug_hook", (getter)Allocator_get_hook, NULL, "the debug hook, or None"},
    {NULL}
};

static PyMethodDef Allocator_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))Allocator_allocate, METH_VARARGS | METH_KEYWORDS,
     "allocate(nbytes, device=0, stream=0) -> Allocation"},
    {"free_ptr", (PyCFunction)Allocator_free_ptr, METH_VARARGS, "free_ptr(device, ptr): give a block back by address"},
    {"stats", (PyCFunction)Allocator_stats, METH_VARARGS, "stats(device) -> dict of exact counters"},
    {"devices", (PyCFunction)Allocator_devices, METH_NOARGS, "devices that have a pool"},
    {"reset_peaks", (PyCFunction)Allocator_reset_peaks, METH_VARARGS, "reset_peaks(device): peaks to the levels now"},
    {"release", (PyCFunction)(void (*)(void))Allocator_release, METH_VARARGS | METH_KEYWORDS,
     "release(device, stream=None, keep=0) -> bytes given back to the device"},
    {"set_limit", (PyCFunction)Allocator_set_limit, METH_VARARGS, "set_limit(device, limit); 0: none"},
    {"pin_pages", (PyCFunction)Allocator_pin_pages, METH_O,
     "pin_pages(on): while pinned nothing is unmapped (scheme expandable); pins nest"},
    {"vm_range", (PyCFunction)Allocator_vm_range, METH_VARARGS,
     "vm_range(device, ptr) -> (base, nbytes) of the expandable scheme's address range holding ptr, or None"},
    {"live_blocks", (PyCFunction)Allocator_live_blocks, METH_VARARGS, "live_blocks(device) -> [info]"},
    {"cached_blocks", (PyCFunction)Allocator_cached_blocks, METH_VARARGS, "cached_blocks(device) -> [info]"},
    {"table_sizes", (PyCFunction)Allocator_table_sizes, METH_VARARGS,
     "table_sizes(device) -> (live table slots, live blocks, bin table slots)"},
    {"release_scan_visits", (PyCFunction)Allocator_release_scan_visits, METH_VARARGS,
     "release_scan_visits(device) -> nodes the searches for whole free segments to give back have visited"},
    {"timeline_events", (PyCFunction)Allocator_timeline_events, METH_NOARGS,
     "timeline_events() -> (raw event bytes, events dropped)"},
    {"set_debug", (PyCFunction)Allocator_set_debug, METH_VARARGS, "set_debug(hook_or_None, tail_bytes)"},
    {"cfunctions", (PyCFunction)Allocator_cfunctions, METH_NOARGS,
     "(param, malloc, free) for cupy.cuda.memory.CFunctionAllocator"},
    {"forget_after_fork", (PyCFunction)Allocator_forget_after_fork, METH_NOARGS,
     "drop every pool without freeing (for a forked child)"},
    {"bind_torch", (PyCFunction)Allocator_bind_torch, METH_NOARGS,
     "serve PyTorch's xpool_torch_malloc/xpool_torch_free from this allocator (for the life of the process)"},
    {NULL}
};

static PyTypeObject AllocatorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xpool._core.Allocator",
    .tp_basicsize = sizeof(Allocator),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Allocator(backend, error_factory, settings, stream_lookup=0): per-device caching allocator over "
              "a raw backend.",
    .tp_new = Allocator_new,
    .tp_init = (initproc)Allocator_init,
    .tp_dealloc = (destructor)Allocator_dealloc,
    .tp_methods = Allocator_methods,
    .tp_getset = Allocator_getset,
    .tp_weaklistoffset = offsetof(Allocator, weakreflist),
};

/* ------------------------------------------------------------------ CUDA's virtual-memory ops (_vmm_cuda.c)
 * cuda_vmm(): the driver's ops as a capsule named "xpool.vmm" (CupyBackend.vmm()); a failed op raises VmmError
 * (VmmOutOfMemory, a MemoryError too, for XV_OOM) with .status and .done.  The tests' host twin makes capsules of
 * the same ABI (twin/). */

static PyObject *VmmError, *VmmOutOfMemory;
static XvVmm cuda_ops;

static PyObject *py_cuda_vmm(PyObject *mod, PyObject *unused)
{
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = xv_cuda_open(&cuda_ops);
    Py_END_ALLOW_THREADS
    if (st == XV_OK) return PyCapsule_New(&cuda_ops, XV_CAPSULE, NULL);
    PyObject *type = st == XV_OOM ? VmmOutOfMemory : VmmError;
    PyObject *exc = PyObject_CallFunction(type, "s", *xv_message() ? xv_message() : "virtual memory op failed");
    PyObject *code = exc ? PyLong_FromLong(st) : NULL;
    if (code && PyObject_SetAttrString(exc, "status", code) == 0 && PyObject_SetAttrString(exc, "done", py_zero) == 0)
        PyErr_SetObject(type, exc);
    Py_XDECREF(code);
    Py_XDECREF(exc);
    return NULL;
}

/* The exceptions and status codes of the ops, on the module; -1 with an exception. */
static int add_vmm(PyObject *m)
{
    VmmError = PyErr_NewExceptionWithDoc("xpool._core.VmmError", "A virtual-memory op failed (.status, .done).",
                                         PyExc_RuntimeError, NULL);
    PyObject *bases = VmmError ? PyTuple_Pack(2, VmmError, PyExc_MemoryError) : NULL;
    VmmOutOfMemory = bases ? PyErr_NewExceptionWithDoc("xpool._core.VmmOutOfMemory", "No physical memory (or address "
                                                       "space) for a map or reserve.", bases, NULL) : NULL;
    Py_XDECREF(bases);
    if (!VmmOutOfMemory || PyModule_AddObjectRef(m, "VmmError", VmmError) < 0 ||
        PyModule_AddObjectRef(m, "VmmOutOfMemory", VmmOutOfMemory) < 0) return -1;
    const char *names[] = {"OK", "OOM", "INVALID", "UNAVAILABLE", "ERROR"};
    for (int i = 0; i <= XV_ERROR; i++)
        if (PyModule_AddIntConstant(m, names[i], i) < 0) return -1;
    return PyModule_AddStringConstant(m, "CAPSULE", XV_CAPSULE) < 0 || PyModule_AddIntConstant(m, "ABI", XV_ABI) < 0
           ? -1 : 0;
}

/* ------------------------------------------------------------------ module */

static PyObject *py_size_class(PyObject *mod, PyObject *args)
{
    unsigned long long n;
    int k = 1;
    if (!PyArg_ParseTuple(args, "K|i", &n, &k)) return NULL;
    if (k < 1 || k > XP_MAX_CLASSES_PER_DOUBLING) {
        PyErr_Format(PyExc_ValueError, "classes_per_doubling must be in [1, %d], got %d",
                     XP_MAX_CLASSES_PER_DOUBLING, k);
        return NULL;
    }
    if (n > XP_MAX_REQUEST) {
        xp_refuse_request(n);
        return NULL;
    }
    return PyLong_FromSize_t(xp_size_class((size_t)n, (unsigned)k));
}

static PyMethodDef module_methods[] = {
    {"size_class", py_size_class, METH_VARARGS, "size_class(nbytes, k=1): the C twin of xpool.size_class"},
    {"torch_bound", py_torch_bound, METH_NOARGS, "the Allocator PyTorch's hooks serve from, or None"},
    {"cuda_vmm", py_cuda_vmm, METH_NOARGS,
     "The CUDA driver's ops as an 'xpool.vmm' capsule; VmmError (status UNAVAILABLE) without a usable driver."},
    {NULL}
};

static struct PyModuleDef core_module_def = {
    PyModuleDef_HEAD_INIT, "xpool._core", "The C core of xpool's caching allocator.", -1,
    module_methods
};

PyMODINIT_FUNC PyInit__core(void)
{
    if (PyType_Ready(&AllocatorType) < 0 || PyType_Ready(&AllocationType) < 0) return NULL;
    if (xp_pool_module_init() < 0 || xp_ladder_module_init() < 0) return NULL;
    py_zero = PyLong_FromLong(0);
    if (!py_zero) return NULL;
    PyObject *m = PyModule_Create(&core_module_def);
    if (!m) return NULL;
#ifdef Py_GIL_DISABLED
    /* The debug hook's state, the hook and backend references and the fork bookkeeping rely on
     * the GIL (see Concurrency in _core.h): a free-threaded interpreter keeps it on for us. */
    if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED) < 0) { Py_DECREF(m); return NULL; }
#endif
    if (add_vmm(m) < 0 || PyModule_AddObjectRef(m, "Allocator", (PyObject *)&AllocatorType) < 0 ||
        PyModule_AddObjectRef(m, "Allocation", (PyObject *)&AllocationType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DEVICES", XP_MAX_DEVICES) < 0 ||
        PyModule_AddIntConstant(m, "EVENT_SIZE", sizeof(Event)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_CLASSES_PER_DOUBLING", XP_MAX_CLASSES_PER_DOUBLING) < 0 ||
        PyModule_AddObject(m, "MAX_REQUEST", PyLong_FromSize_t(XP_MAX_REQUEST)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    core_module = Py_NewRef(m);   /* for the life of the process, as a single-phase module's own state */
    return m;
}
