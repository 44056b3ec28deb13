/*
 * xpool._core: the hot path's operations on a device pool's C structures.
 *
 * Static, in a header, so that each file that runs a hit or a free has them inlined beside its entry point:
 * _alloc.c (CuPy's hooks, Allocator.allocate, with the GIL) and _torch.c (PyTorch's entry points, without
 * it).  Nothing here locks, calls Python or the backend: the callers hold the pool lock.  The schemes' hit
 * side is here (scheme_block_size, scheme_take, cache_block); their miss side is their XpScheme table.
 *
 * Note [Hit path].  A hit is one lock, a table lookup (seed: the bin of its stream and class, LIFO; segments and
 * expandable: the best fit in the free-range treap, or the exact-size cache beside it, FreeTree.recent) and an
 * insert into the live table; a free the reverse.  No Python, no backend call, no allocation in the common case
 * (Blocks of merged ranges are kept for the next split).  CuPy's hook is given the device, so it asks CuPy's
 * per-device current stream directly (cupy_backends' get_stream_ptr) rather than cudaGetDevice first.
 */
#ifndef XPOOL_HOT_H
#define XPOOL_HOT_H

#include "_core.h"   /* first: Python.h sets the feature macros <time.h> needs (CLOCK_MONOTONIC) */

#include <time.h>

/* ------------------------------------------------------------------ size classes */

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

/* The j-th of the k classes between p and 2p. */
static inline size_t klass(size_t p, size_t j, unsigned k)
{
    return round_up(p + (j * p + k - 1) / k, XP_ALIGN);
}

/* Class of an n-byte request; k classes per doubling above 1 MiB. */
static inline size_t size_class(size_t n, unsigned k)
{
    if (n <= XP_SMALL_MAX)
        return n == 0 ? XP_ALIGN : round_up(n, XP_ALIGN);
    /* p: the largest power of two below n, so p < n <= 2p */
    unsigned shift = 63 - __builtin_clzll((unsigned long long)(n - 1));
    size_t p = (size_t)1 << shift;
    if (k == 1) return 2 * p;                       /* the design's classes, the next power of two: no division */
    size_t j = ((n - p) * k + p - 1) >> shift;      /* least j with p + j p / k >= n */
    /* class j is p + ceil(j p / k) rounded up to 512 B; the rounding can make
     * class j-1 large enough already (p / k >= 16 KiB, so one step at most) */
    if (j > 1 && klass(p, j - 1, k) >= n) j--;
    return klass(p, j, k);
}

/* ------------------------------------------------------------------ tables */

static inline size_t mix(uint64_t x)
{
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return (size_t)(x ^ (x >> 33));
}

#define PTRTABLE_MIN_CAP 256

/* Rehashes into a table sized for the live entries alone, dropping the tombstones: at most a quarter full afterwards,
 * so the next rehash is at least cap/4 inserts away (amortised O(1)), and a table whose blocks came and went at ever
 * new addresses stays as small as what is alive. */
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

/* ------------------------------------------------------------------ statistics and the timeline */

static inline void origin_in(Stats *s, int origin, size_t size)
{
    if (origin != ORIGIN_CUPY) s->bytes_in_use_by[origin] += size;
}

static inline void origin_out(Stats *s, int origin, size_t size)
{
    if (origin != ORIGIN_CUPY) s->bytes_in_use_by[origin] -= size;
}

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
        e->origin = b && event != EV_MAP && event != EV_UNMAP ? (int32_t)b->origin : -1;   /* pages: no origin */
        tl->count++;
    }
    pthread_mutex_unlock(&tl->lock);
}

/* Counts a block as handed out, with its requested bytes set, and records `event` (0: none, the caller
 * records it).  Pool lock held. */
static void count_in_use(Allocator *A, DevicePool *pool, Block *b, int event)
{
    pool->st.blocks_in_use++; pool->st.bytes_in_use += b->size;
    pool->st.bytes_requested += b->requested;
    origin_in(&pool->st, b->origin, b->size);
    note_peaks(&pool->st);
    if (event) timeline_record(&A->tl, event, pool, b, b->requested);
}

/* Stamps a block taken from the cache as the current request's (requested, serial, origin, hook).  Lock held. */
static inline void stamp_handed_out(DevicePool *pool, Block *b, size_t requested, int origin, int hooked)
{
    b->requested = requested; b->serial = pool->st.requests;
    b->origin = origin; b->handed_out = !hooked; b->guarded = 0;
}

/* ------------------------------------------------------------------ schemes: the hit side (Note [Schemes]) */

/* Bytes a block takes: its class (seed), or the request rounded up to 512 B, cut from a segment
 * (segments) or from the mapped pages of an address range (expandable).  n <= XP_MAX_REQUEST + XP_MAX_DEBUG_TAIL. */
static inline size_t scheme_block_size(const Allocator *A, size_t n)
{
    switch (A->scheme) {
    case XP_SCHEME_SEED: return size_class(n, A->k);
    default: return n == 0 ? XP_ALIGN : round_up(n, XP_ALIGN);
    }
}

/* A block whose give-back is a device allocation of its own (a class block), not a range of a segment. */
static inline int is_allocation(const Block *b) { return !b->in_segment; }

/* Puts a block that is in no table into the cache: a range merges with its free neighbours in the
 * FreeTree, a class block goes on the bin of its stream and class.  That bin exists: seed_make makes it
 * before the block is first handed out, and bins are never removed, so caching never needs memory.
 * Pool lock held; the caller takes the block's bytes off the counter they were on. */
static void cache_block(DevicePool *pool, Block *b)
{
    b->requested = 0;
    if (b->in_segment) {   /* merges with free neighbours: b may be freed, never use it after this */
        SegDelta d = {0, 0};
        if (pool->vm) xe_put(pool->vm, &pool->segs, b, &d);
        else seg_put(&pool->segs, b, &d);
        apply_delta(&pool->st, d);
        return;
    }
    Bin *bin = bintable_find(&pool->bins, b->stream, b->size);
    b->next = bin->top; bin->top = b; bin->count++;
    pool->st.blocks_cached++; pool->st.bytes_cached += b->size;
}

/* A cached block of `size` bytes for `stream`, taken off the cached counters; NULL when none.  Pool
 * lock held.  A range can come out larger than asked (no memory to split it): see b->size. */
static inline Block *scheme_take(Allocator *A, DevicePool *pool, intptr_t stream, size_t size)
{
    switch (A->scheme) {
    case XP_SCHEME_SEED: {
        Bin *bin = bintable_find(&pool->bins, stream, size);
        Block *b = bin ? bin->top : NULL;
        if (!b) return NULL;
        bin->top = b->next; bin->count--;
        b->next = NULL;
        pool->st.blocks_cached--; pool->st.bytes_cached -= b->size;
        return b;
    }
    case XP_SCHEME_EXPANDABLE: {
        SegDelta d = {0, 0};
        Block *b = xe_take(pool->vm, &pool->segs, stream, size, &d);
        apply_delta(&pool->st, d);
        return b;
    }
    default: {
        SegDelta d = {0, 0};
        Block *b = seg_take(&pool->segs, stream, size, &d);
        apply_delta(&pool->st, d);
        return b;
    }
    }
}

/* ------------------------------------------------------------------ the hit */

/* The hit path, pool lock held (Note [Hit path]): a cached block of `size` bytes for `stream` handed out,
 * the request and the hit counted.  NULL when none is cached, or when the live table has no room for it
 * (*no_room; the block stays cached); nothing is counted then.  Both ways in use it: xp_alloc with the
 * GIL, PyTorch's take_nogil (_torch.c) without. */
static inline Block *take_hit(Allocator *A, DevicePool *pool, intptr_t stream, size_t size, size_t requested,
                              int origin, int hooked, int *no_room)
{
    *no_room = 0;
    Block *b = scheme_take(A, pool, stream, size);
    if (!b) return NULL;
    if (ptrtable_insert(&pool->live, b) < 0) {   /* back where it was */
        cache_block(pool, b);
        *no_room = 1;
        return NULL;
    }
    pool->st.requests++;
    stamp_handed_out(pool, b, requested, origin, hooked);
    pool->st.hits++;
    count_in_use(A, pool, b, EV_HIT);
    return b;
}

#endif
