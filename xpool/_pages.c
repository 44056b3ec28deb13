/* xpool._core: scheme expandable, blocks cut from pages mapped into reserved address ranges (see _core.h for the
 * layers and the locks; the range manager is _expandable.c).
 *
 * Note [Expandable segments].  As PyTorch's expandable segments: per (device, stream), one address range reserved
 * up front (1.125x the device's memory, so one suffices), its pages (the device's granularity, 2 MiB on an H200)
 * mapped as the pool grows, in handles of a size chosen per request (Note [Handles] in _expandable.c).  Blocks are cut from the mapped free space by the best fit of scheme segments (the hit
 * path is the same); a miss maps the fewest pages that make room at the lowest address where free space and
 * unmapped pages of its stream hold the request, so memory one segment would strand next to another is reused.
 * Pages are mapped only by a miss (a try of the ladder) and unmapped only by empty_cache, trim and the ladder,
 * whole free pages, never one holding a byte in use.  The ops (_vmm.h) are called from C, without the pool lock,
 * with the GIL let go around them when it is held: an unmap synchronises the device, as cudaFree does.  Plans and
 * their finishes run under the pool lock; while a plan is in flight its mapped bytes count on bytes_releasing, so
 * reserved is always the mapped bytes.  Blocks cannot be shared by CUDA IPC (cuMemCreate makes no shareable
 * handle): Pool.check_ipc says so before cudaIpcGetMemHandle fails.
 *
 * Note [Expandable segments: peer access].  A map makes its pages readable and writable for every device that can
 * access the pool's device (ops.peers: cuDeviceCanAccessPeer, asked once per device), as cudaMalloc's memory is
 * reachable from a peer once peer access is on: a copy to another GPU or a kernel reading another GPU's array works
 * as with CuPy's pool.  It is behaviour, not a setting (docs/decisions/0007). */
#include "_hot.h"

#include <stdarg.h>
#include <stdio.h>

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

static void vm_raise(const DevicePool *pool, const VmFault *f)
{
    PyErr_Format(f->status == VM_NO_HOST_MEMORY || f->status == XV_OOM ? PyExc_MemoryError : PyExc_RuntimeError,
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

/* ------------------------------------------------------------------ captures, pins */

/* The ops' capture query: a failed one counts as capturing (giving nothing back is always safe). */
static int ops_capturing(Allocator *A, int device, intptr_t handle)
{
    return A->vmm.ops->capturing(A->vmm.ctx, device, handle) != 0;
}

/* XpScheme.captures: the ops asked about the streams backend_captures asks (Note [Capture: every stream of a
 * device]) and every stream with a range here.  C only: no GIL needed, never -1. */
static int vm_captures(Allocator *A, DevicePool *pool, intptr_t key)
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

/* ------------------------------------------------------------------ pages back */

/* Gives back the address ranges left with nothing mapped (empty_cache, or the ladder when the address space ran
 * out); the first failed op in *f. */
static void vm_give_ranges(Allocator *A, DevicePool *pool, XpGil *g, VmFault *f)
{
    const XvOps *ops = A->vmm.ops;
    for (;;) {
        XeRange *empty[64];
        pthread_mutex_lock(&pool->lock);
        size_t n = xe_take_empty(pool->vm, empty, 64);
        pthread_mutex_unlock(&pool->lock);
        if (!n) return;
        xp_gil_drop(g);
        int failed = 0;
        for (size_t i = 0; i < n; i++) {
            int st = ops->release(A->vmm.ctx, pool->device, empty[i]->base, empty[i]->bytes);
            if (st != XV_OK) {
                vm_fault(f, st, "%s", ops->message(A->vmm.ctx));
                failed = 1;   /* it is back on the device's list: taking it again would loop */
            }
            XeDelta e = {0};
            pthread_mutex_lock(&pool->lock);
            xe_release_finish(pool->vm, empty[i], st == XV_OK, &e);
            pthread_mutex_unlock(&pool->lock);
        }
        if (failed) return;
    }
}

/* Unmaps the whole free pages `spec` allows, then (give_ranges) gives back the address ranges left with nothing
 * mapped.  Returns the bytes unmapped; the first failed op is kept in *f (every run is still tried; what a failed
 * unmap left mapped stays, free and counted).  The caller asked whether a stream captures.  No pool lock held; the
 * GIL is let go around the ops when g allows. */
static uint64_t vm_release(Allocator *A, DevicePool *pool, const XeRelease *spec, int give_ranges, XpGil *g,
                           VmFault *f)
{
    if (!atomic_load_explicit(&pool->vm_ready, memory_order_acquire)) return 0;
    const XvOps *ops = A->vmm.ops;
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
        int st = ops->unmap(A->vmm.ctx, pool->device, run.addr, run.bytes, 0, &done);   /* its handles as mapped */
        if (st != XV_OK) vm_fault(f, st, "%s", ops->message(A->vmm.ctx));
        XeDelta e = {0};
        pthread_mutex_lock(&pool->lock);
        xe_unmap_finish(x, &pool->segs, &plan, i, done, &e);
        vm_apply(pool, e);
        if (done) vm_event(A, pool, EV_UNMAP, run.range->stream, run.addr, done);
        pthread_mutex_unlock(&pool->lock);
        unmapped += done;
    }
    xe_unmap_plan_free(&plan);
    if (give_ranges) vm_give_ranges(A, pool, g, f);
    vm_unmap_end(A);
    return unmapped;
}

/* XpScheme.release: whole free pages until at most `keep` bytes stay cached (of one stream, or all), and, when
 * `empty`, the emptied address ranges.  Bytes unmapped; -1 with the first failed op's error (the rest was tried). */
static long long vm_release_cached(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep,
                                   int empty, XpGil *g)
{
    pthread_mutex_lock(&pool->lock);
    uint64_t cached = pool->st.bytes_cached;
    pthread_mutex_unlock(&pool->lock);
    XeRelease spec = {all_streams, stream, keep ? (cached > keep ? cached - keep : 0) : UINT64_MAX};
    VmFault f = {0};
    uint64_t n = vm_release(A, pool, &spec, empty, g, &f);
    if (!f.status) return (long long)n;
    xp_gil_take(g);
    vm_raise(pool, &f);
    return -1;
}

/* XpScheme.free_cache: every whole free page of the device; the ranges stay, unless the address space ran out. */
static int vm_free_cache(Allocator *A, DevicePool *pool, Climb *c, XpGil *g)
{
    XeRelease all = {1, 0, UINT64_MAX};
    vm_release(A, pool, &all, c->no_range, g, &c->fault);
    if (c->fault.status) return TRY_FAILED;
    c->no_range = 0;
    return 0;
}

/* XpScheme.discard: a block of mapped pages is never a device allocation of its own: it is cached. */
static void vm_discard(Allocator *A, DevicePool *pool, Block *b)
{
    (void)A;
    pthread_mutex_lock(&pool->lock);
    pool->st.bytes_releasing -= b->size;
    b->poisoned = 0;
    cache_block(pool, b);
    pthread_mutex_unlock(&pool->lock);
}

/* ------------------------------------------------------------------ the device's ranges */

int xp_vm_open(Allocator *A, PyObject *backend)
{
    PyObject *vmm = PyObject_GetAttrString(backend, "vmm");
    if (!vmm) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "scheme 'expandable' needs a backend with virtual memory (a vmm() method, as "
                     "xpool.backends.CupyBackend has); %.100s has none: use scheme 'segments' with it",
                     Py_TYPE(backend)->tp_name);
        return -1;
    }
    PyObject *cap = PyObject_CallNoArgs(vmm);
    Py_DECREF(vmm);
    if (!cap) {
        PyObject *exc = PyErr_GetRaisedException();
        PyErr_Format(PyExc_RuntimeError, "scheme 'expandable': %.100s.vmm() failed: %S", Py_TYPE(backend)->tp_name, exc);
        PyObject *err = PyErr_GetRaisedException();
        PyException_SetCause(err, exc);
        PyErr_SetRaisedException(err);
        return -1;
    }
    XvVmm *v = PyCapsule_IsValid(cap, XV_CAPSULE) ? PyCapsule_GetPointer(cap, XV_CAPSULE) : NULL;
    if (!v || !v->ops || v->ops->abi != XV_ABI) {
        PyErr_Format(PyExc_TypeError, "scheme 'expandable': %.100s.vmm() must return an '" XV_CAPSULE "' capsule of "
                     "ABI %d, got %R", Py_TYPE(backend)->tp_name, XV_ABI, cap);
        Py_DECREF(cap);
        return -1;
    }
    A->vmm = *v;
    Py_XSETREF(A->vmm_capsule, cap);
    return 0;
}

/* The device's range manager, made on its first miss (with the GIL): its page is the device's granularity, a range
 * 1.125x the device's memory, its peers every device that can access it.  0, or -1 with an exception. */
static int vm_init(Allocator *A, DevicePool *pool)
{
    size_t page = 0;
    uint64_t peers = 0;
    int st;
    const char *what = "cannot run";
    char why[256] = "";
    Py_BEGIN_ALLOW_THREADS
    st = A->vmm.ops->granularity(A->vmm.ctx, pool->device, &page);
    if (st == XV_OK && (st = A->vmm.ops->peers(A->vmm.ctx, pool->device, &peers)) != XV_OK)
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

/* ------------------------------------------------------------------ pages mapped (a try of the ladder) */

/* Plans where the block goes: the lowest address where free space and unmapped pages of its stream hold it, a new
 * address range reserved when none does.  TRY_GOT with the pool lock held and *p planned; TRY_NO_ROOM (the address
 * space refused a range) or TRY_FAILED (c->fault) without it. */
static int plan_block(Allocator *A, DevicePool *pool, Climb *c, XeMapPlan *p, XpGil *g)
{
    const XvOps *ops = A->vmm.ops;
    XeDevice *x = pool->vm;
    for (;;) {
        XeDelta d = {0};
        pthread_mutex_lock(&pool->lock);
        if (xe_plan_map(x, &pool->segs, c->stream, c->size, p, &d) < 0) {
            pthread_mutex_unlock(&pool->lock);
            vm_fault(&c->fault, VM_NO_HOST_MEMORY, "no host memory to plan a map of %zu B", c->size);
            return TRY_FAILED;
        }
        vm_apply(pool, d);
        if (p->range) return TRY_GOT;   /* the lock stays held */
        pthread_mutex_unlock(&pool->lock);
        uintptr_t base = 0;
        xp_gil_drop(g);
        int st = ops->reserve(A->vmm.ctx, pool->device, p->new_range, x->page, &base);
        if (st != XV_OK) {
            vm_fault(st == XV_OOM ? &c->oom : &c->fault, st, "%s", ops->message(A->vmm.ctx));
            if (st != XV_OOM) return TRY_FAILED;
            c->by_device = c->no_range = 1;
            return TRY_NO_ROOM;
        }
        XeDelta e = {0};
        pthread_mutex_lock(&pool->lock);
        XeRange *r = xe_add_range(x, c->stream, base, p->new_range, &e);
        pthread_mutex_unlock(&pool->lock);
        if (!r) {
            ops->release(A->vmm.ctx, pool->device, base, p->new_range);
            vm_fault(&c->fault, VM_NO_HOST_MEMORY, "no host memory to keep an address range");
            return TRY_FAILED;
        }
    }
}

/* Maps the plan's runs in order (the GIL let go); the number that succeeded, the failure's status in *st (kept in
 * c).  In debug mode new pages are poisoned, as a freed block is, before anyone sees them; a hook that raises
 * leaves its exception in *exc. */
static size_t map_runs(Allocator *A, DevicePool *pool, Climb *c, XeMapPlan *p, XpGil *g, int *st, PyObject **exc)
{
    const XvOps *ops = A->vmm.ops;
    XeDevice *x = pool->vm;
    xp_gil_drop(g);
    size_t ok = 0;
    for (*st = XV_OK; ok < p->n_maps; ok++) {
        *st = ops->map(A->vmm.ctx, pool->device, p->map[ok].addr, p->map[ok].bytes, p->handle, x->peers);
        if (*st != XV_OK) {
            vm_fault(*st == XV_OOM ? &c->oom : &c->fault, *st, "%s", ops->message(A->vmm.ctx));
            return ok;
        }
    }
    if (!c->hook) return ok;
    xp_gil_take(g);
    p->poisoned = 1;
    for (size_t i = 0; i < p->n_maps && !*exc; i++) {
        Block run = {.ptr = p->map[i].addr, .size = p->map[i].bytes, .stream = c->stream, .device = pool->device,
                     .origin = c->origin};
        if (call_hook(c->hook, "on_segment", &run, 0) < 0) {
            *exc = PyErr_GetRaisedException();
            p->poisoned = 0;
        }
    }
    return ok;
}

/* Finishes the plan after `ok` maps: the block in use and counted, or NULL (not every map succeeded, the hook
 * raised, or no room in the live table: what was mapped stays, cached).  The events: the maps, then the miss, each
 * with the counters as they stand once the block is counted. */
static Block *finish_block(Allocator *A, DevicePool *pool, Climb *c, XeMapPlan *p, size_t ok, int keep, int *no_room)
{
    XeDelta e = {0};
    pthread_mutex_lock(&pool->lock);
    pool->st.bytes_pending -= p->map_bytes;
    Block *b = xe_map_finish(pool->vm, &pool->segs, p, ok, &e);
    vm_apply(pool, e);
    note_peaks(&pool->st);
    if (b && (!keep || (*no_room = ptrtable_insert(&pool->live, b) < 0))) {   /* not handed out: cached, mapped */
        cache_block(pool, b);
        b = NULL;
    }
    if (b) {
        stamp_handed_out(pool, b, c->requested, c->origin, c->hook != NULL);
        b->poisoned = c->hook && p->all_poisoned;   /* debug mode checks a block of freed bytes for writes */
        if (c->step) pool->st.oom_recoveries++;
        count_in_use(A, pool, b, 0);
    }
    for (size_t i = 0; i < ok; i++) vm_event(A, pool, EV_MAP, c->stream, p->map[i].addr, p->map[i].bytes);
    if (b) timeline_record(&A->tl, EV_MISS, pool, b, b->requested);
    pthread_mutex_unlock(&pool->lock);
    return b;
}

/* A block freed since the hit looked (another thread's free, a dead array the ladder's gc.collect() freed) may hold
 * the request now: taken as a hit would take it, the miss maps nothing.  The block in use and counted, or NULL. */
static Block *late_hit(Allocator *A, DevicePool *pool, Climb *c)
{
    SegDelta d = {0, 0};
    pthread_mutex_lock(&pool->lock);
    Block *b = xe_take(pool->vm, &pool->segs, c->stream, c->size, &d);
    apply_delta(&pool->st, d);
    if (b && ptrtable_insert(&pool->live, b) < 0) {   /* back where it was: the plan maps instead */
        cache_block(pool, b);
        b = NULL;
    }
    if (b) {
        stamp_handed_out(pool, b, c->requested, c->origin, c->hook != NULL);
        if (c->step) pool->st.oom_recoveries++;
        count_in_use(A, pool, b, EV_MISS);
    }
    pthread_mutex_unlock(&pool->lock);
    return b;
}

/* XpScheme.try_: plan where the block goes, count the pages it maps against the limit (under the lock, with the
 * plan, so threads cannot pass the limit together), map them and make the block.  TRY_GOT with c->block;
 * TRY_NO_ROOM when the limit or the device (out of memory, or of address space) refuses; TRY_FAILED with c->fault
 * (or, in debug mode, the hook's exception set).  A plan of several runs whose k-th map fails keeps the runs mapped
 * before it, as free cached pages. */
static int vm_try(Allocator *A, DevicePool *pool, Climb *c, XpGil *g)
{
    if ((c->block = late_hit(A, pool, c))) return TRY_GOT;
    XeMapPlan p;
    int r = plan_block(A, pool, c, &p, g);
    if (r != TRY_GOT) return r;
    uint64_t limit = pool->limit, after = committed(&pool->st) + p.map_bytes;
    c->refused = p.map_bytes;
    if (limit && after > limit) {   /* the plan goes back as it was */
        XeDelta e = {0};
        xe_map_finish(pool->vm, &pool->segs, &p, 0, &e);
        vm_apply(pool, e);
        pthread_mutex_unlock(&pool->lock);
        c->by_device = 0;
        c->over_limit = c->size > limit || p.map_bytes > limit;   /* no release can make either fit */
        return TRY_NO_ROOM;
    }
    pool->st.bytes_pending += p.map_bytes;
    pthread_mutex_unlock(&pool->lock);
    PyObject *exc = NULL;
    int st;
    size_t ok = map_runs(A, pool, c, &p, g, &st, &exc);
    int no_room = 0;
    Block *b = finish_block(A, pool, c, &p, ok, st == XV_OK && !exc, &no_room);
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

/* ------------------------------------------------------------------ new blocks */

/* A new block of mapped pages up the ladder (its tries are vm_try); the hit found no free space of its stream that
 * fits.  A block larger than the whole device raises at once (reason too_large).  NULL with an exception (the GIL
 * held then). */
static Block *vm_climb(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
                       PyObject *hook, int origin, XpGil *g)
{
    uint64_t capacity = pool_known_capacity(pool);
    if (capacity && size > capacity) {   /* no freeing or retrying can help: bad input */
        xp_gil_take(g);
        raise_oom(A, pool, requested, size, "too_large", NULL);
        return NULL;
    }
    Climb c = {.requested = requested, .size = size, .exact = size, .stream = stream, .origin = origin,
               .hook = hook};
    return climb(A, pool, &c, g) == TRY_GOT ? c.block : NULL;
}

/* XpScheme.make (with the GIL). */
static Block *vm_make(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size,
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

const XpScheme xp_expandable = {"expandable", vm_make, vm_try, vm_free_cache, vm_release_cached, vm_captures,
                                vm_discard};
