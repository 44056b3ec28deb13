/*
 * xpool._core: the C core of xpool's caching allocator, one extension module.  Its files, bottom up (a file
 * calls only the files above it in this list by name; a scheme is reached through its table, XpScheme):
 *
 *   _segments.c   best fit in segments: free ranges in a treap, split and merged (no locks, no Python)
 *   _expandable.c scheme expandable's range manager: address ranges, mapped pages, plans (no locks, no Python)
 *   _pool.c       what every path shares: per-thread stream keys, the device pools, the debug hook, the streams a
 *                 pool serves and whether one captures, the out-of-memory error
 *   _ladder.c     the recovery ladder (Note [Recovery ladder]): try; free the cache, retry; collect, retry; raise
 *   _blocks.c     schemes seed and segments: blocks that are backend allocations (or ranges of them)
 *   _pages.c      scheme expandable: blocks cut from pages mapped into reserved address ranges
 *   _alloc.c      the entry paths: allocate and free (CuPy's C hooks among them), giving back
 *   _torch.c      PyTorch's pluggable-allocator entry points, without the GIL where they can
 *   _module.c     the CPython binding: the Allocation and Allocator types, argument parsing, module init
 *   _vmm_cuda.c   CUDA's virtual-memory ops (_vmm.h's table), the driver loaded at run time; calls no other file
 * _hot.h holds the hit path's operations, static, so each entry path has them inlined.  Only PyInit__core and the
 * xpool_torch_* functions are exported (setup.py builds with -fvisibility=hidden).
 *
 * Data, bottom up (as in CuPy's memory.pyx):
 *   size_class()  a pure function: request bytes -> class bytes (scheme seed)
 *   Block         a device allocation of one class (seed), a range of a segment (segments), or a range of mapped
 *                 pages (expandable)
 *   PtrTable      open-addressing map ptr -> Block, for the blocks in use
 *   BinTable      open-addressing map (stream, class) -> Bin, a LIFO stack of free Blocks (seed)
 *   FreeTree      free ranges by (stream, size, ptr) (segments, expandable)
 *   DevicePool    one per device: the tables, the statistics, the limit, one mutex
 *   Allocator     the Python object: the device pools, the backend, the scheme, the timeline, the debug hook
 *
 * Schemes (Note [Schemes]).  How blocks are made is one choice per Allocator: its XpScheme table (xp_seed,
 * xp_segments, xp_expandable) holds every difference on the miss side; the hit side switches on A->scheme in
 * _hot.h, inlined.  The raw device calls belong to a Python backend object (backend.malloc/free: CuPy's runtime,
 * host memory in the tests), or, for scheme expandable, to the ops table backend.vmm() hands over (called from
 * C).  Neither is called on a hit.  Every scheme releases nothing on a miss: memory goes back on empty_cache(),
 * trim(), the ladder and the pool's end (docs/decisions/0001-one-release-rule-per-scheme.md).
 *
 * Concurrency.  Every entry point runs with the GIL held (CuPy calls its C hooks from Cython with it), and the
 * module tells a free-threaded CPython so (Py_MOD_GIL_USED).  PyTorch's hooks (_torch.c) are the exception: they
 * run without the GIL; their hit and free paths touch only C structures under the pool lock, scheme expandable's
 * miss runs in C, and every path that runs Python takes the GIL first.
 *
 * Locks, and their order.  Each is taken alone, but DevicePool.lock -> Timeline.lock:
 *   Allocator.registry_lock  the device pools' creation and default limit
 *   Allocator.debug_lock     the debug hook and its tail, swapped together
 *   Allocator.pin_lock       scheme expandable: pins (debug mode's check reads blocks) against unmaps
 *   DevicePool.lock          everything of one device's pool; then, inside it, Timeline.lock
 *   ended_lock (_pool.c)     which threads' stream keys have ended
 *   cu.lock (_vmm_cuda.c)    the lazy retain of each device's primary context
 * No lock is ever held while Python runs (backend calls, hooks, gc) or while a device op runs: a Python call may
 * switch threads, and a thread blocked on a C mutex with the GIL would deadlock with a holder waiting for it.
 *
 * The limit.  Every byte the backend may hold for a device is counted while the pool lock is dropped around a
 * device call: bytes_pending from before a malloc (or map) until its block is recorded, bytes_releasing from when
 * a block leaves the cache until the device has it back.  Threads sharing a device cannot pass the limit together.
 *
 * Inputs are checked once, where they enter (the entry points; settings in xpool/settings.py); the functions
 * below them take them as given.
 */
#ifndef XPOOL_CORE_H
#define XPOOL_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "_expandable.h"
#include "_segments.h"
#include "_vmm.h"

#define XP_ALIGN 512u                     /* cudaMalloc alignment and the small-class step */
#define XP_SMALL_MAX (1u << 20)           /* up to 1 MiB: multiples of 512 B */
#define XP_MAX_REQUEST ((size_t)1 << 48)  /* 256 TiB: larger than any device */
#define XP_MAX_DEVICES 64
#define XP_MAX_CLASSES_PER_DOUBLING 64
#define XP_STREAM_PER_THREAD 2            /* cudaStreamPerThread's handle value */
#define XP_MAX_DEBUG_TAIL (1 << 20)       /* canary bytes; keeps request + tail far from wrapping */
#define XP_SMALL_SEGMENT (2u << 20)       /* segments: a block up to 1 MiB starts a 2 MiB segment, shared by later
                                             small blocks (Note [Small segments]); a larger one's is its size */
#define XP_EXPORT __attribute__((visibility("default")))   /* symbols PyTorch looks up by name */

/* How blocks are made (names in xpool/settings.py).  Note [Schemes] */
enum { XP_SCHEME_SEGMENTS = 0, XP_SCHEME_SEED = 1, XP_SCHEME_EXPANDABLE = 2, XP_SCHEMES = 3 };

/* Who a block was handed to: CuPy's C hooks, PyTorch's pluggable-allocator hooks, Allocator.allocate(). */
enum { ORIGIN_CUPY = 0, ORIGIN_TORCH = 1, ORIGIN_PYTHON = 2, XP_ORIGINS = 3 };
extern const char *const origin_names[XP_ORIGINS];

#if PY_VERSION_HEX < 0x030C0000   /* the 3.12 exception API, for 3.11 */
static inline PyObject *PyErr_GetRaisedException(void)
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

static inline void PyErr_SetRaisedException(PyObject *exc)
{
    if (!exc) { PyErr_Clear(); return; }
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}
#endif

/* ------------------------------------------------------------------ tables (Block: _segments.h) */
#define TOMBSTONE ((Block *)1)

typedef struct { Block **slots; size_t cap, used, filled; } PtrTable;   /* cap a power of two; filled: + tombstones */
typedef struct Bin { intptr_t stream; size_t size; Block *top; size_t count; } Bin;   /* a LIFO stack of free Blocks */
typedef struct { Bin **slots; size_t cap, used; } BinTable;

/* ------------------------------------------------------------------ device pools */

typedef struct {
    uint64_t requests, hits, misses, device_mallocs, device_frees, frees;
    uint64_t device_maps, device_unmaps;   /* scheme expandable: ops calls that mapped, unmapped a run of handles */
    uint64_t oom_recoveries, oom_errors;
    uint64_t blocks_in_use, blocks_cached;
    uint64_t bytes_in_use;            /* bytes of blocks in use (their class or range) */
    uint64_t bytes_requested;         /* requested bytes of blocks in use */
    uint64_t bytes_cached;            /* bytes of free blocks */
    uint64_t bytes_pending;           /* counted for device mallocs (maps) in flight */
    uint64_t bytes_releasing;         /* out of the cache, not yet back on the device (expandable: mapped bytes a
                                         plan holds) */
    uint64_t peak_bytes_in_use, peak_bytes_requested, peak_bytes_reserved;
    /* bytes in use by origin; [ORIGIN_CUPY] stays 0: CuPy's share is bytes_in_use less the others, so CuPy's
     * path pays no counter for it (origin_in/origin_out) */
    uint64_t bytes_in_use_by[XP_ORIGINS];
} Stats;

/* Device allocations a pool holds for one stream key: the streams asked before anything goes back there. */
typedef struct { intptr_t key; uint64_t allocations; } StreamUse;

typedef struct DevicePool {
    pthread_mutex_t lock;
    int device;
    /* everything below is guarded by lock */
    StreamUse *streams;     /* the stream keys holding device allocations here, with their counts */
    size_t n_streams, streams_cap;
    PtrTable live;          /* blocks in use, by pointer */
    BinTable bins;          /* free blocks, by (stream, class) (scheme seed) */
    FreeTree segs;          /* free ranges (segments); free mapped blocks (expandable) */
    XeDevice *vm;           /* scheme expandable: the address ranges and their pages (NULL until vm_ready) */
    _Atomic int vm_ready;   /* vm is set: read without the lock by PyTorch's GIL-free miss */
    Stats st;
    uint64_t limit;         /* bytes the device may hold for this pool, pending mallocs included; 0 = none */
    uint64_t capacity;      /* the device's total bytes, asked once (pool_capacity); 0 = unknown */
    struct DevicePool *older;   /* in a fork()ed child: the parent's pool it replaced (forked_pools) */
} DevicePool;

/* Bytes the device holds for the pool (in use, cached, being given back); with device calls in flight, what the
 * limit is checked against. */
static inline uint64_t reserved(const Stats *s) { return s->bytes_in_use + s->bytes_cached + s->bytes_releasing; }
static inline uint64_t committed(const Stats *s) { return reserved(s) + s->bytes_pending; }

/* ------------------------------------------------------------------ timeline */

/* EV_MAP, EV_UNMAP (scheme expandable): pages mapped or unmapped, ptr and size the run's */
enum { EV_HIT = 1, EV_MISS = 2, EV_FREE = 3, EV_RELEASE = 4, EV_OOM = 5, EV_MAP = 6, EV_UNMAP = 7 };

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
    int32_t origin;         /* the block's origin; -1 for an event without a block (oom, map, unmap) */
    int32_t unused;
} Event;

typedef struct {
    _Atomic int on;         /* read without the lock: the hot path pays one load when off */
    pthread_mutex_t lock;   /* taken after a DevicePool.lock, never before */
    Event *buf;             /* ring of cap events, NULL when off */
    size_t cap;
    uint64_t count;         /* events ever recorded since the last clear */
} Timeline;

/* ------------------------------------------------------------------ the Allocator object */

/* CuPy's `intptr_t get_stream_ptr(int device)`: a device's current stream; on error -1 (Cython 3) or 0, raised. */
typedef intptr_t (*stream_fn_t)(int device);
struct XpScheme;

typedef struct {
    PyObject_HEAD
    PyObject *backend;        /* .malloc(device, nbytes) -> int, .free(device, ptr, nbytes): xpool.backends.Backend */
    PyObject *error_factory;  /* (device, requested, size, in_use, cached, limit, reason) -> exception */
    PyObject *settings;       /* the xpool.Settings it was made with */
    PyObject *weakreflist;
    stream_fn_t stream_fn;    /* a device's current stream, from CuPy; NULL: stream 0 unless given */
    int n_devices;            /* the backend's devices (at most XP_MAX_DEVICES): set once, read without a lock */
    int scheme;               /* XP_SCHEME_*: the hit side's switch */
    const struct XpScheme *ops;   /* the same scheme's miss side */
    unsigned k;               /* scheme seed: classes per doubling above 1 MiB */
    int tells_capture;        /* the backend has .capturing(device, stream) */
    int tells_alive;          /* the backend has .stream_alive(device, stream): asked before another stream's
                                 capture state (a destroyed stream must never be asked) */
    PyObject *vmm_capsule;    /* scheme expandable: backend.vmm(), kept alive while its ops are used */
    XvVmm vmm;                /* scheme expandable: the ops table in it (_vmm.h), called from C */
    /* scheme expandable: debug mode's check() reads live blocks from a listing that may be stale; while it reads
     * (pins), nothing is unmapped (a block freed meanwhile keeps its pages), and the other way round */
    pthread_mutex_t pin_lock;
    pthread_cond_t pin_cv;
    int pins, unmapping;      /* guarded by pin_lock */
    int forked;               /* set in a fork()ed child */
    pthread_mutex_t debug_lock;     /* guards debug_hook and debug_tail: set_hook swaps them together */
    PyObject *debug_hook;     /* NULL, or .on_alloc(info) / .on_free(info) / .on_reuse(info) / .on_segment(info) */
    size_t debug_tail;        /* bytes of canary room added in debug mode */
    _Atomic int debug_on;     /* debug_hook != NULL; read without the lock, so the hot path pays one load */
    pthread_mutex_t registry_lock;  /* guards creation of pools[], default_limit and default_fraction */
    uint64_t default_limit;   /* the limit of a device's pool when it is created; 0 = none */
    double default_fraction;  /* > 0: instead, that share of the device's memory */
    _Atomic(DevicePool *) pools[XP_MAX_DEVICES];
    /* In a fork()ed child: the parent's pools (linked by .older), whose blocks may still die here; written only
     * by forget_pools_after_fork, in the child before it has other threads. */
    DevicePool *forked_pools[XP_MAX_DEVICES];
    Timeline tl;
} Allocator;

/* ------------------------------------------------------------------ per-thread stream keys (_pool.c)
 *
 * Note [Per-thread stream keys].  cudaStreamPerThread is one handle for a different stream in each thread: its
 * blocks are keyed by thread, or a block freed on one thread's stream would be reused on another's.  A thread's
 * key is handed to it on first use, from a process-wide count, and never to another thread (a key from the
 * thread's id would be: ids are reused as threads end); keys are negative, so no stream handle is one.  A key
 * ends with its thread: with the thread's Python state where it has one (before Thread.join() returns), else
 * with its POSIX thread-specific data. */
extern _Thread_local intptr_t xp_own_thread_key;   /* this thread's key; 0 until its first use */
intptr_t xp_new_thread_key(void);
int xp_thread_key_ended(intptr_t key);

/* The free-list key of a stream handle: the handle itself, or this thread's key for cudaStreamPerThread. */
static inline intptr_t stream_key(intptr_t stream)
{
    if (stream != XP_STREAM_PER_THREAD) return stream;
    intptr_t key = xp_own_thread_key;
    return key ? key : xp_new_thread_key();
}

/* The stream handle of a key, when this thread can name it: a handle is its own; this thread's key is
 * cudaStreamPerThread; -1 for another thread's key (its per-thread stream has no handle here). */
static inline intptr_t stream_handle(intptr_t key)
{
    if (key >= 0) return key;
    return key == xp_own_thread_key ? XP_STREAM_PER_THREAD : -1;
}

/* ------------------------------------------------------------------ the GIL, taken only when needed
 * An operation that may run without the GIL (PyTorch's miss of scheme expandable) or that drops it around device
 * calls says where it stands in an XpGil.  Never take it with a pool lock held: its holder may wait for that lock. */
typedef struct {
    int held;                 /* this thread holds the GIL now */
    int caller_held;          /* it held it when the operation began, and must at the end */
    int may_drop;             /* the GIL may be let go around device ops (not in a dealloc) */
    int ensured;              /* taken here with PyGILState_Ensure: released by xp_gil_end */
    PyGILState_STATE state;
    PyThreadState *saved;     /* let go with PyEval_SaveThread */
} XpGil;

#define XP_GIL_HELD ((XpGil){.held = 1, .caller_held = 1, .may_drop = 1})
#define XP_GIL_NONE ((XpGil){.may_drop = 1})

static inline void xp_gil_drop(XpGil *g)
{
    if (g->held && g->may_drop) { g->saved = PyEval_SaveThread(); g->held = 0; }
}

static inline void xp_gil_take(XpGil *g)
{
    if (g->held) return;
    if (g->saved) { PyEval_RestoreThread(g->saved); g->saved = NULL; }
    else { g->state = PyGILState_Ensure(); g->ensured = 1; }
    g->held = 1;
}

/* The GIL as the caller had it: held again, or released if this operation took it. */
static inline void xp_gil_end(XpGil *g)
{
    if (g->caller_held || g->ensured) xp_gil_take(g);
    if (g->ensured) { PyGILState_Release(g->state); g->ensured = 0; g->held = 0; }
}

/* ------------------------------------------------------------------ the recovery ladder (_ladder.c) */

enum { TRY_GOT = 0, TRY_FAILED = -1, TRY_NO_ROOM = 1 };   /* what one try came to */
#define VM_NO_HOST_MEMORY 100         /* VmFault.status: the host had no memory for the bookkeeping */

/* What a failed device op said, kept for the error raised later, with the GIL. */
typedef struct {
    int status;               /* 0: none; an XvStatus; VM_NO_HOST_MEMORY */
    char why[256];
} VmFault;

/* One request's way up the ladder. */
typedef struct {
    size_t requested, size;     /* the request; the bytes of the device allocation (expandable: of the block) */
    size_t exact;               /* the block's own bytes: what size falls back to when a shared segment does not
                                   fit (Note [Small segments]); size itself otherwise */
    intptr_t stream;            /* the request's stream key */
    int step;                   /* 0: the first try; 1, 2: after freeing the cache (and collecting) */
    int reserved;               /* size counts in bytes_pending: from the try that passed the limit on */
    int over_limit;             /* the limit refused, and what it refused is larger than the limit itself */
    size_t refused;             /* the bytes the last try asked of the limit or the device (expandable: the pages it
                                   maps, whole pages; the others: size) */
    int by_device;              /* what refused the last try: the device (a MemoryError), else the limit */
    PyObject *cause;            /* the backend's MemoryError of the last try, or NULL */
    uintptr_t ptr;              /* seed, segments: the device allocation the try got */
    int origin;                 /* expandable: who the block is handed to */
    PyObject *hook;             /* expandable: the debug hook (a borrowed reference), or NULL */
    Block *block;               /* expandable: the block the try that got it made */
    int no_range;               /* expandable: the address space refused a range: emptied ranges go back too */
    VmFault oom;                /* expandable: why the device refused the last try (the error's cause) */
    VmFault fault;              /* expandable: an op that failed for another reason (raised by climb) */
} Climb;

/* One request's way up the ladder: TRY_GOT, or TRY_FAILED with an exception (the GIL held then). */
int climb(Allocator *A, DevicePool *pool, Climb *c, XpGil *g);
int xp_ladder_module_init(void);   /* with the GIL, once: gc.collect */

/* ------------------------------------------------------------------ a scheme's miss side (Note [Schemes]) */

typedef struct XpScheme {
    const char *name;
    /* A miss: a new block of `size` bytes in use (counted), or NULL with an exception.  With the GIL. */
    Block *(*make)(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size, PyObject *hook,
                   int origin);
    /* One try of the ladder: TRY_GOT, TRY_NO_ROOM (the limit or the device refused), TRY_FAILED. */
    int (*try_)(Allocator *A, DevicePool *pool, Climb *c, XpGil *g);
    /* The ladder's "free the cache": everything cached on the device back to it.  0, or TRY_FAILED. */
    int (*free_cache)(Allocator *A, DevicePool *pool, Climb *c, XpGil *g);
    /* Cached bytes back to the device until at most `keep` stay cached (of one stream, unless all_streams);
     * `empty`: empty_cache (expandable: the emptied address ranges too).  Bytes given back, or -1. */
    long long (*release)(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep, int empty,
                         XpGil *g);
    /* 1 when nothing may go back to the device now (a stream of it captures, or may), 0 when it may, -1 with the
     * backend's exception.  With the GIL, no pool lock. */
    int (*captures)(Allocator *A, DevicePool *pool, intptr_t key);
    /* A new block whose hand-out failed (its debug hook raised; its bytes on bytes_releasing): back to the device
     * unless a stream captures (then cached), keeping the exception set. */
    void (*discard)(Allocator *A, DevicePool *pool, Block *b);
} XpScheme;

extern const XpScheme xp_seed, xp_segments, xp_expandable;

/* ------------------------------------------------------------------ _pool.c */

int xp_pool_module_init(void);                              /* with the GIL, once */
/* The hit path's checks and lookups are inline here, their rare sides in _pool.c: a call across files costs a hit
 * and a free a few percent (scripts/hit_builds.py).  ValueError unless 0 <= device < A->n_devices; a device's pool,
 * made on first use (NULL with an exception). */
int xp_refuse_device(const Allocator *A, int device);
static inline int xp_check_device(const Allocator *A, int device)
{
    return device >= 0 && device < A->n_devices ? 0 : xp_refuse_device(A, device);
}
static inline DevicePool *pool_lookup(Allocator *A, int device)
{
    return atomic_load_explicit(&A->pools[device], memory_order_acquire);
}
DevicePool *pool_make(Allocator *A, int device);
static inline DevicePool *pool_get(Allocator *A, int device)
{
    DevicePool *pool = pool_lookup(A, device);
    return pool ? pool : pool_make(A, device);
}
uint64_t pool_capacity(Allocator *A, DevicePool *pool);    /* the device's bytes (0: unknown), asked once, GIL held */
uint64_t pool_known_capacity(DevicePool *pool);            /* the same as asked so far, without Python */

/* The debug hook: a new reference with its tail (NULL when off), dropped keeping any exception set, swapped with its
 * tail (None: off), called as hook.<name>(info) (-1 with its exception). */
PyObject *block_info(const Block *b, size_t requested);
PyObject *debug_hook_ref(Allocator *A, size_t *tail);
static inline PyObject *debug_snapshot(Allocator *A, size_t *tail)
{
    *tail = 0;
    return atomic_load_explicit(&A->debug_on, memory_order_acquire) ? debug_hook_ref(A, tail) : NULL;
}
void drop_hook_ref(PyObject *hook);
static inline void drop_hook(PyObject *hook)
{
    if (hook) drop_hook_ref(hook);
}
void set_hook(Allocator *A, PyObject *hook, size_t tail);
int call_hook(PyObject *hook, const char *name, const Block *b, size_t requested);

/* The stream keys holding device allocations (pool lock held): `key`'s entry (made when `make`), and one gone. */
StreamUse *stream_use(DevicePool *pool, intptr_t key, int make);
void stream_use_gone(DevicePool *pool, intptr_t key);
/* Whether a stream of keys[0..k) captures (keys[0] the legacy stream, keys[1] the request's), each asked through
 * `ask`; another thread's per-thread stream captures while it lives.  The first nonzero answer (-1: an error). */
int streams_capture(Allocator *A, int device, const intptr_t *keys, size_t k, int (*ask)(Allocator *, int, intptr_t));
int backend_captures(Allocator *A, DevicePool *pool, intptr_t key);   /* captures() over backend.capturing */
static inline int device_captures(Allocator *A, DevicePool *pool, intptr_t key)
{
    return A->ops->captures(A, pool, key);
}
/* Raises xpool.OutOfMemoryError for a request (reason: what refused), chained to `cause` (stolen).  -1. */
int raise_oom(Allocator *A, DevicePool *pool, size_t requested, size_t size, const char *reason, PyObject *cause);

/* ------------------------------------------------------------------ _pages.c, for _torch.c and _module.c */

/* PyTorch's miss of scheme expandable (debug off, pool->vm_ready): a new block, the request and miss counted, without
 * the GIL unless the ladder collects or raises (g says; NULL with the exception, GIL held); end with xp_gil_end(g). */
Block *xp_vm_alloc(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, int origin, XpGil *g);
void xp_pin_pages(Allocator *A, int on);   /* while a pin holds, nothing is unmapped */
int xp_vm_range_of(Allocator *A, int device, uintptr_t ptr, uintptr_t *base, size_t *bytes);   /* 1: ptr's range */
int xp_vm_open(Allocator *A, PyObject *backend);   /* backend.vmm()'s ops into A->vmm; -1 with an exception */

/* ------------------------------------------------------------------ _alloc.c, for _torch.c and _module.c */

size_t xp_size_class(size_t n, unsigned k);   /* size classes; n <= XP_MAX_REQUEST + XP_MAX_DEBUG_TAIL */
void xp_refuse_request(unsigned long long n); /* the ValueError for n > XP_MAX_REQUEST */
/* A block in use, or NULL with an exception (device and requested checked by the caller; ORIGIN_CUPY: the caller
 * gives it a reference to A). */
Block *xp_alloc(Allocator *A, int device, intptr_t stream, size_t requested, int origin);
/* A block back to its own device's pool, to its stream's cache: 0; 1 with the debug hook's exception (taken back;
 * a block it could not poison went back to the device); 2 a block of the parent process, in a fork()ed child:
 * forgotten; -1 with an exception (a bad device, a pointer not handed out): nothing changed.  *holds_ref: the block
 * held a reference to A (handed to CuPy), which the caller drops, last. */
int xp_free(Allocator *A, int device, uintptr_t ptr, int *holds_ref);
void *cupy_malloc(void *param, size_t size, int device);   /* CuPy's CFunctionAllocator hooks */
void cupy_free(void *param, void *ptr, int device);
/* Cached bytes back until at most `keep` stay (one stream's, or all); `empty` with keep 0: empty_cache().  Nothing
 * while a stream of the device captures.  Bytes, or -1. */
long long xp_release(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep, int empty,
                     XpGil *g);

/* ------------------------------------------------------------------ _torch.c, for _module.c */
PyObject *Allocator_bind_torch(Allocator *self, PyObject *unused);
PyObject *py_torch_bound(PyObject *mod, PyObject *unused);

#endif
