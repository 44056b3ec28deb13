/* xpool._vmm: virtual-memory ops on CUDA and on host memory (see _vmm.h, Note [Expandable segments]). */
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

/* Unmaps n pages from addr on, each one mapping; the first failure stops it.  Pages counted in *done. */
static XVCUresult cu_unmap_pages(uintptr_t addr, size_t n, size_t page, size_t *done)
{
    for (size_t i = 0; i < n; i++) {
        XVCUresult r = cu.d.cuMemUnmap((XVCUdeviceptr)(addr + i * page), page);
        if (r != XVCUDA_SUCCESS) return r;
        (*done)++;
    }
    return XVCUDA_SUCCESS;
}

static int cu_map(void *ctx, int device, uintptr_t addr, size_t bytes, size_t page, uint64_t peers)
{
    (void)ctx;
    if (!page || bytes % page || addr % page)
        return fail(XV_INVALID, "map: %zu B at 0x%zx is not whole %zu B pages", bytes, (size_t)addr, page);
    CuScope s;
    int st = cu_enter(device, &s);
    if (st != XV_OK) return st;
    /* Relaxed for this thread: a map while a stream captures (a graph's private pool) is legal then. */
    int mode = XVCU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = cu.d.cuThreadExchangeStreamCaptureMode &&
                    cu.d.cuThreadExchangeStreamCaptureMode(&mode) == XVCUDA_SUCCESS;
    XVCUmemAllocationProp p = cu_prop(device);
    size_t n = bytes / page, made = 0;
    XVCUresult r = XVCUDA_SUCCESS;
    const char *call = "cuMemCreate";
    for (; made < n; made++) {
        /* One physical allocation per page, its handle released once mapped: the mapping keeps the memory and
         * cuMemUnmap frees it, so no handle table is kept (cuMemRelease's contract). */
        XVCUmemGenericAllocationHandle h;
        if ((r = cu.d.cuMemCreate(&h, page, &p, 0)) != XVCUDA_SUCCESS) break;
        if ((r = cu.d.cuMemMap((XVCUdeviceptr)(addr + made * page), page, 0, h, 0)) != XVCUDA_SUCCESS) {
            call = "cuMemMap";
            cu.d.cuMemRelease(h);
            break;
        }
        if ((r = cu.d.cuMemRelease(h)) != XVCUDA_SUCCESS) { call = "cuMemRelease"; made++; break; }
    }
    if (r == XVCUDA_SUCCESS) {
        XVCUmemAccessDesc desc[XV_MAX_DEVICES];
        size_t k = 0;
        desc[k].location.type = XVCU_MEM_LOCATION_TYPE_DEVICE;
        desc[k].location.id = device;
        desc[k++].flags = XVCU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        for (int d = 0; d < XV_MAX_DEVICES; d++) {
            if (d == device || !(peers >> d & 1)) continue;
            desc[k].location.type = XVCU_MEM_LOCATION_TYPE_DEVICE;
            desc[k].location.id = d;
            desc[k++].flags = XVCU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        }
        r = cu.d.cuMemSetAccess((XVCUdeviceptr)addr, bytes, desc, k);
        call = "cuMemSetAccess";
    }
    if (r != XVCUDA_SUCCESS) {
        XVCUresult failed = r;
        size_t undone = 0;
        XVCUresult u = cu_unmap_pages(addr, made, page, &undone);
        char tail[160];
        if (u == XVCUDA_SUCCESS)
            snprintf(tail, sizeof tail, " at page %zu of %zu (%zu B pages on device %d)", made, n, page, device);
        else   /* the driver is broken: say what stays mapped */
            snprintf(tail, sizeof tail, " at page %zu of %zu; undoing it failed too (%s): %zu B stay mapped at 0x%zx",
                     made, n, cu_name(u), (made - undone) * page, (size_t)(addr + undone * page));
        st = cu_fail(failed, call, tail);
    }
    if (exchanged) cu.d.cuThreadExchangeStreamCaptureMode(&mode);
    cu_leave(&s);
    return st;
}

static int cu_unmap(void *ctx, int device, uintptr_t addr, size_t bytes, size_t page, size_t *done)
{
    (void)ctx;
    *done = 0;
    if (!page || bytes % page || addr % page)
        return fail(XV_INVALID, "unmap: %zu B at 0x%zx is not whole %zu B pages", bytes, (size_t)addr, page);
    CuScope s;
    int st = cu_enter(device, &s);
    if (st != XV_OK) return st;
    /* cuMemUnmap need not wait for the kernels still using the pages (cudaFree does): wait for them here */
    XVCUresult r = cu.d.cuCtxSynchronize();
    size_t pages = 0;
    if (r == XVCUDA_SUCCESS) {
        r = cu_unmap_pages(addr, bytes / page, page, &pages);
        if (r != XVCUDA_SUCCESS) {
            char tail[128];
            snprintf(tail, sizeof tail, " at page %zu of %zu (0x%zx)", pages, bytes / page,
                     (size_t)(addr + pages * page));
            st = cu_fail(r, "cuMemUnmap", tail);
        }
    } else {
        st = cu_fail(r, "cuCtxSynchronize", " before unmapping");
    }
    cu_leave(&s);
    *done = pages * page;
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

/* ================================================================== the host twin */

/* One mapped page: the twin's bookkeeping, sorted by address (binary search; a map inserts its pages at one
 * place).  Page sizes are those of the map that made them. */
typedef struct {
    uintptr_t addr;
    size_t bytes;
    int device;
    uint64_t peers;
} Page;

typedef struct {
    uintptr_t addr;
    size_t bytes;
    int device;
} Range;

struct XvHost {
    int n;
    size_t gran[XV_MAX_DEVICES];
    uint64_t capacity[XV_MAX_DEVICES];
    uint64_t mapped[XV_MAX_DEVICES];
    int capturing[XV_MAX_DEVICES];
    uint64_t peers[XV_MAX_DEVICES];      /* peers(device): every other device unless set */
    Page *pages;
    size_t n_pages, cap_pages;
    Range *ranges;
    size_t n_ranges, cap_ranges;
    XvHostCounters c;
    int fail_maps, fail_map_status, fail_unmaps, fail_reserves, fail_map_skip;
    size_t fail_map_after, fail_unmap_after;
};

/* One lock for every twin: they are test doubles, and a fork()ed child gets a fresh one. */
static pthread_mutex_t host_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t host_once = PTHREAD_ONCE_INIT;

static void host_after_fork_in_child(void) { pthread_mutex_init(&host_lock, NULL); }
static void host_init_once(void) { pthread_atfork(NULL, NULL, host_after_fork_in_child); }

static int gran_ok(size_t g)
{
    long hp = sysconf(_SC_PAGESIZE);
    return g && !(g & (g - 1)) && hp > 0 && g % (size_t)hp == 0;
}

XvHost *xv_host_new(int n_devices, size_t granularity)
{
    pthread_once(&host_once, host_init_once);
    if (n_devices < 1 || n_devices > XV_MAX_DEVICES || !gran_ok(granularity)) return NULL;
    XvHost *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->n = n_devices;
    uint64_t all = n_devices == 64 ? UINT64_MAX : ((uint64_t)1 << n_devices) - 1;
    for (int d = 0; d < n_devices; d++) {
        h->gran[d] = granularity;
        h->capacity[d] = UINT64_MAX;
        h->peers[d] = all & ~((uint64_t)1 << d);
    }
    return h;
}

/* The first page at or after addr. */
static size_t page_at(const XvHost *h, uintptr_t addr)
{
    size_t lo = 0, hi = h->n_pages;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (h->pages[mid].addr < addr) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* The range holding [addr, addr + bytes), or -1. */
static long range_of(const XvHost *h, uintptr_t addr, size_t bytes)
{
    for (size_t i = 0; i < h->n_ranges; i++) {
        const Range *r = &h->ranges[i];
        if (addr >= r->addr && addr - r->addr <= r->bytes && bytes <= r->bytes - (addr - r->addr)) return (long)i;
    }
    return -1;
}

/* Host memory back to PROT_NONE with its pages dropped, as after a reserve. */
static int drop(uintptr_t addr, size_t bytes)
{
    void *p = mmap((void *)addr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? -1 : 0;
}

static int host_check(const XvHost *h, int device, const char *op)
{
    if (device < 0 || device >= h->n) return fail(XV_INVALID, "%s: device must be in [0, %d), got %d", op, h->n, device);
    return XV_OK;
}

static int host_granularity(void *ctx, int device, size_t *bytes)
{
    XvHost *h = ctx;
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "granularity");
    if (st == XV_OK) *bytes = h->gran[device];
    pthread_mutex_unlock(&host_lock);
    return st;
}

static int host_reserve(void *ctx, int device, size_t bytes, size_t align, uintptr_t *addr)
{
    XvHost *h = ctx;
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "reserve");
    if (st != XV_OK) goto out;
    if (!align) align = h->gran[device];
    if (!bytes || align % h->gran[device] || bytes % align) {
        st = fail(XV_INVALID, "reserve: %zu B aligned to %zu B is not whole %zu B pages", bytes, align,
                  h->gran[device]);
        goto out;
    }
    if (h->fail_reserves) {
        h->fail_reserves--;
        h->c.reserve_failures++;
        st = fail(XV_OOM, "reserve: injected failure (%zu B)", bytes);
        goto out;
    }
    if (h->n_ranges == h->cap_ranges) {
        size_t cap = h->cap_ranges ? 2 * h->cap_ranges : 16;
        Range *r = realloc(h->ranges, cap * sizeof *r);
        if (!r) { st = fail(XV_OOM, "reserve: no host memory for the bookkeeping"); goto out; }
        h->ranges = r; h->cap_ranges = cap;
    }
    /* over-reserve by one alignment, then trim both ends: mmap aligns to the host page only */
    size_t span = bytes + align;
    char *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { st = fail(XV_OOM, "reserve: mmap of %zu B: %s", span, strerror(errno)); goto out; }
    uintptr_t a = ((uintptr_t)p + align - 1) / align * align;
    if (a > (uintptr_t)p) munmap(p, a - (uintptr_t)p);
    if ((uintptr_t)p + span > a + bytes) munmap((void *)(a + bytes), (uintptr_t)p + span - (a + bytes));
    size_t i = h->n_ranges++;
    while (i && h->ranges[i - 1].addr > a) { h->ranges[i] = h->ranges[i - 1]; i--; }
    h->ranges[i] = (Range){a, bytes, device};
    h->c.reserves++;
    *addr = a;
out:
    pthread_mutex_unlock(&host_lock);
    return st;
}

static int host_release(void *ctx, int device, uintptr_t addr, size_t bytes)
{
    XvHost *h = ctx;
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "release");
    long i = st == XV_OK ? range_of(h, addr, bytes) : -1;
    if (st != XV_OK) goto out;
    if (i < 0 || h->ranges[i].addr != addr || h->ranges[i].bytes != bytes) {
        st = fail(XV_INVALID, "release: 0x%zx (%zu B) is not a reserved range", (size_t)addr, bytes);
        goto out;
    }
    size_t first = page_at(h, addr);
    if (first < h->n_pages && h->pages[first].addr < addr + bytes) {
        st = fail(XV_INVALID, "release: range 0x%zx still has a page mapped at 0x%zx", (size_t)addr,
                  (size_t)h->pages[first].addr);
        goto out;
    }
    munmap((void *)addr, bytes);
    memmove(&h->ranges[i], &h->ranges[i + 1], (h->n_ranges - i - 1) * sizeof(Range));
    h->n_ranges--;
    h->c.releases++;
out:
    pthread_mutex_unlock(&host_lock);
    return st;
}

static int host_map(void *ctx, int device, uintptr_t addr, size_t bytes, size_t page, uint64_t peers)
{
    XvHost *h = ctx;
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "map");
    size_t n = 0, made = 0, at;
    if (st != XV_OK) goto out;
    if (!page || page % h->gran[device] || !bytes || bytes % page || addr % page) {
        st = fail(XV_INVALID, "map: %zu B at 0x%zx is not whole %zu B pages of granularity %zu B", bytes,
                  (size_t)addr, page, h->gran[device]);
        goto out;
    }
    if (h->n < 64 && peers >> h->n) {
        st = fail(XV_INVALID, "map: peers 0x%llx name no device of %d", (unsigned long long)peers, h->n);
        goto out;
    }
    if (peers & ~h->peers[device] & ~((uint64_t)1 << device)) {   /* as cuMemSetAccess for a device without P2P */
        st = fail(XV_INVALID, "map: peers 0x%llx name a device that cannot access device %d (its peers: 0x%llx)",
                  (unsigned long long)peers, device, (unsigned long long)h->peers[device]);
        goto out;
    }
    if (range_of(h, addr, bytes) < 0) {
        st = fail(XV_INVALID, "map: [0x%zx, +%zu) is not inside a reserved range", (size_t)addr, bytes);
        goto out;
    }
    at = page_at(h, addr);
    /* a page mapped before addr that reaches into it, or one inside */
    if ((at > 0 && h->pages[at - 1].addr + h->pages[at - 1].bytes > addr) ||
        (at < h->n_pages && h->pages[at].addr < addr + bytes)) {
        st = fail(XV_INVALID, "map: [0x%zx, +%zu) is already mapped in part", (size_t)addr, bytes);
        goto out;
    }
    n = bytes / page;
    if (h->n_pages + n > h->cap_pages) {
        size_t cap = h->cap_pages ? h->cap_pages : 256;
        while (cap < h->n_pages + n) cap *= 2;
        Page *p = realloc(h->pages, cap * sizeof *p);
        if (!p) { st = fail(XV_OOM, "map: no host memory for the bookkeeping"); goto out; }
        h->pages = p; h->cap_pages = cap;
    }
    int fault = h->fail_maps > 0 && !h->fail_map_skip;
    if (h->fail_maps > 0 && h->fail_map_skip) h->fail_map_skip--;
    if (fault) h->fail_maps--;
    for (; made < n; made++) {   /* page by page, as the driver makes them */
        if (fault && made == (h->fail_map_after < n ? h->fail_map_after : n - 1)) {
            st = fail(h->fail_map_status, "map: injected %s at page %zu of %zu",
                      h->fail_map_status == XV_OOM ? "out of memory" : "failure", made, n);
            break;
        }
        if (h->mapped[device] + (made + 1) * page > h->capacity[device]) {
            st = fail(XV_OOM, "map: device %d out of memory at page %zu of %zu (%llu B mapped, capacity %llu B)",
                      device, made, n, (unsigned long long)h->mapped[device], (unsigned long long)h->capacity[device]);
            break;
        }
        void *p = mmap((void *)(addr + made * page), page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (p == MAP_FAILED) {
            st = fail(errno == ENOMEM ? XV_OOM : XV_ERROR, "map: mmap at page %zu of %zu: %s", made, n, strerror(errno));
            break;
        }
    }
    if (st != XV_OK) {
        if (made) drop(addr, made * page);   /* all or nothing */
        h->c.map_failures++;
        goto out;
    }
    memmove(&h->pages[at + n], &h->pages[at], (h->n_pages - at) * sizeof(Page));
    for (size_t i = 0; i < n; i++) h->pages[at + i] = (Page){addr + i * page, page, device, peers & ~((uint64_t)1 << device)};
    h->n_pages += n;
    h->mapped[device] += bytes;
    h->c.maps++;
    h->c.map_pages += n;
out:
    pthread_mutex_unlock(&host_lock);
    return st;
}

static int host_unmap(void *ctx, int device, uintptr_t addr, size_t bytes, size_t page, size_t *done)
{
    XvHost *h = ctx;
    *done = 0;
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "unmap");
    size_t n = 0, at = 0, k = 0;
    if (st != XV_OK) goto out;
    if (!page || !bytes || bytes % page || addr % page) {
        st = fail(XV_INVALID, "unmap: %zu B at 0x%zx is not whole %zu B pages", bytes, (size_t)addr, page);
        goto out;
    }
    n = bytes / page;
    at = page_at(h, addr);
    /* every page must be mapped, on this device, with this page size: CUDA unmaps whole mappings only */
    for (size_t i = 0; i < n; i++) {
        const Page *p = at + i < h->n_pages ? &h->pages[at + i] : NULL;
        if (!p || p->addr != addr + i * page || p->bytes != page || p->device != device) {
            st = fail(XV_INVALID, "unmap: 0x%zx is not a mapped %zu B page of device %d%s", (size_t)(addr + i * page),
                      page, device, p && p->addr == addr + i * page ? " (mapped with another page or device)" : "");
            goto out;
        }
    }
    if (h->capturing[device]) h->c.unmaps_while_capturing++;
    k = n;
    if (h->fail_unmaps > 0) {
        h->fail_unmaps--;
        k = h->fail_unmap_after < n ? h->fail_unmap_after : n - 1;
        st = fail(XV_ERROR, "unmap: injected failure at page %zu of %zu", k, n);
    }
    if (k && drop(addr, k * page) < 0) {
        st = fail(XV_ERROR, "unmap: mmap(PROT_NONE): %s", strerror(errno));
        k = 0;
    }
    memmove(&h->pages[at], &h->pages[at + k], (h->n_pages - at - k) * sizeof(Page));
    h->n_pages -= k;
    h->mapped[device] -= k * page;
    h->c.unmap_pages += k;
    if (st == XV_OK) h->c.unmaps++; else h->c.unmap_failures++;
    *done = k * page;
out:
    pthread_mutex_unlock(&host_lock);
    return st;
}

static int host_capturing(void *ctx, int device, intptr_t stream)
{
    (void)stream;
    XvHost *h = ctx;
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "capturing");
    int on = st == XV_OK ? h->capturing[device] : -st;
    pthread_mutex_unlock(&host_lock);
    return on;
}

static int host_peers(void *ctx, int device, uint64_t *mask)
{
    XvHost *h = ctx;
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "peers");
    *mask = st == XV_OK ? h->peers[device] : 0;
    pthread_mutex_unlock(&host_lock);
    return st;
}

static const XvOps host_ops = {XV_ABI, "host", host_granularity, host_reserve, host_release, host_map, host_unmap,
                               host_capturing, op_message, host_peers};

XvVmm xv_host_vmm(XvHost *h) { return (XvVmm){&host_ops, h}; }
int xv_host_devices(const XvHost *h) { return h->n; }

void xv_host_free(XvHost *h)
{
    if (!h) return;
    pthread_mutex_lock(&host_lock);
    for (size_t i = 0; i < h->n_ranges; i++) munmap((void *)h->ranges[i].addr, h->ranges[i].bytes);
    pthread_mutex_unlock(&host_lock);
    free(h->pages);
    free(h->ranges);
    free(h);
}

int xv_host_set_capacity(XvHost *h, int device, uint64_t bytes)
{
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "set_capacity");
    if (st == XV_OK) h->capacity[device] = bytes;
    pthread_mutex_unlock(&host_lock);
    return st;
}

int xv_host_set_capturing(XvHost *h, int device, int on)
{
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "set_capturing");
    if (st == XV_OK) h->capturing[device] = !!on;
    pthread_mutex_unlock(&host_lock);
    return st;
}

int xv_host_set_peers(XvHost *h, int device, uint64_t mask)
{
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "set_peers");
    if (st == XV_OK && (mask >> device & 1 || (h->n < 64 && mask >> h->n)))
        st = fail(XV_INVALID, "set_peers: 0x%llx names device %d itself or no device of %d", (unsigned long long)mask,
                  device, h->n);
    else if (st == XV_OK)
        h->peers[device] = mask;
    pthread_mutex_unlock(&host_lock);
    return st;
}

int xv_host_set_granularity(XvHost *h, int device, size_t bytes)
{
    pthread_mutex_lock(&host_lock);
    int st = host_check(h, device, "set_granularity");
    if (st == XV_OK && !gran_ok(bytes))
        st = fail(XV_INVALID, "granularity %zu B is not a power of two and a multiple of the host page", bytes);
    else if (st == XV_OK && h->n_ranges)
        st = fail(XV_INVALID, "set_granularity: ranges are reserved already");
    else if (st == XV_OK)
        h->gran[device] = bytes;
    pthread_mutex_unlock(&host_lock);
    return st;
}

uint64_t xv_host_capacity(XvHost *h, int device)
{
    pthread_mutex_lock(&host_lock);
    uint64_t v = device >= 0 && device < h->n ? h->capacity[device] : 0;
    pthread_mutex_unlock(&host_lock);
    return v;
}

uint64_t xv_host_mapped(XvHost *h, int device)
{
    pthread_mutex_lock(&host_lock);
    uint64_t v = device >= 0 && device < h->n ? h->mapped[device] : 0;
    pthread_mutex_unlock(&host_lock);
    return v;
}

void xv_host_fail_maps(XvHost *h, int count, int status, size_t after_pages, int skip)
{
    pthread_mutex_lock(&host_lock);
    h->fail_map_skip = skip;
    h->fail_maps = count;
    h->fail_map_status = status == XV_OOM ? XV_OOM : XV_ERROR;
    h->fail_map_after = after_pages;
    pthread_mutex_unlock(&host_lock);
}

void xv_host_fail_unmaps(XvHost *h, int count, size_t after_pages)
{
    pthread_mutex_lock(&host_lock);
    h->fail_unmaps = count;
    h->fail_unmap_after = after_pages;
    pthread_mutex_unlock(&host_lock);
}

void xv_host_fail_reserves(XvHost *h, int count)
{
    pthread_mutex_lock(&host_lock);
    h->fail_reserves = count;
    pthread_mutex_unlock(&host_lock);
}

XvHostCounters xv_host_counters(XvHost *h)
{
    pthread_mutex_lock(&host_lock);
    XvHostCounters c = h->c;
    pthread_mutex_unlock(&host_lock);
    return c;
}

/* The walks copy the bookkeeping first, so fn may call back into the twin. */
int xv_host_each_page(XvHost *h, int (*fn)(int, uintptr_t, size_t, uint64_t, void *), void *arg)
{
    pthread_mutex_lock(&host_lock);
    size_t n = h->n_pages;
    Page *copy = malloc((n ? n : 1) * sizeof *copy);
    if (copy) memcpy(copy, h->pages, n * sizeof *copy);
    pthread_mutex_unlock(&host_lock);
    if (!copy) return -1;
    int r = 0;
    for (size_t i = 0; i < n && !r; i++) r = fn(copy[i].device, copy[i].addr, copy[i].bytes, copy[i].peers, arg);
    free(copy);
    return r;
}

int xv_host_each_range(XvHost *h, int (*fn)(int, uintptr_t, size_t, void *), void *arg)
{
    pthread_mutex_lock(&host_lock);
    size_t n = h->n_ranges;
    Range *copy = malloc((n ? n : 1) * sizeof *copy);
    if (copy) memcpy(copy, h->ranges, n * sizeof *copy);
    pthread_mutex_unlock(&host_lock);
    if (!copy) return -1;
    int r = 0;
    for (size_t i = 0; i < n && !r; i++) r = fn(copy[i].device, copy[i].addr, copy[i].bytes, arg);
    free(copy);
    return r;
}

int xv_host_is_mapped(XvHost *h, uintptr_t addr, int *device)
{
    pthread_mutex_lock(&host_lock);
    size_t at = page_at(h, addr + 1);   /* the first page starting after addr: the one before may hold it */
    int yes = at > 0 && h->pages[at - 1].addr <= addr && addr - h->pages[at - 1].addr < h->pages[at - 1].bytes;
    if (yes && device) *device = h->pages[at - 1].device;
    pthread_mutex_unlock(&host_lock);
    return yes;
}
