/*
 * xpool._expandable: the range manager of the expandable scheme (Note [Expandable segments] in _pages.c).
 *
 * Per (device, stream), one large reserved address range (more when one fills up), its pages mapped as the pool
 * grows.  Every byte of a range lies in exactly one Block of its chain (Block.prev_addr/next_addr, by address):
 * mapped blocks, in use or free, and runs of unmapped pages.  The free mapped blocks are the ordinary free ranges of
 * _segments.c, in the device's FreeTree: a hit is seg_take's best fit, split and merge (xe_take/xe_put), so the hit
 * path is scheme segments'.  Unmapped runs are Blocks of the chain too, kept apart from the tree in their range's own
 * list, so a free block never merges with one (seg_put merges only with free neighbours).
 *
 * Only a miss maps pages, and only releases (empty_cache, trim, the ladder) unmap them.  Both are planned under the
 * core's pool lock, the device ops (_vmm.h) are called after (with the lock dropped, if the core likes), and a finish
 * call commits or rolls back, under the lock again.  While a plan is in flight its pieces are out of every list, so
 * other threads' takes, puts and plans never touch them; the bytes of mapped pieces count on XeDelta.held (the core
 * keeps them on bytes_releasing, so reserved stays the mapped bytes throughout).
 *
 *   miss:     xe_plan_map -> (range NULL: ops.reserve(new_range), xe_add_range, plan again)
 *             -> ops.map for each of plan.map[] in order -> xe_map_finish(maps that succeeded)
 *   release:  xe_plan_unmap -> for each run: ops.unmap -> xe_unmap_finish(bytes it unmapped)
 *             -> (empty_cache) xe_take_empty -> ops.release -> xe_release_finish
 *
 * A page is never unmapped while any byte of it belongs to a block in use or held by a plan: only whole handles
 * (Note [Handles] in _expandable.c) inside one free block are planned.  Nothing here locks, calls Python or ops.
 */
#ifndef XPOOL_EXPANDABLE_H
#define XPOOL_EXPANDABLE_H

#include <stddef.h>
#include <stdint.h>

#include "_segments.h"

/* Block.vm_state of a range's blocks */
enum {
    XE_MAPPED = 0,     /* mapped: in use (the core's) or free (the FreeTree's) */
    XE_UNMAPPED = 1,   /* whole unmapped pages, in its range's index of runs (a treap by address: left/right) */
    XE_MAPPING = 2,    /* whole unmapped pages a map plan is mapping */
    XE_UNMAPPING = 3,  /* whole free pages an unmap plan is unmapping (their bytes on XeDelta.held) */
    XE_HELD = 4,       /* a free block a map plan joins to its new pages (its bytes on XeDelta.held) */
};

typedef struct XeRange {
    uintptr_t base;
    size_t bytes;
    intptr_t stream;       /* every block of it is of this stream */
    Block *first;          /* the chain; the Block at base is never freed while the range lives */
    Block *runs;           /* its XE_UNMAPPED blocks: a treap by address with each subtree's most span (run_max) */
    size_t mapped;         /* bytes of XE_MAPPED, XE_HELD and XE_UNMAPPING blocks */
    uint64_t *edges;       /* a bit per page boundary (bytes / page + 1): where a handle begins or ends */
    unsigned in_flight;    /* plans holding pieces of it: it is not given back while any does */
} XeRange;

typedef struct {
    int device;
    size_t page;           /* the unit of physical memory: ops.granularity(device), a power of two */
    uint64_t peers;        /* the other devices every map makes its pages accessible to (ops.map's peers) */
    size_t range_bytes;    /* a new range's size, whole pages (xe_range_bytes) */
    size_t small_request, large_handle;   /* the handle rule's (xe_handle_bytes; 1 MiB, 20 MiB) */
    XeRange **ranges;      /* by base address */
    size_t n_ranges, cap_ranges;
    uint64_t mapped;       /* over all ranges */
} XeDevice;

/* Change of the core's counters caused by one call, added to them under the pool lock (as SegDelta). */
typedef struct {
    SegDelta free;         /* blocks_cached, bytes_cached: the free mapped blocks */
    int64_t held;          /* bytes_releasing: mapped bytes out of the cache while a plan is in flight */
    int64_t mapped;        /* the mapped bytes: reserved is always in use + cached + held = mapped */
    int64_t maps, unmaps;  /* ops.map calls that succeeded, ops.unmap calls that unmapped pages: the device calls */
    int64_t map_pages, unmap_pages;   /* handles (Note [Handles]: one or more pages each) */
    int64_t ranges;        /* ranges added less ranges given back */
} XeDelta;

#define XE_PLAN_MAPS 3     /* unmapped runs a miss may map together (with the free blocks between them) */

typedef struct {
    XeRange *range;        /* NULL: no range of the stream has room: reserve new_range bytes and plan again */
    size_t new_range;
    uintptr_t ptr;         /* the block it makes: [ptr, ptr + size) */
    size_t size;
    struct { uintptr_t addr; size_t bytes; } map[XE_PLAN_MAPS];   /* the ops.map calls, in this order */
    size_t handle;         /* ops.map's handle size for each (the last handle of a run the rest) */
    size_t n_maps;
    size_t map_bytes;      /* their sum: what the limit counts as pending until the finish */
    Block *piece[2 * XE_PLAN_MAPS + 1];   /* XE_HELD and XE_MAPPING blocks, by address */
    size_t n_pieces;
    Block *spare;          /* for the free rest after the block: taken now, so the finish cannot fail */
    int poisoned;          /* set by the caller before the finish: the maps' pages were filled with poison (debug
                              mode), so the free rest of them is filed poisoned, as a freed block is */
    int all_poisoned;      /* set by a finish that made the block: every byte of it was poison (freed blocks it
                              joined, new pages), so debug mode checks it as a reused block */
} XeMapPlan;

typedef struct {
    XeRange *range;
    Block *b;              /* the XE_UNMAPPING block: [addr, addr + bytes) */
    uintptr_t addr;
    size_t bytes;
    Block *spare;          /* for the mapped rest of a failed unmap */
} XeUnmapRun;

typedef struct {
    XeUnmapRun *runs;      /* one ops.unmap each */
    size_t n, cap;
    uint64_t bytes;        /* their sum */
} XeUnmapPlan;

/* What a release may unmap. */
typedef struct {
    int all_streams;       /* else only blocks of `stream` */
    intptr_t stream;
    uint64_t need;         /* at least this many bytes, as few whole handles as cover it: the smallest free block
                              that covers it alone, else the largest first; UINT64_MAX: every whole free handle */
} XeRelease;

/* A range's size for a device of `capacity` bytes: 1.125x it (as PyTorch), whole pages, at least one page. */
size_t xe_range_bytes(uint64_t capacity, size_t page);

size_t xe_handle_bytes(const XeDevice *x, size_t size);   /* a miss's handle size (Note [Handles]) */
/* 0, or -1 for a page that is not a power of two of at least 512 B. */
int xe_init(XeDevice *x, int device, size_t page, size_t range_bytes, uint64_t peers);
/* Frees the manager's own memory (ranges, unmapped runs) without calling an op: the core has given back
 * what it could, or is a fork()ed child that must not touch the parent's memory.  Free and live blocks are
 * the FreeTree's and the core's. */
void xe_destroy(XeDevice *x);

/* The hit path: seg_take / seg_put on the device's free mapped blocks, the spans of the unmapped runs near the block
 * kept (O(1) unless a run is near, then O(log n)). */
Block *xe_take(XeDevice *x, FreeTree *t, intptr_t stream, size_t size, SegDelta *d);
Block *xe_put(XeDevice *x, FreeTree *t, Block *b, SegDelta *d);

/* Plans a miss of `size` bytes (> 0, a multiple of 512) on `stream`: the lowest address of the stream's ranges
 * where a free block, unmapped runs after it and free blocks between them hold `size` bytes together, mapping
 * as few pages as that takes, in handles of xe_handle_bytes (growing at the end is the last run's case); O(ranges
 * x log runs).  0 (see p->range), -1 without host memory (nothing changed). */
int xe_plan_map(XeDevice *x, FreeTree *t, intptr_t stream, size_t size, XeMapPlan *p, XeDelta *d);
/* Finishes a plan whose first `maps_ok` maps succeeded.  All of them: returns the block, in use (requested
 * 0, its size exactly p->size), the rest of the new pages free.  Fewer: NULL; the pages that were mapped stay
 * mapped, as free blocks (counted so), the rest goes back as it was. */
Block *xe_map_finish(XeDevice *x, FreeTree *t, XeMapPlan *p, size_t maps_ok, XeDelta *d);

/* Adds a range ops.reserve made for `stream` (whole pages).  NULL without host memory (give it back). */
XeRange *xe_add_range(XeDevice *x, intptr_t stream, uintptr_t base, size_t bytes, XeDelta *d);

/* Plans a release: takes whole free handles out of the tree, per spec.  0; -1 without host memory (the runs
 * planned so far are in the plan, still to be finished). */
int xe_plan_unmap(XeDevice *x, FreeTree *t, const XeRelease *spec, XeUnmapPlan *plan, XeDelta *d);
/* Finishes run i after ops.unmap unmapped `done` bytes of it (all on success, a prefix on failure: the rest
 * stays mapped and free). */
void xe_unmap_finish(XeDevice *x, FreeTree *t, XeUnmapPlan *plan, size_t i, size_t done, XeDelta *d);
void xe_unmap_plan_free(XeUnmapPlan *plan);

/* Takes the ranges with nothing mapped and no plan in flight off the device (at most cap): empty_cache gives
 * their addresses back.  After ops.release: xe_release_finish(released = whether it succeeded; if not, the
 * range comes back). */
size_t xe_take_empty(XeDevice *x, XeRange **out, size_t cap);
void xe_release_finish(XeDevice *x, XeRange *r, int released, XeDelta *d);

/* The range holding ptr, or NULL (e.g. to refuse a CUDA IPC handle for such a block). */
XeRange *xe_range_of(const XeDevice *x, uintptr_t ptr);

#endif
