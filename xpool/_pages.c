/* xpool._core: scheme expandable's pages (Note [Expandable segments]): unmapped when cached pages go back, mapped
 * by a miss's try of the recovery ladder, and that miss itself.  What _alloc.c and this file share: _pages.h;
 * the layers, the GIL rules and the lock order: _core.h. */
#include "_hot.h"
#include "_pages.h"

#include <stdarg.h>
#include <stdio.h>

/* ------------------------------------------------------------------ scheme expandable: pages back (Note [Expandable segments])
 *
 * The scheme's memory is pages mapped into address ranges reserved per (device, stream) (pool->vm, the range
 * manager of _expandable.c); blocks are cut from the mapped free space by the same best fit as scheme segments
 * (xe_take / xe_put on the hit path, _hot.h).  Pages are mapped only by a miss (vm_try, a try of the ladder) and
 * unmapped only here, whole free pages, never one holding a byte in use.  The ops (_vmm.h) are called from C,
 * without the pool lock, with the GIL let go around them when it is held (XpGil): the unmap synchronises the
 * device, as cudaFree does.  Plans and their finishes run under the pool lock; while a plan is in flight its
 * mapped bytes count on bytes_releasing, so reserved is always the mapped bytes. */

#define VM_UNKNOWN_CAPACITY ((uint64_t)1 << 40)   /* a device whose size cannot be asked: ranges of 1.125 TiB */

/* Keeps the first fault only (the ops' message is thread-local: copied at once). */
static void vm_fault(VmFault *f, int status, const char *fmt, ...)
{
    if (f->status) return;
    f->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->why, sizeof f->why, fmt, ap);
    va_end(ap);
}

void vm_raise(const DevicePool *pool, const VmFault *f)
{
    if (f->status == VM_NO_HOST_MEMORY)
        PyErr_Format(PyExc_MemoryError, "xpool (scheme expandable, device %d): %s", pool->device, f->why);
    else
        PyErr_Format(f->status == XV_OOM ? PyExc_MemoryError : PyExc_RuntimeError,
                     "xpool (scheme expandable, device %d): %s", pool->device, f->why);
}

/* A call's change of the range manager's counters, added to the pool's.  Pool lock held. */
static void vm_apply(DevicePool *pool, XeDelta d)
{
    pool->st.blocks_cached += d.free.free_ranges;
    pool->st.bytes_cached += d.free.free_bytes;
    pool->st.bytes_releasing += d.held;
    pool->st.device_maps += d.maps;
    pool->st.device_unmaps += d.unmaps;
}

/* A map or unmap of [addr, addr + bytes) in the timeline.  Pool lock held. */
static void vm_event(Allocator *A, DevicePool *pool, int event, intptr_t stream, uintptr_t addr, size_t bytes)
{
    Block run = {.ptr = addr, .size = bytes, .stream = stream, .device = pool->device};
    timeline_record(&A->tl, event, pool, &run, 0);
}

/* The ops' capture query: a failed one counts as capturing (giving nothing back is always safe). */
static int ops_capturing(Allocator *A, int device, intptr_t handle)
{
    return A->vmm.ops->capturing(A->vmm.ctx, device, handle) != 0;
}

/* device_captures of scheme expandable: 1 when nothing may be unmapped on the device now, ops.capturing asked
 * of the streams device_captures asks (the legacy stream, where a global-mode capture of a blocking stream
 * shows, `key`'s stream) and every stream with a range here: the unmap synchronises the device, which would end
 * any capture on it, as cudaFree would (Note [Capture: every stream of a device]).  Another thread's per-thread
 * stream cannot be asked from this thread: it counts as capturing while that thread lives; so does a query that
 * fails (giving nothing back is always safe).  C only (no GIL needed, never -1), no pool lock held. */
int vm_captures(Allocator *A, DevicePool *pool, intptr_t key)
{
    pthread_mutex_lock(&pool->lock);
    size_t n = pool->vm ? pool->vm->n_ranges : 0, k = 0;
    intptr_t *keys = malloc((n + 2) * sizeof(intptr_t));
    if (keys) {
        keys[k++] = 0;
        keys[k++] = key;
        for (size_t i = 0; i < n; i++) keys[k++] = pool->vm->ranges[i]->stream;
    }
    pthread_mutex_unlock(&pool->lock);
    if (!keys) return 1;
    int capturing = streams_capture(A, pool->device, keys, k, ops_capturing);
    free(keys);
    return capturing;
}

void xp_pin_pages(Allocator *A, int on)
{
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&A->pin_lock);
    if (on) {
        while (A->unmapping) pthread_cond_wait(&A->pin_cv, &A->pin_lock);
        A->pins++;
    } else if (A->pins && !--A->pins) {
        pthread_cond_broadcast(&A->pin_cv);
    }
    pthread_mutex_unlock(&A->pin_lock);
    Py_END_ALLOW_THREADS
}

/* An unmap (or a range given back) begins: it waits, the GIL let go, until no check reads live blocks. */
static void vm_unmap_begin(Allocator *A, XpGil *g)
{
    pthread_mutex_lock(&A->pin_lock);
    if (A->pins) {
        pthread_mutex_unlock(&A->pin_lock);
        xp_gil_drop(g);   /* the check needs the GIL to finish (a dealloc, which cannot drop it, has no check) */
        pthread_mutex_lock(&A->pin_lock);
        while (A->pins) pthread_cond_wait(&A->pin_cv, &A->pin_lock);
    }
    A->unmapping++;
    pthread_mutex_unlock(&A->pin_lock);
}

static void vm_unmap_end(Allocator *A)
{
    pthread_mutex_lock(&A->pin_lock);
    if (!--A->unmapping) pthread_cond_broadcast(&A->pin_cv);
    pthread_mutex_unlock(&A->pin_lock);
}

/* Unmaps the whole free pages `spec` allows, then (give_ranges: empty_cache) gives back the address ranges left
 * with nothing mapped.  Nothing while a stream of the device captures (vm_captures, for a request on `key`).
 * Returns the bytes unmapped; the first failed op is kept in *f (every run is still tried; what a failed unmap
 * left mapped stays, free and counted).  No pool lock held; the GIL is let go around the ops when g allows. */
uint64_t vm_release(Allocator *A, DevicePool *pool, const XeRelease *spec, intptr_t key, int give_ranges,
                    XpGil *g, VmFault *f)
{
    if (!atomic_load_explicit(&pool->vm_ready, memory_order_acquire) || vm_captures(A, pool, key)) return 0;
    const XvOps *ops = A->vmm.ops;
    void *ctx = A->vmm.ctx;
    XeDevice *x = pool->vm;
    XeUnmapPlan plan;
    XeDelta d = {0};
    vm_unmap_begin(A, g);
    pthread_mutex_lock(&pool->lock);
    int planned = xe_plan_unmap(x, &pool->segs, spec, &plan, &d);
    vm_apply(pool, d);
    pthread_mutex_unlock(&pool->lock);
    if (planned < 0) vm_fault(f, VM_NO_HOST_MEMORY, "no host memory to plan a release");
    uint64_t unmapped = 0;
    if (plan.n) xp_gil_drop(g);
    for (size_t i = 0; i < plan.n; i++) {
        size_t done = 0;
        XeUnmapRun run = plan.runs[i];
        int st = ops->unmap(ctx, pool->device, run.addr, run.bytes, x->page, &done);
        if (st != XV_OK) vm_fault(f, st, "%s", ops->message(ctx));
        XeDelta e = {0};
        pthread_mutex_lock(&pool->lock);
        xe_unmap_finish(x, &pool->segs, &plan, i, done, &e);
        vm_apply(pool, e);
        if (done) vm_event(A, pool, EV_UNMAP, run.range->stream, run.addr, done);
        if (done && spec->for_miss) note_miss_unmap(pool, run.addr, done);
        pthread_mutex_unlock(&pool->lock);
        unmapped += done;
    }
    xe_unmap_plan_free(&plan);
    while (give_ranges) {
        XeRange *empty[64];
        pthread_mutex_lock(&pool->lock);
        size_t n = xe_take_empty(x, empty, 64);
        pthread_mutex_unlock(&pool->lock);
        if (!n) break;
        xp_gil_drop(g);
        for (size_t i = 0; i < n; i++) {
            int st = ops->release(ctx, pool->device, empty[i]->base, empty[i]->bytes);
            if (st != XV_OK) {
                vm_fault(f, st, "%s", ops->message(ctx));
                give_ranges = 0;          /* it is back on the device's list: taking it again would loop */
            }
            XeDelta e = {0};
            pthread_mutex_lock(&pool->lock);
            xe_release_finish(x, empty[i], st == XV_OK, &e);
            pthread_mutex_unlock(&pool->lock);
        }
    }
    vm_unmap_end(A);
    return unmapped;
}

/* release_cached / empty_cache of scheme expandable: whole free pages until at most `keep` bytes stay cached
 * (of one stream, or all), and, when give_ranges, the emptied address ranges.  Bytes unmapped; -1 with the first
 * failed op's error (the rest was still tried). */
long long vm_release_cached(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep,
                            int give_ranges, XpGil *g)
{
    pthread_mutex_lock(&pool->lock);
    uint64_t cached = pool->st.bytes_cached;
    pthread_mutex_unlock(&pool->lock);
    XeRelease spec = {all_streams, stream, keep ? (cached > keep ? cached - keep : 0) : UINT64_MAX, 0};
    VmFault f = {0};
    uint64_t n = vm_release(A, pool, &spec, stream, give_ranges, g, &f);
    if (!f.status) return (long long)n;
    xp_gil_take(g);
    vm_raise(pool, &f);
    return -1;
}

/* The device's bytes as the first miss asked them (vm_init), without calling Python again. */
uint64_t vm_capacity(DevicePool *pool)
{
    pthread_mutex_lock(&pool->lock);
    uint64_t capacity = pool->capacity;
    pthread_mutex_unlock(&pool->lock);
    return capacity;
}

const char *const xp_peer_names[XP_PEER_CHOICES] = {"none", "all"};

/* The device's range manager, made on its first miss (with the GIL): its page is the device's granularity, a
 * range 1.125x the device's memory, its peers (peer_access "all") every device that can access it.  0, or -1
 * with an exception. */
static int vm_init(Allocator *A, DevicePool *pool)
{
    size_t page = 0;
    uint64_t peers = 0;
    int st;
    const char *what = "cannot run";
    char why[256] = "";
    Py_BEGIN_ALLOW_THREADS
    st = A->vmm.ops->granularity(A->vmm.ctx, pool->device, &page);
    if (st == XV_OK && A->peer_access == XP_PEERS_ALL &&
        (st = A->vmm.ops->peers(A->vmm.ctx, pool->device, &peers)) != XV_OK)
        what = "cannot tell which devices may access";
    if (st != XV_OK) snprintf(why, sizeof why, "%s", A->vmm.ops->message(A->vmm.ctx));
    Py_END_ALLOW_THREADS
    if (st != XV_OK) {
        PyErr_Format(PyExc_RuntimeError, "xpool: scheme 'expandable' %s on device %d: %s", what, pool->device, why);
        return -1;
    }
    uint64_t capacity = pool_capacity(A, pool);
    XeDevice *x = calloc(1, sizeof *x);
    if (!x) { PyErr_NoMemory(); return -1; }
    if (xe_init(x, pool->device, page, xe_range_bytes(capacity ? capacity : VM_UNKNOWN_CAPACITY, page), peers) < 0) {
        free(x);
        PyErr_Format(PyExc_ValueError, "xpool: scheme 'expandable': device %d's granularity of %zu B is not a power "
                     "of two of at least 512 B", pool->device, page);
        return -1;
    }
    pthread_mutex_lock(&pool->lock);
    if (!pool->vm) {
        pool->vm = x;
        x = NULL;
        atomic_store_explicit(&pool->vm_ready, 1, memory_order_release);
    }
    pthread_mutex_unlock(&pool->lock);
    free(x);   /* another thread made it first */
    return 0;
}

int xp_vm_range_of(Allocator *A, int device, uintptr_t ptr, uintptr_t *base, size_t *bytes)
{
    DevicePool *pool = A->scheme == XP_SCHEME_EXPANDABLE ? pool_lookup(A, device) : NULL;
    if (!pool || !atomic_load_explicit(&pool->vm_ready, memory_order_acquire)) return 0;
    pthread_mutex_lock(&pool->lock);
    XeRange *r = xe_range_of(pool->vm, ptr);
    if (r) { *base = r->base; *bytes = r->bytes; }
    pthread_mutex_unlock(&pool->lock);
    return r != NULL;
}

/* ------------------------------------------------------------------ scheme expandable: pages mapped (a ladder's try) */

/* Bytes a miss of scheme expandable should unmap first, its maps counted already in `after` (0: none;
 * UINT64_MAX: every whole free page of its stream), as release_on_miss says: Note [Release on miss], the same
 * rule and budget as scheme segments, in pages.  Pool lock held. */
static uint64_t vm_miss_excess(Allocator *A, DevicePool *pool, uint64_t after, size_t requested)
{
    if (A->release_on_miss == XP_RELEASE_NEVER || !pool->st.blocks_cached) return 0;
    if (A->release_on_miss == XP_RELEASE_ALWAYS) return UINT64_MAX;
    uint64_t mark = miss_mark(A, pool, requested);
    if (pool->miss_released > XP_MISS_BUDGET * mark) pool->miss_release_off = 1;
    if (after <= mark || pool->miss_release_off || !miss_may_release(A, pool, requested)) return 0;
    return after - mark;
}

/* One try of scheme expandable: plan where the block goes (the lowest address where free space and unmapped
 * pages of its stream hold it; a new address range when none does), count the pages it maps against the limit
 * (under the lock, with the plan, so threads cannot pass the limit together), at the first try unmap what a
 * miss gives back (release_on_miss), map the pages and make the block, in use and counted.  TRY_GOT with
 * c->block; TRY_NO_ROOM when the limit or the device (out of memory, or of address space) refuses; TRY_FAILED
 * with c->fault (or, in debug mode, the hook's exception set).  A plan of several runs whose k-th map fails
 * keeps the runs mapped before it, as free cached pages. */
int vm_try(Allocator *A, DevicePool *pool, Climb *c, XpGil *g)
{
    const XvOps *ops = A->vmm.ops;
    void *ctx = A->vmm.ctx;
    XeDevice *x = pool->vm;
    XeMapPlan p;
    for (;;) {
        XeDelta d = {0};
        pthread_mutex_lock(&pool->lock);
        if (xe_plan_map(x, &pool->segs, c->stream, c->size, &p, &d) < 0) {
            pthread_mutex_unlock(&pool->lock);
            vm_fault(&c->fault, VM_NO_HOST_MEMORY, "no host memory to plan a map of %zu B", c->size);
            return TRY_FAILED;
        }
        vm_apply(pool, d);
        if (p.range) break;   /* the lock stays held */
        pthread_mutex_unlock(&pool->lock);
        uintptr_t base = 0;
        xp_gil_drop(g);
        int st = ops->reserve(ctx, pool->device, p.new_range, x->page, &base);
        if (st != XV_OK) {
            vm_fault(st == XV_OOM ? &c->oom : &c->fault, st, "%s", ops->message(ctx));
            if (st != XV_OOM) return TRY_FAILED;
            c->by_device = c->no_range = 1;
            return TRY_NO_ROOM;
        }
        XeDelta e = {0};
        pthread_mutex_lock(&pool->lock);
        XeRange *r = xe_add_range(x, c->stream, base, p.new_range, &e);
        pthread_mutex_unlock(&pool->lock);
        if (!r) {
            ops->release(ctx, pool->device, base, p.new_range);
            vm_fault(&c->fault, VM_NO_HOST_MEMORY, "no host memory to keep an address range");
            return TRY_FAILED;
        }
    }
    uint64_t limit = pool->limit, after = committed(&pool->st) + p.map_bytes;
    if (limit && after > limit) {   /* the plan goes back as it was */
        XeDelta e = {0};
        xe_map_finish(x, &pool->segs, &p, 0, &e);
        vm_apply(pool, e);
        pthread_mutex_unlock(&pool->lock);
        c->by_device = 0;
        c->over_limit = c->size > limit || p.map_bytes > limit;   /* no release can make either fit */
        return TRY_NO_ROOM;
    }
    pool->st.bytes_pending += p.map_bytes;
    for (size_t i = 0; c->step == 0 && i < p.n_maps; i++) note_miss_map(A, pool, p.map[i].addr, p.map[i].bytes);
    uint64_t need = c->step == 0 ? vm_miss_excess(A, pool, after, c->requested) : 0;
    pthread_mutex_unlock(&pool->lock);
    if (need) {   /* a failed unmap leaves its pages cached: the miss goes on */
        XeRelease idle = {0, c->stream, need, miss_min_idle(A), 1};
        VmFault ignored = {0};
        uint64_t got = vm_release(A, pool, &idle, c->stream, 0, g, &ignored);
        pthread_mutex_lock(&pool->lock);
        pool->miss_released += got;   /* what the device got back: a failed unmap spends no budget */
        pthread_mutex_unlock(&pool->lock);
    }
    xp_gil_drop(g);
    size_t ok = 0;
    int st = XV_OK;
    for (; ok < p.n_maps; ok++) {
        st = ops->map(ctx, pool->device, p.map[ok].addr, p.map[ok].bytes, x->page, x->peers);
        if (st != XV_OK) {
            vm_fault(st == XV_OOM ? &c->oom : &c->fault, st, "%s", ops->message(ctx));
            break;
        }
    }
    PyObject *exc = NULL;
    if (st == XV_OK && c->hook) {   /* debug mode: new pages are poisoned, as a freed block is, before anyone sees them */
        xp_gil_take(g);
        p.poisoned = 1;
        for (size_t i = 0; i < p.n_maps && !exc; i++) {
            Block run = {.ptr = p.map[i].addr, .size = p.map[i].bytes, .stream = c->stream, .device = pool->device,
                         .origin = c->origin};
            if (call_hook(c->hook, "on_segment", &run, 0) < 0) {
                exc = PyErr_GetRaisedException();
                p.poisoned = 0;
            }
        }
    }
    int no_room = 0;
    XeDelta e = {0};
    pthread_mutex_lock(&pool->lock);
    pool->st.bytes_pending -= p.map_bytes;
    Block *b = xe_map_finish(x, &pool->segs, &p, ok, &e);
    vm_apply(pool, e);
    note_peaks(&pool->st);
    if (b && (exc || (no_room = ptrtable_insert(&pool->live, b) < 0))) {   /* not handed out: cached, mapped */
        cache_block(pool, b);
        b = NULL;
    }
    if (b) {
        if (committed(&pool->st) > pool->high_water) pool->high_water = committed(&pool->st);
        b->requested = c->requested;
        b->serial = pool->st.requests;
        b->origin = c->origin; b->handed_out = c->hook == NULL; b->guarded = 0;
        if (c->step) pool->st.oom_recoveries++;
        count_in_use(A, pool, b, 0);
    }
    /* the maps, then the miss, each with the counters as they stand once the block is counted */
    for (size_t i = 0; i < ok; i++) vm_event(A, pool, EV_MAP, c->stream, p.map[i].addr, p.map[i].bytes);
    if (b) timeline_record(&A->tl, EV_MISS, pool, b, b->requested);
    pthread_mutex_unlock(&pool->lock);
    if (b) {
        c->block = b;
        return TRY_GOT;
    }
    if (exc) {   /* the GIL is held: the hook ran */
        PyErr_SetRaisedException(exc);
        return TRY_FAILED;
    }
    if (no_room) {
        vm_fault(&c->fault, VM_NO_HOST_MEMORY, "no host memory for the table of blocks in use");
        return TRY_FAILED;
    }
    if (st != XV_OOM) return TRY_FAILED;
    c->by_device = 1;
    return TRY_NO_ROOM;
}

/* ------------------------------------------------------------------ scheme expandable: new blocks */

/* Scheme expandable: a new block of mapped pages, up the ladder (climb, whose tries are vm_try); the hit found
 * no free space of its stream that fits.  NULL with an exception (the GIL held then). */
static Block *vm_climb(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
                       PyObject *hook, int origin, XpGil *g)
{
    Climb c = {.requested = requested, .size = size, .exact = size, .stream = stream, .origin = origin,
               .hook = hook};
    return climb(A, pool, stream, &c, NULL, g) == TRY_GOT ? c.block : NULL;
}

Block *vm_make(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
               PyObject *hook, int origin)
{
    if (!atomic_load_explicit(&pool->vm_ready, memory_order_acquire) && vm_init(A, pool) < 0) return NULL;
    XpGil g = XP_GIL_HELD;
    Block *b = vm_climb(A, pool, stream, requested, size, hook, origin, &g);
    xp_gil_end(&g);
    return b;
}

Block *xp_vm_alloc(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, int origin, XpGil *g)
{
    pthread_mutex_lock(&pool->lock);
    pool->st.requests++;
    pool->st.misses++;
    pthread_mutex_unlock(&pool->lock);
    return vm_climb(A, pool, stream, requested, scheme_block_size(A, requested), NULL, origin, g);
}

