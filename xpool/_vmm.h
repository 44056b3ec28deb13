/*
 * xpool._vmm: the virtual-memory operations under the expandable scheme (Note [Expandable segments]).
 *
 * An ops table the core calls from C, with no Python and no GIL: reserve an address range, map physical
 * pages into it, unmap them, give the range back.  Two implementations: CUDA's virtual memory management,
 * the driver loaded at run time (xv_cuda_open), and a host twin over real host memory with a per-device
 * capacity, bookkeeping to check against and injectable faults (xv_host_*), so the scheme runs in CPU tests.
 *
 * A backend that supports the scheme hands the core a PyCapsule named XV_CAPSULE wrapping an XvVmm
 * (backend.vmm(), see xpool/backends.py).  Every op is thread-safe and may block (the CUDA ops synchronise
 * the device before unmapping, as cudaFree does); the core calls them without its pool lock.
 *
 * Units: bytes; addresses as uintptr_t.  `page` is the unit of physical memory: one physical allocation per
 * page, a multiple of granularity(device); a range, every address and every size given to map/unmap are
 * multiples of it, and unmap must use the page its pages were mapped with (CUDA unmaps whole mappings only).
 */
#ifndef XPOOL_VMM_H
#define XPOOL_VMM_H

#include <stddef.h>
#include <stdint.h>

#define XV_CAPSULE "xpool.vmm"
#define XV_ABI 2

typedef enum {
    XV_OK = 0,
    XV_OOM = 1,          /* no physical memory, or no address space, for it: starts the out-of-memory ladder */
    XV_INVALID = 2,      /* bad arguments or state: not reserved, already mapped, not mapped, misaligned */
    XV_UNAVAILABLE = 3,  /* no driver, or a device without virtual memory management */
    XV_ERROR = 4,        /* anything else the driver refused */
} XvStatus;

typedef struct XvOps {
    unsigned abi;        /* XV_ABI */
    const char *name;    /* "cuda" or "host" */
    /* The least page of `device` (CUDA: CU_MEM_ALLOC_GRANULARITY_MINIMUM; a power of two). */
    int (*granularity)(void *ctx, int device, size_t *bytes);
    /* An address range of `bytes` aligned to `align` (a multiple of the granularity), nothing mapped. */
    int (*reserve)(void *ctx, int device, size_t bytes, size_t align, uintptr_t *addr);
    /* Gives back a range reserve() returned, exactly [addr, addr + bytes), with nothing mapped in it. */
    int (*release)(void *ctx, int device, uintptr_t addr, size_t bytes);
    /* Creates bytes/page physical pages on `device`, maps them at [addr, addr + bytes) inside a reserved range
     * and makes them read/write for `device` and every device whose bit is set in `peers`.  All or nothing: on
     * failure nothing stays mapped or created. */
    int (*map)(void *ctx, int device, uintptr_t addr, size_t bytes, size_t page, uint64_t peers);
    /* Unmaps [addr, addr + bytes) page by page, freeing the physical memory, after the device has finished
     * its queued work.  *done: bytes unmapped from addr on (all of them on XV_OK; a prefix on failure, the
     * rest still mapped). */
    int (*unmap)(void *ctx, int device, uintptr_t addr, size_t bytes, size_t page, size_t *done);
    /* 1 when `stream` of `device` captures a CUDA graph (the host twin: any stream of a device set capturing),
     * 0 when not, or a negative XvStatus. */
    int (*capturing)(void *ctx, int device, intptr_t stream);
    /* Why this thread's last failed op failed (a thread-local buffer, valid until its next op). */
    const char *(*message)(void *ctx);
    /* *mask: the devices other than `device` whose kernels and copies can reach its memory directly (CUDA:
     * cuDeviceCanAccessPeer from each of them; the twin: every other device unless set otherwise), a bit per
     * device.  What map's `peers` may name for peer access (Note [Expandable segments]: peer access). */
    int (*peers)(void *ctx, int device, uint64_t *mask);
} XvOps;

typedef struct {
    const XvOps *ops;
    void *ctx;
} XvVmm;

/* CUDA: loads libcuda (or $XPOOL_LIBCUDA) once per process.  XV_UNAVAILABLE when it cannot, with why in
 * xv_message().  The ops use each device's primary context (CuPy's and PyTorch's). */
int xv_cuda_open(XvVmm *out);

/* The calling thread's last message of either implementation. */
const char *xv_message(void);

/* ------------------------------------------------------------------ the host twin */

typedef struct XvHost XvHost;

typedef struct {
    uint64_t reserves, releases;        /* ops that succeeded */
    uint64_t maps, unmaps;              /* calls that succeeded (a failed unmap's prefix counts in unmap_pages) */
    uint64_t map_pages, unmap_pages;
    uint64_t map_failures, unmap_failures, reserve_failures;
    uint64_t unmaps_while_capturing;    /* unmaps of a device set capturing: the core must make none */
} XvHostCounters;

/* A twin of n_devices (at most 64) devices, unbounded, each with granularity `granularity` (a power of two,
 * a multiple of the host's page size).  NULL without memory or with a bad granularity. */
XvHost *xv_host_new(int n_devices, size_t granularity);
/* Unmaps and releases whatever is left. */
void xv_host_free(XvHost *h);
XvVmm xv_host_vmm(XvHost *h);
int xv_host_devices(const XvHost *h);
/* Setters return XV_INVALID for a bad device (or granularity); UINT64_MAX capacity: unbounded. */
int xv_host_set_capacity(XvHost *h, int device, uint64_t bytes);
int xv_host_set_granularity(XvHost *h, int device, size_t bytes);   /* only while nothing is reserved */
int xv_host_set_capturing(XvHost *h, int device, int on);
/* The devices peers(device) names: a bit per device, `device`'s own and bits past the twin's devices refused. */
int xv_host_set_peers(XvHost *h, int device, uint64_t mask);
uint64_t xv_host_capacity(XvHost *h, int device);
uint64_t xv_host_mapped(XvHost *h, int device);
/* Faults: after `skip` maps that are let through, the next `count` maps fail with `status` (XV_OOM or XV_ERROR)
 * after `after_pages` of their pages were made (then undone; at the last page if they have fewer); the next
 * `count` unmaps fail after unmapping `after_pages` pages (fewer than they have); the next `count` reserves fail
 * with XV_OOM. */
void xv_host_fail_maps(XvHost *h, int count, int status, size_t after_pages, int skip);
void xv_host_fail_unmaps(XvHost *h, int count, size_t after_pages);
void xv_host_fail_reserves(XvHost *h, int count);
XvHostCounters xv_host_counters(XvHost *h);
/* Every mapped page in address order: fn(device, addr, bytes, peers, arg); stops when fn returns nonzero. */
int xv_host_each_page(XvHost *h, int (*fn)(int, uintptr_t, size_t, uint64_t, void *), void *arg);
/* Every reserved range in address order: fn(device, addr, bytes, arg). */
int xv_host_each_range(XvHost *h, int (*fn)(int, uintptr_t, size_t, void *), void *arg);
/* 1 when addr lies in a mapped page (*device set), 0 when not. */
int xv_host_is_mapped(XvHost *h, uintptr_t addr, int *device);

#endif
