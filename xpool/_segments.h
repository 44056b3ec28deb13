/*
 * xpool._segments: the ranges of the `segments` scheme.
 *
 * A segment is one backend allocation.  It is cut into ranges, each a Block: in use (in the core's live table) or
 * free (in the device's FreeTree).  A request is served from the best-fitting free range of a segment of its own
 * stream, split when the range is larger; a range given back merges with free neighbours of its segment, so a segment
 * whose ranges are all free is one free Block again, and only such whole segments go back to the backend
 * (empty_cache, trim, the OOM ladder).
 *
 * Note [Schemes].  seed: one device allocation per block, of its size class (the design's classes: up to 1 MiB
 * multiples of 512 B, above k classes per doubling); segments: best fit in segments, split and merged (this file);
 * expandable: the same best fit in pages mapped into reserved address ranges (_expandable.c).  The schemes differ on
 * the miss side only (XpScheme).
 *
 * Ranges never cross segments (the neighbours are linked per segment) and a segment serves one stream, so reuse stays
 * stream-ordered as with the size classes.  The tree is ordered by (stream, size, ptr): best fit is one descent,
 * O(log n) expected (a treap, its priorities hashed from the address, so replays are deterministic).  Note [Whole
 * free segments]: the whole free segments are indexed apart (FreeTree.whole), so giving them back walks those alone,
 * never the free ranges of partly used segments.
 *
 * Nothing here locks, calls Python or the backend: the core calls these under its DevicePool.lock and does the
 * backend calls itself.
 */
#ifndef XPOOL_SEGMENTS_H
#define XPOOL_SEGMENTS_H

#include <stddef.h>
#include <stdint.h>

typedef struct Block {
    uintptr_t ptr;
    size_t size;            /* bytes it spans: a class size, or a range of a segment */
    size_t requested;       /* bytes asked for while in use, 0 while cached */
    intptr_t stream;        /* stream it was handed out on; reused only there */
    int device;
    uint8_t in_segment;     /* (ranges of a segment: the fields from prev_addr on; unused for class blocks) */
    uint8_t is_free;        /* free, in the tree */
    uint8_t waiting;        /* free, in FreeTree.recent */
    uint8_t vm_state;       /* scheme expandable: XE_MAPPED (0) or what the range's pages under it are doing
                             * (_expandable.h); 0 for every other block */
    uint64_t serial;        /* allocation number on its device, for diagnostics */
    union {
        struct Block *next;     /* link in its bin while cached (size classes), or in FreeTree.spare */
        struct Block *wleft;    /* a whole free segment in the tree: child in FreeTree.whole (never in a bin) */
    };
    unsigned origin : 2;     /* who it was last handed to: ORIGIN_CUPY, ORIGIN_TORCH or ORIGIN_PYTHON;
                              * a block handed to CuPy holds a reference to the Allocator (cupy_malloc) */
    /* Debug state, so a hook turned on while blocks exist checks only what it prepared */
    unsigned guarded : 1;    /* a debug hook wrote the canary past `requested` when handed out */
    unsigned poisoned : 1;   /* a debug hook filled it with poison when it was cached (ranges: all of it) */
    unsigned handed_out : 1; /* in use and its hook has run: listed by live_blocks(), check() */
    unsigned in_whole : 1;   /* a whole free segment in the tree, and so in FreeTree.whole */
    uint32_t prio;                          /* treap priority */
    struct Block *prev_addr, *next_addr;   /* neighbours in the same segment, by address */
    struct Block *left, *right;            /* children in the FreeTree while free */
    struct Block *wright;                  /* the other child in FreeTree.whole (wleft: above) */
    size_t run_span, run_max;  /* scheme expandable, an unmapped run: the most a plan starting at it can join, and
                                * the most of that in its subtree of the range's index (Note [Unmapped runs]) */
} Block;

/* Slots of the exact-size cache (at most 64: FreeTree.occupied is their bitmap), and how many waiting ranges
 * a request scans beside the tree before they are all filed in it (seg_take). */
#define SEG_RECENT 64
#define SEG_SCAN 8

typedef struct {
    Block *root;            /* free ranges by (stream, size, ptr) */
    /* The exact-size fast path (Note [Hit path]).  A free range is filed here first, one per slot by
     * (stream, size): the rest of a split, a freed range once merged with its free neighbours.  The next request of its
     * exact size and stream takes it back in O(1), with no insert or remove in the tree, when it is the
     * best fit of all (no free range of that size at a lower address in the tree); a freed range
     * merges with a waiting neighbour at once.  So what is free, how it is merged and which range each
     * request gets stay exactly as with the tree alone (replays are unchanged); only where a range is
     * kept differs.  A range moves into the tree when its slot is taken by another key, and all of them
     * do when too many wait for a request to scan them beside the tree (seg_take) and before segments
     * are given back (seg_flush).  A pair that cuts a range and gives it back (the rest waits, the freed
     * range merges with it and waits) so costs a descent and no insert or remove in the tree, where it
     * cost two of each; an exact-size pair, a slot and a descent. */
    Block *recent[SEG_RECENT];
    uint64_t occupied;      /* bit i: recent[i] holds a range */
    size_t n_recent;        /* ranges waiting in recent[] */
    Block *spare;           /* Blocks of merged ranges, kept for the next split (linked by .next):
                             * a split and a merge per alloc/free pair would otherwise cost a malloc
                             * and a free each */
    size_t n_spare;
    /* Note [Whole free segments]  Only whole free segments go back to the device (empty_cache, trim, the
     * ladder), and finding them must not cost more as free ranges inside partly used segments pile up.  `whole`
     * indexes the whole free segments filed in the tree: a second treap over the same Blocks (wleft/wright), by
     * (stream, size, ptr) as the tree, kept where the tree files or unfiles a whole range.  The whole ones waiting
     * in recent[] (at most SEG_RECENT, Note [Hit path]) stay out of it and are scanned beside it, in key order: a
     * search costs O(log n + SEG_RECENT + whole free segments of the stream), never O(free ranges).  Waiting ones
     * stay out because indexing them grew a Block to three cache lines and cost the hit path a treap insert and
     * remove; wleft shares the bin link `next`, which a free range never uses.  The cost as a count:
     * xpool_twin.testing.release_scan_visits (the tests' fixture package). */
    Block *whole;
    size_t n_whole;
    uint64_t whole_visits;  /* nodes of `whole` the searches for segments to give back have visited (a cost
                               counter for tests and benchmarks) */
} FreeTree;

/* Whether any free range waits, in the tree or in recent[]. */
static inline int seg_any_free(const FreeTree *t) { return t->root || t->n_recent; }


/* Change of the core's counters caused by one call (the core's Stats stay the one source of truth). */
typedef struct {
    int64_t free_ranges;    /* blocks_cached */
    int64_t free_bytes;     /* bytes_cached */
} SegDelta;

/* Bytes of the segment made for a `size`-byte range: size rounded up to `round`. */
size_t seg_size_for(size_t size, size_t round);

/* A new segment: b spans it (ptr, size = segment bytes, stream, device set).  Cuts the first
 * `size` bytes off for use and files the rest as a free range. */
void seg_init(FreeTree *t, Block *b, size_t size, SegDelta *d);

/* The best fit for `size` bytes on `stream`, the least (size, address) of every free range that fits,
 * waiting or in the tree, taken out and cut to `size` (the rest stays free); NULL when none fits.  A
 * waiting range of exactly `size` that is this best fit is taken in O(1); up to SEG_SCAN waiting ranges
 * are scanned beside the tree's descent, more are filed in the tree first. */
Block *seg_take(FreeTree *t, intptr_t stream, size_t size, SegDelta *d);

/* Takes the free range b (waiting or in the tree) out, as seg_take would, without cutting it. */
void seg_unfile(FreeTree *t, Block *b, SegDelta *d);

/* Moves every range waiting in t->recent into the tree (see FreeTree.recent). */
void seg_flush(FreeTree *t);

/* Gives an in-use range back: it merges with its free neighbours (their Blocks are freed) and waits
 * in t->recent.  Returns the free range that now holds it. */
Block *seg_put(FreeTree *t, Block *b, SegDelta *d);

/* Takes whole free segments (of `stream` only, unless all_streams) out, in (stream, size, ptr) order, appending
 * them to out[*n] (room for `cap`), until the free bytes `*cached` drop to `keep` or none is left.
 * O(log n + whole free segments walked). */
void seg_take_whole(FreeTree *t, int all_streams, intptr_t stream, uint64_t keep, uint64_t *cached,
                    Block **out, size_t *n, size_t cap, SegDelta *d);

/* Calls fn(b, arg) on every free range, in key order (the waiting ones after the tree's); stops early
 * when fn returns nonzero. */
int seg_each_free(const FreeTree *t, int (*fn)(Block *, void *), void *arg);

/* Frees every Block of the tree (the pool is being destroyed). */
void seg_destroy(FreeTree *t);

#endif
