/* xpool._vmm: CUDA's virtual-memory ops, the driver loaded at run time (see _vmm.h). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "_vmm.h"
#include "_vmm_cuda.h"

#define XV_MAX_DEVICES 64

static _Thread_local char msg_buf[512];

const char *xv_message(void) { return msg_buf; }
static const char *op_message(void *ctx) { (void)ctx; return msg_buf; }

static int fail(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg_buf, sizeof msg_buf, fmt, ap);
    va_end(ap);
    return status;
}

/* ================================================================== CUDA */

typedef struct {
#define XV_FIELD(name, type, sym) __typeof__(type) name;
    XVCU_FUNCTIONS(XV_FIELD)
#undef XV_FIELD
} Driver;

static struct {
    pthread_once_t once;
    int status;                          /* of loading: XV_OK or XV_UNAVAILABLE */
    char why[256];
    Driver d;
    pthread_mutex_t lock;                /* guards the lazy retain of primary[] */
    _Atomic(XVCUcontext) primary[XV_MAX_DEVICES];
    _Atomic int vmm_ok[XV_MAX_DEVICES];  /* 1: supports VMM, -1: does not, 0: not asked */
} cu = {PTHREAD_ONCE_INIT, 0, "", {0}, PTHREAD_MUTEX_INITIALIZER, {0}, {0}};

static const char *cu_name(XVCUresult r)
{
    const char *s = NULL;
    if (cu.d.cuGetErrorName && cu.d.cuGetErrorName(r, &s) == XVCUDA_SUCCESS && s) return s;
    return "CUDA_ERROR_?";
}

static const char *cu_string(XVCUresult r)
{
    const char *s = NULL;
    if (cu.d.cuGetErrorString && cu.d.cuGetErrorString(r, &s) == XVCUDA_SUCCESS && s) return s;
    return "unknown error";
}

static int cu_status(XVCUresult r)
{
    switch (r) {
    case XVCUDA_ERROR_OUT_OF_MEMORY: return XV_OOM;
    case XVCUDA_ERROR_INVALID_VALUE:
    case XVCUDA_ERROR_INVALID_DEVICE: return XV_INVALID;
    case XVCUDA_ERROR_NOT_SUPPORTED:
    case XVCUDA_ERROR_NO_DEVICE:
    case XVCUDA_ERROR_STUB_LIBRARY: return XV_UNAVAILABLE;
    default: return XV_ERROR;
    }
}

/* "cuMemCreate(...) failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)<tail>" */
static int cu_fail(XVCUresult r, const char *call, const char *tail)
{
    return fail(cu_status(r), "%s failed: %s (%s)%s", call, cu_name(r), cu_string(r), tail ? tail : "");
}

/* Every handle a map made, by address: an unmap unmaps the mappings of its run and releases their handles, as
 * PyTorch's unmapHandles does, so a map costs two driver calls a handle and one a run (cuMemSetAccess), an unmap
 * one a run (cuCtxSynchronize) and two a handle (Note [Handles] in _expandable.c).  A fork()ed child's lock is new. */
typedef struct { uintptr_t addr; size_t bytes; XVCUmemGenericAllocationHandle h; int device; } CuMapping;
static struct { pthread_mutex_t lock; CuMapping *m; size_t n, cap; } maps = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0};

static void maps_after_fork_in_child(void) { pthread_mutex_init(&maps.lock, NULL); }

/* Without these the ops still work: maps run in the thread's own capture mode, errors go unnamed. */
static int optional(const char *sym)
{
    return !strcmp(sym, "cuThreadExchangeStreamCaptureMode") || !strcmp(sym, "cuGetErrorName") ||
           !strcmp(sym, "cuGetErrorString");
}

static void cu_load(void)
{
    const char *path = getenv("XPOOL_LIBCUDA");
    void *lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(cu.why, sizeof cu.why, "cannot load the CUDA driver (%s): %s",
                 path && *path ? path : "libcuda.so.1, or $XPOOL_LIBCUDA", dlerror());
        cu.status = XV_UNAVAILABLE;
        return;
    }
    /* cuInit first: cuGetProcAddress answers for an initialised driver */
    XVCUresult (*init)(unsigned) = (XVCUresult (*)(unsigned))dlsym(lib, "cuInit");
    XVCUresult (*version)(int *) = (XVCUresult (*)(int *))dlsym(lib, "cuDriverGetVersion");
    int have = 0;
    if (!init || !version) {
        snprintf(cu.why, sizeof cu.why, "%s is no CUDA driver (no cuInit)", path && *path ? path : "libcuda.so.1");
        cu.status = XV_UNAVAILABLE;
        return;
    }
    XVCUresult r = init(0);
    if (r != XVCUDA_SUCCESS) {
        const char *nm = NULL;
        XVCUresult (*name)(XVCUresult, const char **) = (XVCUresult (*)(XVCUresult, const char **))dlsym(lib, "cuGetErrorName");
        if (name) name(r, &nm);
        snprintf(cu.why, sizeof cu.why, "cuInit failed: %s (%d)", nm ? nm : "CUDA_ERROR_?", r);
        cu.status = XV_UNAVAILABLE;
        return;
    }
    version(&have);
    xvcu_getproc_v2_t gp2 = (xvcu_getproc_v2_t)dlsym(lib, "cuGetProcAddress_v2");
    xvcu_getproc_v1_t gp1 = gp2 ? NULL : (xvcu_getproc_v1_t)dlsym(lib, "cuGetProcAddress");
    /* The ABI these declarations follow; an older driver is asked for its own (the same signatures since 11.3). */
    int want = have && have < 12000 ? have : 12000;
    const char *missing = NULL;
#define XV_RESOLVE(name, type, sym)                                                                        \
    {                                                                                                      \
        void *fn = NULL;                                                                                   \
        int found = 0;                                                                                     \
        if (gp2) gp2(#name, &fn, want, XVCU_GET_PROC_ADDRESS_DEFAULT, &found);                             \
        else if (gp1) gp1(#name, &fn, want, XVCU_GET_PROC_ADDRESS_DEFAULT);                                \
        if (!fn) fn = dlsym(lib, sym);   /* before 11.3, or not found by version */                       \
        cu.d.name = (__typeof__(type))fn;                                                                  \
        if (!fn && !missing && !optional(sym)) missing = sym;                                              \
    }
    XVCU_FUNCTIONS(XV_RESOLVE)
#undef XV_RESOLVE
    if (missing) {
        snprintf(cu.why, sizeof cu.why, "the CUDA driver (%d) has no %s", have, missing);
        cu.status = XV_UNAVAILABLE;
        return;
    }
    pthread_atfork(NULL, NULL, maps_after_fork_in_child);
    cu.status = XV_OK;
}

/* The device's primary context, retained once and kept for the process (CuPy and PyTorch use it). */
static int cu_primary(int device, XVCUcontext *out)
{
    if (device < 0 || device >= XV_MAX_DEVICES) return fail(XV_INVALID, "device %d out of range", device);
    XVCUcontext c = atomic_load(&cu.primary[device]);
    if (c) { *out = c; return XV_OK; }
    pthread_mutex_lock(&cu.lock);
    c = atomic_load(&cu.primary[device]);
    int status = XV_OK;
    if (!c) {
        XVCUdevice dev;
        int vmm = 0;
        XVCUresult r = cu.d.cuDeviceGet(&dev, device);
        if (r == XVCUDA_SUCCESS)
            r = cu.d.cuDeviceGetAttribute(&vmm, XVCU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
        if (r != XVCUDA_SUCCESS) status = cu_fail(r, "cuDeviceGet", NULL);
        else if (!vmm) status = fail(XV_UNAVAILABLE, "device %d does not support virtual memory management", device);
        else if ((r = cu.d.cuDevicePrimaryCtxRetain(&c, dev)) != XVCUDA_SUCCESS)
            status = cu_fail(r, "cuDevicePrimaryCtxRetain", NULL);
        else atomic_store(&cu.primary[device], c);
    }
    pthread_mutex_unlock(&cu.lock);
    *out = c;
    return status;
}

/* Makes the device's primary context current for one op; cu_leave undoes it. */
typedef struct { int pushed; } CuScope;

static int cu_enter(int device, CuScope *s)
{
    s->pushed = 0;
    pthread_once(&cu.once, cu_load);
    if (cu.status != XV_OK) return fail(cu.status, "%s", cu.why);
    XVCUcontext want = NULL, cur = NULL;
    int st = cu_primary(device, &want);
    if (st != XV_OK) return st;
    XVCUresult r = cu.d.cuCtxGetCurrent(&cur);
    if (r != XVCUDA_SUCCESS) return cu_fail(r, "cuCtxGetCurrent", NULL);
    if (cur == want) return XV_OK;
    if ((r = cu.d.cuCtxPushCurrent(want)) != XVCUDA_SUCCESS) return cu_fail(r, "cuCtxPushCurrent", NULL);
    s->pushed = 1;
    return XV_OK;
}

static void cu_leave(CuScope *s)
{
    XVCUcontext popped;
    if (s->pushed) cu.d.cuCtxPopCurrent(&popped);
}

static XVCUmemAllocationProp cu_prop(int device)
{
    XVCUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = XVCU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = XVCU_MEM_HANDLE_TYPE_NONE;   /* no IPC: Note [Expandable segments] */
    p.location.type = XVCU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    return p;
}

static int cu_granularity(void *ctx, int device, size_t *bytes)
{
    (void)ctx;
    CuScope s;
    int st = cu_enter(device, &s);
    if (st != XV_OK) return st;
    XVCUmemAllocationProp p = cu_prop(device);
    XVCUresult r = cu.d.cuMemGetAllocationGranularity(bytes, &p, XVCU_MEM_ALLOC_GRANULARITY_MINIMUM);
    cu_leave(&s);
    return r == XVCUDA_SUCCESS ? XV_OK : cu_fail(r, "cuMemGetAllocationGranularity", NULL);
}

static int cu_reserve(void *ctx, int device, size_t bytes, size_t align, uintptr_t *addr)
{
    (void)ctx;
    CuScope s;
    int st = cu_enter(device, &s);
    if (st != XV_OK) return st;
    XVCUdeviceptr p = 0;
    /* Relaxed for this thread, as for a map: a graph's private pool reserves its first range mid-capture */
    int mode = XVCU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = cu.d.cuThreadExchangeStreamCaptureMode &&
                    cu.d.cuThreadExchangeStreamCaptureMode(&mode) == XVCUDA_SUCCESS;
    XVCUresult r = cu.d.cuMemAddressReserve(&p, bytes, align, 0, 0);
    if (exchanged) cu.d.cuThreadExchangeStreamCaptureMode(&mode);
    cu_leave(&s);
    if (r != XVCUDA_SUCCESS) {
        char tail[64];
        snprintf(tail, sizeof tail, " reserving %zu B", bytes);
        return cu_fail(r, "cuMemAddressReserve", tail);
    }
    *addr = (uintptr_t)p;
    return XV_OK;
}

static int cu_release(void *ctx, int device, uintptr_t addr, size_t bytes)
{
    (void)ctx;
    CuScope s;
    int st = cu_enter(device, &s);
    if (st != XV_OK) return st;
    XVCUresult r = cu.d.cuMemAddressFree((XVCUdeviceptr)addr, bytes);
    cu_leave(&s);
    return r == XVCUDA_SUCCESS ? XV_OK : cu_fail(r, "cuMemAddressFree", NULL);
}

static size_t maps_at(uintptr_t addr)   /* the first mapping at or after addr; lock held */
{
    size_t lo = 0, hi = maps.n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (maps.m[mid].addr < addr) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int maps_add(const CuMapping *m, size_t n)   /* n mappings end to end: 0, or -1 without host memory */
{
    pthread_mutex_lock(&maps.lock);
    size_t cap = maps.cap ? maps.cap : 256, at;
    while (cap < maps.n + n) cap *= 2;
    CuMapping *a = cap > maps.cap ? realloc(maps.m, cap * sizeof *a) : maps.m;
    if (a && (maps.m = a, maps.cap = cap, at = maps_at(m[0].addr), 1)) {
        memmove(&a[at + n], &a[at], (maps.n - at) * sizeof *a);
        memcpy(&a[at], m, n * sizeof *m);
        maps.n += n;
    }
    pthread_mutex_unlock(&maps.lock);
    return a ? 0 : -1;
}

/* Unmaps and releases m[0..n) in order, counting them in *done; the first failure stops it (*call: which). */
static XVCUresult cu_undo(const CuMapping *m, size_t n, size_t *done, const char **call)
{
    for (XVCUresult r; *done < n; (*done)++) {
        if ((r = cu.d.cuMemUnmap((XVCUdeviceptr)m[*done].addr, m[*done].bytes)) != XVCUDA_SUCCESS) {
            *call = "cuMemUnmap";
            return r;
        }
        if ((r = cu.d.cuMemRelease(m[*done].h)) != XVCUDA_SUCCESS) { *call = "cuMemRelease"; (*done)++; return r; }
    }
    return XVCUDA_SUCCESS;
}

/* One access call over the run: `device` and every peer in one list of descriptors. */
static XVCUresult cu_access(int device, uintptr_t addr, size_t bytes, uint64_t peers)
{
    XVCUmemAccessDesc desc[XV_MAX_DEVICES];
    size_t k = 0;
    for (int d = -1; d < XV_MAX_DEVICES; d++) {
        if (d >= 0 && (d == device || !(peers >> d & 1))) continue;
        desc[k].location.type = XVCU_MEM_LOCATION_TYPE_DEVICE;
        desc[k].location.id = d < 0 ? device : d;
        desc[k++].flags = XVCU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    return cu.d.cuMemSetAccess((XVCUdeviceptr)addr, bytes, desc, k);
}

static int cu_map(void *ctx, int device, uintptr_t addr, size_t bytes, size_t handle, uint64_t peers)
{
    (void)ctx;
    if (!handle || !bytes) return fail(XV_INVALID, "map: %zu B in %zu B handles", bytes, handle);
    size_t n = (bytes + handle - 1) / handle, made = 0, undone = 0;   /* the last handle the rest */
    CuMapping *m = malloc(n * sizeof *m);
    if (!m) return fail(XV_OOM, "map: no host memory for %zu handles", n);
    CuScope s;
    int st = cu_enter(device, &s);
    if (st != XV_OK) { free(m); return st; }
    /* Relaxed for this thread: a map while a stream captures (a graph's private pool) is legal then. */
    int mode = XVCU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = cu.d.cuThreadExchangeStreamCaptureMode &&
                    cu.d.cuThreadExchangeStreamCaptureMode(&mode) == XVCUDA_SUCCESS;
    XVCUmemAllocationProp p = cu_prop(device);
    XVCUresult r = XVCUDA_SUCCESS, u = XVCUDA_SUCCESS;
    const char *call = "cuMemCreate", *ucall = "";
    for (; made < n; made++) {
        size_t sz = made + 1 < n ? handle : bytes - made * handle;
        m[made] = (CuMapping){addr + made * handle, sz, 0, device};
        if ((r = cu.d.cuMemCreate(&m[made].h, sz, &p, 0)) != XVCUDA_SUCCESS) break;
        if ((r = cu.d.cuMemMap((XVCUdeviceptr)m[made].addr, sz, 0, m[made].h, 0)) != XVCUDA_SUCCESS) {
            call = "cuMemMap";
            cu.d.cuMemRelease(m[made].h);
            break;
        }
    }
    if (r == XVCUDA_SUCCESS && (r = cu_access(device, addr, bytes, peers)) != XVCUDA_SUCCESS) call = "cuMemSetAccess";
    int no_host = r == XVCUDA_SUCCESS && maps_add(m, n) < 0;
    if (r != XVCUDA_SUCCESS || no_host) {
        if ((u = cu_undo(m, made, &undone, &ucall)) == XVCUDA_SUCCESS) ucall = "";
        char tail[200];   /* a broken driver's undo says what stays mapped */
        snprintf(tail, sizeof tail, " at handle %zu of %zu (%zu B handles on device %d)%s%s%s", made, n, handle,
                 device, *ucall ? "; undoing it failed too: " : "", ucall, *ucall ? cu_name(u) : "");
        st = no_host ? fail(XV_OOM, "map: no host memory to record %zu handles", n) : cu_fail(r, call, tail);
    }
    free(m);
    if (exchanged) cu.d.cuThreadExchangeStreamCaptureMode(&mode);
    cu_leave(&s);
    return st;
}

static int cu_unmap(void *ctx, int device, uintptr_t addr, size_t bytes, size_t handle, size_t *done)
{
    (void)ctx;
    *done = 0;
    CuScope s;
    int st = cu_enter(device, &s);
    if (st != XV_OK) return st;
    pthread_mutex_lock(&maps.lock);
    size_t at = maps_at(addr), n = 0, k = 0;
    for (uintptr_t a = addr; a < addr + bytes || !bytes; n++, a += maps.m[at + n - 1].bytes) {   /* they tile it */
        const CuMapping *m = at + n < maps.n ? &maps.m[at + n] : NULL;
        if (!bytes || !m || m->addr != a || m->device != device || (handle && m->bytes != handle) ||
            m->bytes > addr + bytes - a) {
            pthread_mutex_unlock(&maps.lock);
            cu_leave(&s);
            return fail(XV_INVALID, "unmap: 0x%zx is not a whole mapping of device %d inside [0x%zx, +%zu)",
                        (size_t)a, device, (size_t)addr, bytes);
        }
    }
    /* The run's handles copied out, the table let go: the synchronisation may wait on work another thread queues
     * after its own map returns (NCCL's kernels on two devices).  No other op touches this run's entries. */
    CuMapping *run = malloc(n * sizeof *run);
    if (run) memcpy(run, &maps.m[at], n * sizeof *run);
    pthread_mutex_unlock(&maps.lock);
    if (!run) { cu_leave(&s); return fail(XV_OOM, "unmap: no host memory for %zu handles", n); }
    /* cuMemUnmap need not wait for the kernels still using the pages (cudaFree does): wait for them here */
    XVCUresult r = cu.d.cuCtxSynchronize();
    const char *call = "cuCtxSynchronize";
    if (r == XVCUDA_SUCCESS) r = cu_undo(run, n, &k, &call);
    for (size_t i = 0; i < k; i++) *done += run[i].bytes;
    free(run);
    pthread_mutex_lock(&maps.lock);
    at = maps_at(addr);
    memmove(&maps.m[at], &maps.m[at + k], (maps.n - at - k) * sizeof *maps.m);
    maps.n -= k;
    pthread_mutex_unlock(&maps.lock);
    char tail[128];
    snprintf(tail, sizeof tail, " at handle %zu of %zu (0x%zx)", k, n, (size_t)(addr + *done));
    if (r != XVCUDA_SUCCESS) st = cu_fail(r, call, k || strcmp(call, "cuCtxSynchronize") ? tail : " before unmapping");
    cu_leave(&s);
    return st;
}

static int cu_capturing(void *ctx, int device, intptr_t stream)
{
    (void)ctx;
    CuScope s;
    int st = cu_enter(device, &s);
    if (st != XV_OK) return -st;
    int status = 0;
    XVCUresult r = cu.d.cuStreamIsCapturing((XVCUstream)stream, &status);
    cu_leave(&s);
    if (r == XVCUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return 1;   /* the legacy stream beside a global capture */
    if (r != XVCUDA_SUCCESS) return -cu_fail(r, "cuStreamIsCapturing", NULL);
    return status != XVCU_STREAM_CAPTURE_STATUS_NONE;
}

/* The devices whose contexts can access `device`'s memory (cuDeviceCanAccessPeer(peer, device)); asked once per
 * device by the core, so no cache.  A device past the 64 a mask holds is left out. */
static int cu_peers(void *ctx, int device, uint64_t *mask)
{
    (void)ctx;
    *mask = 0;
    pthread_once(&cu.once, cu_load);
    if (cu.status != XV_OK) return fail(cu.status, "%s", cu.why);
    int n = 0;
    XVCUdevice dev, other;
    XVCUresult r = cu.d.cuDeviceGetCount(&n);
    if (r != XVCUDA_SUCCESS) return cu_fail(r, "cuDeviceGetCount", NULL);
    if ((r = cu.d.cuDeviceGet(&dev, device)) != XVCUDA_SUCCESS) return cu_fail(r, "cuDeviceGet", NULL);
    for (int d = 0; d < n && d < XV_MAX_DEVICES; d++) {
        int can = 0;
        if (d == device) continue;
        if ((r = cu.d.cuDeviceGet(&other, d)) != XVCUDA_SUCCESS ||
            (r = cu.d.cuDeviceCanAccessPeer(&can, other, dev)) != XVCUDA_SUCCESS)
            return cu_fail(r, "cuDeviceCanAccessPeer", NULL);
        if (can) *mask |= (uint64_t)1 << d;
    }
    return XV_OK;
}

static const XvOps cuda_ops = {XV_ABI, "cuda", cu_granularity, cu_reserve, cu_release, cu_map, cu_unmap,
                               cu_capturing, op_message, cu_peers};

int xv_cuda_open(XvVmm *out)
{
    pthread_once(&cu.once, cu_load);
    out->ops = &cuda_ops;
    out->ctx = NULL;
    if (cu.status != XV_OK) return fail(cu.status, "%s", cu.why);
    return XV_OK;
}
