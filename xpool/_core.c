/*
 * xpool._core: the hot path of xpool's caching allocator.
 *
 * Layers, bottom up (as in CuPy's memory.pyx):
 *   size_class()  a pure function: request bytes -> class bytes
 *   Block         one device allocation of one class size (scheme seed), or a range of a
 *                 segment (scheme xpool: best fit, split, merged again; _segments.c)
 *   PtrTable      open-addressing map ptr -> Block, for the blocks in use
 *   BinTable      open-addressing map (stream, class) -> Bin, a LIFO stack of free Blocks
 *   DevicePool    one per device: the two tables, the statistics, the limit, one mutex
 *   Allocator     the Python object: the device registry, the backend, the timeline
 *
 * The raw device allocate/free functions are never called from C directly:
 * they belong to a Python "backend" object (CuPy's runtime on a GPU, real host
 * memory in the tests), called only on a miss, on trimming and on OOM
 * recovery.  The hit path is pure C.
 *
 * Concurrency.  Every entry point runs with the GIL held (CuPy calls the
 * CFunctionAllocator hooks from Cython with the GIL), and the module says so
 * to free-threaded CPython (Py_MOD_GIL_USED): the debug hook's Python state,
 * the hook and backend references and the fork bookkeeping rely on it.  The
 * mutexes guard the C structures and document ownership.  PyTorch's hooks
 * (xpool_torch_malloc/free) are the exception: PyTorch calls them without the
 * GIL; their hit and free paths touch only C structures under the pool mutex,
 * and every path that runs Python takes the GIL first (see there).
 * Lock order: Allocator.registry_lock, Allocator.debug_lock: each alone;
 * DevicePool.lock -> Allocator.timeline_lock.  No lock is ever held while
 * Python code runs (backend calls, debug hooks, gc): a Python call may switch
 * threads, and a thread blocked on a C mutex while holding the GIL would
 * deadlock with the holder waiting for the GIL.
 *
 * The limit.  Every byte the backend may hold for a device is counted while
 * the pool lock is dropped around a backend call: bytes_pending from before a
 * device malloc until its block is recorded, bytes_releasing from when a block
 * leaves the cache until the backend has freed it.  So threads sharing a
 * device cannot pass the limit check together, and the device never holds
 * more than the limit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "_segments.h"

#define XP_ALIGN 512u                     /* cudaMalloc alignment and the small-class step */
#define XP_SMALL_MAX (1u << 20)           /* up to 1 MiB: multiples of 512 B */
#define XP_MAX_REQUEST ((size_t)1 << 48)  /* 256 TiB: larger than any device */
#define XP_MAX_DEVICES 64
#define XP_MAX_CLASSES_PER_DOUBLING 64
#define XP_STREAM_PER_THREAD 2            /* cudaStreamPerThread's handle value */
#define XP_MAX_DEBUG_TAIL (1 << 20)       /* canary bytes; keeps request + tail far from wrapping */
#define XP_EXPORT __attribute__((visibility("default")))   /* symbols PyTorch looks up by name */
/* Scheme xpool cuts every block from segments (best fit, split, merge; _segments.c).  Scheme seed
 * (the design's) gives each block a device allocation of its class: 512 B steps to 1 MiB, then k
 * classes per doubling.  Replays of recorded traces chose segments for small blocks too: with
 * sequence lengths that vary, 512 B classes made 30-190 device mallocs per step (memory_study.py). */
#define XP_SCHEME_XPOOL 0
#define XP_SCHEME_SEED 1

/* Who a block was handed to: CuPy's C hooks, PyTorch's pluggable-allocator hooks, Allocator.allocate(). */
enum { ORIGIN_CUPY = 0, ORIGIN_TORCH = 1, ORIGIN_PYTHON = 2, XP_ORIGINS = 3 };
static const char *const origin_names[XP_ORIGINS] = {"cupy", "torch", "python"};

#if PY_VERSION_HEX < 0x030C0000
/* The 3.12 exception API, for 3.10 and 3.11. */
static PyObject *PyErr_GetRaisedException(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!type) return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

static void PyErr_SetRaisedException(PyObject *exc)
{
    if (!exc) { PyErr_Clear(); return; }
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}
#endif

/* ------------------------------------------------------------------ size classes */

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

/* The j-th of the k classes between p and 2p. */
static inline size_t klass(size_t p, size_t j, unsigned k)
{
    return round_up(p + (j * p + k - 1) / k, XP_ALIGN);
}

/* Class of an n-byte request; k classes per doubling above 1 MiB.  0 for n too large. */
static size_t size_class(size_t n, unsigned k)
{
    if (n <= XP_SMALL_MAX)
        return n == 0 ? XP_ALIGN : round_up(n, XP_ALIGN);
    if (n > XP_MAX_REQUEST)
        return 0;
    /* p: the largest power of two below n, so p < n <= 2p */
    size_t p = (size_t)1 << (63 - __builtin_clzll((unsigned long long)(n - 1)));
    size_t j = ((n - p) * k + p - 1) / p;          /* least j with p + j p / k >= n */
    /* class j is p + ceil(j p / k) rounded up to 512 B; the rounding can make
     * class j-1 large enough already (p / k >= 16 KiB, so one step at most) */
    if (j > 1 && klass(p, j - 1, k) >= n) j--;
    return klass(p, j, k);
}

/* Bytes a block takes: its class (seed), or the request rounded up to 512 B, cut from a segment
 * (xpool).  0 for n too large. */
static size_t block_size(size_t n, int scheme, unsigned k)
{
    if (scheme == XP_SCHEME_SEED) return size_class(n, k);
    return n > XP_MAX_REQUEST ? 0 : n == 0 ? XP_ALIGN : round_up(n, XP_ALIGN);
}

/* ------------------------------------------------------------------ blocks and tables */

/* Block (a class block, or a range of a segment) is defined in _segments.h */

#define TOMBSTONE ((Block *)1)

typedef struct {
    Block **slots;
    size_t cap;             /* power of two */
    size_t used;            /* live entries */
    size_t filled;          /* live + tombstones */
} PtrTable;

typedef struct Bin {
    intptr_t stream;
    size_t size;
    Block *top;
    size_t count;
} Bin;

typedef struct {
    Bin **slots;
    size_t cap;
    size_t used;
} BinTable;

static inline size_t mix(uint64_t x)
{
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return (size_t)(x ^ (x >> 33));
}

#define PTRTABLE_MIN_CAP 256

/* Rehashes into a table sized for the live entries alone, dropping the
 * tombstones: at most a quarter full afterwards, so the next rehash is at
 * least cap/4 inserts away (amortised O(1)), and a table whose blocks came and
 * went at ever new addresses stays as small as what is alive. */
static int ptrtable_rehash(PtrTable *t)
{
    size_t cap = PTRTABLE_MIN_CAP;
    while ((t->used + 1) * 4 > cap) cap *= 2;
    Block **slots = calloc(cap, sizeof(Block *));
    if (!slots) return -1;
    for (size_t i = 0; i < t->cap; i++) {
        Block *b = t->slots[i];
        if (b && b != TOMBSTONE) {
            size_t h = mix(b->ptr) & (cap - 1);
            while (slots[h]) h = (h + 1) & (cap - 1);
            slots[h] = b;
        }
    }
    free(t->slots);
    t->slots = slots; t->cap = cap; t->filled = t->used;
    return 0;
}

static int ptrtable_insert(PtrTable *t, Block *b)
{
    if ((t->filled + 1) * 2 > t->cap && ptrtable_rehash(t) < 0) return -1;
    size_t h = mix(b->ptr) & (t->cap - 1);
    while (t->slots[h] && t->slots[h] != TOMBSTONE) h = (h + 1) & (t->cap - 1);
    if (!t->slots[h]) t->filled++;
    t->slots[h] = b; t->used++;
    return 0;
}

static Block **ptrtable_slot(PtrTable *t, uintptr_t ptr)
{
    if (!t->cap) return NULL;
    size_t h = mix(ptr) & (t->cap - 1);
    for (Block *b; (b = t->slots[h]); h = (h + 1) & (t->cap - 1))
        if (b != TOMBSTONE && b->ptr == ptr) return &t->slots[h];
    return NULL;
}

static Block *ptrtable_remove(PtrTable *t, uintptr_t ptr)
{
    Block **slot = ptrtable_slot(t, ptr);
    if (!slot) return NULL;
    Block *b = *slot;
    *slot = TOMBSTONE; t->used--;
    return b;
}

static inline size_t bin_hash(intptr_t stream, size_t size)
{
    return mix((uint64_t)stream * 0x9e3779b97f4a7c15ULL ^ (uint64_t)size);
}

static Bin *bintable_find(BinTable *t, intptr_t stream, size_t size)
{
    if (!t->cap) return NULL;
    size_t h = bin_hash(stream, size) & (t->cap - 1);
    for (Bin *b; (b = t->slots[h]); h = (h + 1) & (t->cap - 1))
        if (b->size == size && b->stream == stream) return b;
    return NULL;
}

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

/* ------------------------------------------------------------------ device pools */

typedef struct {
    uint64_t requests, hits, misses, device_mallocs, device_frees, frees;
    uint64_t oom_recoveries, oom_errors;
    uint64_t blocks_in_use, blocks_cached;
    uint64_t bytes_in_use;            /* class bytes of blocks in use */
    uint64_t bytes_requested;         /* requested bytes of blocks in use */
    uint64_t bytes_cached;            /* class bytes of free blocks */
    uint64_t bytes_pending;           /* reserved for device mallocs in flight */
    uint64_t bytes_releasing;         /* taken from the cache, the backend's free not yet returned */
    uint64_t peak_bytes_in_use, peak_bytes_requested, peak_bytes_reserved;
    /* class bytes in use by origin; [ORIGIN_CUPY] stays 0: CuPy's share is bytes_in_use less the
     * others, so CuPy's path pays no counter for it (see origin_in/origin_out) */
    uint64_t bytes_in_use_by[XP_ORIGINS];
} Stats;

static inline void origin_in(Stats *s, int origin, size_t size)
{
    if (origin != ORIGIN_CUPY) s->bytes_in_use_by[origin] += size;
}

static inline void origin_out(Stats *s, int origin, size_t size)
{
    if (origin != ORIGIN_CUPY) s->bytes_in_use_by[origin] -= size;
}

typedef struct DevicePool {
    pthread_mutex_t lock;
    int device;
    /* everything below is guarded by lock */
    PtrTable live;          /* blocks in use, by pointer */
    BinTable bins;          /* free blocks, by (stream, class) */
    FreeTree segs;          /* free ranges of segments (scheme xpool), by (stream, size, ptr) */
    Stats st;
    uint64_t limit;         /* bytes the device may hold for this pool, pending mallocs included; 0 = none */
    uint64_t capacity;      /* the device's total bytes, asked once on the first miss; 0 = unknown */
    uint64_t high_water;    /* most bytes committed by a device malloc of this pool (release_for_miss);
                               reset_peaks leaves it alone: it is the pool's own, not a statistic */
    uint64_t miss_released; /* bytes misses gave back since the last empty_cache (release_for_miss) */
    int miss_release_off;   /* they passed XP_MISS_BUDGET marks: misses give nothing back until empty_cache */
    struct DevicePool *older;   /* in a fork()ed child: the parent's pool it replaced (forked_pools) */
} DevicePool;

/* Bytes the device holds for the pool: in use, cached, and being given back. */
static inline uint64_t reserved(const Stats *s)
{
    return s->bytes_in_use + s->bytes_cached + s->bytes_releasing;
}

/* What the limit is checked against: reserved plus device mallocs in flight. */
static inline uint64_t committed(const Stats *s) { return reserved(s) + s->bytes_pending; }

static void apply_delta(Stats *st, SegDelta d)
{
    st->blocks_cached += d.free_ranges;
    st->bytes_cached += d.free_bytes;
}

static void note_peaks(Stats *s)
{
    if (s->bytes_in_use > s->peak_bytes_in_use) s->peak_bytes_in_use = s->bytes_in_use;
    if (s->bytes_requested > s->peak_bytes_requested) s->peak_bytes_requested = s->bytes_requested;
    if (reserved(s) > s->peak_bytes_reserved) s->peak_bytes_reserved = reserved(s);
}

/* ------------------------------------------------------------------ timeline */

enum { EV_HIT = 1, EV_MISS = 2, EV_FREE = 3, EV_RELEASE = 4, EV_OOM = 5 };

typedef struct {
    int64_t t_ns;
    int32_t device;
    int32_t event;
    int64_t stream;
    uint64_t ptr;
    uint64_t requested;
    uint64_t size;
    uint64_t bytes_in_use;
    uint64_t bytes_cached;
    int32_t origin;         /* the block's origin; -1 for an event without a block (oom) */
    int32_t unused;
} Event;

typedef struct {
    _Atomic int on;         /* read without the lock: the hot path pays one load when off */
    pthread_mutex_t lock;   /* taken after a DevicePool.lock, never before */
    Event *buf;             /* ring of cap events, NULL when off */
    size_t cap;
    uint64_t count;         /* events ever recorded since the last clear */
} Timeline;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void timeline_record(Timeline *tl, int event, const DevicePool *pool, const Block *b,
                            size_t requested)
{
    if (!atomic_load_explicit(&tl->on, memory_order_relaxed)) return;
    pthread_mutex_lock(&tl->lock);
    if (tl->buf) {
        Event *e = &tl->buf[tl->count % tl->cap];
        e->t_ns = now_ns();
        e->device = pool->device;
        e->event = event;
        e->stream = b ? b->stream : 0;
        e->ptr = b ? b->ptr : 0;
        e->requested = requested;
        e->size = b ? b->size : 0;
        e->bytes_in_use = pool->st.bytes_in_use;
        e->bytes_cached = pool->st.bytes_cached;
        e->origin = b ? b->origin : -1;
        tl->count++;
    }
    pthread_mutex_unlock(&tl->lock);
}

/* ------------------------------------------------------------------ the Allocator object */

/* CuPy's `intptr_t get_stream_ptr(int device)` (cupy_backends.cuda.stream): the current stream of a
 * device, as this thread set it; it may raise (no CUDA driver), returning -1 (Cython 3) or 0 (Cython 0.29). */
typedef intptr_t (*stream_fn_t)(int device);

/* release_on_miss: what a miss of scheme xpool gives back first (release_for_miss) */
enum { XP_RELEASE_OFF, XP_RELEASE_HIGH_WATER, XP_RELEASE_ALL, XP_RELEASE_MAX = XP_RELEASE_ALL };
#define XP_RELEASE_IDLE 64  /* requests a whole free segment must stay so before a miss gives it back
                               (release_for_miss) */
#define XP_MISS_BUDGET 1    /* bytes misses may give back, in high-water marks, until empty_cache
                               (release_for_miss) */

typedef struct {
    PyObject_HEAD
    PyObject *backend;        /* .malloc(device, nbytes) -> int, .free(device, ptr, nbytes): xpool.backends.Backend */
    PyObject *error_factory;  /* (device, requested, size, in_use, cached, limit, reason) -> exception */
    PyObject *weakreflist;
    stream_fn_t stream_fn;    /* a device's current stream, from CuPy; NULL: stream 0 unless given */
    unsigned k;               /* classes per doubling above 1 MiB (scheme seed) */
    int scheme;               /* XP_SCHEME_*: how blocks are made */
    size_t segment_round;     /* scheme xpool: a new segment for a block above 1 MiB: rounded up to this */
    size_t small_segment;     /* scheme xpool: a new segment for a block up to 1 MiB: rounded up to this */
    int release_on_miss;      /* scheme xpool: XP_RELEASE_*: which whole free segments of its stream a miss
                                 gives back first (release_for_miss) */
    uint64_t release_idle;    /* XP_RELEASE_HIGH_WATER: a miss gives back only segments whole and free for at
                                 least this many requests (release_for_miss); default XP_RELEASE_IDLE */
    int tells_capture;        /* the backend has .capturing(device, stream): stream_capturing asks it */
    int forked;               /* set in a fork()ed child */
    pthread_mutex_t debug_lock;     /* guards debug_hook and debug_tail: set_debug swaps them together */
    PyObject *debug_hook;     /* NULL, or .on_alloc(info) / .on_free(info) / .on_reuse(info) */
    size_t debug_tail;        /* bytes of canary room added in debug mode */
    _Atomic int debug_on;     /* debug_hook != NULL; read without the lock, so the hot path pays one load */
    pthread_mutex_t registry_lock;  /* guards creation of pools[], default_limit and default_fraction;
                                       lookups read pools[] atomically */
    uint64_t default_limit;   /* the limit of a device's pool when it is created; 0 = none */
    double default_fraction;  /* > 0: instead, that share of the device's memory */
    _Atomic(DevicePool *) pools[XP_MAX_DEVICES];
    /* In a fork()ed child: the parent's pools (linked by .older), whose blocks may still die here;
     * written only by forget_after_fork, in the child before it has other threads. */
    DevicePool *forked_pools[XP_MAX_DEVICES];
    Timeline tl;
} Allocator;

static PyObject *gc_collect;          /* gc.collect, for the second OOM retry */

static int collect_garbage(void)
{
    PyObject *r = PyObject_CallNoArgs(gc_collect);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* The device's total bytes, from backend.total_memory(device); -1 with its error. */
static int device_capacity(Allocator *A, int device, uint64_t *out)
{
    PyObject *r = PyObject_CallMethod(A->backend, "total_memory", "i", device);
    if (!r) return -1;
    *out = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    return PyErr_Occurred() ? -1 : 0;
}

/* A limit of `fraction` (> 0) of a device: at least one byte, never "no limit". */
static uint64_t limit_from_fraction(double fraction, uint64_t capacity)
{
    uint64_t limit = (uint64_t)(fraction * (double)capacity);
    return limit ? limit : 1;
}

static DevicePool *pool_get(Allocator *A, int device)
{
    if (device < 0 || device >= XP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device must be in [0, %d), got %d", XP_MAX_DEVICES, device);
        return NULL;
    }
    DevicePool *pool = atomic_load_explicit(&A->pools[device], memory_order_acquire);
    if (pool) return pool;
    pthread_mutex_lock(&A->registry_lock);
    uint64_t limit = A->default_limit, capacity = 0;
    double fraction = A->default_fraction;
    pthread_mutex_unlock(&A->registry_lock);
    if (fraction > 0) {   /* the limit is a share of this device: ask its size, outside the lock */
        if (device_capacity(A, device, &capacity) < 0) return NULL;
        limit = limit_from_fraction(fraction, capacity);
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

static PyObject *block_info(const Block *b, size_t requested)
{
    return Py_BuildValue("{s:i,s:K,s:n,s:n,s:L,s:K,s:s,s:O,s:O}", "device", b->device,
                         "ptr", (unsigned long long)b->ptr, "size", (Py_ssize_t)b->size,
                         "requested", (Py_ssize_t)requested, "stream", (long long)b->stream,
                         "serial", (unsigned long long)b->serial, "origin", origin_names[b->origin],
                         "guarded", b->guarded ? Py_True : Py_False,
                         "poisoned", b->poisoned ? Py_True : Py_False);
}

/* The debug hook (a new reference, NULL when off) and its tail, as one pair:
 * an operation uses the hook it started with, even if set_debug swaps it while
 * a hook call has let another thread run. */
static PyObject *debug_snapshot(Allocator *A, size_t *tail)
{
    *tail = 0;
    if (!atomic_load_explicit(&A->debug_on, memory_order_acquire)) return NULL;
    pthread_mutex_lock(&A->debug_lock);
    PyObject *hook = A->debug_hook;
    Py_XINCREF(hook);
    if (hook) *tail = A->debug_tail;
    pthread_mutex_unlock(&A->debug_lock);
    return hook;
}

/* Drops debug_snapshot()'s reference, keeping any exception set: it may be the
 * hook's last reference, and freeing it may run Python code. */
static void drop_hook(PyObject *hook)
{
    if (!hook) return;
    PyObject *exc = PyErr_GetRaisedException();
    Py_DECREF(hook);
    if (exc) PyErr_SetRaisedException(exc);
}

/* Calls hook.<name>(info); -1 with the hook's exception set if it raised. */
static int call_hook(PyObject *hook, const char *name, const Block *b, size_t requested)
{
    PyObject *info = block_info(b, requested);
    if (!info) return -1;
    PyObject *r = PyObject_CallMethod(hook, name, "O", info);
    Py_DECREF(info);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* Puts a block that is in no table into the cache, in the bin of its stream
 * and class.  That bin exists: xp_alloc makes it before the block is first
 * handed out, and bins are never removed, so caching never needs memory.
 * Pool lock held; the caller takes the block's bytes off the counter they
 * were on. */
static void cache_block(DevicePool *pool, Block *b)
{
    b->requested = 0;
    if (b->in_segment) {   /* merges with free neighbours: b may be freed, never use it after this */
        SegDelta d = {0, 0};
        seg_put(&pool->segs, b, &d);
        apply_delta(&pool->st, d);
        return;
    }
    Bin *bin = bintable_find(&pool->bins, b->stream, b->size);
    b->next = bin->top; bin->top = b; bin->count++;
    pool->st.blocks_cached++; pool->st.bytes_cached += b->size;
}

/* A cached block of `size` bytes for `stream`, taken off the cached counters; NULL when none.  Pool
 * lock held.  A range can come out larger than asked (no memory to split it): see b->size. */
static Block *cache_take(Allocator *A, DevicePool *pool, intptr_t stream, size_t size)
{
    if (A->scheme == XP_SCHEME_XPOOL) {
        SegDelta d = {0, 0};
        Block *b = seg_take(&pool->segs, stream, size, &d);
        apply_delta(&pool->st, d);
        return b;
    }
    Bin *bin = bintable_find(&pool->bins, stream, size);
    Block *b = bin ? bin->top : NULL;
    if (!b) return NULL;
    bin->top = b->next; bin->count--;
    b->next = NULL;
    pool->st.blocks_cached--; pool->st.bytes_cached -= b->size;
    return b;
}

/* Takes cached blocks of one device (of one stream, or all when all_streams)
 * out of the cache until at most `keep` bytes stay cached; their bytes move to
 * bytes_releasing, so they still count against the limit.  Pool lock held.
 * 0 with a malloc'd array in *out (*n blocks), -1 without memory. */
static int take_cached(DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep,
                       int segments_only, Block ***out, size_t *n)
{
    *n = 0; *out = NULL;
    size_t cap = pool->st.blocks_cached;
    if (!cap || pool->st.bytes_cached <= keep) return 0;
    Block **blocks = malloc(cap * sizeof(Block *));
    if (!blocks) return -1;
    for (size_t i = 0; !segments_only && i < pool->bins.cap && pool->st.bytes_cached > keep; i++) {
        Bin *bin = pool->bins.slots[i];
        if (!bin || (!all_streams && bin->stream != stream)) continue;
        while (bin->top && pool->st.bytes_cached > keep) {
            Block *b = bin->top;
            bin->top = b->next; bin->count--;
            b->next = NULL;
            pool->st.blocks_cached--; pool->st.bytes_cached -= b->size;
            pool->st.bytes_releasing += b->size;
            blocks[(*n)++] = b;
        }
    }
    if (seg_any_free(&pool->segs) && pool->st.bytes_cached > keep) {   /* of segments, whole free ones only */
        size_t first = *n;
        uint64_t cached = pool->st.bytes_cached;
        SegDelta d = {0, 0};
        seg_take_whole(&pool->segs, all_streams, stream, keep, &cached, blocks, n, cap, &d);
        apply_delta(&pool->st, d);
        for (size_t i = first; i < *n; i++) pool->st.bytes_releasing += blocks[i]->size;
    }
    *out = blocks;
    return 0;
}

/* 1 when `stream` (a free-list key) is being captured into a CUDA graph, as the backend's optional
 * .capturing(device, stream) says; 0 when not, or when the backend cannot tell; -1 with its exception.
 * Called with the GIL held and no pool lock, on the miss and out-of-memory paths only.  While a stream
 * captures, the pool must not give memory back: cudaFree synchronises the device, which ends the capture
 * with an error (cudaErrorStreamCaptureUnsupported) and loses the graph. */
static int stream_capturing(Allocator *A, int device, intptr_t stream)
{
    if (!A->tells_capture) return 0;
    intptr_t handle = stream < 0 ? XP_STREAM_PER_THREAD : stream;   /* a per-thread key: that thread's stream */
    PyObject *r = PyObject_CallMethod(A->backend, "capturing", "in", device, (Py_ssize_t)handle);
    if (!r) return -1;
    int yes = PyObject_IsTrue(r);
    Py_DECREF(r);
    return yes;
}

/* Gives a block that is in no table, its bytes on bytes_releasing, back to
 * the device.  A backend free that raises has not freed the block (the
 * Backend contract): it goes back to the cache, so the counters keep matching
 * what the device holds and a later release tries again; -1 with the
 * backend's exception. */
static int give_back(Allocator *A, DevicePool *pool, Block *b)
{
    PyObject *r = PyObject_CallMethod(A->backend, "free", "iKn", pool->device,
                                      (unsigned long long)b->ptr, (Py_ssize_t)b->size);
    Py_XDECREF(r);
    pthread_mutex_lock(&pool->lock);
    pool->st.bytes_releasing -= b->size;
    if (r) {
        pool->st.device_frees++;
        timeline_record(&A->tl, EV_RELEASE, pool, b, 0);
    } else {
        cache_block(pool, b);
    }
    pthread_mutex_unlock(&pool->lock);
    if (!r) return -1;
    free(b);
    return 0;
}

/* Gives cached blocks back to the device.  Returns bytes released; -1 with
 * the first failed free's exception (every block is tried; those whose free
 * failed stay cached). */
static long long release_from(Allocator *A, DevicePool *pool, int all_streams,
                              intptr_t stream, uint64_t keep, int segments_only)
{
    Block **blocks;
    size_t n;
    pthread_mutex_lock(&pool->lock);
    int taken = take_cached(pool, all_streams, stream, keep, segments_only, &blocks, &n);
    pthread_mutex_unlock(&pool->lock);
    if (taken < 0) { PyErr_NoMemory(); return -1; }
    long long released = 0;
    PyObject *first = NULL;
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

static long long release_cached(Allocator *A, DevicePool *pool, int all_streams,
                                intptr_t stream, uint64_t keep)
{
    return release_from(A, pool, all_streams, stream, keep, 0);
}

/* Whole free segments of one stream back to the device (scheme xpool, on a miss). */
static long long release_segments(Allocator *A, DevicePool *pool, intptr_t stream)
{
    return release_from(A, pool, 0, stream, 0, 1);
}

/* Bytes a miss wanting a `want`-byte segment should give back at the high-water mark (0: none).  Pool lock held. */
static uint64_t miss_excess(DevicePool *pool, size_t want)
{
    uint64_t after = committed(&pool->st) + want, mark = pool->high_water;
    if (pool->miss_released > XP_MISS_BUDGET * mark) pool->miss_release_off = 1;
    if (after <= mark || pool->miss_release_off || !seg_any_free(&pool->segs) || !pool->st.blocks_cached) return 0;
    return after - mark;
}

/* scheme xpool, on a miss of `size` bytes on `stream`: whole free segments of the stream go back to the
 * device first, as A->release_on_miss says.  0, or -1 with the first failed free's exception.
 *
 * XP_RELEASE_HIGH_WATER (the default) gives back only when the new segment would take the pool's
 * committed bytes above their high-water mark, and then only enough to stay at it: the smallest whole
 * free segment that covers the excess, else the largest first.  Below the mark a miss just adds a
 * segment, so the cache fills up to what a step needs and the misses stop; giving everything back on
 * every miss (XP_RELEASE_ALL) kept re-missing segments it had just freed (memory_study.py, the unfused
 * GPT's batch-4 trace: device mallocs per step ran 120, 57, 22, 3 before settling; with the mark: 120,
 * 7, 5, 1, 0, and less waste, 1.26 against 1.34 peak reserved/requested; on the H200, 2 device mallocs
 * per step after 5 warm-up steps at batch 32).
 *
 * And only segments that have been whole and free for at least A->release_idle requests (XP_RELEASE_IDLE,
 * 64; FreeTree.clock counts them).  A segment freed moments ago is in the working set (the forward's
 * activations, all freed as the backward reaches them) and is cut again later in the step: once the pool
 * sits at its mark, every miss gave back such segments and the next step re-made them, for good (the
 * fused GPT's batch 4 on the H200: 1-3 device mallocs and 0-38 frees in every step after warm-up; replayed
 * on the CuPy-path trace: 3, 2, 1, 1, 1, 2 per step, then 0 only by luck).  What a miss should give back is
 * dead: the setup's segments, a shape no longer asked for; those stay idle far longer than 64 requests.
 * Replayed (memory_study, CuPy-path traces; peak reserved/requested, device mallocs/frees after 5 warm-up
 * steps): batch 4 1.051 and 3/75 -> 1.037 and 0/0; batch 32 1.002 -> 1.017, 0/0 both; varying lengths 1.007
 * and 4/4 -> 1.029 and 1/0 (the longest length after shorter ones); per-parameter AdamW (NumPy trace) 1.031
 * and 2/31 -> 1.042 and 0/0 (its CuPy-path trace still misses at steps 6 and 9: its moments walk through
 * memory, and never giving back misses at step 6 too).  10-150 requests all converge at batch 4; 32 still churns with
 * per-parameter AdamW; 200 keeps the setup's segments through step 0 (1.11).  As a backstop for a program whose requests never settle: once misses have given back
 * more than XP_MISS_BUDGET times the mark, they give back nothing until the next empty_cache(), as with
 * release_on_miss=0, which never frees. */
static int release_for_miss(Allocator *A, DevicePool *pool, intptr_t stream, size_t size)
{
    int capturing;
    if (A->release_on_miss == XP_RELEASE_ALL) {
        capturing = stream_capturing(A, pool->device, stream);
        if (capturing) return capturing < 0 ? -1 : 0;    /* a capture cannot take a cudaFree: the miss only adds */
        return release_segments(A, pool, stream) < 0 ? -1 : 0;
    }
    size_t want = seg_size_for(size, size <= XP_SMALL_MAX ? A->small_segment : A->segment_round);
    pthread_mutex_lock(&pool->lock);
    uint64_t excess = miss_excess(pool, want);
    pthread_mutex_unlock(&pool->lock);
    if (!excess) return 0;
    /* something would go back: not while the stream captures (asked without the lock, it calls Python; and
     * only here, so the misses that give nothing back ask nothing) */
    capturing = stream_capturing(A, pool->device, stream);
    if (capturing) return capturing < 0 ? -1 : 0;
    pthread_mutex_lock(&pool->lock);
    excess = miss_excess(pool, want);                    /* again: another thread may have moved it */
    if (!excess) {
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    size_t cap = pool->st.blocks_cached, n = 0;
    Block **blocks = malloc(cap * sizeof(Block *));
    if (!blocks) { pthread_mutex_unlock(&pool->lock); PyErr_NoMemory(); return -1; }
    SegDelta d = {0, 0};
    seg_take_whole_need(&pool->segs, stream, excess, A->release_idle, blocks, &n, cap, &d);
    apply_delta(&pool->st, d);
    for (size_t i = 0; i < n; i++) pool->st.bytes_releasing += blocks[i]->size;
    pthread_mutex_unlock(&pool->lock);
    PyObject *first = NULL;
    uint64_t released = 0;
    for (size_t i = 0; i < n; i++) {
        size_t bytes = blocks[i]->size;
        if (give_back(A, pool, blocks[i]) == 0) { released += bytes; continue; }
        if (!first) first = PyErr_GetRaisedException(); else PyErr_Clear();   /* it is cached again */
    }
    free(blocks);
    pthread_mutex_lock(&pool->lock);
    pool->miss_released += released;   /* what the device got back: a failed free spends no budget */
    pthread_mutex_unlock(&pool->lock);
    if (first) { PyErr_SetRaisedException(first); return -1; }
    return 0;
}

static PyObject *make_oom(Allocator *A, DevicePool *pool, size_t requested, size_t size,
                          const char *reason)
{
    Stats s;
    pthread_mutex_lock(&pool->lock);
    s = pool->st;
    pool->st.oom_errors++;
    timeline_record(&A->tl, EV_OOM, pool, NULL, requested);
    uint64_t limit = pool->limit;
    pthread_mutex_unlock(&pool->lock);
    return PyObject_CallFunction(A->error_factory, "inKKKKs", pool->device, (Py_ssize_t)requested,
                                 (unsigned long long)size, (unsigned long long)s.bytes_in_use,
                                 (unsigned long long)s.bytes_cached, (unsigned long long)limit,
                                 reason);
}

static int raise_oom(Allocator *A, DevicePool *pool, size_t requested, size_t size,
                     const char *reason, PyObject *cause)
{
    PyObject *err = make_oom(A, pool, requested, size, reason);
    if (err) {
        if (cause) PyException_SetCause(err, cause); else Py_XDECREF(cause);
        PyErr_SetObject((PyObject *)Py_TYPE(err), err);
        Py_DECREF(err);
    } else {
        Py_XDECREF(cause);
    }
    return -1;
}

/* Counts `size` bytes as pending against the device's limit, under the lock,
 * before the backend is called: threads sharing a device cannot all pass the
 * check and overshoot together.  Over the limit: free the cache and retry;
 * gc.collect(), free the cache again and retry; then raise
 * xpool.OutOfMemoryError.  A request larger than the limit itself raises at
 * once, leaving the cache alone. */
static int reserve(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size)
{
    for (int attempt = 0; ; attempt++) {
        pthread_mutex_lock(&pool->lock);
        uint64_t limit = pool->limit;
        int fits = !limit || committed(&pool->st) + size <= limit;
        if (fits) pool->st.bytes_pending += size;
        pthread_mutex_unlock(&pool->lock);
        if (fits) return 0;
        if (size > limit || attempt == 2) return raise_oom(A, pool, requested, size, "limit", NULL);
        int capturing = stream_capturing(A, pool->device, stream);     /* freeing the cache would end it */
        if (capturing) return capturing < 0 ? -1 : raise_oom(A, pool, requested, size, "limit_capturing", NULL);
        if (attempt == 1 && collect_garbage() < 0) return -1;
        if (release_cached(A, pool, 1, 0, 0) < 0) return -1;
    }
}

static void unreserve(DevicePool *pool, size_t size)
{
    pthread_mutex_lock(&pool->lock);
    pool->st.bytes_pending -= size;
    pthread_mutex_unlock(&pool->lock);
}

/* One device allocation of `size` bytes through the backend, with the OOM
 * recovery ladder: free this device's cache and retry; gc.collect(), free the
 * cache again and retry; then raise xpool.OutOfMemoryError.  Only a
 * MemoryError from backend.malloc starts the ladder; any other error is
 * passed on.  On success the bytes stay pending: the caller records the block. */
static int device_malloc(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
                         uintptr_t *ptr)
{
    pthread_mutex_lock(&pool->lock);
    uint64_t capacity = pool->capacity;
    pthread_mutex_unlock(&pool->lock);
    if (!capacity) {   /* misses are rare and slow anyway: ask the backend once */
        if (device_capacity(A, pool->device, &capacity) < 0) { PyErr_Clear(); capacity = 0; }
        pthread_mutex_lock(&pool->lock);
        pool->capacity = capacity;
        pthread_mutex_unlock(&pool->lock);
    }
    if (capacity && size > capacity)   /* no freeing or retrying can help: bad input */
        return raise_oom(A, pool, requested, size, "too_large", NULL);
    if (reserve(A, pool, stream, requested, size) < 0) return -1;
    for (int attempt = 0; attempt < 3; attempt++) {
        PyObject *r = PyObject_CallMethod(A->backend, "malloc", "in", pool->device, (Py_ssize_t)size);
        if (r) {
            unsigned long long p = PyLong_Check(r) ? PyLong_AsUnsignedLongLong(r) : 0;
            if (PyErr_Occurred()) p = 0;   /* negative, or past 64 bits */
            if (!p) {   /* 0 is no address: a block there could never be told apart from "released" */
                PyErr_Clear();
                PyErr_Format(PyLong_Check(r) ? PyExc_ValueError : PyExc_TypeError,
                             "backend.malloc(%d, %zu) must return the block's address, an int > 0; "
                             "got %R", pool->device, size, r);
                Py_DECREF(r);
                break;
            }
            Py_DECREF(r);
            pthread_mutex_lock(&pool->lock);
            pool->st.device_mallocs++;
            if (attempt) pool->st.oom_recoveries++;
            pthread_mutex_unlock(&pool->lock);
            *ptr = (uintptr_t)p;
            return 0;
        }
        if (!PyErr_ExceptionMatches(PyExc_MemoryError)) break;
        PyObject *exc = PyErr_GetRaisedException();
        if (attempt == 2) {
            unreserve(pool, size);
            return raise_oom(A, pool, requested, size, "device", exc);
        }
        int capturing = stream_capturing(A, pool->device, stream);     /* freeing the cache would end it */
        if (capturing) {
            unreserve(pool, size);
            if (capturing > 0) return raise_oom(A, pool, requested, size, "device_capturing", exc);
            Py_DECREF(exc);
            return -1;
        }
        Py_DECREF(exc);
        /* dead arrays held by reference cycles give their blocks back */
        if (attempt == 1 && collect_garbage() < 0) break;
        if (release_cached(A, pool, 1, 0, 0) < 0) break;
    }
    unreserve(pool, size);
    return -1;
}

/* A block handed out in debug mode becomes visible to check() only once its
 * hook has written the canary. */
static int prepare(DevicePool *pool, Block *b, PyObject *hook, const char *name)
{
    if (call_hook(hook, name, b, b->requested) < 0) return -1;
    pthread_mutex_lock(&pool->lock);
    b->guarded = 1; b->handed_out = 1;
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

/* Counts a block as handed out, with its requested bytes set.  Pool lock held. */
static void count_in_use(Allocator *A, DevicePool *pool, Block *b, int event)
{
    pool->st.blocks_in_use++; pool->st.bytes_in_use += b->size;
    pool->st.bytes_requested += b->requested;
    origin_in(&pool->st, b->origin, b->size);
    note_peaks(&pool->st);
    timeline_record(&A->tl, event, pool, b, b->requested);
}

/* Undoes the hand-out of a block whose debug hook raised (the caller never sees
 * it), keeping the hook's exception set: back to the cache (a reused block), or
 * to the device (a new one).  Either way it is not known to hold poison now. */
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
    if (to_device && give_back(A, pool, b) < 0) PyErr_Clear();   /* then it is cached */
    PyErr_SetRaisedException(exc);
}

/* Bytes of a new segment for a `size`-byte range: up to 1 MiB, small_segment bytes (shared by later small
 * blocks, as PyTorch's small pool does); above, the range rounded up to segment_round; exactly size
 * when the rounding alone would break the device's size or the limit (the request may still fit). */
static size_t segment_bytes(Allocator *A, DevicePool *pool, size_t size)
{
    size_t got = seg_size_for(size, size <= XP_SMALL_MAX ? A->small_segment : A->segment_round);
    if (got == size) return got;
    pthread_mutex_lock(&pool->lock);
    uint64_t limit = pool->limit, res = committed(&pool->st), capacity = pool->capacity;
    pthread_mutex_unlock(&pool->lock);
    if (!capacity) {   /* as device_malloc does: asked once, on the first miss */
        if (device_capacity(A, pool->device, &capacity) < 0) { PyErr_Clear(); capacity = 0; }
        pthread_mutex_lock(&pool->lock);
        pool->capacity = capacity;
        pthread_mutex_unlock(&pool->lock);
    }
    if ((capacity && got > capacity) || (limit && res + got > limit)) return size;
    return got;
}

static Block *alloc_block(Allocator *A, int device, intptr_t stream, size_t requested,
                          size_t size, PyObject *hook, int origin)
{
    DevicePool *pool = pool_get(A, device);
    if (!pool) return NULL;

    pthread_mutex_lock(&pool->lock);
    pool->st.requests++;
    Block *b = cache_take(A, pool, stream, size);
    if (b) {
        if (ptrtable_insert(&pool->live, b) < 0) {   /* back where it was */
            cache_block(pool, b);
            pthread_mutex_unlock(&pool->lock);
            PyErr_NoMemory();
            return NULL;
        }
        b->requested = requested;
        b->serial = pool->st.requests;
        b->origin = origin; b->handed_out = !hook; b->guarded = 0;
        pool->st.hits++;
        count_in_use(A, pool, b, EV_HIT);
        pthread_mutex_unlock(&pool->lock);
        if (hook && prepare(pool, b, hook, "on_reuse") < 0) {
            take_back(A, pool, b, 0);
            return NULL;
        }
        return b;
    }
    pool->st.misses++;
    /* scheme xpool: a new segment, the block its first range */
    int segment = A->scheme == XP_SCHEME_XPOOL;
    /* the block's bin exists before the block is handed out: freeing it never needs memory */
    Bin *bin = segment ? NULL : bintable_get(&pool->bins, stream, size);
    pthread_mutex_unlock(&pool->lock);
    if ((!segment && !bin) || !(b = calloc(1, sizeof(Block)))) {
        PyErr_NoMemory();
        return NULL;
    }
    /* Whole free segments of this stream are all smaller than the request (best fit found none):
     * on a miss they go back first, so the new segment takes their place instead of adding to the
     * reserve.  Without it, memory freed as many segments (activations) cannot serve a larger
     * request (the optimizer's flat buffers) and reserved grows by both (memory_study.py: 1.24 ->
     * 1.02 peak reserved/requested with varying sequence lengths).  Costs backend frees (cudaFree
     * synchronises) on misses only, which stop once a step's working set settles: release_for_miss
     * says which segments and when. */
    if (segment && A->release_on_miss && release_for_miss(A, pool, stream, size) < 0) {
        free(b);
        return NULL;
    }
    size_t got = segment ? segment_bytes(A, pool, size) : size;
    uintptr_t ptr = 0;
    if (device_malloc(A, pool, stream, requested, got, &ptr) < 0) {
        free(b);
        return NULL;
    }
    b->ptr = ptr; b->size = got; b->requested = requested;
    b->stream = stream; b->device = device; b->origin = origin; b->handed_out = !hook;
    b->in_segment = segment;   /* from here a failed give_back caches it as a whole free segment */
    if (got > size && hook) {
        /* the rest of the segment is cached from the start: poisoned, as a freed block is */
        if (call_hook(hook, "on_segment", b, 0) < 0) {
            PyObject *exc = PyErr_GetRaisedException();
            pthread_mutex_lock(&pool->lock);
            pool->st.bytes_pending -= got;
            pool->st.bytes_releasing += got;
            pthread_mutex_unlock(&pool->lock);
            if (give_back(A, pool, b) < 0) PyErr_Clear();   /* then it is cached */
            PyErr_SetRaisedException(exc);
            return NULL;
        }
        b->poisoned = 1;
    }
    pthread_mutex_lock(&pool->lock);
    if (committed(&pool->st) > pool->high_water) pool->high_water = committed(&pool->st);
    pool->st.bytes_pending -= got;
    b->serial = pool->st.requests;
    if (ptrtable_insert(&pool->live, b) < 0) {
        pool->st.bytes_releasing += got;
        pthread_mutex_unlock(&pool->lock);
        if (give_back(A, pool, b) < 0) PyErr_Clear();   /* then it is cached */
        PyErr_NoMemory();
        return NULL;
    }
    if (segment) {
        SegDelta d = {0, 0};
        seg_init(&pool->segs, b, size, &d);   /* the rest: a free range, poisoned if b was */
        apply_delta(&pool->st, d);
        b->poisoned = 0;
    }
    count_in_use(A, pool, b, EV_MISS);
    pthread_mutex_unlock(&pool->lock);
    if (hook && prepare(pool, b, hook, "on_alloc") < 0) {
        take_back(A, pool, b, !segment);   /* a range: the rest of its segment may be in use already */
        return NULL;
    }
    return b;
}

/* The allocation path.  Returns the block (in use), or NULL with an exception
 * set.  origin: who the block is handed to (ORIGIN_CUPY: the caller gives it a
 * reference to A). */
static Block *xp_alloc(Allocator *A, int device, intptr_t stream, size_t requested, int origin)
{
    /* checked before the debug tail is added: near 2**64 the sum would wrap to a small class */
    if (requested > XP_MAX_REQUEST) {
        PyErr_Format(PyExc_ValueError, "nbytes=%zu is larger than any device (max %zu)",
                     requested, (size_t)XP_MAX_REQUEST);
        return NULL;
    }
    size_t tail;
    PyObject *hook = debug_snapshot(A, &tail);
    size_t size = block_size(requested + tail, A->scheme, A->k);
    Block *b = NULL;
    if (!size)
        PyErr_Format(PyExc_ValueError, "nbytes=%zu is larger than any device (max %zu)",
                     requested, (size_t)XP_MAX_REQUEST - tail);
    else
        b = alloc_block(A, device, stream, requested, size, hook, origin);
    drop_hook(hook);
    return b;
}

/* In a fork()ed child: forgets a block the parent handed out (its memory is
 * never freed or reused here).  1 if ptr was one, with *holds_ref set. */
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

/* The free path: the block goes back to its own device's pool, to the bin of
 * the stream it was handed out on.  Returns
 *   0  done;
 *   1  with the debug hook's exception: the block was taken back, but the hook
 *      raised (it found damage, or could not poison the block: the block then
 *      goes back to the device rather than into the cache unpoisoned);
 *   2  a block the parent process handed out, dying in a fork()ed child: forgotten;
 *  -1  with an exception: a pointer this pool did not hand out (nothing changed).
 * *holds_ref: the block held a reference to A (it was handed to CuPy); the
 * caller drops it, last. */
static int xp_free(Allocator *A, int device, uintptr_t ptr, int *holds_ref)
{
    *holds_ref = 0;
    if (device < 0 || device >= XP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device must be in [0, %d), got %d", XP_MAX_DEVICES, device);
        return -1;
    }
    DevicePool *pool = atomic_load_explicit(&A->pools[device], memory_order_acquire);
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
                b->poisoned = 0;
                if (atomic_load_explicit(&A->tl.on, memory_order_relaxed)) {
                    Block freed = *b;   /* a range may merge into its neighbour and be gone */
                    cache_block(pool, b);
                    timeline_record(&A->tl, EV_FREE, pool, &freed, requested);
                } else {
                    cache_block(pool, b);
                }
                pthread_mutex_unlock(&pool->lock);
                return 0;
            }
            /* debug mode: out of the live table, so check() never reads it half poisoned and no
             * other free can take it.  Neither in use nor cached while the hook works on it, the
             * block counts with the bytes on their way out (bytes_releasing): the device holds it. */
            pool->st.bytes_releasing += b->size;
        }
        pthread_mutex_unlock(&pool->lock);
    }
    if (!b) {
        drop_hook(hook);
        if (A->forked && forget_inherited(A, device, ptr, holds_ref)) return 2;
        PyErr_Format(PyExc_ValueError,
                     "xpool: pointer 0x%zx on device %d was not handed out by this pool "
                     "(or was freed twice)", (size_t)ptr, device);
        return -1;
    }
    /* the block is this thread's alone until it is cached */
    int hook_failed = call_hook(hook, "on_free", b, requested) < 0;
    drop_hook(hook);
    PyObject *exc = hook_failed ? PyErr_GetRaisedException() : NULL;
    if (hook_failed) {
        b->poisoned = 0;
        if (b->in_segment) {   /* a range is no device allocation: cached, known unpoisoned */
            pthread_mutex_lock(&pool->lock);
            pool->st.bytes_releasing -= b->size;
            cache_block(pool, b);
            pthread_mutex_unlock(&pool->lock);
        } else if (give_back(A, pool, b) < 0) {
            PyErr_Clear();   /* then it is cached, unpoisoned */
        }
        PyErr_SetRaisedException(exc);
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

/* ------------------------------------------------------------------ CuPy's CFunctionAllocator hooks */

/* void *malloc(void *param, size_t size, int device): CuPy (Cython 3) checks for a
 * Python error when this returns (void *)-1, so an exception set here propagates
 * out of cupy's allocation as-is. */
/* The free-list key of a stream handle.  cudaStreamPerThread is one handle for a different stream in each
 * thread: key it by thread (as CuPy's pool does), or a block freed on one thread's stream would be reused on
 * another's.  CuPy's and PyTorch's entry points key alike, so the two frameworks share blocks per stream. */
static inline intptr_t stream_key(intptr_t stream)
{
    return stream == XP_STREAM_PER_THREAD ? -(intptr_t)PyThread_get_thread_ident() : stream;
}

static void *cupy_malloc(void *param, size_t size, int device)
{
    Allocator *A = (Allocator *)param;
    intptr_t stream = 0;
    if (A->stream_fn) {
        /* the device's own current stream: CuPy's get_current_stream_ptr() would first ask CUDA which
         * device is current (cudaGetDevice) and look up a second thread-local, and the device is given */
        stream = A->stream_fn(device);
        /* asked whatever the value: CuPy 14 (Cython 3) fails with -1, CuPy 13 with 0 */
        if (PyErr_Occurred()) return (void *)(intptr_t)-1;
        stream = stream_key(stream);
    }
    Block *b = xp_alloc(A, device, stream, size, ORIGIN_CUPY);
    if (!b) return (void *)(intptr_t)-1;
    Py_INCREF(A);   /* CuPy's memory object does not own the allocator: each block does */
    return (void *)b->ptr;
}

/* void free(void *param, void *ptr, int device): called from a destructor, maybe
 * while an exception propagates (which must survive), so an error here can only
 * be reported, not raised. */
static void cupy_free(void *param, void *ptr, int device)
{
    Allocator *A = (Allocator *)param;
    /* CuPy's CFunctionAllocatorMemory calls this from a Cython __dealloc__, which has already set any
     * exception aside: usually there is none, and checking costs less than taking and putting back */
    PyObject *in_flight = PyErr_Occurred() ? PyErr_GetRaisedException() : NULL;
    int holds_ref;
    int r = xp_free(A, device, (uintptr_t)ptr, &holds_ref);
    if (r == -1 || r == 1) PyErr_WriteUnraisable(NULL);
    if (in_flight) PyErr_SetRaisedException(in_flight);
    if (holds_ref) Py_DECREF(A);   /* last: it may be the allocator's last reference */
}

/* ------------------------------------------------------------------ PyTorch's CUDAPluggableAllocator hooks */

/* torch.cuda.memory.CUDAPluggableAllocator(xpool._core.__file__, "xpool_torch_malloc", "xpool_torch_free")
 * serves PyTorch's CUDA tensors from the same Allocator as CuPy (xpool.enable_torch() sets it up), so a
 * block one framework frees is reused by the other: same device, same stream handle (PyTorch passes its
 * current cudaStream_t; CuPy's current stream pointer is the same handle for the same stream).
 *
 * PyTorch calls these without the GIL, from any thread (its autograd engine runs backward in its own
 * threads).  The hit path and the free path touch only C structures under the pool's mutex, so they run
 * without the GIL; everything that can call Python (a miss: backend, OOM ladder, gc; debug hooks; error
 * reports) takes it with PyGILState_Ensure, holding no mutex, as the rest of the core does. */

/* The Allocator PyTorch allocates from (Allocator.bind_torch).  Its reference is never dropped: a PyTorch
 * thread may be inside it without the GIL at any moment, and PyTorch cannot change allocators once it has
 * allocated anyway. */
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

/* xp_alloc's hit path, callable without the GIL: C structures only, no Python object, no error set.
 * NULL when no cached block fits; nothing is counted then (the caller goes on to xp_alloc, which counts
 * the request).  Keep it in step with xp_alloc's hit path: tests/test_torch_allocator.py checks that a
 * hit through either path leaves the same counters and timeline events. */
static Block *torch_take_cached(Allocator *A, DevicePool *pool, intptr_t stream, size_t size,
                                size_t requested)
{
    pthread_mutex_lock(&pool->lock);
    Block *b = cache_take(A, pool, stream, size);
    if (!b) {
        pthread_mutex_unlock(&pool->lock);
        return NULL;
    }
    if (ptrtable_insert(&pool->live, b) < 0) {   /* no room in the table: back, xp_alloc reports it */
        cache_block(pool, b);
        pthread_mutex_unlock(&pool->lock);
        return NULL;
    }
    pool->st.requests++;
    b->requested = requested;
    b->serial = pool->st.requests;
    b->origin = ORIGIN_TORCH; b->handed_out = 1; b->guarded = 0;   /* never in debug mode */
    pool->st.hits++;
    count_in_use(A, pool, b, EV_HIT);
    pthread_mutex_unlock(&pool->lock);
    return b;
}

/* xp_free's caching path (debug mode off), callable without the GIL.  0: the block is back in its
 * bin (which exists: caching needs no memory); -1: nothing changed, the caller takes the GIL path (an
 * unknown pointer, a block handed to CuPy or Python).  Keep it in step with xp_free. */
static int torch_give_back(Allocator *A, DevicePool *pool, uintptr_t ptr)
{
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

/* The allocation behind both exported malloc functions.  0 and *out on success; -1 with torch_error. */
static int torch_alloc(size_t size, int device, void *stream_handle, void **out)
{
    Allocator *A = atomic_load_explicit(&torch_allocator, memory_order_acquire);
    if (!A) {
        snprintf(torch_error, sizeof torch_error, "xpool: no pool is bound to PyTorch; call "
                 "xpool.enable_torch() before PyTorch's first CUDA allocation");
        return -1;
    }
    intptr_t stream = stream_key((intptr_t)stream_handle);
    /* the hit path, without the GIL; debug mode's checks run Python, so it always takes the GIL path */
    if (device >= 0 && device < XP_MAX_DEVICES && size <= XP_MAX_REQUEST &&
        !atomic_load_explicit(&A->debug_on, memory_order_acquire)) {
        DevicePool *pool = atomic_load_explicit(&A->pools[device], memory_order_acquire);
        size_t cls = block_size(size, A->scheme, A->k);   /* no debug tail: debug mode is off */
        Block *b = pool && cls ? torch_take_cached(A, pool, stream, cls, size) : NULL;
        if (b) { *out = (void *)b->ptr; return 0; }
    }
    if (!python_usable()) {
        snprintf(torch_error, sizeof torch_error, "xpool: PyTorch asked for %zu bytes while Python "
                 "is shutting down", size);
        return -1;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    Block *b = xp_alloc(A, device, stream, size, ORIGIN_TORCH);
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
    if (torch_alloc((size_t)size, device, stream, &p) == 0) return p;
    throw_runtime_error(torch_error);
    fprintf(stderr, "%s\nxpool: could not raise this through PyTorch (no C++ runtime found)\n", torch_error);
    return NULL;
}

/* The same for C callers (and tests): NULL on failure, the reason in xpool_torch_last_error(). */
XP_EXPORT void *xpool_torch_try_malloc(ssize_t size, int device, void *stream)
{
    void *p = NULL;
    return torch_alloc((size_t)size, device, stream, &p) == 0 ? p : NULL;
}

XP_EXPORT const char *xpool_torch_last_error(void) { return torch_error; }

/* void free(void *ptr, ssize_t size, int device, cudaStream_t stream): called from PyTorch's deleters,
 * which cannot fail, so an error (a pointer xpool did not hand to PyTorch) is reported as unraisable. */
XP_EXPORT void xpool_torch_free(void *ptr, ssize_t size, int device, void *stream)
{
    Allocator *A = atomic_load_explicit(&torch_allocator, memory_order_acquire);
    DevicePool *pool = A && device >= 0 && device < XP_MAX_DEVICES
                       ? atomic_load_explicit(&A->pools[device], memory_order_acquire) : NULL;
    torch_error[0] = 0;
    if (pool && !atomic_load_explicit(&A->debug_on, memory_order_acquire) &&
        torch_give_back(A, pool, (uintptr_t)ptr) == 0)
        return;
    if (!python_usable()) return;   /* the process is ending: the device memory goes with it */
    PyGILState_STATE gil = PyGILState_Ensure();
    int origin = -1;
    if (pool) {
        pthread_mutex_lock(&pool->lock);
        Block **slot = ptrtable_slot(&pool->live, (uintptr_t)ptr);
        if (slot) origin = (*slot)->origin;
        pthread_mutex_unlock(&pool->lock);
    }
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
static PyObject *Allocator_bind_torch(Allocator *self, PyObject *unused)
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

static PyObject *py_torch_bound(PyObject *mod, PyObject *unused)
{
    Allocator *A = atomic_load(&torch_allocator);
    return Py_NewRef(A ? (PyObject *)A : Py_None);
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

/* ------------------------------------------------------------------ Allocator methods */

static PyObject *py_zero;

/* A non-negative int argument as uint64, or an error naming it: PyArg's "K"
 * would take -1 as 2**64-1. */
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

/* Swaps the debug hook (None: off) and its tail together; the old hook is
 * dropped after the lock, as dropping it may run Python code. */
static void set_hook(Allocator *A, PyObject *hook, size_t tail)
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

static int Allocator_init(Allocator *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"backend", "error_factory", "classes_per_doubling", "limit",
                             "stream_fn", "debug_hook", "debug_tail", "scheme", "segment_round",
                             "small_segment", "release_on_miss", "release_idle", NULL};
    PyObject *backend, *factory, *hook = Py_None;
    const char *scheme = "xpool";
    int k = 1;
    unsigned long long limit = 0, stream_fn = 0;
    /* Blocks up to 1 MiB start 2 MiB segments that later small blocks share (few device calls for
     * many small arrays, as PyTorch's small pool); a larger block's segment is its size to 512 B, as
     * CuPy's arena allocates.  Chosen, with release_on_miss, by replaying the recorded traces
     * (xlab/memory_study.py): rounding large segments to 2 MiB wasted more at batch 4. */
    Py_ssize_t tail = 0, seg_round = XP_ALIGN, small_seg = 2 << 20;
    int release_on_miss = 1;
    long long release_idle = XP_RELEASE_IDLE;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|iO&KOnsnniL", kwlist, &backend, &factory, &k,
                                     u64_limit, &limit, &stream_fn, &hook, &tail, &scheme, &seg_round,
                                     &small_seg, &release_on_miss, &release_idle))
        return -1;
    int scheme_id;
    if (!strcmp(scheme, "xpool")) scheme_id = XP_SCHEME_XPOOL;
    else if (!strcmp(scheme, "seed")) scheme_id = XP_SCHEME_SEED;
    else {
        PyErr_Format(PyExc_ValueError, "scheme must be 'xpool' or 'seed', got '%s'", scheme);
        return -1;
    }
    if (seg_round < (Py_ssize_t)XP_ALIGN || seg_round % XP_ALIGN) {
        PyErr_Format(PyExc_ValueError, "segment_round must be a positive multiple of 512, got %zd", seg_round);
        return -1;
    }
    if (small_seg < (Py_ssize_t)XP_ALIGN || small_seg % XP_ALIGN) {
        PyErr_Format(PyExc_ValueError, "small_segment must be a positive multiple of 512, got %zd", small_seg);
        return -1;
    }
    if (k < 1 || k > XP_MAX_CLASSES_PER_DOUBLING) {
        PyErr_Format(PyExc_ValueError, "classes_per_doubling must be in [1, %d], got %d",
                     XP_MAX_CLASSES_PER_DOUBLING, k);
        return -1;
    }
    if (tail < 0) {
        PyErr_SetString(PyExc_ValueError, "debug_tail must be >= 0");
        return -1;
    }
    if (tail > XP_MAX_DEBUG_TAIL) {
        PyErr_Format(PyExc_ValueError, "debug_tail must be <= %d", XP_MAX_DEBUG_TAIL);
        return -1;
    }
    if (release_on_miss < 0 || release_on_miss > XP_RELEASE_MAX) {
        PyErr_Format(PyExc_ValueError, "release_on_miss must be in [0, %d], got %d", XP_RELEASE_MAX,
                     release_on_miss);
        return -1;
    }
    if (release_idle < 0) {
        PyErr_Format(PyExc_ValueError, "release_idle must be >= 0, got %lld", release_idle);
        return -1;
    }
    Py_INCREF(backend); Py_XSETREF(self->backend, backend);
    Py_INCREF(factory); Py_XSETREF(self->error_factory, factory);
    self->tells_capture = PyObject_HasAttrString(backend, "capturing");
    self->k = (unsigned)k;
    self->scheme = scheme_id;
    self->segment_round = (size_t)seg_round;
    self->small_segment = (size_t)small_seg;
    self->release_on_miss = release_on_miss;
    self->release_idle = (uint64_t)release_idle;
    self->default_limit = limit;
    self->stream_fn = (stream_fn_t)(uintptr_t)stream_fn;
    set_hook(self, hook, (size_t)tail);
    return 0;
}

static PyObject *Allocator_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Allocator *self = (Allocator *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    pthread_mutex_init(&self->registry_lock, NULL);
    pthread_mutex_init(&self->debug_lock, NULL);
    pthread_mutex_init(&self->tl.lock, NULL);
    self->debug_hook = NULL;
    for (int i = 0; i < XP_MAX_DEVICES; i++) atomic_init(&self->pools[i], NULL);
    return (PyObject *)self;
}

static void pool_destroy(DevicePool *pool, int free_blocks)
{
    if (free_blocks) {
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
        free(pool->live.slots);
        free(pool->bins.slots);
        pthread_mutex_destroy(&pool->lock);
        free(pool);
    }
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
            if (self->backend && release_cached(self, pool, 1, 0, 0) < 0) PyErr_WriteUnraisable(NULL);
            pool_destroy(pool, 1);
        }
        for (DevicePool *p = self->forked_pools[d], *older; p; p = older) {   /* our copies only */
            older = p->older;
            pool_destroy(p, 1);
        }
    }
    if (in_flight) PyErr_SetRaisedException(in_flight);
    free(self->tl.buf);
    Py_XDECREF(self->backend);
    Py_XDECREF(self->error_factory);
    Py_XDECREF(self->debug_hook);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Allocator_allocate(Allocator *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nbytes", "device", "stream", NULL};
    PyObject *nobj;
    int device = 0;
    long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|iL", kwlist, &nobj, &device, &stream))
        return NULL;
    if (!PyLong_Check(nobj) || PyBool_Check(nobj)) {
        PyErr_Format(PyExc_TypeError, "nbytes must be an int, got %.100s", Py_TYPE(nobj)->tp_name);
        return NULL;
    }
    long long n = PyLong_AsLongLong(nobj);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "nbytes is larger than any device");
        return NULL;
    }
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %lld", n);
        return NULL;
    }
    Block *b = xp_alloc(self, device, (intptr_t)stream, (size_t)n, ORIGIN_PYTHON);
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
    a->owner = self; a->ptr = b->ptr; a->size = b->size; a->requested = (size_t)n;
    a->stream = b->stream; a->device = device;
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

static DevicePool *pool_arg(Allocator *self, int device, int create)
{
    if (device < 0 || device >= XP_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device must be in [0, %d), got %d", XP_MAX_DEVICES, device);
        return NULL;
    }
    return create ? pool_get(self, device) : atomic_load(&self->pools[device]);
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
        "{s:i,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
        "device", device, "requests", K(s.requests), "hits", K(s.hits), "misses", K(s.misses),
        "device_mallocs", K(s.device_mallocs), "device_frees", K(s.device_frees),
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
    intptr_t s = 0;
    if (stream != Py_None) {
        s = (intptr_t)PyLong_AsLongLong(stream);
        if (PyErr_Occurred()) return NULL;
    }
    if (stream == Py_None && !keep) {   /* empty_cache(): misses may give back again (release_for_miss) */
        pthread_mutex_lock(&pool->lock);
        pool->miss_released = 0;
        pool->miss_release_off = 0;
        pthread_mutex_unlock(&pool->lock);
    }
    long long n = release_cached(self, pool, stream == Py_None, s, keep);
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

/* The blocks of one device, in use (live) or cached, as a list of infos:
 * copied under the lock, turned into Python objects after it. */
typedef struct { Block *out; size_t n, cap; } CopyOut;

static int copy_free_range(Block *b, void *arg)
{
    CopyOut *c = arg;
    if (c->n >= c->cap) return 1;
    c->out[c->n++] = *b;
    return 0;
}

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

/* set_default_limit(nbytes, fraction): the limit of every device's pool created from now on:
 * nbytes (0: none), or, when fraction > 0, that share of the device's memory. */
static PyObject *Allocator_set_default_limit(Allocator *self, PyObject *args)
{
    unsigned long long limit;
    double fraction;
    if (!PyArg_ParseTuple(args, "O&d", u64_limit, &limit, &fraction)) return NULL;
    if (!(fraction >= 0 && fraction <= 1)) {
        PyErr_Format(PyExc_ValueError, "fraction must be in [0, 1], got %R", PyTuple_GET_ITEM(args, 1));
        return NULL;
    }
    pthread_mutex_lock(&self->registry_lock);
    self->default_limit = limit;
    self->default_fraction = fraction;
    pthread_mutex_unlock(&self->registry_lock);
    Py_RETURN_NONE;
}

static PyObject *Allocator_timeline_enable(Allocator *self, PyObject *args)
{
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "n", &cap)) return NULL;
    if (cap < 0) { PyErr_SetString(PyExc_ValueError, "capacity must be >= 0"); return NULL; }
    Event *buf = cap ? calloc((size_t)cap, sizeof(Event)) : NULL;
    if (cap && !buf) return PyErr_NoMemory();
    pthread_mutex_lock(&self->tl.lock);
    Event *old = self->tl.buf;
    self->tl.buf = buf; self->tl.cap = (size_t)cap; self->tl.count = 0;
    atomic_store(&self->tl.on, buf != NULL);
    pthread_mutex_unlock(&self->tl.lock);
    free(old);
    Py_RETURN_NONE;
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

/* (param, malloc, free) addresses for cupy.cuda.memory.CFunctionAllocator */
static PyObject *Allocator_cfunctions(Allocator *self, PyObject *unused)
{
    return Py_BuildValue("(KKK)", (unsigned long long)(uintptr_t)self,
                         (unsigned long long)(uintptr_t)&cupy_malloc,
                         (unsigned long long)(uintptr_t)&cupy_free);
}

/* In a child made by fork() the parent's device memory is not ours to use or
 * free: forget every pool without touching the backend, and make the locks new
 * (one may have been held by a parent thread that does not exist here). */
static PyObject *Allocator_forget_after_fork(Allocator *self, PyObject *unused)
{
    pthread_mutex_init(&self->registry_lock, NULL);
    pthread_mutex_init(&self->debug_lock, NULL);
    pthread_mutex_init(&self->tl.lock, NULL);
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

static PyObject *Allocator_get_k(Allocator *self, void *closure) { return PyLong_FromUnsignedLong(self->k); }
static PyObject *Allocator_get_tail(Allocator *self, void *closure)
{
    size_t tail;
    PyObject *hook = debug_snapshot(self, &tail);
    Py_XDECREF(hook);
    return PyLong_FromSize_t(tail);
}
static PyObject *Allocator_get_scheme(Allocator *self, void *closure)
{
    return PyUnicode_FromString(self->scheme == XP_SCHEME_SEED ? "seed" : "xpool");
}
static PyObject *Allocator_get_backend(Allocator *self, void *closure) { return Py_NewRef(self->backend); }
static PyObject *Allocator_get_hook(Allocator *self, void *closure)
{
    size_t tail;
    PyObject *hook = debug_snapshot(self, &tail);
    return hook ? hook : Py_NewRef(Py_None);
}

static PyGetSetDef Allocator_getset[] = {
    {"classes_per_doubling", (getter)Allocator_get_k, NULL, "size classes per doubling above 1 MiB"},
    {"scheme", (getter)Allocator_get_scheme, NULL, "'xpool' (segments) or 'seed' (size classes)"},
    {"debug_tail", (getter)Allocator_get_tail, NULL, "canary bytes added to each request in debug mode"},
    {"backend", (getter)Allocator_get_backend, NULL, "the raw allocate/free backend"},
    {"debug_hook", (getter)Allocator_get_hook, NULL, "the debug hook, or None"},
    {NULL}
};

static PyMethodDef Allocator_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))Allocator_allocate, METH_VARARGS | METH_KEYWORDS,
     "allocate(nbytes, device=0, stream=0) -> Allocation"},
    {"free_ptr", (PyCFunction)Allocator_free_ptr, METH_VARARGS, "free_ptr(device, ptr): give a block back by address"},
    {"stats", (PyCFunction)Allocator_stats, METH_VARARGS, "stats(device) -> dict of exact counters"},
    {"devices", (PyCFunction)Allocator_devices, METH_NOARGS, "devices that have a pool"},
    {"reset_peaks", (PyCFunction)Allocator_reset_peaks, METH_VARARGS, "reset_peaks(device)"},
    {"release", (PyCFunction)(void (*)(void))Allocator_release, METH_VARARGS | METH_KEYWORDS,
     "release(device, stream=None, keep=0) -> bytes given back to the device"},
    {"set_limit", (PyCFunction)Allocator_set_limit, METH_VARARGS, "set_limit(device, limit); 0: none"},
    {"live_blocks", (PyCFunction)Allocator_live_blocks, METH_VARARGS, "live_blocks(device) -> [info]"},
    {"cached_blocks", (PyCFunction)Allocator_cached_blocks, METH_VARARGS, "cached_blocks(device) -> [info]"},
    {"table_sizes", (PyCFunction)Allocator_table_sizes, METH_VARARGS,
     "table_sizes(device) -> (live table slots, live blocks, bin table slots)"},
    {"set_default_limit", (PyCFunction)Allocator_set_default_limit, METH_VARARGS,
     "set_default_limit(nbytes, fraction): the limit of each device's pool created from now on"},
    {"timeline_enable", (PyCFunction)Allocator_timeline_enable, METH_VARARGS,
     "timeline_enable(capacity): record events into a ring of that size (0: off)"},
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
    .tp_doc = "Per-device, size-classed caching allocator over a raw backend.",
    .tp_new = Allocator_new,
    .tp_init = (initproc)Allocator_init,
    .tp_dealloc = (destructor)Allocator_dealloc,
    .tp_methods = Allocator_methods,
    .tp_getset = Allocator_getset,
    .tp_weaklistoffset = offsetof(Allocator, weakreflist),
};

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
    size_t c = size_class((size_t)n, (unsigned)k);
    if (!c) {
        PyErr_Format(PyExc_ValueError, "nbytes=%llu is larger than any device", n);
        return NULL;
    }
    return PyLong_FromSize_t(c);
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

/* time_pairs(param, malloc, free, nbytes, pairs, device=0) -> ns: `pairs` malloc+free pairs through a C
 * allocator's two functions (Allocator.cfunctions(), noop_cfunctions()), timed in C.  The C allocator's own
 * cost, without CuPy's objects or a Python loop around it: xlab.bench.alloc --host measures the hit path
 * with it on a CPU (over host memory), where CuPy's arrays cannot be made. */
static PyObject *py_time_pairs(PyObject *mod, PyObject *args)
{
    unsigned long long param, malloc_fn, free_fn;
    Py_ssize_t nbytes, pairs;
    int device = 0;
    if (!PyArg_ParseTuple(args, "KKKnn|i", &param, &malloc_fn, &free_fn, &nbytes, &pairs, &device))
        return NULL;
    if (nbytes < 0 || pairs < 0) {
        PyErr_Format(PyExc_ValueError, "nbytes and pairs must be >= 0, got nbytes=%zd, pairs=%zd", nbytes,
                     pairs);
        return NULL;
    }
    if (!malloc_fn || !free_fn) {
        PyErr_SetString(PyExc_ValueError, "malloc and free must be function addresses, got 0");
        return NULL;
    }
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

/* time_calls(fn, calls, device=None) -> ns: `calls` calls of a stream lookup, timed in C: `intptr_t fn(int
 * device)` (what the CuPy hook calls, CuPy's get_stream_ptr) or, with device None, `intptr_t fn(void)`
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
        if (d < 0 || d >= XP_MAX_DEVICES) {
            PyErr_Format(PyExc_ValueError, "device must be in [0, %d) or None, got %ld", XP_MAX_DEVICES, d);
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

static PyMethodDef module_methods[] = {
    {"time_pairs", py_time_pairs, METH_VARARGS,
     "time_pairs(param, malloc, free, nbytes, pairs, device=0) -> ns: malloc+free pairs timed in C"},
    {"time_calls", py_time_calls, METH_VARARGS,
     "time_calls(fn, calls, device=None) -> ns: calls of intptr_t fn(int device) (or fn(void)) timed in C"},
    {"noop_cfunctions", py_noop_cfunctions, METH_VARARGS,
     "noop_cfunctions(ptr) -> (param, malloc, free): a do-nothing C allocator, the floor for benchmarks"},
    {"size_class", py_size_class, METH_VARARGS, "size_class(nbytes, k=1): the C twin of xpool.size_class"},
    {"torch_bound", py_torch_bound, METH_NOARGS, "the Allocator PyTorch's hooks serve from, or None"},
    {NULL}
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "xpool._core", "The C hot path of xpool's caching allocator.", -1,
    module_methods
};

PyMODINIT_FUNC PyInit__core(void)
{
    if (PyType_Ready(&AllocatorType) < 0 || PyType_Ready(&AllocationType) < 0) return NULL;
    PyObject *gc = PyImport_ImportModule("gc");
    if (!gc) return NULL;
    gc_collect = PyObject_GetAttrString(gc, "collect");
    Py_DECREF(gc);
    if (!gc_collect) return NULL;
    py_zero = PyLong_FromLong(0);
    if (!py_zero) return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
#ifdef Py_GIL_DISABLED
    /* The debug hook's state, the hook and backend references and the fork bookkeeping rely on
     * the GIL (see Concurrency at the top): a free-threaded interpreter keeps it on for us. */
    if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED) < 0) { Py_DECREF(m); return NULL; }
#endif
    if (PyModule_AddObjectRef(m, "Allocator", (PyObject *)&AllocatorType) < 0 ||
        PyModule_AddObjectRef(m, "Allocation", (PyObject *)&AllocationType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DEVICES", XP_MAX_DEVICES) < 0 ||
        PyModule_AddIntConstant(m, "EVENT_SIZE", sizeof(Event)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_CLASSES_PER_DOUBLING", XP_MAX_CLASSES_PER_DOUBLING) < 0 ||
        PyModule_AddObject(m, "MAX_REQUEST", PyLong_FromSize_t(XP_MAX_REQUEST)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
