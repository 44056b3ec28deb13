/* xpool._core: the recovery ladder, one request's way up when the limit or the device refuses it (see _core.h).
 *
 * Note [Recovery ladder].  As PyTorch's malloc reads: try; free this device's cache and try again; collect garbage
 * (dead arrays held by reference cycles give their blocks back), free the cache and try again; raise
 * xpool.OutOfMemoryError.  What refuses, the limit or the device's out-of-memory (a MemoryError from
 * backend.malloc, XV_OOM from the ops), climbs the same ladder; any other error is passed on at once.  Nothing is
 * freed when it cannot help (a request larger than the limit itself) or must not happen (a stream of the device
 * captures: a cudaFree would end the capture); the error then says so.  A try and "free the cache" are the
 * scheme's (XpScheme.try_, .free_cache): the ladder knows no scheme.  The GIL is taken only for what needs it
 * (collecting, raising): scheme expandable climbs without it on PyTorch's path. */
#include "_core.h"

#include <stdio.h>

static PyObject *gc_collect;          /* gc.collect, for the ladder's last step */

int xp_ladder_module_init(void)
{
    PyObject *gc = PyImport_ImportModule("gc");
    if (!gc) return -1;
    gc_collect = PyObject_GetAttrString(gc, "collect");
    Py_DECREF(gc);
    return gc_collect ? 0 : -1;
}

/* The ladder's last step: raise xpool.OutOfMemoryError (reason: what refused, and why it could not be helped),
 * the pending bytes given up first.  TRY_FAILED. */
static int give_up(Allocator *A, DevicePool *pool, Climb *c, const char *reason, XpGil *g)
{
    if (c->reserved) {
        pthread_mutex_lock(&pool->lock);
        pool->st.bytes_pending -= c->size;
        pthread_mutex_unlock(&pool->lock);
        c->reserved = 0;
    }
    xp_gil_take(g);
    PyObject *cause = c->cause;
    c->cause = NULL;
    if (!cause && c->by_device && c->oom.status)   /* scheme expandable: the op's own words */
        cause = PyObject_CallFunction(PyExc_MemoryError, "s", c->oom.why);
    PyErr_Clear();   /* a failure to make the cause leaves the error without one */
    raise_oom(A, pool, c->requested, c->refused ? c->refused : c->size, reason, cause);
    return TRY_FAILED;
}

/* A step of the ladder: free this device's cache (after gc.collect() when `collect`), then try again. */
static int free_cache_and_retry(Allocator *A, DevicePool *pool, Climb *c, int collect, XpGil *g)
{
    if (c->over_limit) return give_up(A, pool, c, "limit_too_small", g);   /* no freeing can help */
    int capturing = device_captures(A, pool, c->stream);
    if (capturing < 0) return TRY_FAILED;
    if (capturing) return give_up(A, pool, c, c->by_device ? "device_capturing" : "limit_capturing", g);
    if (collect) {
        xp_gil_take(g);
        PyObject *r = PyObject_CallNoArgs(gc_collect);
        if (!r) return TRY_FAILED;
        Py_DECREF(r);
    }
    if (A->ops->free_cache(A, pool, c, g) < 0) return TRY_FAILED;
    c->step++;
    return A->ops->try_(A, pool, c, g);
}

/* A failed device op kept in c->fault, raised with the GIL. */
static void raise_fault(const DevicePool *pool, const VmFault *f)
{
    PyErr_Format(f->status == VM_NO_HOST_MEMORY || f->status == XV_OOM ? PyExc_MemoryError : PyExc_RuntimeError,
                 "xpool (scheme expandable, device %d): %s", pool->device, f->why);
}

int climb(Allocator *A, DevicePool *pool, Climb *c, XpGil *g)
{
    int r = A->ops->try_(A, pool, c, g);
    if (r == TRY_NO_ROOM) r = free_cache_and_retry(A, pool, c, 0, g);
    if (r == TRY_NO_ROOM) r = free_cache_and_retry(A, pool, c, 1, g);
    if (r == TRY_NO_ROOM) r = give_up(A, pool, c, c->by_device ? "device" : "limit", g);
    if (r != TRY_GOT && c->reserved) {
        pthread_mutex_lock(&pool->lock);
        pool->st.bytes_pending -= c->size;
        pthread_mutex_unlock(&pool->lock);
        c->reserved = 0;
    }
    if (r == TRY_FAILED && c->fault.status) {
        xp_gil_take(g);
        if (!PyErr_Occurred()) raise_fault(pool, &c->fault);
    }
    if (c->cause) {
        xp_gil_take(g);
        Py_CLEAR(c->cause);
    }
    return r;
}
