/*
 * xpool._vmm: the Python face of the virtual-memory ops (_vmm.h).
 *
 *   cuda_vmm()  the CUDA ops as a PyCapsule named "xpool.vmm" (CupyBackend.vmm())
 *   HostTwin    host memory standing in for device memory: .vmm() gives its capsule (HostBackend.vmm()), the
 *               rest is bookkeeping to check a pool against and faults to inject
 *   Ops         any capsule's ops called from Python (tests, the GPU smoke check)
 *   address()   the XvVmm a capsule holds, as an int, for a C harness driven through ctypes
 *
 * The core takes the XvVmm from the capsule and calls its ops from C; the capsule keeps its owner alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_vmm.h"

static PyObject *VmmError, *VmmOutOfMemory;

/* Raises for a failed op: VmmOutOfMemory (a MemoryError) for XV_OOM, else VmmError; .status and .done set. */
static PyObject *raise_status(int status, const char *message, size_t done)
{
    PyObject *type = status == XV_OOM ? VmmOutOfMemory : VmmError;
    PyObject *exc = PyObject_CallFunction(type, "s", message && *message ? message : "virtual memory op failed");
    if (!exc) return NULL;
    PyObject *st = PyLong_FromLong(status), *dn = PyLong_FromSize_t(done);
    if (st && dn && PyObject_SetAttrString(exc, "status", st) == 0 && PyObject_SetAttrString(exc, "done", dn) == 0)
        PyErr_SetObject(type, exc);
    Py_XDECREF(st);
    Py_XDECREF(dn);
    Py_DECREF(exc);
    return NULL;
}

static void capsule_release(PyObject *capsule)
{
    Py_XDECREF((PyObject *)PyCapsule_GetContext(capsule));
}

/* A capsule over vmm that keeps owner (may be NULL) alive. */
static PyObject *make_capsule(XvVmm *vmm, PyObject *owner)
{
    PyObject *cap = PyCapsule_New(vmm, XV_CAPSULE, capsule_release);
    if (!cap) return NULL;
    Py_XINCREF(owner);
    if (PyCapsule_SetContext(cap, owner) < 0) { Py_XDECREF(owner); Py_DECREF(cap); return NULL; }
    return cap;
}

static XvVmm cuda_vmm;

static PyObject *py_cuda_vmm(PyObject *mod, PyObject *unused)
{
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = xv_cuda_open(&cuda_vmm);
    Py_END_ALLOW_THREADS
    if (st != XV_OK) return raise_status(st, xv_message(), 0);
    return make_capsule(&cuda_vmm, NULL);
}

static XvVmm *vmm_of(PyObject *capsule)
{
    if (!PyCapsule_IsValid(capsule, XV_CAPSULE)) {
        PyErr_Format(PyExc_TypeError, "expected an '" XV_CAPSULE "' capsule (a backend's vmm()), got %R", capsule);
        return NULL;
    }
    XvVmm *v = PyCapsule_GetPointer(capsule, XV_CAPSULE);
    if (v && v->ops->abi != XV_ABI) {
        PyErr_Format(PyExc_ValueError, "xpool.vmm capsule of ABI %u, expected %u", v->ops->abi, XV_ABI);
        return NULL;
    }
    return v;
}

static PyObject *py_address(PyObject *mod, PyObject *capsule)
{
    XvVmm *v = vmm_of(capsule);
    return v ? PyLong_FromVoidPtr(v) : NULL;
}

/* ------------------------------------------------------------------ HostTwin */

typedef struct {
    PyObject_HEAD
    XvHost *h;
    XvVmm vmm;
} HostTwin;

/* a device-indexed setting: None, an int for every device, or one per device */
static int per_device(PyObject *o, int n, const char *name, uint64_t none, uint64_t *out)
{
    if (o == Py_None) { for (int d = 0; d < n; d++) out[d] = none; return 0; }
    if (PyLong_Check(o)) {
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (PyErr_Occurred()) { PyErr_Format(PyExc_ValueError, "%s must be an int >= 0 or None", name); return -1; }
        for (int d = 0; d < n; d++) out[d] = v;
        return 0;
    }
    PyObject *seq = PySequence_Fast(o, "");
    if (!seq) { PyErr_Format(PyExc_TypeError, "%s must be an int, a sequence of ints or None", name); return -1; }
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values for %d devices", name, PySequence_Fast_GET_SIZE(seq), n);
        Py_DECREF(seq);
        return -1;
    }
    for (int d = 0; d < n; d++) {
        PyObject *x = PySequence_Fast_GET_ITEM(seq, d);
        out[d] = x == Py_None ? none : PyLong_AsUnsignedLongLong(x);
        if (PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "%s[%d] must be an int >= 0 or None", name, d);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static int HostTwin_init(HostTwin *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"n_devices", "capacity", "granularity", NULL};
    int n = 8;
    PyObject *capacity = Py_None, *granularity = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|iOO", kwlist, &n, &capacity, &granularity)) return -1;
    if (self->h) { PyErr_SetString(PyExc_RuntimeError, "HostTwin is initialised already"); return -1; }
    if (n < 1 || n > 64) { PyErr_Format(PyExc_ValueError, "n_devices must be in [1, 64], got %d", n); return -1; }
    uint64_t cap[64], gran[64];
    if (per_device(capacity, n, "capacity", UINT64_MAX, cap) < 0) return -1;
    if (granularity && per_device(granularity, n, "granularity", 1 << 16, gran) < 0) return -1;
    if (!granularity) for (int d = 0; d < n; d++) gran[d] = 1 << 16;
    XvHost *h = xv_host_new(n, (size_t)gran[0]);
    if (!h) {
        PyErr_Format(PyExc_ValueError, "granularity must be a power of two and a multiple of the host page, "
                     "got %llu", (unsigned long long)gran[0]);
        return -1;
    }
    for (int d = 0; d < n; d++) {
        if (xv_host_set_granularity(h, d, (size_t)gran[d]) != XV_OK) {
            PyErr_Format(PyExc_ValueError, "granularity[%d]: %s", d, xv_message());
            xv_host_free(h);
            return -1;
        }
        xv_host_set_capacity(h, d, cap[d]);
    }
    self->h = h;
    self->vmm = xv_host_vmm(h);
    return 0;
}

static void HostTwin_dealloc(HostTwin *self)
{
    xv_host_free(self->h);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int twin_ready(HostTwin *self)
{
    if (self->h) return 0;
    PyErr_SetString(PyExc_RuntimeError, "HostTwin.__init__ was not called");
    return -1;
}

static int device_arg(HostTwin *self, int device)
{
    if (twin_ready(self) < 0) return -1;
    if (device >= 0 && device < xv_host_devices(self->h)) return 0;
    PyErr_Format(PyExc_ValueError, "device must be in [0, %d), got %d", xv_host_devices(self->h), device);
    return -1;
}

static PyObject *HostTwin_vmm(HostTwin *self, PyObject *unused)
{
    if (twin_ready(self) < 0) return NULL;
    return make_capsule(&self->vmm, (PyObject *)self);
}

static PyObject *HostTwin_set_capacity(HostTwin *self, PyObject *args)
{
    int device;
    PyObject *o;
    if (!PyArg_ParseTuple(args, "iO", &device, &o) || device_arg(self, device) < 0) return NULL;
    uint64_t bytes = UINT64_MAX;
    if (o != Py_None) {
        bytes = PyLong_AsUnsignedLongLong(o);
        if (PyErr_Occurred()) { PyErr_SetString(PyExc_ValueError, "capacity must be an int >= 0 or None"); return NULL; }
    }
    xv_host_set_capacity(self->h, device, bytes);
    Py_RETURN_NONE;
}

static PyObject *HostTwin_capacity(HostTwin *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device) || device_arg(self, device) < 0) return NULL;
    uint64_t c = xv_host_capacity(self->h, device);
    if (c == UINT64_MAX) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(c);
}

static PyObject *HostTwin_granularity(HostTwin *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device) || device_arg(self, device) < 0) return NULL;
    size_t g = 0;
    self->vmm.ops->granularity(self->vmm.ctx, device, &g);
    return PyLong_FromSize_t(g);
}

static PyObject *HostTwin_mapped_bytes(HostTwin *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device) || device_arg(self, device) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(xv_host_mapped(self->h, device));
}

static PyObject *HostTwin_set_capturing(HostTwin *self, PyObject *args)
{
    int device, on;
    if (!PyArg_ParseTuple(args, "ip", &device, &on) || device_arg(self, device) < 0) return NULL;
    xv_host_set_capturing(self->h, device, on);
    Py_RETURN_NONE;
}

static PyObject *HostTwin_set_peers(HostTwin *self, PyObject *args)
{
    int device;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "iK", &device, &mask) || device_arg(self, device) < 0) return NULL;
    if (xv_host_set_peers(self->h, device, mask) != XV_OK) {
        PyErr_Format(PyExc_ValueError, "%s", xv_message());
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *HostTwin_fail_maps(HostTwin *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"count", "kind", "after_pages", "skip", NULL};
    int count = 1, skip = 0;
    const char *kind = "oom";
    Py_ssize_t after = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|isni", kwlist, &count, &kind, &after, &skip) ||
        twin_ready(self) < 0)
        return NULL;
    int oom = !strcmp(kind, "oom");
    if ((!oom && strcmp(kind, "error")) || count < 0 || after < 0 || skip < 0) {
        PyErr_Format(PyExc_ValueError, "fail_maps: kind must be 'oom' or 'error', count, after_pages and skip "
                     ">= 0; got kind=%s", kind);
        return NULL;
    }
    xv_host_fail_maps(self->h, count, oom ? XV_OOM : XV_ERROR, (size_t)after, skip);
    Py_RETURN_NONE;
}

static PyObject *HostTwin_fail_unmaps(HostTwin *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"count", "after_pages", NULL};
    int count = 1;
    Py_ssize_t after = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|in", kwlist, &count, &after) || twin_ready(self) < 0) return NULL;
    if (count < 0 || after < 0) {
        PyErr_SetString(PyExc_ValueError, "fail_unmaps: count and after_pages must be >= 0");
        return NULL;
    }
    xv_host_fail_unmaps(self->h, count, (size_t)after);
    Py_RETURN_NONE;
}

static PyObject *HostTwin_fail_reserves(HostTwin *self, PyObject *args)
{
    int count = 1;
    if (!PyArg_ParseTuple(args, "|i", &count) || twin_ready(self) < 0) return NULL;
    if (count < 0) { PyErr_SetString(PyExc_ValueError, "fail_reserves: count must be >= 0"); return NULL; }
    xv_host_fail_reserves(self->h, count);
    Py_RETURN_NONE;
}

static PyObject *HostTwin_counters(HostTwin *self, PyObject *unused)
{
    if (twin_ready(self) < 0) return NULL;
    XvHostCounters c = xv_host_counters(self->h);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
                         "reserves", (unsigned long long)c.reserves, "releases", (unsigned long long)c.releases,
                         "maps", (unsigned long long)c.maps, "unmaps", (unsigned long long)c.unmaps,
                         "map_pages", (unsigned long long)c.map_pages, "unmap_pages", (unsigned long long)c.unmap_pages,
                         "map_failures", (unsigned long long)c.map_failures,
                         "unmap_failures", (unsigned long long)c.unmap_failures,
                         "reserve_failures", (unsigned long long)c.reserve_failures,
                         "unmaps_while_capturing", (unsigned long long)c.unmaps_while_capturing);
}

static int add_page(int device, uintptr_t addr, size_t bytes, uint64_t peers, void *arg)
{
    PyObject *t = Py_BuildValue("(iKnK)", device, (unsigned long long)addr, (Py_ssize_t)bytes, (unsigned long long)peers);
    if (!t) return -1;
    int r = PyList_Append(arg, t);
    Py_DECREF(t);
    return r;
}

static int add_range(int device, uintptr_t addr, size_t bytes, void *arg)
{
    PyObject *t = Py_BuildValue("(iKn)", device, (unsigned long long)addr, (Py_ssize_t)bytes);
    if (!t) return -1;
    int r = PyList_Append(arg, t);
    Py_DECREF(t);
    return r;
}

static PyObject *HostTwin_pages(HostTwin *self, PyObject *unused)
{
    if (twin_ready(self) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out && xv_host_each_page(self->h, add_page, out) != 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        Py_CLEAR(out);
    }
    return out;
}

static PyObject *HostTwin_ranges(HostTwin *self, PyObject *unused)
{
    if (twin_ready(self) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out && xv_host_each_range(self->h, add_range, out) != 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        Py_CLEAR(out);
    }
    return out;
}

static PyObject *HostTwin_is_mapped(HostTwin *self, PyObject *arg)
{
    if (twin_ready(self) < 0) return NULL;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(xv_host_is_mapped(self->h, (uintptr_t)addr, NULL));
}

static PyObject *HostTwin_get_n_devices(HostTwin *self, void *closure)
{
    if (twin_ready(self) < 0) return NULL;
    return PyLong_FromLong(xv_host_devices(self->h));
}

static PyMethodDef HostTwin_methods[] = {
    {"vmm", (PyCFunction)HostTwin_vmm, METH_NOARGS, "Its ops as a PyCapsule named 'xpool.vmm' (keeps the twin alive)."},
    {"set_capacity", (PyCFunction)HostTwin_set_capacity, METH_VARARGS, "set_capacity(device, nbytes or None)"},
    {"capacity", (PyCFunction)HostTwin_capacity, METH_VARARGS, "capacity(device) -> bytes, or None: unbounded"},
    {"granularity", (PyCFunction)HostTwin_granularity, METH_VARARGS, "granularity(device) -> bytes"},
    {"mapped_bytes", (PyCFunction)HostTwin_mapped_bytes, METH_VARARGS, "mapped_bytes(device) -> bytes mapped now"},
    {"set_capturing", (PyCFunction)HostTwin_set_capturing, METH_VARARGS,
     "set_capturing(device, on): every stream of the device captures (ops.capturing says so; unmaps are counted)"},
    {"set_peers", (PyCFunction)HostTwin_set_peers, METH_VARARGS,
     "set_peers(device, mask): the devices (a bit each) that can access the device's pages (default: every other)"},
    {"fail_maps", (PyCFunction)HostTwin_fail_maps, METH_VARARGS | METH_KEYWORDS,
     "fail_maps(count=1, kind='oom'|'error', after_pages=0, skip=0): after `skip` maps, the next `count` fail "
     "after making `after_pages` pages (undone)"},
    {"fail_unmaps", (PyCFunction)HostTwin_fail_unmaps, METH_VARARGS | METH_KEYWORDS,
     "fail_unmaps(count=1, after_pages=0): the next unmaps fail after unmapping that many pages"},
    {"fail_reserves", (PyCFunction)HostTwin_fail_reserves, METH_VARARGS, "fail_reserves(count=1)"},
    {"counters", (PyCFunction)HostTwin_counters, METH_NOARGS, "Calls made: reserves, maps, unmaps, pages, failures."},
    {"pages", (PyCFunction)HostTwin_pages, METH_NOARGS, "Every mapped page: [(device, addr, nbytes, peers)] by address."},
    {"ranges", (PyCFunction)HostTwin_ranges, METH_NOARGS, "Every reserved range: [(device, addr, nbytes)] by address."},
    {"is_mapped", (PyCFunction)HostTwin_is_mapped, METH_O, "is_mapped(addr) -> bool"},
    {NULL}
};

static PyGetSetDef HostTwin_getset[] = {
    {"n_devices", (getter)HostTwin_get_n_devices, NULL, "devices it pretends to have", NULL},
    {NULL}
};

static PyTypeObject HostTwinType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xpool._vmm.HostTwin",
    .tp_basicsize = sizeof(HostTwin),
    .tp_dealloc = (destructor)HostTwin_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HostTwin(n_devices=8, capacity=None, granularity=65536): address ranges and pages on host memory.\n\n"
              "capacity: bytes per device (an int for all, one per device, None: unbounded); past it a map fails\n"
              "with out of memory.  granularity: the page of each device (a power of two, a multiple of the host page).\n"
              "A reserved range is PROT_NONE host memory; a map puts fresh read/write pages over it, an unmap drops\n"
              "them again, so a touch of an unmapped page faults as on a GPU.",
    .tp_methods = HostTwin_methods,
    .tp_getset = HostTwin_getset,
    .tp_init = (initproc)HostTwin_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ Ops */

typedef struct {
    PyObject_HEAD
    PyObject *capsule;
    XvVmm *vmm;
} Ops;

static int Ops_init(Ops *self, PyObject *args, PyObject *kwds)
{
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule)) return -1;
    XvVmm *v = vmm_of(capsule);
    if (!v) return -1;
    Py_XSETREF(self->capsule, Py_NewRef(capsule));
    self->vmm = v;
    return 0;
}

static void Ops_dealloc(Ops *self)
{
    Py_XDECREF(self->capsule);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ops_ready(Ops *self)
{
    if (self->vmm) return 0;
    PyErr_SetString(PyExc_RuntimeError, "Ops.__init__ was not called");
    return -1;
}

/* page 0: the device's granularity */
static int page_arg(Ops *self, int device, Py_ssize_t *page)
{
    if (*page < 0) { PyErr_SetString(PyExc_ValueError, "page must be >= 0"); return -1; }
    if (*page) return 0;
    size_t g = 0;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = self->vmm->ops->granularity(self->vmm->ctx, device, &g);
    Py_END_ALLOW_THREADS
    if (st != XV_OK) { raise_status(st, self->vmm->ops->message(self->vmm->ctx), 0); return -1; }
    *page = (Py_ssize_t)g;
    return 0;
}

static PyObject *Ops_granularity(Ops *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device) || ops_ready(self) < 0) return NULL;
    Py_ssize_t page = 0;
    if (page_arg(self, device, &page) < 0) return NULL;
    return PyLong_FromSsize_t(page);
}

static PyObject *Ops_reserve(Ops *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "nbytes", "align", NULL};
    int device;
    Py_ssize_t nbytes, align = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in|n", kwlist, &device, &nbytes, &align) || ops_ready(self) < 0)
        return NULL;
    if (nbytes <= 0) { PyErr_SetString(PyExc_ValueError, "nbytes must be > 0"); return NULL; }
    if (page_arg(self, device, &align) < 0) return NULL;
    uintptr_t addr = 0;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = self->vmm->ops->reserve(self->vmm->ctx, device, (size_t)nbytes, (size_t)align, &addr);
    Py_END_ALLOW_THREADS
    if (st != XV_OK) return raise_status(st, self->vmm->ops->message(self->vmm->ctx), 0);
    return PyLong_FromUnsignedLongLong(addr);
}

static PyObject *Ops_release(Ops *self, PyObject *args)
{
    int device;
    unsigned long long addr;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "iKn", &device, &addr, &nbytes) || ops_ready(self) < 0) return NULL;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = self->vmm->ops->release(self->vmm->ctx, device, (uintptr_t)addr, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    if (st != XV_OK) return raise_status(st, self->vmm->ops->message(self->vmm->ctx), 0);
    Py_RETURN_NONE;
}

static PyObject *Ops_map(Ops *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "addr", "nbytes", "page", "peers", NULL};
    int device;
    unsigned long long addr, peers = 0;
    Py_ssize_t nbytes, page = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iKn|nK", kwlist, &device, &addr, &nbytes, &page, &peers) ||
        ops_ready(self) < 0 || page_arg(self, device, &page) < 0)
        return NULL;
    if (nbytes < 0) { PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0"); return NULL; }
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = self->vmm->ops->map(self->vmm->ctx, device, (uintptr_t)addr, (size_t)nbytes, (size_t)page, peers);
    Py_END_ALLOW_THREADS
    if (st != XV_OK) return raise_status(st, self->vmm->ops->message(self->vmm->ctx), 0);
    Py_RETURN_NONE;
}

static PyObject *Ops_unmap(Ops *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "addr", "nbytes", "page", NULL};
    int device;
    unsigned long long addr;
    Py_ssize_t nbytes, page = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iKn|n", kwlist, &device, &addr, &nbytes, &page) ||
        ops_ready(self) < 0 || page_arg(self, device, &page) < 0)
        return NULL;
    if (nbytes < 0) { PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0"); return NULL; }
    size_t done = 0;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = self->vmm->ops->unmap(self->vmm->ctx, device, (uintptr_t)addr, (size_t)nbytes, (size_t)page, &done);
    Py_END_ALLOW_THREADS
    if (st != XV_OK) return raise_status(st, self->vmm->ops->message(self->vmm->ctx), done);
    return PyLong_FromSize_t(done);
}

static PyObject *Ops_capturing(Ops *self, PyObject *args)
{
    int device;
    Py_ssize_t stream;
    if (!PyArg_ParseTuple(args, "in", &device, &stream) || ops_ready(self) < 0) return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = self->vmm->ops->capturing(self->vmm->ctx, device, (intptr_t)stream);
    Py_END_ALLOW_THREADS
    if (r < 0) return raise_status(-r, self->vmm->ops->message(self->vmm->ctx), 0);
    return PyBool_FromLong(r);
}

static PyObject *Ops_peers(Ops *self, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i", &device) || ops_ready(self) < 0) return NULL;
    uint64_t mask = 0;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = self->vmm->ops->peers(self->vmm->ctx, device, &mask);
    Py_END_ALLOW_THREADS
    if (st != XV_OK) return raise_status(st, self->vmm->ops->message(self->vmm->ctx), 0);
    return PyLong_FromUnsignedLongLong(mask);
}

static PyObject *Ops_get_name(Ops *self, void *closure)
{
    if (ops_ready(self) < 0) return NULL;
    return PyUnicode_FromString(self->vmm->ops->name);
}

static PyMethodDef Ops_methods[] = {
    {"granularity", (PyCFunction)Ops_granularity, METH_VARARGS, "granularity(device) -> bytes"},
    {"reserve", (PyCFunction)Ops_reserve, METH_VARARGS | METH_KEYWORDS,
     "reserve(device, nbytes, align=0) -> addr (align 0: the granularity)"},
    {"release", (PyCFunction)Ops_release, METH_VARARGS, "release(device, addr, nbytes)"},
    {"map", (PyCFunction)Ops_map, METH_VARARGS | METH_KEYWORDS,
     "map(device, addr, nbytes, page=0, peers=0): all or nothing (page 0: the granularity)"},
    {"unmap", (PyCFunction)Ops_unmap, METH_VARARGS | METH_KEYWORDS,
     "unmap(device, addr, nbytes, page=0) -> bytes unmapped; a failure's VmmError.done says how many were"},
    {"capturing", (PyCFunction)Ops_capturing, METH_VARARGS, "capturing(device, stream) -> bool"},
    {"peers", (PyCFunction)Ops_peers, METH_VARARGS,
     "peers(device) -> mask: the other devices (a bit each) that can access the device's memory directly"},
    {NULL}
};

static PyGetSetDef Ops_getset[] = {
    {"name", (getter)Ops_get_name, NULL, "'cuda' or 'host'", NULL},
    {NULL}
};

static PyTypeObject OpsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "xpool._vmm.Ops",
    .tp_basicsize = sizeof(Ops),
    .tp_dealloc = (destructor)Ops_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ops(capsule): the virtual-memory ops of an 'xpool.vmm' capsule, called from Python.\n\n"
              "Failures raise VmmOutOfMemory (a MemoryError) for out of memory, VmmError otherwise; both carry\n"
              ".status (an XV_* code) and .done (bytes an unmap did unmap).",
    .tp_methods = Ops_methods,
    .tp_getset = Ops_getset,
    .tp_init = (initproc)Ops_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"cuda_vmm", py_cuda_vmm, METH_NOARGS,
     "The CUDA driver's ops as an 'xpool.vmm' capsule; VmmError (status UNAVAILABLE) without a usable driver."},
    {"address", py_address, METH_O, "address(capsule) -> the XvVmm* it holds, as an int (for ctypes harnesses)"},
    {NULL}
};

static struct PyModuleDef vmm_module = {PyModuleDef_HEAD_INIT, "xpool._vmm",
                                        "Virtual-memory ops for the expandable scheme (CUDA and a host twin).", -1,
                                        module_methods};

PyMODINIT_FUNC PyInit__vmm(void)
{
    if (PyType_Ready(&HostTwinType) < 0 || PyType_Ready(&OpsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&vmm_module);
    if (!m) return NULL;
    VmmError = PyErr_NewExceptionWithDoc("xpool._vmm.VmmError", "A virtual-memory op failed (.status, .done).",
                                         PyExc_RuntimeError, NULL);
    PyObject *bases = VmmError ? PyTuple_Pack(2, VmmError, PyExc_MemoryError) : NULL;
    VmmOutOfMemory = bases ? PyErr_NewExceptionWithDoc("xpool._vmm.VmmOutOfMemory",
                                                      "No physical memory (or address space) for a map or reserve.",
                                                      bases, NULL) : NULL;
    Py_XDECREF(bases);
    if (!VmmOutOfMemory || PyModule_AddObjectRef(m, "VmmError", VmmError) < 0 ||
        PyModule_AddObjectRef(m, "VmmOutOfMemory", VmmOutOfMemory) < 0 ||
        PyModule_AddObjectRef(m, "HostTwin", (PyObject *)&HostTwinType) < 0 ||
        PyModule_AddObjectRef(m, "Ops", (PyObject *)&OpsType) < 0 ||
        PyModule_AddStringConstant(m, "CAPSULE", XV_CAPSULE) < 0 || PyModule_AddIntConstant(m, "ABI", XV_ABI) < 0 ||
        PyModule_AddIntConstant(m, "OK", XV_OK) < 0 || PyModule_AddIntConstant(m, "OOM", XV_OOM) < 0 ||
        PyModule_AddIntConstant(m, "INVALID", XV_INVALID) < 0 ||
        PyModule_AddIntConstant(m, "UNAVAILABLE", XV_UNAVAILABLE) < 0 ||
        PyModule_AddIntConstant(m, "ERROR", XV_ERROR) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
