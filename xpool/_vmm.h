/*
 * xpool._vmm: the virtual-memory operations under the expandable scheme (Note [Expandable segments]).
 *
 * An ops table the core calls from C, with no Python and no GIL: reserve an address range, map physical
 * pages into it, unmap them, give the range back.  xpool implements it on CUDA's virtual memory management,
 * the driver loaded at run time (xv_cuda_open); the tests implement it on host memory (twin/).
 *
 * A backend that supports the scheme hands the core a PyCapsule named XV_CAPSULE wrapping an XvVmm
 * (backend.vmm(), see xpool/backends.py).  Every op is thread-safe and may block (the CUDA ops synchronise
 * the device before unmapping, as cudaFree does); the core calls them without its pool lock.
 *
 * Units: bytes; addresses as uintptr_t.  A range, every address and every size given to map/unmap are multiples
 * of granularity(device).  Physical memory comes in handles (one physical allocation each) of a size the core
 * chooses per map (Note [Handles] in _expandable.c), mapped and unmapped whole: CUDA unmaps whole mappings only.
 */
#ifndef XPOOL_VMM_H
#define XPOOL_VMM_H

#include <stddef.h>
#include <stdint.h>

#define XV_CAPSULE "xpool.vmm"
#define XV_ABI 3

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
    /* Creates physical handles of `handle` bytes on `device` (the last one the rest), maps them at [addr, addr +
     * bytes) inside a reserved range and makes the run read/write for `device` and every device whose bit is set in
     * `peers` (CUDA: one cuMemSetAccess).  All or nothing: on failure nothing stays mapped or created. */
    int (*map)(void *ctx, int device, uintptr_t addr, size_t bytes, size_t handle, uint64_t peers);
    /* Unmaps the handles that tile [addr, addr + bytes) (`handle` nonzero: each of that size), freeing them, after
     * the device has finished its queued work.  *done: bytes unmapped from addr on, whole handles (all of them on
     * XV_OK; a prefix on failure, the rest still mapped). */
    int (*unmap)(void *ctx, int device, uintptr_t addr, size_t bytes, size_t handle, size_t *done);
    /* 1 when `stream` of `device` captures a CUDA graph (the host twin: any stream of a device set capturing),
     * 0 when not, or a negative XvStatus. */
    int (*capturing)(void *ctx, int device, intptr_t stream);
    /* Why this thread's last failed op failed (a thread-local buffer, valid until its next op). */
    const char *(*message)(void *ctx);
    /* *mask: the devices other than `device` whose kernels and copies can reach its memory directly (CUDA:
     * cuDeviceCanAccessPeer from each of them; the twin: every other device unless set otherwise), a bit per
     * device.  What map's `peers` may name (Note [Expandable segments: peer access] in _pages.c). */
    int (*peers)(void *ctx, int device, uint64_t *mask);
} XvOps;

typedef struct {
    const XvOps *ops;
    void *ctx;
} XvVmm;

/* CUDA: loads libcuda (or $XPOOL_LIBCUDA) once per process.  XV_UNAVAILABLE when it cannot, with why in
 * xv_message().  The ops use each device's primary context (CuPy's and PyTorch's). */
int xv_cuda_open(XvVmm *out);

/* The calling thread's last message of the CUDA ops. */
const char *xv_message(void);

#endif
