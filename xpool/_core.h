/*
 * xpool._core: the C core of xpool's caching allocator, as one extension module built from
 *   _alloc.c     the allocator: size classes, tables, device pools, statistics, timeline, the schemes,
 *                the alloc and free paths (CuPy's C hooks among them), giving back, the recovery ladder
 *   _pages.c     scheme expandable's pages: unmapped on giving back, mapped by its try of the ladder, its miss
 *                (what it and _alloc.c share, no other file: _pages.h)
 *   _segments.c  the segments scheme's ranges: best fit, split, merge (no locks, no Python)
 *   _expandable.c  scheme expandable's range manager: address ranges, mapped pages, plans (no locks, no Python)
 *   _module.c    the CPython binding: the Allocation and Allocator types, argument parsing, module init
 *   _torch.c     PyTorch's pluggable-allocator entry points (xpool_torch_malloc, xpool_torch_free, ...)
 * This header holds what they share; _hot.h the hit path's operations, static, so both entry paths have
 * them inlined.  Only PyInit__core and the xpool_torch_* functions are exported
 * (setup.py builds with -fvisibility=hidden), so calls between the files are direct calls.
 *
 * Layers, bottom up (as in CuPy's memory.pyx):
 *   size_class()  a pure function: request bytes -> class bytes
 *   Block         one device allocation of one class size (scheme seed), or a range of a
 *                 segment (scheme segments: best fit, split, merged again; _segments.c)
 *   PtrTable      open-addressing map ptr -> Block, for the blocks in use
 *   BinTable      open-addressing map (stream, class) -> Bin, a LIFO stack of free Blocks
 *   DevicePool    one per device: the tables, the free ranges, the statistics, the limit, one mutex
 *   Allocator     the Python object: the device registry, the backend, the timeline
 *
 * The raw device allocate/free functions are never called from C directly:
 * they belong to a Python "backend" object (CuPy's runtime on a GPU, real host
 * memory in the tests), called only on a miss, on giving back and on out-of-memory
 * recovery.  The hit path is pure C.
 *
 * Schemes (Note [Schemes]).  How blocks are made is one choice per Allocator (Allocator.scheme), made in
 * five scheme_* functions: the hit side in _hot.h (scheme_block_size, scheme_take), the miss side in
 * _alloc.c (scheme_make, scheme_take_idle, scheme_give_back).  Everything else is shared.  A new scheme is
 * an XP_SCHEME_* id below, its name (and its fields) in xpool/settings.py, the fields read in
 * read_settings (_module.c), and a case in each scheme_* function; the others' hit paths do not change.
 * Scheme expandable's blocks are not device allocations of the backend but ranges of pages it maps into
 * reserved address ranges (Note [Expandable segments]): it makes them through the virtual-memory ops the
 * backend hands over (backend.vmm(), kept in Allocator.vmm; _vmm.h), called from C, and gives pages back in
 * its own release (vm_release in _pages.c, which release_cached turns to); the ladder, the limit, the
 * statistics, the timeline, debug mode and the entry points are the shared ones.
 *
 * Concurrency.  Every entry point runs with the GIL held (CuPy calls the
 * CFunctionAllocator hooks from Cython with the GIL), and the module says so
 * to free-threaded CPython (Py_MOD_GIL_USED): the debug hook's Python state,
 * the hook and backend references and the fork bookkeeping rely on it.  The
 * mutexes guard the C structures and document ownership.  PyTorch's hooks
 * (xpool_torch_malloc/free, _torch.c) are the exception: PyTorch calls them without the
 * GIL; their hit and free paths (_hot.h, as the others') touch only C structures under
 * the pool mutex, and every path that runs Python takes the GIL first.
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
 *
 * Inputs are checked once, where they enter: a request's size and device by the entry point that
 * receives it (Allocator.allocate, CuPy's hook, PyTorch's hook; xp_free checks the device of a free), the
 * settings by xpool.Settings (the core reads only a Settings of the package that loaded it); the functions
 * below the entry points take them as given.  The recovery ladder is one function (device_malloc, Note
 * [Recovery ladder]), the device's capacity asked in one place (pool_capacity).
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
#define XP_EXPORT __attribute__((visibility("default")))   /* symbols PyTorch looks up by name */

/* How blocks are made (Allocator.scheme; names in xpool/settings.py).  Note [Schemes] */
enum { XP_SCHEME_SEGMENTS = 0, XP_SCHEME_SEED = 1, XP_SCHEME_EXPANDABLE = 2, XP_SCHEMES = 3 };
extern const char *const xp_scheme_names[XP_SCHEMES];

/* peer_access of scheme expandable: which other devices a map makes its pages accessible to (names in
 * xpool/settings.py).  Note [Expandable segments]: peer access */
enum { XP_PEERS_NONE = 0, XP_PEERS_ALL = 1, XP_PEER_CHOICES = 2 };
extern const char *const xp_peer_names[XP_PEER_CHOICES];

/* release_on_miss: what a miss of scheme segments (release_for_miss) or expandable (vm_try) gives back first */
enum { XP_RELEASE_NEVER = 0, XP_RELEASE_HIGH_WATER = 1, XP_RELEASE_ALWAYS = 2, XP_RELEASE_BOUNDED = 3,
       XP_RELEASE_GROWTH = 4, XP_RELEASE_UNTIL_CHURN = 5, XP_RELEASE_PEAK = 6, XP_RELEASE_CHOICES = 7 };
extern const char *const xp_release_names[XP_RELEASE_CHOICES];
#define XP_MISS_BUDGET 1    /* bytes misses may give back, in high-water marks, until empty_cache
                               (Note [Release on miss]) */
#define XP_CHURN_RING 8     /* "until_churn", "peak": the page runs misses unmapped that a map is checked against */

/* Who a block was handed to: CuPy's C hooks, PyTorch's pluggable-allocator hooks, Allocator.allocate(). */
enum { ORIGIN_CUPY = 0, ORIGIN_TORCH = 1, ORIGIN_PYTHON = 2, XP_ORIGINS = 3 };
extern const char *const origin_names[XP_ORIGINS];

#if PY_VERSION_HEX < 0x030C0000
/* The 3.12 exception API, for 3.10 and 3.11. */
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

/* ------------------------------------------------------------------ tables */

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

/* ------------------------------------------------------------------ device pools */

typedef struct {
    uint64_t requests, hits, misses, device_mallocs, device_frees, frees;
    uint64_t device_maps, device_unmaps;   /* scheme expandable: ops.map / ops.unmap calls that succeeded */
    uint64_t oom_recoveries, oom_errors;
    uint64_t blocks_in_use, blocks_cached;
    uint64_t bytes_in_use;            /* class bytes of blocks in use */
    uint64_t bytes_requested;         /* requested bytes of blocks in use */
    uint64_t bytes_cached;            /* class bytes of free blocks */
    uint64_t bytes_pending;           /* reserved for device mallocs in flight */
    uint64_t bytes_releasing;         /* taken from the cache, the backend's free not yet returned (scheme
                                         expandable: mapped bytes a map or unmap plan holds) */
    uint64_t peak_bytes_in_use, peak_bytes_requested, peak_bytes_reserved;
    /* class bytes in use by origin; [ORIGIN_CUPY] stays 0: CuPy's share is bytes_in_use less the
     * others, so CuPy's path pays no counter for it (see origin_in/origin_out) */
    uint64_t bytes_in_use_by[XP_ORIGINS];
} Stats;

/* Device allocations a pool holds for one stream key: the streams it knows on a device, which it asks before
 * giving anything back there (Note [Capture: every stream of a device]). */
typedef struct {
    intptr_t key;
    uint64_t allocations;
} StreamUse;

typedef struct DevicePool {
    pthread_mutex_t lock;
    int device;
    /* everything below is guarded by lock */
    StreamUse *streams;     /* the stream keys holding device allocations here, with their counts */
    size_t n_streams, streams_cap;
    PtrTable live;          /* blocks in use, by pointer */
    BinTable bins;          /* free blocks, by (stream, class) (scheme seed) */
    FreeTree segs;          /* free ranges of segments (scheme segments), by (stream, size, ptr); scheme
                               expandable: its free mapped blocks */
    XeDevice *vm;           /* scheme expandable: the address ranges and their pages (NULL until vm_ready) */
    _Atomic int vm_ready;   /* vm is set: read without the lock by PyTorch's GIL-free miss */
    Stats st;
    uint64_t limit;         /* bytes the device may hold for this pool, pending mallocs included; 0 = none */
    uint64_t capacity;      /* the device's total bytes, asked once (pool_capacity); 0 = unknown */
    uint64_t high_water;    /* most bytes committed by a device malloc of this pool (release_for_miss);
                               reset_peaks leaves it alone: it is the pool's own, not a statistic */
    uint64_t miss_released; /* bytes misses gave back since the last empty_cache (release_for_miss) */
    int miss_release_off;   /* they passed XP_MISS_BUDGET marks: misses give nothing back until empty_cache */
    uint64_t requested_high;    /* most bytes requested before the last reset_peaks (XP_RELEASE_BOUNDED's mark,
                                   with the peak since: miss_mark); like high_water, not a statistic */
    struct { uintptr_t addr; uint64_t bytes, most; } miss_unmapped[XP_CHURN_RING];   /* "until_churn", "peak":
                                   the last runs misses unmapped, with the demand's most at the time (Note [Release
                                   on miss: until_churn], Note [Release on miss: peak]) */
    unsigned miss_unmapped_n;   /* runs recorded so far (the ring's next slot, modulo XP_CHURN_RING) */
    uint64_t churned_at;        /* "until_churn", "peak": a miss mapped pages a miss had unmapped while the demand's
                                   most was this (under "peak": within release_bound of it); 0 none: until the
                                   demand passes it, misses under the most give nothing back */
    struct DevicePool *older;   /* in a fork()ed child: the parent's pool it replaced (forked_pools) */
} DevicePool;

/* Bytes the device holds for the pool: in use, cached, and being given back. */
static inline uint64_t reserved(const Stats *s)
{
    return s->bytes_in_use + s->bytes_cached + s->bytes_releasing;
}

/* What the limit is checked against: reserved plus device mallocs in flight. */
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

/* ------------------------------------------------------------------ the Allocator object */

/* CuPy's `intptr_t get_stream_ptr(int device)` (cupy_backends.cuda.stream): the current stream of a
 * device, as this thread set it; it may raise (no CUDA driver), returning -1 (Cython 3) or 0 (Cython 0.29). */
typedef intptr_t (*stream_fn_t)(int device);

typedef struct {
    PyObject_HEAD
    PyObject *backend;        /* .malloc(device, nbytes) -> int, .free(device, ptr, nbytes): xpool.backends.Backend */
    PyObject *error_factory;  /* (device, requested, size, in_use, cached, limit, reason) -> exception */
    PyObject *settings;       /* the xpool.Settings it was made with */
    PyObject *weakreflist;
    stream_fn_t stream_fn;    /* a device's current stream, from CuPy; NULL: stream 0 unless given */
    int n_devices;            /* the backend's devices (at most XP_MAX_DEVICES): set once, read without a lock */
    int scheme;               /* XP_SCHEME_*: how blocks are made */
    unsigned k;               /* scheme seed: classes per doubling above 1 MiB */
    size_t segment_round;     /* scheme segments: a new segment for a block above 1 MiB: rounded up to this */
    size_t small_segment;     /* scheme segments: a new segment for a block up to 1 MiB: rounded up to this */
    int release_on_miss;      /* scheme segments: XP_RELEASE_*: which whole free segments of its stream a miss
                                 gives back first (release_for_miss) */
    uint64_t release_idle;    /* XP_RELEASE_HIGH_WATER: a miss gives back only segments whole and free for at
                                 least this many requests (release_for_miss) */
    double release_bound;     /* XP_RELEASE_BOUNDED, _GROWTH, _UNTIL_CHURN, _PEAK: a miss gives back what would
                                 take committed bytes above this many times the most bytes ever requested
                                 (miss_mark); _PEAK: only a miss whose demand is within it of that most */
    int tells_capture;        /* the backend has .capturing(device, stream): stream_capturing asks it */
    int tells_alive;          /* the backend has .stream_alive(device, stream): asked before another stream's
                                 capture state (a destroyed stream must never be asked: Note [Capture: every
                                 stream of a device]) */
    PyObject *vmm_capsule;    /* scheme expandable: backend.vmm(), kept alive while its ops are used */
    XvVmm vmm;                /* scheme expandable: the ops table in it (_vmm.h), called from C */
    int peer_access;          /* scheme expandable: XP_PEERS_*: XP_PEERS_ALL maps pages for every device that can
                                 access the pool's device (vm_init asks ops.peers once per device) */
    /* scheme expandable: debug mode's check() reads live blocks from a listing that may be stale; while it
     * reads (pins), nothing is unmapped (a block freed meanwhile keeps its pages), and the other way round */
    pthread_mutex_t pin_lock;
    pthread_cond_t pin_cv;
    int pins, unmapping;      /* guarded by pin_lock */
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
     * written only by forget_pools_after_fork, in the child before it has other threads. */
    DevicePool *forked_pools[XP_MAX_DEVICES];
    Timeline tl;
} Allocator;

/* Per-thread stream keys (Note [Per-thread stream keys]).  cudaStreamPerThread is one handle for a different
 * stream in each thread: its blocks are keyed by thread, or a block freed on one thread's stream would be
 * reused on another's.  A thread's key is handed to it on first use, from a process-wide count, and never
 * to another thread (a key from the thread's id would be: the system reuses ids as threads end); keys are
 * negative, so no stream handle is one.  xp_thread_key_ended says whether the key's thread has ended. */
extern _Thread_local intptr_t xp_own_thread_key;   /* this thread's key; 0 until its first use */
intptr_t xp_new_thread_key(void);
int xp_thread_key_ended(intptr_t key);

/* The free-list key of a stream handle: the handle itself, or this thread's key for cudaStreamPerThread.
 * Every entry point keys alike (CuPy's, PyTorch's, Allocator.allocate), so blocks are shared per stream. */
static inline intptr_t stream_key(intptr_t stream)
{
    if (stream != XP_STREAM_PER_THREAD) return stream;
    intptr_t key = xp_own_thread_key;
    return key ? key : xp_new_thread_key();
}

/* The stream handle of a free-list key, when this thread can name it: a handle is its own; this thread's key
 * is cudaStreamPerThread; -1 for another thread's key (its per-thread stream has no handle here). */
static inline intptr_t stream_handle(intptr_t key)
{
    if (key >= 0) return key;
    return key == xp_own_thread_key ? XP_STREAM_PER_THREAD : -1;
}

/* ------------------------------------------------------------------ the GIL, taken only when needed

 * An operation that may run without the GIL (PyTorch's miss of scheme expandable) or that drops it around
 * blocking device calls (an ops.map or ops.unmap: the unmap synchronises the device) says where it stands in
 * an XpGil.  Never take it (xp_gil_take) with a pool lock held: the holder of the GIL may be waiting for it. */
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

/* ------------------------------------------------------------------ _alloc.c, for the other files */

int xp_alloc_module_init(void);   /* with the GIL, once: what the ladder calls (gc.collect) */

size_t xp_size_class(size_t n, unsigned k);   /* size classes; n <= XP_MAX_REQUEST + XP_MAX_DEBUG_TAIL */

/* The ValueError for a request of n > XP_MAX_REQUEST bytes ("larger than any device"). */
void xp_refuse_request(unsigned long long n);

/* The allocation path: the block (in use), or NULL with an exception set.  device in [0, XP_MAX_DEVICES)
 * and requested <= XP_MAX_REQUEST, checked by the caller.  origin: who the block is handed to (ORIGIN_CUPY:
 * the caller gives it a reference to A). */
Block *xp_alloc(Allocator *A, int device, intptr_t stream, size_t requested, int origin);

/* The free path: the block goes back to its own device's pool, to the cache of the stream it was handed
 * out on.  Returns
 *   0  done;
 *   1  with the debug hook's exception: the block was taken back, but the hook
 *      raised (it found damage, or could not poison the block: the block then
 *      goes back to the device rather than into the cache unpoisoned);
 *   2  a block the parent process handed out, dying in a fork()ed child: forgotten;
 *  -1  with an exception: a bad device, or a pointer this pool did not hand out (nothing changed).
 * *holds_ref: the block held a reference to A (it was handed to CuPy); the caller drops it, last. */
int xp_free(Allocator *A, int device, uintptr_t ptr, int *holds_ref);

/* CuPy's CFunctionAllocator hooks (Allocator.cfunctions() hands their addresses out). */
void *cupy_malloc(void *param, size_t size, int device);
void cupy_free(void *param, void *ptr, int device);

/* ValueError unless 0 <= device < A->n_devices (the backend's devices); 0 when it is.  Every entry point asks
 * it before anything is made or counted for the device. */
int xp_check_device(const Allocator *A, int device);
/* A device's pool, made on first use (NULL with an exception); device checked by the caller. */
DevicePool *pool_get(Allocator *A, int device);
static inline DevicePool *pool_lookup(Allocator *A, int device)
{
    return atomic_load_explicit(&A->pools[device], memory_order_acquire);
}

/* Cached blocks back to the device until at most `keep` bytes stay cached (of one stream, or all when
 * all_streams).  Returns bytes released; -1 with the first failed free's exception.  Scheme expandable: whole
 * free pages unmapped (nothing while a stream of the device captures), the address ranges kept. */
long long release_cached(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep);
/* 1 when nothing may go back to the device now: a stream of it captures, or may (Note [Capture: every
 * stream of a device]); 0 when it may; -1 with the backend's exception.  With the GIL, no pool lock (scheme
 * expandable: the ops answer, from C; no GIL needed, never -1). */
int device_captures(Allocator *A, DevicePool *pool, intptr_t key);
/* empty_cache() of one device: release_cached of everything; scheme expandable gives the address ranges left
 * with nothing mapped back too.  g: whether the GIL may be let go around device ops. */
long long empty_cache(Allocator *A, DevicePool *pool, XpGil *g);

/* empty_cache(): misses may give back again (Note [Release on miss]).  forget_misses: the same, pool lock held. */
void reset_miss_budget(DevicePool *pool);
void forget_misses(DevicePool *pool);
uint64_t miss_mark(const Allocator *A, const DevicePool *pool, size_t requested);
int miss_may_release(const Allocator *A, const DevicePool *pool, size_t requested);
/* "until_churn" (pool lock held): a miss unmapped [addr, addr + bytes); a miss will map [addr, addr + bytes). */
void note_miss_unmap(DevicePool *pool, uintptr_t addr, uint64_t bytes);
void note_miss_map(const Allocator *A, DevicePool *pool, uintptr_t addr, uint64_t bytes);

/* Requests a free segment (expandable: a free block's pages) must have stayed unchanged before a miss may give it
 * back: release_idle under "high_water"; every other rule takes any age (Note [Release on miss]). */
static inline uint64_t miss_min_idle(const Allocator *A)
{
    return A->release_on_miss == XP_RELEASE_HIGH_WATER ? A->release_idle : 0;
}

PyObject *block_info(const Block *b, size_t requested);

/* The debug hook (a new reference, NULL when off) and its tail, as one pair; drop_hook() drops it keeping
 * any exception set; set_hook() swaps hook (None: off) and tail together. */
PyObject *debug_snapshot(Allocator *A, size_t *tail);
void drop_hook(PyObject *hook);
void set_hook(Allocator *A, PyObject *hook, size_t tail);

/* ------------------------------------------------------------------ _pages.c, for the other files */

/* Scheme expandable, PyTorch's miss (debug mode off, the device's ranges made: pool->vm_ready): a new block of
 * `requested` bytes through the ladder, the request and the miss counted.  Runs without the GIL unless the
 * ladder must collect garbage or raise: then it takes it (g says so); NULL with the exception set, the GIL
 * held.  The caller ends with xp_gil_end(g). */
Block *xp_vm_alloc(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, int origin, XpGil *g);
/* Pins the pages of scheme expandable (on) or lets them go (off): while any pin holds, nothing is unmapped.
 * With the GIL; it is let go while a pin waits for an unmap in flight. */
void xp_pin_pages(Allocator *A, int on);
/* The address range of scheme expandable holding ptr on the device: 1 with *base, *bytes; 0 when none does. */
int xp_vm_range_of(Allocator *A, int device, uintptr_t ptr, uintptr_t *base, size_t *bytes);

/* ------------------------------------------------------------------ _torch.c, for _module.c */

PyObject *Allocator_bind_torch(Allocator *self, PyObject *unused);
PyObject *py_torch_bound(PyObject *mod, PyObject *unused);

#endif
