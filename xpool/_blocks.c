/* xpool._core: schemes seed and segments, whose blocks are backend allocations (seed: one per block, of its size
 * class) or ranges of them (segments: best fit in segments, _segments.c).  Their miss, their try of the ladder and
 * their giving back; the hit side is _hot.h's (see _core.h for the layers and the locks).
 *
 * Note [Small segments].  Scheme segments gives a block up to 1 MiB a segment of XP_SMALL_SEGMENT (2 MiB), which
 * later small blocks of its stream share, as PyTorch's small pool does: a loop of many small blocks makes a few
 * device calls, not one each.  A larger block's segment is its own size (rounded to 512 B).  Where the 2 MiB would
 * break the limit or the device's size the segment is the block alone: the request may still fit. */
#include "_hot.h"

/* ------------------------------------------------------------------ giving back */

/* Takes cached blocks (of one stream, or all) out of the cache into blocks[*n..cap) until at most `keep` bytes
 * stay cached: class blocks, or whole free segments (a segment partly in use stays).  Their bytes move to
 * bytes_releasing, so they still count against the limit.  Pool lock held. */
static void take_idle(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep,
                      Block **blocks, size_t *n, size_t cap)
{
    size_t first = *n;
    if (A->scheme == XP_SCHEME_SEED) {
        for (size_t i = 0; i < pool->bins.cap && pool->st.bytes_cached > keep; i++) {
            Bin *bin = pool->bins.slots[i];
            if (!bin || (!all_streams && bin->stream != stream)) continue;
            while (bin->top && pool->st.bytes_cached > keep) {
                Block *b = bin->top;
                bin->top = b->next; bin->count--;
                b->next = NULL;
                pool->st.blocks_cached--; pool->st.bytes_cached -= b->size;
                blocks[(*n)++] = b;
            }
        }
    } else if (seg_any_free(&pool->segs)) {
        uint64_t cached = pool->st.bytes_cached;
        SegDelta d = {0, 0};
        seg_take_whole(&pool->segs, all_streams, stream, keep, &cached, blocks, n, cap, &d);
        apply_delta(&pool->st, d);
    }
    for (size_t i = first; i < *n; i++) pool->st.bytes_releasing += blocks[i]->size;
}

/* Gives a block that is in no table, its bytes on bytes_releasing, back to the device (backend.free).  A free that
 * raises has not freed the block (the Backend contract): it goes back to the cache, so the counters keep matching
 * what the device holds and a later release tries again; -1 with the backend's exception. */
static int give_back(Allocator *A, DevicePool *pool, Block *b)
{
    PyObject *r = PyObject_CallMethod(A->backend, "free", "iKn", pool->device, (unsigned long long)b->ptr,
                                      (Py_ssize_t)b->size);
    Py_XDECREF(r);
    pthread_mutex_lock(&pool->lock);
    pool->st.bytes_releasing -= b->size;
    if (r) {
        pool->st.device_frees++;
        stream_use_gone(pool, b->stream);
        timeline_record(&A->tl, EV_RELEASE, pool, b, 0);
    } else {
        cache_block(pool, b);
    }
    pthread_mutex_unlock(&pool->lock);
    if (!r) return -1;
    free(b);
    return 0;
}

/* XpScheme.discard: back unless a stream of the device captures (then, or if that cannot be asked, cached),
 * keeping any exception set.  Not known to hold poison either way. */
static void discard(Allocator *A, DevicePool *pool, Block *b)
{
    PyObject *exc = PyErr_GetRaisedException();
    int capturing = backend_captures(A, pool, b->stream);
    if (capturing < 0) PyErr_Clear();
    b->poisoned = 0;
    if (capturing) {
        pthread_mutex_lock(&pool->lock);
        pool->st.bytes_releasing -= b->size;
        cache_block(pool, b);
        pthread_mutex_unlock(&pool->lock);
    } else if (give_back(A, pool, b) < 0) {
        PyErr_Clear();   /* then it is cached */
    }
    PyErr_SetRaisedException(exc);
}

/* XpScheme.release: every block tried (those whose free fails are cached again); the bytes the device got back,
 * or -1 with the first failed free's exception. */
static long long release(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep, int empty,
                         XpGil *g)
{
    (void)empty; (void)g;
    Block **blocks = NULL;
    size_t n = 0;
    int no_memory = 0;
    pthread_mutex_lock(&pool->lock);
    size_t cap = pool->st.blocks_cached;
    if (cap && pool->st.bytes_cached > keep) {
        blocks = malloc(cap * sizeof(Block *));
        if (blocks) take_idle(A, pool, all_streams, stream, keep, blocks, &n, cap);
        else no_memory = 1;
    }
    pthread_mutex_unlock(&pool->lock);
    if (no_memory) { PyErr_NoMemory(); return -1; }
    PyObject *first = NULL;
    long long released = 0;
    for (size_t i = 0; i < n; i++) {
        size_t size = blocks[i]->size;
        if (give_back(A, pool, blocks[i]) == 0) released += (long long)size;
        else if (!first) first = PyErr_GetRaisedException();
        else PyErr_Clear();
    }
    free(blocks);
    if (first) { PyErr_SetRaisedException(first); return -1; }
    return released;
}

/* XpScheme.free_cache: everything cached on the device goes back. */
static int free_cache(Allocator *A, DevicePool *pool, Climb *c, XpGil *g)
{
    (void)c;
    return release(A, pool, 1, 0, 0, 1, g) < 0 ? TRY_FAILED : 0;
}

/* ------------------------------------------------------------------ a try of the ladder */

/* One try: count the bytes against the limit, under the lock, before the backend is called (once: they stay
 * pending for the next tries), then backend.malloc.  TRY_NO_ROOM when the limit or a MemoryError refuses;
 * TRY_FAILED with any other error. */
static int try_once(Allocator *A, DevicePool *pool, Climb *c)
{
    c->refused = c->size;
    if (!c->reserved) {
        pthread_mutex_lock(&pool->lock);
        uint64_t limit = pool->limit;
        c->reserved = !limit || committed(&pool->st) + c->size <= limit;
        if (c->reserved) pool->st.bytes_pending += c->size;
        pthread_mutex_unlock(&pool->lock);
        if (!c->reserved) {
            c->by_device = 0;
            c->over_limit = c->size > limit;
            return TRY_NO_ROOM;
        }
    }
    PyObject *r = PyObject_CallMethod(A->backend, "malloc", "in", pool->device, (Py_ssize_t)c->size);
    if (!r) {
        if (!PyErr_ExceptionMatches(PyExc_MemoryError)) return TRY_FAILED;
        Py_XSETREF(c->cause, PyErr_GetRaisedException());
        c->by_device = 1;
        return TRY_NO_ROOM;
    }
    unsigned long long p = PyLong_Check(r) ? PyLong_AsUnsignedLongLong(r) : 0;
    if (PyErr_Occurred()) p = 0;   /* negative, or past 64 bits */
    if (!p) {   /* 0 is no address: a block there could never be told apart from "released" */
        PyErr_Clear();
        PyErr_Format(PyLong_Check(r) ? PyExc_ValueError : PyExc_TypeError,
                     "backend.malloc(%d, %zu) must return the block's address, an int > 0; got %R", pool->device,
                     c->size, r);
        Py_DECREF(r);
        return TRY_FAILED;
    }
    Py_DECREF(r);
    pthread_mutex_lock(&pool->lock);
    pool->st.device_mallocs++;
    if (c->step) pool->st.oom_recoveries++;
    StreamUse *u = stream_use(pool, c->stream, 1);   /* made before the try (new_allocation): no memory needed */
    if (u) u->allocations++;
    pthread_mutex_unlock(&pool->lock);
    c->ptr = (uintptr_t)p;
    return TRY_GOT;
}

/* XpScheme.try_: try_once, but a segment larger than its block (a small block's shared segment) that finds no room,
 * by the limit or the device, falls back to the block's own bytes at once, before anything is freed. */
static int try_malloc(Allocator *A, DevicePool *pool, Climb *c, XpGil *g)
{
    (void)g;
    int r = try_once(A, pool, c);
    if (r != TRY_NO_ROOM || c->size <= c->exact) return r;
    if (c->reserved) {
        pthread_mutex_lock(&pool->lock);
        pool->st.bytes_pending -= c->size - c->exact;
        pthread_mutex_unlock(&pool->lock);
    }
    c->size = c->exact;
    return try_once(A, pool, c);
}

/* ------------------------------------------------------------------ new blocks */

/* The bin of (stream, class size), made when there is none; NULL without memory.  Pool lock held. */
static Bin *bintable_get(BinTable *t, intptr_t stream, size_t size)
{
    Bin *bin = bintable_find(t, stream, size);
    if (bin) return bin;
    if ((t->used + 1) * 2 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        Bin **slots = calloc(cap, sizeof(Bin *));
        if (!slots) return NULL;
        for (size_t i = 0; i < t->cap; i++) {
            Bin *b = t->slots[i];
            if (!b) continue;
            size_t h = bin_hash(b->stream, b->size) & (cap - 1);
            while (slots[h]) h = (h + 1) & (cap - 1);
            slots[h] = b;
        }
        free(t->slots);
        t->slots = slots; t->cap = cap;
    }
    bin = calloc(1, sizeof(Bin));
    if (!bin) return NULL;
    bin->stream = stream; bin->size = size;
    size_t h = bin_hash(stream, size) & (t->cap - 1);
    while (t->slots[h]) h = (h + 1) & (t->cap - 1);
    t->slots[h] = bin; t->used++;
    return bin;
}

/* A new Block of `bytes` (a segment, or `exact`, the block's own bytes, when the segment finds no room) up the
 * ladder, with the GIL; its bytes stay pending until record_new().  A request larger than the whole device raises
 * at once (reason too_large). */
static Block *new_allocation(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t bytes,
                             size_t exact, int origin, int hooked)
{
    uint64_t capacity = pool_capacity(A, pool);
    if (capacity && bytes > capacity) {
        if (exact > capacity) {   /* no freeing or retrying can help: bad input */
            raise_oom(A, pool, requested, exact, "too_large", NULL);
            return NULL;
        }
        bytes = exact;
    }
    Block *b = calloc(1, sizeof(Block));
    pthread_mutex_lock(&pool->lock);
    int known = stream_use(pool, stream, 1) != NULL;   /* its stream is asked before anything goes back */
    pthread_mutex_unlock(&pool->lock);
    if (!b || !known) {
        free(b);
        PyErr_NoMemory();
        return NULL;
    }
    Climb c = {.requested = requested, .size = bytes, .exact = exact, .stream = stream};
    XpGil g = XP_GIL_HELD;
    if (climb(A, pool, &c, &g) != TRY_GOT) {
        free(b);
        return NULL;
    }
    b->ptr = c.ptr; b->size = c.size; b->requested = requested;
    b->stream = stream; b->device = pool->device; b->origin = origin; b->handed_out = !hooked;
    return b;
}

/* Records a new allocation as a block in use: a segment's first `size` bytes, the rest of it a free range.  The
 * block, or NULL (no room in the live table: the allocation is given back). */
static Block *record_new(Allocator *A, DevicePool *pool, Block *b, size_t size)
{
    pthread_mutex_lock(&pool->lock);
    pool->st.bytes_pending -= b->size;
    b->serial = pool->st.requests;
    if (ptrtable_insert(&pool->live, b) < 0) {
        pool->st.bytes_releasing += b->size;
        pthread_mutex_unlock(&pool->lock);
        PyErr_NoMemory();
        discard(A, pool, b);
        return NULL;
    }
    if (b->in_segment) {
        SegDelta d = {0, 0};
        seg_init(&pool->segs, b, size, &d);   /* the rest: a free range, poisoned if b was */
        apply_delta(&pool->st, d);
        b->poisoned = 0;
    }
    count_in_use(A, pool, b, EV_MISS);
    pthread_mutex_unlock(&pool->lock);
    return b;
}

/* Scheme seed's miss: one device allocation of the block's class.  Its bin exists before the block is handed out,
 * so freeing it never needs memory. */
static Block *seed_make(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
                        PyObject *hook, int origin)
{
    pthread_mutex_lock(&pool->lock);
    Bin *bin = bintable_get(&pool->bins, stream, size);
    pthread_mutex_unlock(&pool->lock);
    if (!bin) {
        PyErr_NoMemory();
        return NULL;
    }
    Block *b = new_allocation(A, pool, stream, requested, size, size, origin, hook != NULL);
    return b ? record_new(A, pool, b, size) : NULL;
}

/* Bytes of a new segment for a `size`-byte range (Note [Small segments]): exactly size when the shared segment
 * would break the limit. */
static size_t segment_bytes(DevicePool *pool, size_t size)
{
    size_t got = seg_size_for(size, size <= XP_SMALL_MAX ? XP_SMALL_SEGMENT : XP_ALIGN);
    if (got == size) return got;
    pthread_mutex_lock(&pool->lock);
    uint64_t limit = pool->limit, res = committed(&pool->st);
    pthread_mutex_unlock(&pool->lock);
    return limit && res + got > limit ? size : got;
}

/* Scheme segments' miss: a new segment, the block its first range (best fit found no free range that fits). */
static Block *segments_make(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
                            PyObject *hook, int origin)
{
    Block *b = new_allocation(A, pool, stream, requested, segment_bytes(pool, size), size, origin, hook != NULL);
    if (!b) return NULL;
    size_t got = b->size;   /* the segment, or the block alone when the segment found no room */
    b->in_segment = 1;      /* from here a failed give_back caches it as a whole free segment */
    if (got > size && hook) {
        /* the rest of the segment is cached from the start: poisoned, as a freed block is */
        if (call_hook(hook, "on_segment", b, 0) < 0) {
            pthread_mutex_lock(&pool->lock);
            pool->st.bytes_pending -= got;
            pool->st.bytes_releasing += got;
            pthread_mutex_unlock(&pool->lock);
            discard(A, pool, b);   /* a whole free segment, unpoisoned, if it stays */
            return NULL;
        }
        b->poisoned = 1;
    }
    return record_new(A, pool, b, size);
}

const XpScheme xp_seed = {"seed", seed_make, try_malloc, free_cache, release, backend_captures, discard};
const XpScheme xp_segments = {"segments", segments_make, try_malloc, free_cache, release, backend_captures, discard};
