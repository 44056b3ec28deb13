/*
 * xlab._probes: the lab's timing probes, in C so a loop adds nothing of Python's to what it times.
 * Lab-only: xpool ships none of this.  Allocators come in as C function addresses (xpool.testing.cfunctions()
 * for a pool, noop_cfunctions() here for the floor), so the probes know no allocator.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "_vmm.h"   /* xpool's ops table (xpool/_vmm.h): the null ops below are one */

#define MAX_DEVICES 64   /* xpool's: a device id beyond it is an error there too */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A C allocator that does nothing: hands out the one pointer it was given.
 * Through CFunctionAllocator it measures the floor of CuPy's C-callback path. */
static void *noop_malloc(void *param, size_t size, int device) { return param; }
static void noop_free(void *param, void *ptr, int device) { }

static PyObject *py_noop_cfunctions(PyObject *mod, PyObject *args)
{
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr)) return NULL;
    return Py_BuildValue("(KKK)", ptr, (unsigned long long)(uintptr_t)&noop_malloc,
                         (unsigned long long)(uintptr_t)&noop_free);
}

/* The arguments both pair timers take: function addresses, and counts >= 0.  -1 with a ValueError. */
static int check_pairs(unsigned long long malloc_fn, unsigned long long free_fn, Py_ssize_t nbytes,
                       Py_ssize_t pairs)
{
    if (nbytes < 0 || pairs < 0) {
        PyErr_Format(PyExc_ValueError, "nbytes and pairs must be >= 0, got nbytes=%zd, pairs=%zd", nbytes,
                     pairs);
        return -1;
    }
    if (!malloc_fn || !free_fn) {
        PyErr_SetString(PyExc_ValueError, "malloc and free must be function addresses, got 0");
        return -1;
    }
    return 0;
}

/* time_pairs(param, malloc, free, nbytes, pairs, device=0) -> ns: `pairs` malloc+free pairs through a C
 * allocator's two functions (xpool.testing.cfunctions(pool), noop_cfunctions()), timed in C.  The C
 * allocator's own cost, without CuPy's objects or a Python loop around it: xlab.bench.alloc --host measures
 * the hit path with it on a CPU (over host memory), where CuPy's arrays cannot be made. */
static PyObject *py_time_pairs(PyObject *mod, PyObject *args)
{
    unsigned long long param, malloc_fn, free_fn;
    Py_ssize_t nbytes, pairs;
    int device = 0;
    if (!PyArg_ParseTuple(args, "KKKnn|i", &param, &malloc_fn, &free_fn, &nbytes, &pairs, &device))
        return NULL;
    if (check_pairs(malloc_fn, free_fn, nbytes, pairs) < 0) return NULL;
    void *(*m)(void *, size_t, int) = (void *(*)(void *, size_t, int))(uintptr_t)malloc_fn;
    void (*f)(void *, void *, int) = (void (*)(void *, void *, int))(uintptr_t)free_fn;
    void *p = (void *)(uintptr_t)param;
    int64_t t0 = now_ns();
    for (Py_ssize_t i = 0; i < pairs; i++) {
        void *ptr = m(p, (size_t)nbytes, device);
        if (ptr == (void *)(intptr_t)-1) return NULL;   /* the allocator's exception is set */
        f(p, ptr, device);
    }
    return PyLong_FromLongLong(now_ns() - t0);
}

/* time_torch_pairs(malloc, free, nbytes, pairs, device=0, stream=0) -> ns: `pairs` malloc+free pairs through
 * PyTorch's pluggable-allocator signature (`void *malloc(ssize_t size, int device, void *stream)`, `void
 * free(void *ptr, ssize_t size, int device, void *stream)`: xpool_torch_malloc / xpool_torch_free), timed in C
 * with the GIL released, as PyTorch calls them.  0 when a malloc returned NULL (no pair is timed past it). */
static PyObject *py_time_torch_pairs(PyObject *mod, PyObject *args)
{
    unsigned long long malloc_fn, free_fn, stream = 0;
    Py_ssize_t nbytes, pairs;
    int device = 0;
    if (!PyArg_ParseTuple(args, "KKnn|iK", &malloc_fn, &free_fn, &nbytes, &pairs, &device, &stream)) return NULL;
    if (check_pairs(malloc_fn, free_fn, nbytes, pairs) < 0) return NULL;
    void *(*m)(Py_ssize_t, int, void *) = (void *(*)(Py_ssize_t, int, void *))(uintptr_t)malloc_fn;
    void (*f)(void *, Py_ssize_t, int, void *) = (void (*)(void *, Py_ssize_t, int, void *))(uintptr_t)free_fn;
    void *s = (void *)(uintptr_t)stream;
    int64_t ns = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t t0 = now_ns();
    Py_ssize_t i = 0;
    for (; i < pairs; i++) {
        void *ptr = m(nbytes, device, s);
        if (!ptr) break;
        f(ptr, nbytes, device, s);
    }
    ns = i == pairs ? now_ns() - t0 : 0;
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(ns);
}

/* time_calls(fn, calls, device=None) -> ns: `calls` calls of a stream lookup, timed in C: `intptr_t fn(int
 * device)` (what xpool's CuPy hook calls, CuPy's get_stream_ptr) or, with device None, `intptr_t fn(void)`
 * (CuPy's get_current_stream_ptr, which CuPy's own pool calls).  What one lookup costs, without the pair
 * around it (xlab.bench.hit). */
static PyObject *py_time_calls(PyObject *mod, PyObject *args)
{
    unsigned long long fn;
    Py_ssize_t calls;
    PyObject *device_obj = Py_None;
    if (!PyArg_ParseTuple(args, "Kn|O", &fn, &calls, &device_obj)) return NULL;
    if (!fn) {
        PyErr_SetString(PyExc_ValueError, "fn must be a function address, got 0");
        return NULL;
    }
    if (calls < 0) {
        PyErr_Format(PyExc_ValueError, "calls must be >= 0, got %zd", calls);
        return NULL;
    }
    int device = -1;
    if (device_obj != Py_None) {
        long d = PyLong_AsLong(device_obj);
        if (d == -1 && PyErr_Occurred()) return NULL;
        if (d < 0 || d >= MAX_DEVICES) {
            PyErr_Format(PyExc_ValueError, "device must be in [0, %d) or None, got %ld", MAX_DEVICES, d);
            return NULL;
        }
        device = (int)d;
    }
    volatile intptr_t sink = 0;
    int64_t t0 = now_ns();
    if (device >= 0) {
        intptr_t (*f)(int) = (intptr_t (*)(int))(uintptr_t)fn;
        for (Py_ssize_t i = 0; i < calls; i++) sink = f(device);
    } else {
        intptr_t (*f)(void) = (intptr_t (*)(void))(uintptr_t)fn;
        for (Py_ssize_t i = 0; i < calls; i++) sink = f();
    }
    int64_t ns = now_ns() - t0;
    (void)sink;
    if (PyErr_Occurred()) return NULL;   /* the lookup failed (no CUDA driver, say) */
    return PyLong_FromLongLong(ns);
}

/* ------------------------------------------------------------------ null virtual-memory ops
 *
 * An ops table of xpool/_vmm.h that touches nothing: reserve hands out addresses from a counter, map and unmap
 * succeed at once, nothing captures.  What a benchmark of the expandable scheme then times is xpool's own work (its
 * plans, its bookkeeping) alone, with no host memory and none of the twin's O(pages) bookkeeping under it. */
typedef struct {
    size_t page;
    _Atomic uintptr_t next;
} NullVmm;

static const char *null_message(void *ctx) { (void)ctx; return ""; }
static int null_granularity(void *ctx, int device, size_t *bytes) { *bytes = ((NullVmm *)ctx)->page; return XV_OK; }
static int null_reserve(void *ctx, int device, size_t bytes, size_t align, uintptr_t *addr)
{
    NullVmm *v = ctx;
    size_t a = align ? align : v->page;
    uintptr_t at = atomic_fetch_add(&v->next, (bytes + a - 1) / a * a + a);
    *addr = (at + a - 1) / a * a;
    return XV_OK;
}
static int null_release(void *ctx, int device, uintptr_t addr, size_t bytes) { return XV_OK; }
static int null_map(void *ctx, int device, uintptr_t addr, size_t bytes, size_t page, uint64_t peers) { return XV_OK; }
static int null_unmap(void *ctx, int device, uintptr_t addr, size_t bytes, size_t page, size_t *done)
{
    *done = bytes;
    return XV_OK;
}
static int null_capturing(void *ctx, int device, intptr_t stream) { return 0; }
static int null_peers(void *ctx, int device, uint64_t *mask) { *mask = 0; return XV_OK; }

static const XvOps null_ops = {XV_ABI, "null", null_granularity, null_reserve, null_release, null_map, null_unmap,
                               null_capturing, null_message, null_peers};

static void null_vmm_free(PyObject *capsule)
{
    XvVmm *v = PyCapsule_GetPointer(capsule, XV_CAPSULE);
    if (v) { free(v->ctx); free(v); }
}

static PyObject *py_null_vmm(PyObject *mod, PyObject *args)
{
    Py_ssize_t page = 1 << 16;
    if (!PyArg_ParseTuple(args, "|n", &page)) return NULL;
    if (page < 512 || (page & (page - 1))) {
        PyErr_Format(PyExc_ValueError, "page must be a power of two of at least 512 B, got %zd", page);
        return NULL;
    }
    XvVmm *v = malloc(sizeof *v);
    NullVmm *ctx = malloc(sizeof *ctx);
    if (!v || !ctx) { free(v); free(ctx); return PyErr_NoMemory(); }
    ctx->page = (size_t)page;
    atomic_init(&ctx->next, (uintptr_t)1 << 40);   /* far from any host address: nothing is ever stored there */
    v->ops = &null_ops;
    v->ctx = ctx;
    PyObject *cap = PyCapsule_New(v, XV_CAPSULE, null_vmm_free);
    if (!cap) { free(ctx); free(v); }
    return cap;
}

static PyMethodDef module_methods[] = {
    {"null_vmm", py_null_vmm, METH_VARARGS,
     "null_vmm(page=65536) -> an 'xpool.vmm' capsule of ops that touch nothing (benchmarks of xpool's own work)"},
    {"time_pairs", py_time_pairs, METH_VARARGS,
     "time_pairs(param, malloc, free, nbytes, pairs, device=0) -> ns: malloc+free pairs timed in C"},
    {"time_calls", py_time_calls, METH_VARARGS,
     "time_calls(fn, calls, device=None) -> ns: calls of intptr_t fn(int device) (or fn(void)) timed in C"},
    {"time_torch_pairs", py_time_torch_pairs, METH_VARARGS,
     "time_torch_pairs(malloc, free, nbytes, pairs, device=0, stream=0) -> ns: PyTorch-signature pairs, "
     "without the GIL"},
    {"noop_cfunctions", py_noop_cfunctions, METH_VARARGS,
     "noop_cfunctions(ptr) -> (param, malloc, free): a do-nothing C allocator, the floor for benchmarks"},
    {NULL}
};

static struct PyModuleDef probes_module = {
    PyModuleDef_HEAD_INIT, "xlab._probes", "The lab's timing probes, in C.", -1, module_methods
};

PyMODINIT_FUNC PyInit__probes(void)
{
    return PyModule_Create(&probes_module);
}
