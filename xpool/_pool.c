/* xpool._core: what every path shares: per-thread stream keys, the device pools, the debug hook, the streams a
 * pool serves and whether one captures, the out-of-memory error (see _core.h for the layers and the locks). */
#include "_hot.h"

#include <string.h>

const char *const origin_names[XP_ORIGINS] = {"cupy", "torch", "python"};

/* ------------------------------------------------------------------ per-thread stream keys (_core.h) */

_Thread_local intptr_t xp_own_thread_key;
static _Atomic uint64_t thread_keys_made;     /* key n is -n: the count never goes back, so no key is reused */
static pthread_once_t thread_exit_once = PTHREAD_ONCE_INIT;
static pthread_key_t thread_exit;             /* its destructor marks the thread's key ended */
static pthread_mutex_t ended_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards ended, ended_bits */
static uint8_t *ended;                        /* bit n-1: the thread of key -n has ended */
static size_t ended_bits;                     /* bits `ended` has room for */

static void mark_ended(uint64_t n)
{
    pthread_mutex_lock(&ended_lock);
    if (n && n <= ended_bits) ended[(n - 1) / 8] |= (uint8_t)(1u << ((n - 1) % 8));
    pthread_mutex_unlock(&ended_lock);
}

/* At a thread's exit (POSIX runs it for every thread that set a value), without the GIL: no Python here. */
static void thread_key_ended(void *value) { mark_ended((uint64_t)(uintptr_t)value); }

/* The capsule in a Python thread's state dict: its destructor runs when the thread's state is cleared, before
 * Thread.join() returns (POSIX's destructor runs later, after the join may have returned). */
static void key_capsule_gone(PyObject *capsule)
{
    mark_ended((uint64_t)(uintptr_t)PyCapsule_GetContext(capsule));
}

static void make_thread_exit(void) { pthread_key_create(&thread_exit, thread_key_ended); }

/* In a fork()ed child, before anything runs: a parent thread may have held ended_lock. */
static void thread_keys_after_fork(void) { pthread_mutex_init(&ended_lock, NULL); }

/* Ties key n to this thread's Python state, when it has one and holds the GIL; no error is left set. */
static void tie_to_thread_state(uint64_t n)
{
    if (!PyGILState_Check()) return;
    PyObject *exc = PyErr_GetRaisedException();
    PyObject *dict = PyThreadState_GetDict();
    PyObject *cap = dict ? PyCapsule_New((void *)&thread_exit, "xpool.thread_key", key_capsule_gone) : NULL;
    if (cap && PyCapsule_SetContext(cap, (void *)(uintptr_t)n) == 0)
        PyDict_SetItemString(dict, "xpool.thread_key", cap);
    Py_XDECREF(cap);
    PyErr_Clear();
    PyErr_SetRaisedException(exc);
}

intptr_t xp_new_thread_key(void)
{
    pthread_once(&thread_exit_once, make_thread_exit);
    uint64_t n = atomic_fetch_add(&thread_keys_made, 1) + 1;
    /* room for its bit now, so no exit destructor allocates; without room the thread counts as alive for good:
     * conservative (Note [Capture: every stream of a device]) */
    pthread_mutex_lock(&ended_lock);
    if (n > ended_bits) {
        size_t bits = ended_bits ? ended_bits * 2 : 1024;
        while (bits < n) bits *= 2;
        uint8_t *grown = realloc(ended, bits / 8);
        if (grown) {
            memset(grown + ended_bits / 8, 0, (bits - ended_bits) / 8);
            ended = grown;
            ended_bits = bits;
        }
    }
    pthread_mutex_unlock(&ended_lock);
    pthread_setspecific(thread_exit, (void *)(uintptr_t)n);
    tie_to_thread_state(n);
    xp_own_thread_key = -(intptr_t)n;
    return xp_own_thread_key;
}

int xp_thread_key_ended(intptr_t key)
{
    uint64_t n = (uint64_t)(-key);
    pthread_mutex_lock(&ended_lock);
    int gone = n >= 1 && n <= ended_bits && (ended[(n - 1) / 8] >> ((n - 1) % 8) & 1);
    pthread_mutex_unlock(&ended_lock);
    return gone;
}

int xp_pool_module_init(void)
{
    pthread_atfork(NULL, NULL, thread_keys_after_fork);
    return 0;
}

/* ------------------------------------------------------------------ device pools */

int xp_refuse_device(const Allocator *A, int device)
{
    PyErr_Format(PyExc_ValueError, "device must be in [0, %d) (the backend's devices), got %d", A->n_devices,
                 device);
    return -1;
}

/* The device's total bytes, from backend.total_memory(device); -1 with its error, or a ValueError naming the call
 * for an answer that is no int in [1, 2**48]. */
static int device_capacity(Allocator *A, int device, uint64_t *out)
{
    PyObject *r = PyObject_CallMethod(A->backend, "total_memory", "i", device);
    if (!r) return -1;
    PyObject *n = PyBool_Check(r) ? NULL : PyNumber_Index(r);
    *out = n ? PyLong_AsUnsignedLongLong(n) : 0;
    Py_XDECREF(n);
    PyErr_Clear();
    if (*out < 1 || *out > XP_MAX_REQUEST)
        PyErr_Format(PyExc_ValueError, "backend.total_memory(%d) must return the device's bytes, an int in [1, "
                     "2**48], got %.100s %R", device, Py_TYPE(r)->tp_name, r);
    Py_DECREF(r);
    return PyErr_Occurred() ? -1 : 0;
}

DevicePool *pool_make(Allocator *A, int device)
{
    DevicePool *pool;
    pthread_mutex_lock(&A->registry_lock);
    uint64_t limit = A->default_limit, capacity = 0;
    double fraction = A->default_fraction;
    pthread_mutex_unlock(&A->registry_lock);
    if (fraction > 0) {   /* the limit is a share of this device: ask its size, outside the lock */
        if (device_capacity(A, device, &capacity) < 0) return NULL;
        limit = (uint64_t)(fraction * (double)capacity);
        if (!limit) limit = 1;   /* any share is at least one byte, never "no limit" */
    }
    pthread_mutex_lock(&A->registry_lock);
    pool = atomic_load_explicit(&A->pools[device], memory_order_relaxed);
    if (!pool && (pool = calloc(1, sizeof(DevicePool)))) {
        pthread_mutex_init(&pool->lock, NULL);
        pool->device = device;
        pool->limit = limit;
        pool->capacity = capacity;
        atomic_store_explicit(&A->pools[device], pool, memory_order_release);
    }
    pthread_mutex_unlock(&A->registry_lock);
    if (!pool) PyErr_NoMemory();
    return pool;
}

uint64_t pool_known_capacity(DevicePool *pool)
{
    pthread_mutex_lock(&pool->lock);
    uint64_t capacity = pool->capacity;
    pthread_mutex_unlock(&pool->lock);
    return capacity;
}

uint64_t pool_capacity(Allocator *A, DevicePool *pool)
{
    uint64_t capacity = pool_known_capacity(pool);
    if (capacity) return capacity;
    if (device_capacity(A, pool->device, &capacity) < 0) { PyErr_Clear(); capacity = 0; }
    pthread_mutex_lock(&pool->lock);
    pool->capacity = capacity;
    pthread_mutex_unlock(&pool->lock);
    return capacity;
}

/* ------------------------------------------------------------------ the debug hook */

PyObject *block_info(const Block *b, size_t requested)
{
    return Py_BuildValue("{s:i,s:K,s:n,s:n,s:L,s:K,s:s,s:O,s:O}", "device", b->device,
                         "ptr", (unsigned long long)b->ptr, "size", (Py_ssize_t)b->size,
                         "requested", (Py_ssize_t)requested, "stream", (long long)b->stream,
                         "serial", (unsigned long long)b->serial, "origin", origin_names[b->origin],
                         "guarded", b->guarded ? Py_True : Py_False,
                         "poisoned", b->poisoned ? Py_True : Py_False);
}

/* An operation uses the hook it started with, even if set_hook swaps it while a hook call lets another run. */
PyObject *debug_hook_ref(Allocator *A, size_t *tail)
{
    pthread_mutex_lock(&A->debug_lock);
    PyObject *hook = A->debug_hook;
    Py_XINCREF(hook);
    if (hook) *tail = A->debug_tail;
    pthread_mutex_unlock(&A->debug_lock);
    return hook;
}

/* The snapshot's reference may be the hook's last, and freeing it may run Python code. */
void drop_hook_ref(PyObject *hook)
{
    PyObject *exc = PyErr_GetRaisedException();
    Py_DECREF(hook);
    if (exc) PyErr_SetRaisedException(exc);
}

/* The old hook is dropped after the lock, as dropping it may run Python code. */
void set_hook(Allocator *A, PyObject *hook, size_t tail)
{
    if (hook == Py_None) hook = NULL;
    Py_XINCREF(hook);
    pthread_mutex_lock(&A->debug_lock);
    PyObject *old = A->debug_hook;
    A->debug_hook = hook;
    A->debug_tail = hook ? tail : 0;
    atomic_store_explicit(&A->debug_on, hook != NULL, memory_order_release);
    pthread_mutex_unlock(&A->debug_lock);
    Py_XDECREF(old);
}

int call_hook(PyObject *hook, const char *name, const Block *b, size_t requested)
{
    PyObject *info = block_info(b, requested);
    if (!info) return -1;
    PyObject *r = PyObject_CallMethod(hook, name, "O", info);
    Py_DECREF(info);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* ------------------------------------------------------------------ the streams a pool serves
 *
 * Note [Capture: every stream of a device].  While a stream of a device captures a CUDA graph, nothing may go back to
 * that device: cudaFree (and an unmap) synchronises the device, which ends every capture on it
 * (cudaErrorStreamCaptureUnsupported) and loses the graph.  So before anything goes back the pool asks the legacy
 * stream (which reports a global-mode capture of any stream of the device), the request's stream, and every stream
 * holding memory of the pool there; a stream the pool holds memory for may have been destroyed since, and asking it
 * is undefined (cuStreamIsCapturing crashed in the driver on an H200), so such a stream is asked only when the
 * backend vouches it lives (.stream_alive).  Another thread's per-thread stream cannot be asked from this thread: it
 * counts as capturing until that thread ends.  Asked before give-backs only, never on a hit, never on a miss. */

StreamUse *stream_use(DevicePool *pool, intptr_t key, int make)
{
    for (size_t i = 0; i < pool->n_streams; i++)
        if (pool->streams[i].key == key) return &pool->streams[i];
    if (!make) return NULL;
    if (pool->n_streams == pool->streams_cap) {
        size_t cap = pool->streams_cap ? 2 * pool->streams_cap : 8;
        StreamUse *grown = realloc(pool->streams, cap * sizeof(StreamUse));
        if (!grown) return NULL;
        pool->streams = grown;
        pool->streams_cap = cap;
    }
    StreamUse *u = &pool->streams[pool->n_streams++];
    u->key = key;
    u->allocations = 0;
    return u;
}

void stream_use_gone(DevicePool *pool, intptr_t key)
{
    StreamUse *u = stream_use(pool, key, 0);
    if (u && u->allocations && !--u->allocations) *u = pool->streams[--pool->n_streams];
}

/* Whether another stream's capture state may be asked: without .stream_alive a backend has no destroyed streams
 * (the host backend); without the GIL (PyTorch's path) another stream is not asked.  1 yes, 0 no. */
static int may_ask(Allocator *A, int device, intptr_t handle)
{
    if (!A->tells_alive) return 1;
    if (!PyGILState_Check()) return 0;
    PyObject *exc = PyErr_GetRaisedException();
    PyObject *r = PyObject_CallMethod(A->backend, "stream_alive", "in", device, (Py_ssize_t)handle);
    int yes = r ? PyObject_IsTrue(r) == 1 : 0;
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_SetRaisedException(exc);
    return yes;
}

int streams_capture(Allocator *A, int device, const intptr_t *keys, size_t k, int (*ask)(Allocator *, int, intptr_t))
{
    int capturing = 0;
    for (size_t i = 0; i < k && !capturing; i++) {
        int seen = 0;
        for (size_t j = 0; j < i && !seen; j++) seen = keys[j] == keys[i];
        if (seen) continue;
        intptr_t handle = stream_handle(keys[i]);
        if (handle < 0)     /* another thread's per-thread stream: unknown while it lives */
            capturing = !xp_thread_key_ended(keys[i]);
        else if (i < 2 || may_ask(A, device, handle))
            capturing = ask(A, device, handle);
    }
    return capturing;
}

static int ask_backend(Allocator *A, int device, intptr_t handle)
{
    PyObject *r = PyObject_CallMethod(A->backend, "capturing", "in", device, (Py_ssize_t)handle);
    if (!r) return -1;
    int yes = PyObject_IsTrue(r);
    Py_DECREF(r);
    return yes;
}

int backend_captures(Allocator *A, DevicePool *pool, intptr_t key)
{
    if (!A->tells_capture) return 0;
    pthread_mutex_lock(&pool->lock);
    size_t n = pool->n_streams;
    intptr_t *keys = malloc((n + 2) * sizeof(intptr_t));
    if (keys) {
        keys[0] = 0;        /* the legacy stream */
        keys[1] = key;
        for (size_t i = 0; i < n; i++) keys[i + 2] = pool->streams[i].key;
    }
    pthread_mutex_unlock(&pool->lock);
    if (!keys) { PyErr_NoMemory(); return -1; }
    int capturing = streams_capture(A, pool->device, keys, n + 2, ask_backend);
    free(keys);
    return capturing;
}

/* ------------------------------------------------------------------ out of memory */

int raise_oom(Allocator *A, DevicePool *pool, size_t requested, size_t size, const char *reason, PyObject *cause)
{
    pthread_mutex_lock(&pool->lock);
    Stats s = pool->st;
    pool->st.oom_errors++;
    uint64_t limit = pool->limit, capacity = pool->capacity;
    timeline_record(&A->tl, EV_OOM, pool, NULL, requested);
    pthread_mutex_unlock(&pool->lock);
    /* the device's bytes (0: unknown) and the scheme, for a request larger than the device */
    PyObject *err = PyObject_CallFunction(A->error_factory, "inKKKKsKs", pool->device, (Py_ssize_t)requested,
                                          (unsigned long long)size, (unsigned long long)s.bytes_in_use,
                                          (unsigned long long)s.bytes_cached, (unsigned long long)limit, reason,
                                          (unsigned long long)capacity, A->ops->name);
    if (err) {
        if (cause) PyException_SetCause(err, cause);
        PyErr_SetObject((PyObject *)Py_TYPE(err), err);
        Py_DECREF(err);
    } else {
        Py_XDECREF(cause);
    }
    return -1;
}
