/* xpool._core: the entry paths: allocate and free (CuPy's C hooks among them), giving back (see _core.h for the
 * layers and the locks).  A miss and a give-back go to the scheme's table (A->ops); a hit is _hot.h's. */
#include "_hot.h"

size_t xp_size_class(size_t n, unsigned k) { return size_class(n, k); }

void xp_refuse_request(unsigned long long n)
{
    PyErr_Format(PyExc_ValueError, "nbytes=%llu is larger than any device (max %zu)", n, (size_t)XP_MAX_REQUEST);
}

/* ------------------------------------------------------------------ the allocation path */

/* A block handed out in debug mode becomes visible to check() only once its hook has written the canary. */
static int prepare(DevicePool *pool, Block *b, PyObject *hook, const char *name)
{
    if (call_hook(hook, name, b, b->requested) < 0) return -1;
    pthread_mutex_lock(&pool->lock);
    b->guarded = 1; b->handed_out = 1;
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

/* Undoes the hand-out of a block whose debug hook raised (the caller never sees it), keeping the hook's exception
 * set: back to the cache (a reused block, a range), or to the device (a new class block).  Either way it is not
 * known to hold poison now. */
static void take_back(Allocator *A, DevicePool *pool, Block *b, int to_device)
{
    PyObject *exc = PyErr_GetRaisedException();
    pthread_mutex_lock(&pool->lock);
    ptrtable_remove(&pool->live, b->ptr);
    pool->st.blocks_in_use--; pool->st.bytes_in_use -= b->size;
    pool->st.bytes_requested -= b->requested;
    origin_out(&pool->st, b->origin, b->size);
    b->poisoned = 0;
    if (to_device) pool->st.bytes_releasing += b->size;
    else cache_block(pool, b);
    pthread_mutex_unlock(&pool->lock);
    PyErr_SetRaisedException(exc);
    if (to_device) A->ops->discard(A, pool, b);
}

/* Note [Ended threads' streams].  A block cached for a per-thread stream key is reused only by that thread (0005):
 * once the thread has ended, nothing can hand it out again.  Rule: at a miss, before the device is asked for more,
 * the blocks cached for ended threads' keys on that device go back to it (seed: blocks; segments: wholly free
 * segments; expandable: free pages, and emptied ranges).  Not reused on the request's stream instead: the ended
 * thread's work is not known to be finished, and a give-back waits for it.  Bound: the device holds at most what its
 * live streams hold plus what ended threads cached since its last miss; nothing goes back while a stream of the
 * device captures or may (0006: another live thread's per-thread stream), so then also what they cached since.
 * The hit and the free pay nothing; PyTorch's GIL-free miss of scheme expandable (_pages.c) skips it.  A failed
 * free leaves its block cached and counted, for the next miss. */
__attribute__((noinline, cold)) static void give_back_ended(Allocator *A, DevicePool *pool, intptr_t stream)
{
    size_t n = 0, ended = 0;
    pthread_mutex_lock(&pool->lock);
    XeDevice *vm = atomic_load_explicit(&pool->vm_ready, memory_order_acquire) ? pool->vm : NULL;
    size_t keys = vm ? vm->n_ranges : pool->n_streams;   /* the stream keys holding device memory here */
    intptr_t *found = keys ? malloc(keys * sizeof(intptr_t)) : NULL;
    for (size_t i = 0; found && i < keys; i++) {
        intptr_t key = vm ? vm->ranges[i]->stream : pool->streams[i].key;
        if (key < 0 && key != stream && key != xp_own_thread_key) found[n++] = key;
    }
    pthread_mutex_unlock(&pool->lock);
    for (size_t i = 0; i < n; i++)
        if (xp_thread_key_ended(found[i])) found[ended++] = found[i];
    if (ended && device_captures(A, pool, stream) == 0)
        for (size_t j = 0; j < ended; j++) {   /* a key twice (two ranges): its second release finds nothing */
            XpGil g = XP_GIL_HELD;
            if (A->ops->release(A, pool, 0, found[j], 0, vm != NULL, &g) < 0)
                PyErr_Clear();   /* not carried into the next key's backend.free, which could not run */
            xp_gil_end(&g);
        }
    PyErr_Clear();
    free(found);
}

static Block *alloc_block(Allocator *A, int device, intptr_t stream, size_t requested, size_t size, PyObject *hook,
                          int origin)
{
    DevicePool *pool = pool_get(A, device);
    if (!pool) return NULL;
    int no_room;
    pthread_mutex_lock(&pool->lock);
    Block *b = take_hit(A, pool, stream, size, requested, origin, hook != NULL, &no_room);
    if (b) {
        pthread_mutex_unlock(&pool->lock);
        if (hook && prepare(pool, b, hook, "on_reuse") < 0) {
            take_back(A, pool, b, 0);
            return NULL;
        }
        return b;
    }
    pool->st.requests++;
    if (no_room) {
        pthread_mutex_unlock(&pool->lock);
        PyErr_NoMemory();
        return NULL;
    }
    pool->st.misses++;
    pthread_mutex_unlock(&pool->lock);
    give_back_ended(A, pool, stream);   /* Note [Ended threads' streams] */
    b = A->ops->make(A, pool, stream, requested, size, hook, origin);
    /* a new block made of freed, poisoned bytes (scheme expandable joins them) is checked as a reused one */
    if (b && hook && prepare(pool, b, hook, b->poisoned ? "on_reuse" : "on_alloc") < 0) {
        take_back(A, pool, b, is_allocation(b));   /* a range: the rest of its segment may be in use already */
        return NULL;
    }
    return b;
}

Block *xp_alloc(Allocator *A, int device, intptr_t stream, size_t requested, int origin)
{
    size_t tail;
    PyObject *hook = debug_snapshot(A, &tail);
    /* requested <= XP_MAX_REQUEST and tail <= XP_MAX_DEBUG_TAIL: the sum cannot wrap */
    Block *b = alloc_block(A, device, stream, requested, scheme_block_size(A, requested + tail), hook, origin);
    drop_hook(hook);
    return b;
}

/* ------------------------------------------------------------------ the free path */

/* In a fork()ed child: forgets a block the parent handed out (its memory is never freed or reused here).  1 if
 * ptr was one, with *holds_ref set. */
static int forget_inherited(Allocator *A, int device, uintptr_t ptr, int *holds_ref)
{
    for (DevicePool *p = A->forked_pools[device]; p; p = p->older) {
        pthread_mutex_lock(&p->lock);
        Block *b = ptrtable_remove(&p->live, ptr);
        pthread_mutex_unlock(&p->lock);
        if (b) {
            *holds_ref = b->origin == ORIGIN_CUPY;
            free(b);
            return 1;
        }
    }
    return 0;
}

/* The hot free: the block out of the live table and into the cache in one lock section.  Pool lock held. */
static void cache_freed(Allocator *A, DevicePool *pool, Block *b, size_t requested)
{
    b->poisoned = 0;
    if (atomic_load_explicit(&A->tl.on, memory_order_relaxed)) {
        Block freed = *b;   /* a range may merge into its neighbour and be gone */
        cache_block(pool, b);
        timeline_record(&A->tl, EV_FREE, pool, &freed, requested);
    } else {
        cache_block(pool, b);
    }
}

/* Debug mode's free: the hook poisons the block (the block is this thread's alone until it is cached); 0, or 1
 * with the hook's exception set. */
static int free_hooked(Allocator *A, DevicePool *pool, Block *b, size_t requested, PyObject *hook)
{
    int hook_failed = call_hook(hook, "on_free", b, requested) < 0;
    drop_hook(hook);
    if (hook_failed) {   /* the hook's exception stays set */
        b->poisoned = 0;
        if (is_allocation(b)) {   /* not cached unpoisoned: back to the device, unless a capture forbids it */
            A->ops->discard(A, pool, b);
            return 1;
        }
        pthread_mutex_lock(&pool->lock);   /* a range is no device allocation: cached, known unpoisoned */
        pool->st.bytes_releasing -= b->size;
        cache_block(pool, b);
        pthread_mutex_unlock(&pool->lock);
        return 1;
    }
    pthread_mutex_lock(&pool->lock);
    pool->st.bytes_releasing -= b->size;
    b->poisoned = 1;
    Block freed = *b;
    cache_block(pool, b);
    timeline_record(&A->tl, EV_FREE, pool, &freed, requested);
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

int xp_free(Allocator *A, int device, uintptr_t ptr, int *holds_ref)
{
    *holds_ref = 0;
    if (xp_check_device(A, device) < 0) return -1;
    DevicePool *pool = pool_lookup(A, device);
    PyObject *hook = NULL;
    Block *b = NULL;
    size_t requested = 0, tail;
    if (pool) {
        hook = debug_snapshot(A, &tail);
        pthread_mutex_lock(&pool->lock);
        b = ptrtable_remove(&pool->live, ptr);
        if (b) {
            *holds_ref = b->origin == ORIGIN_CUPY;
            requested = b->requested;
            b->handed_out = 0;
            pool->st.frees++;
            pool->st.blocks_in_use--; pool->st.bytes_in_use -= b->size;
            pool->st.bytes_requested -= requested;
            origin_out(&pool->st, b->origin, b->size);
            if (!hook) {   /* the hot path: one lock section */
                cache_freed(A, pool, b, requested);
                pthread_mutex_unlock(&pool->lock);
                return 0;
            }
            /* debug mode: out of the live table, so check() never reads it half poisoned and no other free can
             * take it; neither in use nor cached while the hook works on it, it counts on bytes_releasing */
            pool->st.bytes_releasing += b->size;
        }
        pthread_mutex_unlock(&pool->lock);
    }
    if (!b) {
        drop_hook(hook);
        if (A->forked && forget_inherited(A, device, ptr, holds_ref)) return 2;
        PyErr_Format(PyExc_ValueError, "xpool: pointer %p on device %d was not handed out by this pool "
                     "(or was freed twice)", (void *)ptr, device);   /* %p: PyErr_Format has no %zx */
        return -1;
    }
    return free_hooked(A, pool, b, requested, hook);
}

/* ------------------------------------------------------------------ giving back */

long long xp_release(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep, int empty,
                     XpGil *g)
{
    int capturing = device_captures(A, pool, stream);   /* then nothing goes back here: the capture would end */
    if (capturing) return capturing < 0 ? -1 : 0;
    return A->ops->release(A, pool, all_streams, stream, keep, empty && !keep && all_streams, g);
}

/* ------------------------------------------------------------------ CuPy's CFunctionAllocator hooks
 *
 * Note [CuPy's hooks].  xpool.MemoryPool.malloc is CuPy's own CFunctionAllocator calling these two functions: CuPy
 * builds its memory object in Cython, xpool keeps its tables in C behind one mutex per device (docs/decisions/0004).
 * The stream is CuPy's C get_stream_ptr(device), reached through its __pyx_capi__ capsule (signature checked):
 * CuPy's own pool asks get_current_stream_ptr(), which looks up one thread-local more and asks CUDA for the current
 * device first.  CuPy (Cython 3) checks for a Python error when a hook returns (void *)-1, so an OutOfMemoryError
 * raised here comes out of cupy.empty intact; the lookup may raise too (-1 with an error set), and a lookup answering
 * a negative number without one is refused (no handle is negative: those are per-thread keys).  CuPy's memory object
 * does not keep the allocator alive, so each block handed to CuPy holds a reference to it. */

/* void *malloc(void *param, size_t size, int device): CuPy (Cython 3) checks for a Python error when this returns
 * (void *)-1, so an exception set here propagates out of cupy's allocation as-is. */
void *cupy_malloc(void *param, size_t size, int device)
{
    Allocator *A = (Allocator *)param;
    if (size > XP_MAX_REQUEST) {   /* before the debug tail is added: near 2**64 the sum would wrap */
        xp_refuse_request(size);
        return (void *)(intptr_t)-1;
    }
    if (xp_check_device(A, device) < 0) return (void *)(intptr_t)-1;
    intptr_t stream = 0;
    if (A->stream_fn) {
        /* the device's own current stream: CuPy's get_current_stream_ptr() would first ask CUDA which device is
         * current (cudaGetDevice) and look up a second thread-local, and the device is given */
        stream = A->stream_fn(device);
        if (PyErr_Occurred()) return (void *)(intptr_t)-1;   /* CuPy 14 fails with -1, CuPy 13 with 0 */
        if (stream < 0) {
            PyErr_Format(PyExc_ValueError, "xpool: CuPy's current stream of device %d is %zd, not a stream handle",
                         device, (Py_ssize_t)stream);
            return (void *)(intptr_t)-1;
        }
        stream = stream_key(stream);
    }
    Block *b = xp_alloc(A, device, stream, size, ORIGIN_CUPY);
    if (!b) return (void *)(intptr_t)-1;
    Py_INCREF(A);   /* CuPy's memory object does not own the allocator: each block does */
    return (void *)b->ptr;
}

/* void free(void *param, void *ptr, int device): called from a destructor, maybe while an exception propagates
 * (which must survive), so an error here can only be reported, not raised. */
void cupy_free(void *param, void *ptr, int device)
{
    Allocator *A = (Allocator *)param;
    /* CuPy's CFunctionAllocatorMemory calls this from a Cython __dealloc__, which has already set any exception
     * aside: usually there is none, and checking costs less than taking and putting back */
    PyObject *in_flight = PyErr_Occurred() ? PyErr_GetRaisedException() : NULL;
    int holds_ref;
    int r = xp_free(A, device, (uintptr_t)ptr, &holds_ref);
    if (r == -1 || r == 1) PyErr_WriteUnraisable(NULL);
    if (in_flight) PyErr_SetRaisedException(in_flight);
    if (holds_ref) Py_DECREF(A);   /* last: it may be the allocator's last reference */
}
