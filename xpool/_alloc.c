/* xpool._core: the allocator (see _core.h for the layers, the GIL rules and the lock order). */
#include "_hot.h"
#include "_pages.h"

#include <string.h>

const char *const origin_names[XP_ORIGINS] = {"cupy", "torch", "python"};
const char *const xp_scheme_names[XP_SCHEMES] = {"segments", "seed", "expandable"};
const char *const xp_release_names[XP_RELEASE_CHOICES] = {"never", "high_water", "always", "bounded", "growth",
                                                           "until_churn", "peak"};

static PyObject *gc_collect;          /* gc.collect, for the ladder's last retry */
static void thread_keys_after_fork(void);

int xp_alloc_module_init(void)
{
    pthread_atfork(NULL, NULL, thread_keys_after_fork);
    PyObject *gc = PyImport_ImportModule("gc");
    if (!gc) return -1;
    gc_collect = PyObject_GetAttrString(gc, "collect");
    Py_DECREF(gc);
    return gc_collect ? 0 : -1;
}

static int collect_garbage(void)
{
    PyObject *r = PyObject_CallNoArgs(gc_collect);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* ------------------------------------------------------------------ per-thread stream keys (_core.h) */

_Thread_local intptr_t xp_own_thread_key;
static _Atomic uint64_t thread_keys_made;     /* key n is -n: the count never goes back, so no key is reused */
static pthread_once_t thread_exit_once = PTHREAD_ONCE_INIT;
static pthread_key_t thread_exit;             /* its destructor marks the thread's key ended */
static pthread_mutex_t ended_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards ended, ended_bits */
static uint8_t *ended;                        /* bit n-1: the thread of key -n has ended */
static size_t ended_bits;                     /* bits `ended` has room for */

/* At a thread's exit (POSIX runs it for every thread that set a value), without the GIL: no Python here. */
static void thread_key_ended(void *value)
{
    uint64_t n = (uint64_t)(uintptr_t)value;
    pthread_mutex_lock(&ended_lock);
    if (n <= ended_bits) ended[(n - 1) / 8] |= (uint8_t)(1u << ((n - 1) % 8));
    pthread_mutex_unlock(&ended_lock);
}

static void make_thread_exit(void) { pthread_key_create(&thread_exit, thread_key_ended); }

/* In a fork()ed child, before anything runs: a parent thread may have held ended_lock. */
static void thread_keys_after_fork(void) { pthread_mutex_init(&ended_lock, NULL); }

intptr_t xp_new_thread_key(void)
{
    pthread_once(&thread_exit_once, make_thread_exit);
    uint64_t n = atomic_fetch_add(&thread_keys_made, 1) + 1;
    /* room for its bit now, so the exit destructor never allocates; without room the thread counts as
     * alive for good: conservative (Note [Capture: every stream of a device]) */
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

/* ------------------------------------------------------------------ size classes and tables (the rest: _hot.h) */

size_t xp_size_class(size_t n, unsigned k) { return size_class(n, k); }

void xp_refuse_request(unsigned long long n)
{
    PyErr_Format(PyExc_ValueError, "nbytes=%llu is larger than any device (max %zu)", n,
                 (size_t)XP_MAX_REQUEST);
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

int xp_check_device(const Allocator *A, int device)
{
    if (device >= 0 && device < A->n_devices) return 0;
    PyErr_Format(PyExc_ValueError, "device must be in [0, %d) (the backend's devices), got %d", A->n_devices,
                 device);
    return -1;
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

DevicePool *pool_get(Allocator *A, int device)
{
    DevicePool *pool = pool_lookup(A, device);
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

/* The device's total bytes (0: unknown), asked of the backend once, on the first miss that needs it:
 * the one capacity probe of the miss path (a fractional limit asks when the pool is made). */
uint64_t pool_capacity(Allocator *A, DevicePool *pool)
{
    pthread_mutex_lock(&pool->lock);
    uint64_t capacity = pool->capacity;
    pthread_mutex_unlock(&pool->lock);
    if (capacity) return capacity;
    if (device_capacity(A, pool->device, &capacity) < 0) { PyErr_Clear(); capacity = 0; }
    pthread_mutex_lock(&pool->lock);
    pool->capacity = capacity;
    pthread_mutex_unlock(&pool->lock);
    return capacity;
}

/* ------------------------------------------------------------------ debug hooks */

PyObject *block_info(const Block *b, size_t requested)
{
    return Py_BuildValue("{s:i,s:K,s:n,s:n,s:L,s:K,s:s,s:O,s:O}", "device", b->device,
                         "ptr", (unsigned long long)b->ptr, "size", (Py_ssize_t)b->size,
                         "requested", (Py_ssize_t)requested, "stream", (long long)b->stream,
                         "serial", (unsigned long long)b->serial, "origin", origin_names[b->origin],
                         "guarded", b->guarded ? Py_True : Py_False,
                         "poisoned", b->poisoned ? Py_True : Py_False);
}

/* An operation uses the hook it started with, even if set_debug swaps it while a hook call has let
 * another thread run. */
PyObject *debug_snapshot(Allocator *A, size_t *tail)
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

/* The snapshot's reference may be the hook's last, and freeing it may run Python code. */
void drop_hook(PyObject *hook)
{
    if (!hook) return;
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

/* Calls hook.<name>(info); -1 with the hook's exception set if it raised. */
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

/* ------------------------------------------------------------------ schemes (Note [Schemes])
 *
 * Every difference between the schemes is in five scheme_* functions; the rest of the core is shared.
 *   scheme_block_size   bytes a request takes                                  _hot.h
 *   scheme_take         a cached block: the hit (cache_block files one back)   _hot.h
 *   scheme_make         a new block on a miss, through the recovery ladder     below, "new blocks"
 *   scheme_take_idle    cached blocks taken out of the cache to give back      here
 *   scheme_give_back    one such block back to the device                      here
 * Scheme expandable gives back pages, not blocks: release_cached turns to vm_release_cached for it, and its
 * miss (vm_make) maps pages through the ladder's tries (vm_try): both in _pages.c.
 */

/* Takes cached blocks (of one stream, or all when all_streams) out of the cache, into blocks[*n..cap),
 * until at most `keep` bytes stay cached: class blocks, or whole free segments (a segment partly in use
 * stays).  Their bytes move to bytes_releasing, so they still count against the limit.  Pool lock held. */
static void scheme_take_idle(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep,
                             Block **blocks, size_t *n, size_t cap)
{
    switch (A->scheme) {
    case XP_SCHEME_SEED:
        for (size_t i = 0; i < pool->bins.cap && pool->st.bytes_cached > keep; i++) {
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
        break;
    default:
        if (seg_any_free(&pool->segs)) {
            size_t first = *n;
            uint64_t cached = pool->st.bytes_cached;
            SegDelta d = {0, 0};
            seg_take_whole(&pool->segs, all_streams, stream, keep, &cached, blocks, n, cap, &d);
            apply_delta(&pool->st, d);
            for (size_t i = first; i < *n; i++) pool->st.bytes_releasing += blocks[i]->size;
        }
    }
}

/* backend.free for a block taken out of the cache: a class block and a whole free segment are each one
 * device allocation.  The backend's answer (a new reference), NULL with its exception. */
static PyObject *scheme_give_back(Allocator *A, DevicePool *pool, const Block *b)
{
    switch (A->scheme) {
    case XP_SCHEME_SEED:
    case XP_SCHEME_SEGMENTS:
    default:
        return PyObject_CallMethod(A->backend, "free", "iKn", pool->device, (unsigned long long)b->ptr,
                                   (Py_ssize_t)b->size);
    }
}

/* ------------------------------------------------------------------ giving back */

/* The stream keys holding device allocations of the pool (Note [Capture: every stream of a device]): the
 * entry of `key`, made (with no allocation yet) when `make`; NULL when there is none (or no memory to make
 * it).  Pool lock held.  A pool serves a few streams: a scan, on misses and give-backs only. */
static StreamUse *stream_use(DevicePool *pool, intptr_t key, int make)
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

/* A device allocation of `key` went back to the device.  Pool lock held. */
static void stream_use_gone(DevicePool *pool, intptr_t key)
{
    StreamUse *u = stream_use(pool, key, 0);
    if (u && u->allocations && !--u->allocations) *u = pool->streams[--pool->n_streams];
}

/* Whether another stream's capture state may be asked (streams other than the legacy one and the request's):
 * a stream the pool holds memory for may have been destroyed since, and asking a destroyed stream is undefined
 * (cuStreamIsCapturing crashed in the driver on an H200).  Backends without .stream_alive have no such streams
 * (the host backend); without the GIL (PyTorch's path) another stream is not asked.  1 yes, 0 no. */
int may_ask(Allocator *A, int device, intptr_t handle)
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

static int ask_capturing(Allocator *A, int device, intptr_t handle)
{
    PyObject *r = PyObject_CallMethod(A->backend, "capturing", "in", device, (Py_ssize_t)handle);
    if (!r) return -1;
    int yes = PyObject_IsTrue(r);
    Py_DECREF(r);
    return yes;
}

/* Whether a stream of keys[0..k) captures: keys[0] (the legacy stream) and keys[1] (the request's) are asked
 * always, the others only when the backend vouches for them (may_ask); another thread's per-thread stream counts
 * as capturing while that thread lives.  `ask` is the backend's query or the ops'; its first nonzero answer is
 * returned (-1: its error).  Duplicates are asked once. */
int streams_capture(Allocator *A, int device, const intptr_t *keys, size_t k,
                    int (*ask)(Allocator *, int, intptr_t))
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

/* Whether anything may go back to the device now, for a request on `key` (Note [Capture: every stream of a
 * device]): 1 when a stream of the device captures into a CUDA graph, or may, so nothing must (cudaFree
 * synchronises the device, which ends every capture on it, cudaErrorStreamCaptureUnsupported, and loses the
 * graph; unmapping pages is no different); 0 when none does, or the backend cannot tell (it has no
 * .capturing(device, stream)); -1 with the backend's exception.  Asked of the backend for the legacy stream
 * (which reports a global-mode capture of any stream of the device), `key`'s stream and every stream holding
 * a device allocation of the pool here; another thread's per-thread stream cannot be asked from this thread,
 * so while that thread lives it counts as capturing.  With the GIL and no pool lock, before each give-back
 * only: never on a hit, never on a miss that gives nothing back. */
int device_captures(Allocator *A, DevicePool *pool, intptr_t key)
{
    if (A->scheme == XP_SCHEME_EXPANDABLE) return vm_captures(A, pool, key);   /* the ops answer, in C */
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
    int capturing = streams_capture(A, pool->device, keys, n + 2, ask_capturing);
    free(keys);
    return capturing;
}

/* Gives a block that is in no table, its bytes on bytes_releasing, back to
 * the device.  A backend free that raises has not freed the block (the
 * Backend contract): it goes back to the cache, so the counters keep matching
 * what the device holds and a later release tries again; -1 with the
 * backend's exception. */
static int give_back(Allocator *A, DevicePool *pool, Block *b)
{
    PyObject *r = scheme_give_back(A, pool, b);
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

/* A block in no table, its bytes on bytes_releasing, that should go back to the device on an error path
 * (a debug hook failed, no room in the live table): back unless a stream of the device captures (then, or
 * if that cannot be asked, it is cached), keeping any exception set.  Not known to hold poison either way. */
static void give_back_or_keep(Allocator *A, DevicePool *pool, Block *b, intptr_t key)
{
    PyObject *exc = PyErr_GetRaisedException();
    int capturing = device_captures(A, pool, key);
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

/* Gives blocks taken out of the cache back to the device, every one tried, and frees `blocks`: 0, or -1
 * with the first failed free's exception (those whose free failed are cached again); *released: the
 * bytes the device got back either way. */
static int give_back_all(Allocator *A, DevicePool *pool, Block **blocks, size_t n, uint64_t *released)
{
    PyObject *first = NULL;
    *released = 0;
    for (size_t i = 0; i < n; i++) {
        size_t size = blocks[i]->size;
        if (give_back(A, pool, blocks[i]) == 0) *released += size;
        else if (!first) first = PyErr_GetRaisedException();
        else PyErr_Clear();
    }
    free(blocks);
    if (first) { PyErr_SetRaisedException(first); return -1; }
    return 0;
}

long long release_cached(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep)
{
    if (A->scheme == XP_SCHEME_EXPANDABLE) {
        XpGil g = XP_GIL_HELD;
        long long n = vm_release_cached(A, pool, all_streams, stream, keep, 0, &g);
        xp_gil_end(&g);
        return n;
    }
    Block **blocks = NULL;
    size_t n = 0;
    int no_memory = 0;
    pthread_mutex_lock(&pool->lock);
    size_t cap = pool->st.blocks_cached;
    if (cap && pool->st.bytes_cached > keep) {
        blocks = malloc(cap * sizeof(Block *));
        if (blocks) scheme_take_idle(A, pool, all_streams, stream, keep, blocks, &n, cap);
        else no_memory = 1;
    }
    pthread_mutex_unlock(&pool->lock);
    if (no_memory) { PyErr_NoMemory(); return -1; }
    uint64_t released;
    return give_back_all(A, pool, blocks, n, &released) < 0 ? -1 : (long long)released;
}

long long empty_cache(Allocator *A, DevicePool *pool, XpGil *g)
{
    if (A->scheme == XP_SCHEME_EXPANDABLE) return vm_release_cached(A, pool, 1, 0, 0, 1, g);
    return release_cached(A, pool, 1, 0, 0);
}

void forget_misses(DevicePool *pool)
{
    pool->miss_released = 0;
    pool->miss_release_off = 0;
    pool->miss_unmapped_n = 0;
    pool->churned_at = 0;
}

void reset_miss_budget(DevicePool *pool)
{
    pthread_mutex_lock(&pool->lock);
    forget_misses(pool);
    pthread_mutex_unlock(&pool->lock);
}

/* The most bytes ever in use by request before this one: the peak statistic, or the peak before the last
 * reset_peak_stats() when that was higher (pool lock held). */
static uint64_t requested_most(const DevicePool *pool)
{
    uint64_t most = pool->st.peak_bytes_requested;
    return pool->requested_high > most ? pool->requested_high : most;
}

/* The committed bytes a miss of `requested` bytes may reach before it gives back (Note [Release on miss]):
 * "high_water", the most a device malloc or map has taken the pool to; "bounded", "growth", "until_churn" and
 * "peak", release_bound times the most bytes ever in use by request, this one's included (pool lock held). */
uint64_t miss_mark(const Allocator *A, const DevicePool *pool, size_t requested)
{
    int rule = A->release_on_miss;
    if (rule != XP_RELEASE_BOUNDED && rule != XP_RELEASE_GROWTH && rule != XP_RELEASE_UNTIL_CHURN &&
        rule != XP_RELEASE_PEAK)
        return pool->high_water;
    uint64_t most = pool->st.bytes_requested + requested, before = requested_most(pool);
    return (uint64_t)(A->release_bound * (double)(before > most ? before : most));
}

/* Whether a miss of `requested` bytes may give anything back at all: under "growth" only a miss that takes the
 * bytes in use by request past their most ever, so once a program's largest demand has been seen its misses only
 * map (Note [Release on miss: growth]); under "peak" also one that brings them within release_bound of that most,
 * at the program's peak, where its peak reserved is decided, never one below it, where a loop's layout drifts
 * (Note [Release on miss: peak]), and that one only until a miss has mapped pages a miss unmapped at that peak
 * (churn at a recurring peak: note_miss_map); every other rule, yes (pool lock held). */
int miss_may_release(const Allocator *A, const DevicePool *pool, size_t requested)
{
    int rule = A->release_on_miss;
    if (rule != XP_RELEASE_GROWTH && rule != XP_RELEASE_UNTIL_CHURN && rule != XP_RELEASE_PEAK) return 1;
    uint64_t most = requested_most(pool), demand = pool->st.bytes_requested + requested;
    if (demand > most) return 1;
    /* churned_at (0: none; always 0 on scheme segments, which maps nothing) only ever takes the most, so below it
     * means no churn seen at this most */
    if (rule == XP_RELEASE_PEAK) return A->release_bound * (double)demand >= (double)most && pool->churned_at < most;
    return rule == XP_RELEASE_UNTIL_CHURN && pool->churned_at < most;
}

/* "until_churn" (Note [Release on miss: until_churn]): misses give back as under "bounded" until one maps pages a
 * miss unmapped while the demand's most was what it is now (churn: the layout wants those pages every step), then
 * as under "growth" until the demand passes that most.  "peak" (Note [Release on miss: peak]) keeps the same ring
 * of the last XP_CHURN_RING runs misses unmapped, each with the most at the time: a miss that maps pages of a run
 * unmapped at a most within release_bound of the current one (m <= most <= release_bound * m: a peak that recurs,
 * or creeps up by less than the bound) is churn, and churned_at takes the most, so from then on misses at that
 * peak only map, as under "growth", until the demand passes it.  Its ring records every miss's unmaps, but under
 * "peak" only misses at the peak (or past it) unmap at all. */
void note_miss_unmap(DevicePool *pool, uintptr_t addr, uint64_t bytes)
{
    unsigned k = pool->miss_unmapped_n++ % XP_CHURN_RING;
    pool->miss_unmapped[k].addr = addr;
    pool->miss_unmapped[k].bytes = bytes;
    pool->miss_unmapped[k].most = requested_most(pool);
}

/* Whether a run unmapped while the demand's most was `then` was unmapped at the peak of now's most. */
static int same_peak(const Allocator *A, uint64_t then, uint64_t most)
{
    if (A->release_on_miss == XP_RELEASE_PEAK) return then <= most && A->release_bound * (double)then >= (double)most;
    return then == most;
}

void note_miss_map(const Allocator *A, DevicePool *pool, uintptr_t addr, uint64_t bytes)
{
    if (A->release_on_miss != XP_RELEASE_UNTIL_CHURN && A->release_on_miss != XP_RELEASE_PEAK) return;
    uint64_t most = requested_most(pool);
    unsigned n = pool->miss_unmapped_n < XP_CHURN_RING ? pool->miss_unmapped_n : XP_CHURN_RING;
    for (unsigned k = 0; k < n; k++) {
        uintptr_t lo = pool->miss_unmapped[k].addr, hi = lo + pool->miss_unmapped[k].bytes;
        if (same_peak(A, pool->miss_unmapped[k].most, most) && addr < hi && lo < addr + bytes) pool->churned_at = most;
    }
}

/* Bytes of a new segment for a `size`-byte range, before the limit and the device's size are asked. */
static size_t segment_size_for(const Allocator *A, size_t size)
{
    return seg_size_for(size, size <= XP_SMALL_MAX ? A->small_segment : A->segment_round);
}

/* Bytes a miss on `stream` wanting a `want`-byte segment should give back at the high-water mark (0: none,
 * also when the stream has no whole free segment to give: O(log n), Note [Whole free segments]).  Pool lock
 * held. */
static uint64_t miss_excess(const Allocator *A, DevicePool *pool, intptr_t stream, size_t want, size_t requested)
{
    uint64_t after = committed(&pool->st) + want, mark = miss_mark(A, pool, requested);
    if (pool->miss_released > XP_MISS_BUDGET * mark) pool->miss_release_off = 1;
    if (after <= mark || pool->miss_release_off || !miss_may_release(A, pool, requested) ||
        !seg_any_whole(&pool->segs, 0, stream))
        return 0;
    return after - mark;
}

/* Scheme segments, on a miss of `size` bytes on `stream`: whole free segments of the stream go back to the
 * device first, as A->release_on_miss says (Note [Release on miss]): always, or (the default) only the
 * idle ones that keep the pool at its high-water mark.  0, or -1 with the first failed free's exception.
 * Nothing goes back while the stream captures (asked without the lock, it calls Python; and only when
 * something would go back, so the misses that give nothing back ask nothing). */
static int release_for_miss(Allocator *A, DevicePool *pool, intptr_t stream, size_t size)
{
    int capturing;
    if (A->release_on_miss == XP_RELEASE_ALWAYS) {
        pthread_mutex_lock(&pool->lock);
        int any = seg_any_whole(&pool->segs, 0, stream);
        pthread_mutex_unlock(&pool->lock);
        if (!any) return 0;
        capturing = device_captures(A, pool, stream);
        if (capturing) return capturing < 0 ? -1 : 0;    /* a capture cannot take a cudaFree: the miss only adds */
        return release_cached(A, pool, 0, stream, 0) < 0 ? -1 : 0;
    }
    size_t want = segment_size_for(A, size);
    pthread_mutex_lock(&pool->lock);
    uint64_t excess = miss_excess(A, pool, stream, want, size);
    pthread_mutex_unlock(&pool->lock);
    if (!excess) return 0;
    capturing = device_captures(A, pool, stream);
    if (capturing) return capturing < 0 ? -1 : 0;
    pthread_mutex_lock(&pool->lock);
    excess = miss_excess(A, pool, stream, want, size);            /* again: another thread may have moved it */
    if (!excess) {
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    size_t cap = seg_whole_max(&pool->segs), n = 0;     /* only whole free segments can go back */
    Block **blocks = malloc(cap * sizeof(Block *));
    if (!blocks) { pthread_mutex_unlock(&pool->lock); PyErr_NoMemory(); return -1; }
    SegDelta d = {0, 0};
    seg_take_whole_need(&pool->segs, stream, excess, miss_min_idle(A), blocks, &n, cap, &d);
    apply_delta(&pool->st, d);
    for (size_t i = 0; i < n; i++) pool->st.bytes_releasing += blocks[i]->size;
    pthread_mutex_unlock(&pool->lock);
    uint64_t released;
    int r = give_back_all(A, pool, blocks, n, &released);
    pthread_mutex_lock(&pool->lock);
    pool->miss_released += released;   /* what the device got back: a failed free spends no budget */
    pthread_mutex_unlock(&pool->lock);
    return r;
}

/* ------------------------------------------------------------------ out of memory */

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

/* Raises xpool.OutOfMemoryError for the request, chained to `cause` (a reference this steals). */
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

/* ------------------------------------------------------------------ the recovery ladder (Note [Recovery ladder]) */

/* A request's way up (Climb) and what a try came to (TRY_*) are in _pages.h; scheme expandable's try, vm_try,
 * in _pages.c. */

/* One try: count the bytes against the limit, under the lock, before the backend is called (once: they
 * stay pending for the next tries), then backend.malloc.  TRY_NO_ROOM when the limit or a MemoryError
 * refuses; TRY_FAILED with any other error. */
static int try_once(Allocator *A, DevicePool *pool, Climb *c, uintptr_t *ptr)
{
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
                     "backend.malloc(%d, %zu) must return the block's address, an int > 0; got %R",
                     pool->device, c->size, r);
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
    *ptr = (uintptr_t)p;
    return TRY_GOT;
}

/* A try as try_once, but a segment larger than its block (a small block's shared segment) that finds no room,
 * by the limit or the device's free memory, falls back to the block's own bytes at once, before anything is
 * freed: the request may fit where the segment does not (a 4 KiB block on a 4 MiB device with 3 MiB in use). */
static int try_device_malloc(Allocator *A, DevicePool *pool, Climb *c, uintptr_t *ptr)
{
    int r = try_once(A, pool, c, ptr);
    if (r != TRY_NO_ROOM || c->size <= c->exact) return r;
    if (c->reserved) {
        pthread_mutex_lock(&pool->lock);
        pool->st.bytes_pending -= c->size - c->exact;
        pthread_mutex_unlock(&pool->lock);
    }
    c->size = c->exact;
    return try_once(A, pool, c, ptr);
}

/* A try of the request's scheme. */
static int ladder_try(Allocator *A, DevicePool *pool, Climb *c, uintptr_t *ptr, XpGil *g)
{
    return A->scheme == XP_SCHEME_EXPANDABLE ? vm_try(A, pool, c, g) : try_device_malloc(A, pool, c, ptr);
}

/* The ladder's last step: raise xpool.OutOfMemoryError (reason: what refused, and why it could not be
 * helped), the pending bytes given up first.  Returns TRY_FAILED. */
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
    raise_oom(A, pool, c->requested, c->size, reason, cause);
    return TRY_FAILED;
}

/* A step of the ladder: free this device's cache (after gc.collect() when `collect`: dead arrays held by
 * reference cycles give their blocks back), then try again.  Nothing is freed when it cannot help (a
 * request larger than the limit) or must not happen (the stream captures: a cudaFree would end it). */
static int free_cache_and_retry(Allocator *A, DevicePool *pool, intptr_t stream, Climb *c, uintptr_t *ptr,
                                int collect, XpGil *g)
{
    if (c->over_limit) return give_up(A, pool, c, "limit", g);
    int capturing = device_captures(A, pool, stream);
    if (capturing < 0) return TRY_FAILED;
    if (capturing) return give_up(A, pool, c, c->by_device ? "device_capturing" : "limit_capturing", g);
    if (collect) {
        xp_gil_take(g);
        if (collect_garbage() < 0) return TRY_FAILED;
    }
    if (A->scheme == XP_SCHEME_EXPANDABLE) {   /* every whole free page of the device; the ranges stay, unless
                                                  the address space ran out */
        XeRelease all = {1, 0, UINT64_MAX, 0};
        vm_release(A, pool, &all, stream, c->no_range, g, &c->fault);
        if (c->fault.status) return TRY_FAILED;
        c->no_range = 0;
    } else if (release_cached(A, pool, 1, 0, 0) < 0) {
        return TRY_FAILED;
    }
    c->step++;
    return ladder_try(A, pool, c, ptr, g);
}

/* One block's way up the ladder, as PyTorch's malloc reads: try; free this device's cache and retry; collect
 * garbage, free the cache and retry; raise.  Both what refuses, the limit and the device's out-of-memory (a
 * MemoryError from backend.malloc, XV_OOM from the ops), climb the same ladder; any other error is passed on at
 * once.  Scheme expandable: a block larger than the whole device raises at once (reason too_large; the other
 * schemes ask in device_malloc).  On success a device allocation's bytes stay pending: the caller records the
 * block (scheme expandable: the try did).  g: the GIL, taken only for what needs it (collecting, raising). */
int climb(Allocator *A, DevicePool *pool, intptr_t stream, Climb *c, uintptr_t *ptr, XpGil *g)
{
    uint64_t capacity = A->scheme == XP_SCHEME_EXPANDABLE ? vm_capacity(pool) : 0;
    int r;
    if (capacity && c->size > capacity) {   /* no freeing or retrying can help: bad input */
        xp_gil_take(g);
        r = raise_oom(A, pool, c->requested, c->size, "too_large", NULL);
    } else {
        r = ladder_try(A, pool, c, ptr, g);
        if (r == TRY_NO_ROOM) r = free_cache_and_retry(A, pool, stream, c, ptr, 0, g);
        if (r == TRY_NO_ROOM) r = free_cache_and_retry(A, pool, stream, c, ptr, 1, g);
        if (r == TRY_NO_ROOM) r = give_up(A, pool, c, c->by_device ? "device" : "limit", g);
    }
    if (r != TRY_GOT && c->reserved) {
        pthread_mutex_lock(&pool->lock);
        pool->st.bytes_pending -= c->size;
        pthread_mutex_unlock(&pool->lock);
    }
    if (r == TRY_FAILED && c->fault.status) {
        xp_gil_take(g);
        vm_raise(pool, &c->fault);
    }
    if (c->cause) {
        xp_gil_take(g);
        Py_CLEAR(c->cause);
    }
    return r;
}

/* One device allocation of *bytes (a segment, or `exact`, the block's own bytes, when the segment finds no
 * room: try_device_malloc; *bytes says which was made) for a request of `requested` (schemes seed and
 * segments), up the ladder (climb), with the GIL.  A request larger than the whole device raises at once
 * (reason too_large).  On success the bytes stay pending: the caller records the block. */
static int device_malloc(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t *bytes,
                         size_t exact, uintptr_t *ptr)
{
    size_t size = *bytes;
    uint64_t capacity = pool_capacity(A, pool);
    if (capacity && size > capacity) {
        if (exact > capacity)   /* no freeing or retrying can help: bad input */
            return raise_oom(A, pool, requested, exact, "too_large", NULL);
        size = exact;
    }
    Climb c = {.requested = requested, .size = size, .exact = exact, .stream = stream};
    XpGil g = XP_GIL_HELD;
    int r = climb(A, pool, stream, &c, ptr, &g);
    *bytes = c.size;
    return r == TRY_GOT ? 0 : -1;
}

/* ------------------------------------------------------------------ new blocks */

/* A new Block of `bytes` bytes, one device allocation of them (through the ladder); its bytes stay
 * pending until record_new(). */
static Block *new_allocation(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t bytes,
                             size_t exact, int origin, int hooked)
{
    Block *b = calloc(1, sizeof(Block));
    pthread_mutex_lock(&pool->lock);
    int known = stream_use(pool, stream, 1) != NULL;   /* its stream is asked before anything goes back */
    pthread_mutex_unlock(&pool->lock);
    if (!b || !known) {
        free(b);
        PyErr_NoMemory();
        return NULL;
    }
    uintptr_t ptr = 0;
    if (device_malloc(A, pool, stream, requested, &bytes, exact, &ptr) < 0) {
        free(b);
        return NULL;
    }
    b->ptr = ptr; b->size = bytes; b->requested = requested;
    b->stream = stream; b->device = pool->device; b->origin = origin; b->handed_out = !hooked;
    return b;
}

/* Records a new allocation as a block in use: a segment's first `size` bytes, the rest of it a free
 * range.  The block, or NULL (no room in the live table: the allocation is given back). */
static Block *record_new(Allocator *A, DevicePool *pool, Block *b, size_t size)
{
    pthread_mutex_lock(&pool->lock);
    if (committed(&pool->st) > pool->high_water) pool->high_water = committed(&pool->st);
    pool->st.bytes_pending -= b->size;
    b->serial = pool->st.requests;
    if (ptrtable_insert(&pool->live, b) < 0) {
        pool->st.bytes_releasing += b->size;
        pthread_mutex_unlock(&pool->lock);
        PyErr_NoMemory();
        give_back_or_keep(A, pool, b, b->stream);
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

/* Scheme seed: the block is one device allocation of its class.  Its bin exists before the block is
 * handed out, so freeing it never needs memory. */
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

/* Bytes of a new segment for a `size`-byte range (Note [Small segments]): up to 1 MiB, small_segment bytes
 * (shared by later small blocks); above, the range rounded up to segment_round; exactly size when the
 * rounding alone would break the device's size or the limit (the request may still fit). */
static size_t segment_bytes(Allocator *A, DevicePool *pool, size_t size)
{
    size_t got = segment_size_for(A, size);
    if (got == size) return got;
    uint64_t capacity = pool_capacity(A, pool);
    pthread_mutex_lock(&pool->lock);
    uint64_t limit = pool->limit, res = committed(&pool->st);
    pthread_mutex_unlock(&pool->lock);
    if ((capacity && got > capacity) || (limit && res + got > limit)) return size;
    return got;
}

/* Scheme segments: a new segment, the block its first range.  Whole free segments of this stream are all
 * smaller than the request (best fit found none): on a miss they may go back first, so the new segment
 * takes their place instead of adding to the reserve (Note [Release on miss]). */
static Block *segments_make(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
                            PyObject *hook, int origin)
{
    if (A->release_on_miss != XP_RELEASE_NEVER && release_for_miss(A, pool, stream, size) < 0) return NULL;
    size_t got = segment_bytes(A, pool, size);
    Block *b = new_allocation(A, pool, stream, requested, got, size, origin, hook != NULL);
    if (!b) return NULL;
    got = b->size;       /* the segment, or the block alone when the segment found no room */
    b->in_segment = 1;   /* from here a failed give_back caches it as a whole free segment */
    if (got > size && hook) {
        /* the rest of the segment is cached from the start: poisoned, as a freed block is */
        if (call_hook(hook, "on_segment", b, 0) < 0) {
            pthread_mutex_lock(&pool->lock);
            pool->st.bytes_pending -= got;
            pool->st.bytes_releasing += got;
            pthread_mutex_unlock(&pool->lock);
            give_back_or_keep(A, pool, b, stream);   /* a whole free segment, unpoisoned, if it stays */
            return NULL;
        }
        b->poisoned = 1;
    }
    return record_new(A, pool, b, size);
}

/* A miss: a new block of `size` bytes in use (counted), or NULL with an exception. */
static Block *scheme_make(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
                          PyObject *hook, int origin)
{
    switch (A->scheme) {
    case XP_SCHEME_SEED: return seed_make(A, pool, stream, requested, size, hook, origin);
    case XP_SCHEME_EXPANDABLE: return vm_make(A, pool, stream, requested, size, hook, origin);
    default: return segments_make(A, pool, stream, requested, size, hook, origin);
    }
}

/* ------------------------------------------------------------------ the allocation path */

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
    PyErr_SetRaisedException(exc);
    if (to_device) give_back_or_keep(A, pool, b, b->stream);
}

static Block *alloc_block(Allocator *A, int device, intptr_t stream, size_t requested,
                          size_t size, PyObject *hook, int origin)
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
    b = scheme_make(A, pool, stream, requested, size, hook, origin);
    if (b && hook && prepare(pool, b, hook, "on_alloc") < 0) {
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
                     "xpool: pointer %p on device %d was not handed out by this pool "
                     "(or was freed twice)", (void *)ptr, device);   /* %p: PyErr_Format has no %zx */
        return -1;
    }
    /* the block is this thread's alone until it is cached */
    int hook_failed = call_hook(hook, "on_free", b, requested) < 0;
    drop_hook(hook);
    if (hook_failed) {   /* the hook's exception stays set */
        b->poisoned = 0;
        if (is_allocation(b)) {   /* not cached unpoisoned: back to the device, unless a capture forbids it */
            give_back_or_keep(A, pool, b, b->stream);
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

/* ------------------------------------------------------------------ CuPy's CFunctionAllocator hooks */

/* void *malloc(void *param, size_t size, int device): CuPy (Cython 3) checks for a
 * Python error when this returns (void *)-1, so an exception set here propagates
 * out of cupy's allocation as-is. */
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
void cupy_free(void *param, void *ptr, int device)
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
