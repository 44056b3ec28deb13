/* xpool._core: PyTorch's CUDAPluggableAllocator entry points (see _core.h).
 *
 * Note [PyTorch's entry points]. torch.cuda.memory.CUDAPluggableAllocator(xpool._core.__file__, "xpool_torch_malloc",
 * "xpool_torch_free") serves PyTorch's CUDA tensors from the same Allocator as CuPy (xpool.enable_torch() sets it
 * up), so a block one framework frees is reused by the other: same device, same stream handle (PyTorch passes its
 * current cudaStream_t; CuPy's current stream pointer is the same handle for the same stream).
 *
 * PyTorch calls these without the GIL, from any thread (its autograd engine runs backward in its own threads).  The
 * hit path and the free path touch only C structures under the pool's mutex, so they run without the GIL (take_nogil,
 * free_nogil, over _hot.h); everything that can call Python (a miss: backend, OOM ladder, gc; debug hooks; error
 * reports) takes it with PyGILState_Ensure, holding no mutex, as the rest of the core does.  Scheme expandable's miss
 * maps pages through the backend's ops, from C: it runs without the GIL too (miss_nogil) and takes it only if the
 * ladder must collect garbage or raise. */
#include "_hot.h"

#include <dlfcn.h>
#include <stdio.h>

/* The Allocator PyTorch allocates from (Allocator.bind_torch).  Its reference is never dropped: a PyTorch thread may
 * be inside it without the GIL at any moment, and PyTorch cannot change allocators once it has allocated anyway. */
static _Atomic(Allocator *) torch_allocator;
static _Thread_local char torch_error[1024];   /* why this thread's last xpool_torch_* call failed */

static int python_usable(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsInitialized() && !Py_IsFinalizing();
#else
    return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

/* With the GIL held and an exception set: its "Type: message" into torch_error; the exception stays set. */
static void torch_note_error(void)
{
    PyObject *exc = PyErr_GetRaisedException();
    PyObject *text = exc ? PyObject_Str(exc) : NULL;
    const char *msg = text ? PyUnicode_AsUTF8(text) : NULL;
    snprintf(torch_error, sizeof torch_error, "%s: %s", exc ? Py_TYPE(exc)->tp_name : "error",
             msg ? msg : "(no message)");
    PyErr_Clear();
    Py_XDECREF(text);
    PyErr_SetRaisedException(exc);
}

/* xp_alloc's hit path without the GIL: a cached block handed to PyTorch, or NULL (none fits, debug mode is
 * on: nothing is counted, the caller takes the GIL path, which counts the request). */
static Block *take_nogil(Allocator *A, int device, intptr_t stream, size_t requested)
{
    /* debug mode's checks run Python: its requests always take the GIL path */
    if (atomic_load_explicit(&A->debug_on, memory_order_acquire)) return NULL;
    DevicePool *pool = pool_lookup(A, device);
    if (!pool) return NULL;
    size_t size = scheme_block_size(A, requested);   /* no debug tail: debug mode is off */
    int no_room;   /* the GIL path reports it */
    pthread_mutex_lock(&pool->lock);
    Block *b = take_hit(A, pool, stream, size, requested, ORIGIN_TORCH, 0, &no_room);
    pthread_mutex_unlock(&pool->lock);
    return b;
}

/* xp_free's caching path (debug mode off) without the GIL, for blocks handed to PyTorch only: 0 when the
 * block is back in the cache; -1 when nothing changed (an unknown pointer, a block handed to CuPy or Python:
 * the GIL path reports it). */
static int free_nogil(Allocator *A, int device, uintptr_t ptr)
{
    DevicePool *pool = pool_lookup(A, device);
    if (!pool || atomic_load_explicit(&A->debug_on, memory_order_acquire)) return -1;
    pthread_mutex_lock(&pool->lock);
    Block **slot = ptrtable_slot(&pool->live, ptr);
    Block *b = slot ? *slot : NULL;
    if (!b || b->origin != ORIGIN_TORCH) {
        pthread_mutex_unlock(&pool->lock);
        return -1;
    }
    ptrtable_remove(&pool->live, ptr);
    pool->st.frees++;
    pool->st.blocks_in_use--; pool->st.bytes_in_use -= b->size;
    pool->st.bytes_requested -= b->requested;
    origin_out(&pool->st, ORIGIN_TORCH, b->size);
    size_t requested = b->requested;
    b->handed_out = 0; b->poisoned = 0;
    Block freed = *b;   /* a range may merge into its neighbour and be gone */
    cache_block(pool, b);
    timeline_record(&A->tl, EV_FREE, pool, &freed, requested);
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

/* Scheme expandable's miss without the GIL (debug mode off, the device's ranges made by a first miss with the
 * GIL): 0 with *out; -1 with torch_error; 1 when it cannot run here (the caller takes the GIL path). */
static int miss_nogil(Allocator *A, int device, intptr_t stream, size_t size, void **out)
{
    if (A->scheme != XP_SCHEME_EXPANDABLE || atomic_load_explicit(&A->debug_on, memory_order_acquire)) return 1;
    DevicePool *pool = pool_lookup(A, device);
    if (!pool || !atomic_load_explicit(&pool->vm_ready, memory_order_acquire)) return 1;
    XpGil g = XP_GIL_NONE;
    Block *b = xp_vm_alloc(A, pool, stream, size, ORIGIN_TORCH, &g);
    if (b) *out = (void *)b->ptr;
    else {   /* the ladder raised: it holds the GIL */
        torch_note_error();
        PyErr_Clear();
    }
    xp_gil_end(&g);
    return b ? 0 : -1;
}

/* The origin of the block in use at ptr (ORIGIN_*), or -1 when none is. */
static int block_origin(DevicePool *pool, uintptr_t ptr)
{
    pthread_mutex_lock(&pool->lock);
    Block **slot = ptrtable_slot(&pool->live, ptr);
    int origin = slot ? (*slot)->origin : -1;
    pthread_mutex_unlock(&pool->lock);
    return origin;
}

/* The allocation behind both exported malloc functions.  0 and *out on success; -1 with torch_error. */
static int torch_alloc(ssize_t size, int device, void *stream_handle, void **out)
{
    Allocator *A = atomic_load_explicit(&torch_allocator, memory_order_acquire);
    if (!A) {
        snprintf(torch_error, sizeof torch_error, "xpool: no pool is bound to PyTorch; call "
                 "xpool.enable_torch() before PyTorch's first CUDA allocation");
        return -1;
    }
    /* the request's checks, here where it enters (no GIL needed to refuse it) */
    if (size < 0 || (size_t)size > XP_MAX_REQUEST) {
        snprintf(torch_error, sizeof torch_error, size < 0 ? "ValueError: size must be >= 0, got %zd"
                 : "ValueError: size=%zd is larger than any device (max %zu)", size, (size_t)XP_MAX_REQUEST);
        return -1;
    }
    if (device < 0 || device >= A->n_devices) {   /* before any pool is made or request counted */
        snprintf(torch_error, sizeof torch_error, "ValueError: device must be in [0, %d) (the backend's "
                 "devices), got %d", A->n_devices, device);
        return -1;
    }
    intptr_t stream = stream_key((intptr_t)stream_handle);
    Block *b = take_nogil(A, device, stream, (size_t)size);   /* the hit path, without the GIL */
    if (b) { *out = (void *)b->ptr; return 0; }
    if (!python_usable()) {
        snprintf(torch_error, sizeof torch_error, "xpool: PyTorch asked for %zd bytes while Python "
                 "is shutting down", size);
        return -1;
    }
    int r = miss_nogil(A, device, stream, (size_t)size, out);   /* scheme expandable: C only, as a hit */
    if (r <= 0) return r;
    PyGILState_STATE gil = PyGILState_Ensure();
    b = xp_alloc(A, device, stream, (size_t)size, ORIGIN_TORCH);
    if (b) {
        *out = (void *)b->ptr;
    } else {
        torch_note_error();
        PyErr_Clear();   /* PyTorch gets it as a C++ exception, or a C caller from xpool_torch_last_error() */
    }
    PyGILState_Release(gil);
    return b ? 0 : -1;
}

/* PyTorch's CUDAPluggableAllocator does not check what malloc returns: a NULL would become a tensor's
 * data pointer and the next kernel would fault.  The one error it surfaces is a C++ exception (a
 * std::exception reaches Python as RuntimeError with its what()), the documented contract.  The core is
 * C, so it throws std::runtime_error through the C++ ABI (Itanium, libstdc++: PyTorch's Linux builds),
 * looked up in the libstdc++ PyTorch has loaded.  Returns only if that is impossible. */
static void throw_runtime_error(const char *msg)
{
    void *lib = dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_NOLOAD);
    void *h = lib ? lib : RTLD_DEFAULT;
    void *(*allocate)(size_t) = (void *(*)(size_t))dlsym(h, "__cxa_allocate_exception");
    void (*construct)(void *, const char *) = (void (*)(void *, const char *))dlsym(h, "_ZNSt13runtime_errorC1EPKc");
    void (*destroy)(void *) = (void (*)(void *))dlsym(h, "_ZNSt13runtime_errorD1Ev");
    void *type_info = dlsym(h, "_ZTISt13runtime_error");
    void (*throw_)(void *, void *, void (*)(void *)) =
        (void (*)(void *, void *, void (*)(void *)))dlsym(h, "__cxa_throw");
    if (lib) dlclose(lib);   /* NOLOAD: PyTorch's reference keeps it loaded */
    if (!allocate || !construct || !destroy || !type_info || !throw_) return;
    void *e = allocate(64);  /* sizeof(std::runtime_error) is 16 with libstdc++ on LP64: room to spare */
    construct(e, msg);
    throw_(e, type_info, destroy);
}

/* void *malloc(ssize_t size, int device, cudaStream_t stream): PyTorch's pluggable-allocator signature.
 * On failure (after xpool's OOM ladder) it throws std::runtime_error("xpool.OutOfMemoryError: ..."). */
XP_EXPORT void *xpool_torch_malloc(ssize_t size, int device, void *stream)
{
    void *p = NULL;
    if (torch_alloc(size, device, stream, &p) == 0) return p;
    throw_runtime_error(torch_error);
    fprintf(stderr, "%s\nxpool: could not raise this through PyTorch (no C++ runtime found)\n", torch_error);
    return NULL;
}

/* The same for C callers (and tests): NULL on failure, the reason in xpool_torch_last_error(). */
XP_EXPORT void *xpool_torch_try_malloc(ssize_t size, int device, void *stream)
{
    void *p = NULL;
    return torch_alloc(size, device, stream, &p) == 0 ? p : NULL;
}

XP_EXPORT const char *xpool_torch_last_error(void) { return torch_error; }

/* void free(void *ptr, ssize_t size, int device, cudaStream_t stream): called from PyTorch's deleters,
 * which cannot fail, so an error (a pointer xpool did not hand to PyTorch) is reported as unraisable. */
XP_EXPORT void xpool_torch_free(void *ptr, ssize_t size, int device, void *stream)
{
    Allocator *A = atomic_load_explicit(&torch_allocator, memory_order_acquire);
    int known_device = A && device >= 0 && device < A->n_devices;
    torch_error[0] = 0;
    if (A && known_device && free_nogil(A, device, (uintptr_t)ptr) == 0) return;
    if (!python_usable()) return;   /* the process is ending: the device memory goes with it */
    PyGILState_STATE gil = PyGILState_Ensure();
    DevicePool *pool = A && known_device ? pool_lookup(A, device) : NULL;
    int origin = pool ? block_origin(pool, (uintptr_t)ptr) : -1;
    int r = 0;
    if (!A) {
        PyErr_Format(PyExc_RuntimeError, "xpool: PyTorch freed pointer %p but no pool is bound to PyTorch", ptr);
        r = -1;
    } else if (origin >= 0 && origin != ORIGIN_TORCH) {
        PyErr_Format(PyExc_ValueError, "xpool: PyTorch freed pointer %p on device %d, a block handed to "
                     "%s, not to PyTorch; it stays in use", ptr, device, origin_names[origin]);
        r = -1;
    } else {
        int holds_ref;   /* 0: a block handed to PyTorch holds no reference to A */
        r = xp_free(A, device, (uintptr_t)ptr, &holds_ref);   /* 2: the parent's, in a fork()ed child */
    }
    if (r == -1 || r == 1) {
        torch_note_error();
        PyErr_WriteUnraisable(NULL);
    }
    PyGILState_Release(gil);
}

/* bind_torch(): make this Allocator the one PyTorch's hooks serve from. */
PyObject *Allocator_bind_torch(Allocator *self, PyObject *unused)
{
    Allocator *old = atomic_load(&torch_allocator);
    if (old == self) Py_RETURN_NONE;
    if (old) {
        for (int d = 0; d < XP_MAX_DEVICES; d++) {
            DevicePool *pool = atomic_load(&old->pools[d]);
            if (!pool) continue;
            pthread_mutex_lock(&pool->lock);
            uint64_t held = pool->st.bytes_in_use_by[ORIGIN_TORCH];
            pthread_mutex_unlock(&pool->lock);
            if (held) {
                PyErr_Format(PyExc_RuntimeError, "xpool: PyTorch still holds %llu bytes on device %d from "
                             "the pool bound before; they must go back to it first",
                             (unsigned long long)held, d);
                return NULL;
            }
        }
    }
    Py_INCREF(self);   /* kept for the life of the process, as is the one bound before (see above) */
    atomic_store_explicit(&torch_allocator, self, memory_order_release);
    Py_RETURN_NONE;
}

PyObject *py_torch_bound(PyObject *mod, PyObject *unused)
{
    Allocator *A = atomic_load(&torch_allocator);
    return Py_NewRef(A ? (PyObject *)A : Py_None);
}
