/*
 * xpool._vmm: the CUDA ops of _vmm.h as a PyCapsule named "xpool.vmm" (cuda_vmm(), CupyBackend.vmm()), and the
 * errors a failed op raises.  The core takes the XvVmm from a backend's capsule and calls its ops from C.  (The
 * tests' host twin, tests/xpool/fixtures/twin, makes capsules of its own with the same ABI.)
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

/* ------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"cuda_vmm", py_cuda_vmm, METH_NOARGS,
     "The CUDA driver's ops as an 'xpool.vmm' capsule; VmmError (status UNAVAILABLE) without a usable driver."},
    {NULL}
};

static struct PyModuleDef vmm_module = {PyModuleDef_HEAD_INIT, "xpool._vmm",
                                        "CUDA's virtual-memory ops for the expandable scheme.", -1, module_methods};

PyMODINIT_FUNC PyInit__vmm(void)
{
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
