/*
 * xpool._core: what _alloc.c and _pages.c share, and no other file: the recovery ladder's state of one request
 * (Climb), what a failed device op said (VmFault), and the calls each makes of the other.  _pages.c is scheme
 * expandable's pages (Note [Expandable segments]): the shared paths of _alloc.c turn to it for that scheme's
 * capture question (device_captures), its giving back (release_cached, empty_cache, the ladder's "free the
 * cache"), its try of the ladder (ladder_try) and its miss (scheme_make); it calls back the ladder itself
 * (climb) and a few helpers of the miss path.  None of it is on the hit path (_hot.h), which stays inlined in
 * each entry point's file.  The GIL rules and the lock order are _core.h's.
 */
#ifndef XPOOL_PAGES_H
#define XPOOL_PAGES_H

#include "_core.h"

#define VM_NO_HOST_MEMORY 100         /* VmFault.status: the host had no memory for the bookkeeping */

/* What a failed op said, kept for the error the ladder or the caller raises later, with the GIL. */
typedef struct {
    int status;               /* 0: none; an XvStatus; VM_NO_HOST_MEMORY */
    char why[256];
} VmFault;

/* ------------------------------------------------------------------ the recovery ladder (Note [Recovery ladder]) */

enum { TRY_GOT = 0, TRY_FAILED = -1, TRY_NO_ROOM = 1 };   /* what one try came to */

/* One request's way up the ladder. */
typedef struct {
    size_t requested, size;     /* the request; the bytes of the device allocation (expandable: of the block) */
    size_t exact;               /* the block's own bytes: what size falls back to when a shared segment does not
                                   fit (Note [Small segments]); size itself otherwise */
    intptr_t stream;            /* the request's stream key: the allocation is counted as its (stream_use) */
    int step;                   /* 0: the first try; 1, 2: after freeing the cache (and collecting) */
    int reserved;               /* size counts in bytes_pending: from the try that passed the limit on */
    int over_limit;             /* the limit refused, and size is larger than the limit itself */
    int by_device;              /* what refused the last try: the device (a MemoryError), else the limit */
    PyObject *cause;            /* the backend's MemoryError of the last try, or NULL */
    /* scheme expandable (vm_try) */
    int origin;                 /* who the block is handed to */
    PyObject *hook;             /* the debug hook (a borrowed reference), or NULL */
    Block *block;               /* the block the try that got it made */
    int no_range;               /* the address space refused a range: the release gives emptied ranges back */
    VmFault oom;                /* why the device refused the last try (the error's cause) */
    VmFault fault;              /* an op that failed for another reason (raised by climb) */
} Climb;

/* ------------------------------------------------------------------ _alloc.c, for _pages.c */

/* Calls hook.<name>(info); -1 with the hook's exception set if it raised. */
int call_hook(PyObject *hook, const char *name, const Block *b, size_t requested);
/* The device's total bytes (0: unknown), asked of the backend once, with the GIL. */
uint64_t pool_capacity(Allocator *A, DevicePool *pool);
/* Whether another stream's capture state may be asked (the backend vouches it is not destroyed): 1 yes, 0 no. */
int may_ask(Allocator *A, int device, intptr_t handle);
/* Whether a stream of keys[0..k) captures, each asked through `ask` (device_captures, in _alloc.c). */
int streams_capture(Allocator *A, int device, const intptr_t *keys, size_t k,
                    int (*ask)(Allocator *, int, intptr_t));
/* One block's way up the ladder: TRY_GOT, or TRY_FAILED with an exception (the GIL held then). */
int climb(Allocator *A, DevicePool *pool, intptr_t stream, Climb *c, uintptr_t *ptr, XpGil *g);

/* ------------------------------------------------------------------ _pages.c, for _alloc.c */

/* Raises what *f says, with the GIL. */
void vm_raise(const DevicePool *pool, const VmFault *f);
/* device_captures of scheme expandable: C only, no GIL needed, never -1. */
int vm_captures(Allocator *A, DevicePool *pool, intptr_t key);
/* Unmaps the whole free pages *spec allows (and, give_ranges, the emptied ranges): the bytes unmapped, the
 * first failed op in *f. */
uint64_t vm_release(Allocator *A, DevicePool *pool, const XeRelease *spec, intptr_t key, int give_ranges,
                    XpGil *g, VmFault *f);
/* release_cached / empty_cache of scheme expandable: bytes unmapped, or -1 with an exception. */
long long vm_release_cached(Allocator *A, DevicePool *pool, int all_streams, intptr_t stream, uint64_t keep,
                            int give_ranges, XpGil *g);
/* The device's bytes as the first miss asked them, without calling Python. */
uint64_t vm_capacity(DevicePool *pool);
/* The ladder's try of scheme expandable: TRY_GOT with c->block, TRY_NO_ROOM, TRY_FAILED. */
int vm_try(Allocator *A, DevicePool *pool, Climb *c, XpGil *g);
/* scheme_make of scheme expandable (with the GIL): the block in use, or NULL with an exception. */
Block *vm_make(Allocator *A, DevicePool *pool, intptr_t stream, size_t requested, size_t size, PyObject *hook,
               int origin);

#endif
