/*
 * The few CUDA driver types, values and signatures _vmm_cuda.c uses, declared here so xpool builds without CUDA
 * headers and links no CUDA library (the driver is loaded at run time).  Prefixed XVCU_ so that
 * tests/xpool/fixtures/vmm_cuda_layout.c can include this beside <cuda.h> and check every layout and value against
 * it (tests/xpool/test_vmm.py::test_cuda_declarations_match_cuda_h).  They are the CUDA 12.0 ABI, unchanged in 13.
 */
#ifndef XPOOL_VMM_CUDA_H
#define XPOOL_VMM_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef int XVCUresult;
typedef int XVCUdevice;
typedef unsigned long long XVCUdeviceptr;
typedef unsigned long long XVCUmemGenericAllocationHandle;
typedef struct XVCUctx_st *XVCUcontext;
typedef struct XVCUstream_st *XVCUstream;
typedef uint64_t XVcuuint64_t;
/* enums passed as int-sized values */
typedef int XVCUdevice_attribute;
typedef int XVCUmemAllocationGranularity_flags;
typedef int XVCUstreamCaptureStatus;
typedef int XVCUstreamCaptureMode;
typedef int XVCUdriverProcAddressQueryResult;

enum {
    XVCUDA_SUCCESS = 0, XVCUDA_ERROR_INVALID_VALUE = 1, XVCUDA_ERROR_OUT_OF_MEMORY = 2,
    XVCUDA_ERROR_NOT_INITIALIZED = 3, XVCUDA_ERROR_DEINITIALIZED = 4, XVCUDA_ERROR_STUB_LIBRARY = 34, XVCUDA_ERROR_NO_DEVICE = 100,
    XVCUDA_ERROR_INVALID_DEVICE = 101, XVCUDA_ERROR_NOT_FOUND = 500, XVCUDA_ERROR_NOT_SUPPORTED = 801,
    XVCUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
};
enum {
    XVCU_MEM_ALLOCATION_TYPE_PINNED = 0x1, XVCU_MEM_HANDLE_TYPE_NONE = 0x0, XVCU_MEM_LOCATION_TYPE_DEVICE = 0x1,
    XVCU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3, XVCU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
    XVCU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1, XVCU_STREAM_CAPTURE_STATUS_NONE = 0,
    XVCU_STREAM_CAPTURE_MODE_RELAXED = 2, XVCU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
    XVCU_GET_PROC_ADDRESS_DEFAULT = 0,
};

typedef struct {
    int type;                        /* CUmemLocationType */
    int id;
} XVCUmemLocation;

typedef struct {
    int type;                        /* CUmemAllocationType */
    int requestedHandleTypes;        /* CUmemAllocationHandleType */
    XVCUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} XVCUmemAllocationProp;

typedef struct {
    XVCUmemLocation location;
    int flags;                       /* CUmemAccess_flags */
} XVCUmemAccessDesc;

/* cuGetProcAddress_v2 (CUDA 12.0 on) and the 11.3 original */
#define XVCU_GETPROC_V2 XVCUresult (*)(const char *, void **, int, XVcuuint64_t, XVCUdriverProcAddressQueryResult *)
typedef __typeof__(XVCU_GETPROC_V2) xvcu_getproc_v2_t;
typedef XVCUresult (*xvcu_getproc_v1_t)(const char *, void **, int, XVcuuint64_t);

/* The driver functions, by the names cuGetProcAddress knows them (its answer for version 12000 is the
 * _v2 entry point where there is one, e.g. cuCtxPushCurrent_v2). */
#define XVCU_FUNCTIONS(X)                                                                                  \
    X(cuInit, XVCUresult (*)(unsigned), "cuInit")                                                          \
    X(cuDriverGetVersion, XVCUresult (*)(int *), "cuDriverGetVersion")                                     \
    X(cuDeviceGet, XVCUresult (*)(XVCUdevice *, int), "cuDeviceGet")                                       \
    X(cuDeviceGetCount, XVCUresult (*)(int *), "cuDeviceGetCount")                                         \
    X(cuDeviceCanAccessPeer, XVCUresult (*)(int *, XVCUdevice, XVCUdevice), "cuDeviceCanAccessPeer")       \
    X(cuDeviceGetAttribute, XVCUresult (*)(int *, XVCUdevice_attribute, XVCUdevice), "cuDeviceGetAttribute") \
    X(cuDevicePrimaryCtxRetain, XVCUresult (*)(XVCUcontext *, XVCUdevice), "cuDevicePrimaryCtxRetain")     \
    X(cuCtxGetCurrent, XVCUresult (*)(XVCUcontext *), "cuCtxGetCurrent")                                   \
    X(cuCtxPushCurrent, XVCUresult (*)(XVCUcontext), "cuCtxPushCurrent_v2")                                \
    X(cuCtxPopCurrent, XVCUresult (*)(XVCUcontext *), "cuCtxPopCurrent_v2")                                \
    X(cuCtxSynchronize, XVCUresult (*)(void), "cuCtxSynchronize")                                          \
    X(cuMemGetAllocationGranularity,                                                                       \
      XVCUresult (*)(size_t *, const XVCUmemAllocationProp *, XVCUmemAllocationGranularity_flags),         \
      "cuMemGetAllocationGranularity")                                                                     \
    X(cuMemAddressReserve, XVCUresult (*)(XVCUdeviceptr *, size_t, size_t, XVCUdeviceptr,                  \
                                          unsigned long long), "cuMemAddressReserve")                      \
    X(cuMemAddressFree, XVCUresult (*)(XVCUdeviceptr, size_t), "cuMemAddressFree")                         \
    X(cuMemCreate, XVCUresult (*)(XVCUmemGenericAllocationHandle *, size_t, const XVCUmemAllocationProp *, \
                                  unsigned long long), "cuMemCreate")                                      \
    X(cuMemRelease, XVCUresult (*)(XVCUmemGenericAllocationHandle), "cuMemRelease")                        \
    X(cuMemMap, XVCUresult (*)(XVCUdeviceptr, size_t, size_t, XVCUmemGenericAllocationHandle,              \
                               unsigned long long), "cuMemMap")                                            \
    X(cuMemUnmap, XVCUresult (*)(XVCUdeviceptr, size_t), "cuMemUnmap")                                     \
    X(cuMemSetAccess, XVCUresult (*)(XVCUdeviceptr, size_t, const XVCUmemAccessDesc *, size_t),            \
      "cuMemSetAccess")                                                                                    \
    X(cuStreamIsCapturing, XVCUresult (*)(XVCUstream, XVCUstreamCaptureStatus *), "cuStreamIsCapturing")   \
    X(cuThreadExchangeStreamCaptureMode, XVCUresult (*)(XVCUstreamCaptureMode *),                          \
      "cuThreadExchangeStreamCaptureMode")                                                                 \
    X(cuGetErrorName, XVCUresult (*)(XVCUresult, const char **), "cuGetErrorName")                         \
    X(cuGetErrorString, XVCUresult (*)(XVCUresult, const char **), "cuGetErrorString")

#endif
