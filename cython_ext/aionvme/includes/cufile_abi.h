/* The parts of cuFile's ABI that aionvme calls, declared by layout so that
 * neither cufile.h nor cuda.h is needed to build: the library itself is
 * loaded with dlopen at run time (see _gds.pxi).
 *
 * Every type, field order and value below is copied from cufile.h as shipped
 * in the nvidia-cufile 1.15.1.6 wheel (nvidia/cu13/include/cufile.h, cuFile
 * 1.15) and matches rapidsai/kvikio's use of the same API
 * (cpp/src/shim/cufile.cpp, cpp/src/file_handle.cpp). The static asserts pin
 * the x86-64/aarch64 LP64 layout the library was built with. */
#ifndef AIONVME_CUFILE_ABI_H
#define AIONVME_CUFILE_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* cufile.h: #define CUFILEOP_BASE_ERR 5000; CUfileOpError values are
 * CUFILEOP_BASE_ERR + n, so they never collide with an errno. */
#define AIONVME_CUFILEOP_BASE_ERR 5000
#define AIONVME_CU_FILE_SUCCESS 0
#define AIONVME_CU_FILE_DRIVER_NOT_INITIALIZED 5001
#define AIONVME_CU_FILE_IO_NOT_SUPPORTED 5008
#define AIONVME_CU_FILE_CUDA_DRIVER_ERROR 5011
#define AIONVME_CU_FILE_INVALID_VALUE 5022
#define AIONVME_CU_FILE_INTERNAL_ERROR 5030

/* enum CUfileFileHandleType: CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1 (Linux fd). */
#define AIONVME_CU_FILE_HANDLE_TYPE_OPAQUE_FD 1

/* CUfileDriverStatusFlags_t / CUfileDriverControlFlags_t are bit numbers in
 * CUfileDrvProps_t.nvfs.dstatusflags / dcontrolflags. */
#define AIONVME_CU_FILE_NVME_SUPPORTED 4
#define AIONVME_CU_FILE_NVME_P2P_SUPPORTED 11
#define AIONVME_CU_FILE_USE_POLL_MODE 0
#define AIONVME_CU_FILE_ALLOW_COMPAT_MODE 1

/* typedef struct CUfileError { CUfileOpError err; CUresult cu_err; }
 * CUfileError_t; both are C enums (int-sized). Returned by value. */
typedef struct {
    int err;
    int cu_err;
} aionvme_CUfileError_t;

/* typedef struct CUfileDescr_t {
 *     enum CUfileFileHandleType type;
 *     union { int fd; void *handle; } handle;
 *     const CUfileFSOps_t *fs_ops;
 * } CUfileDescr_t;                   (fs_ops NULL: the kernel's VFS) */
typedef union {
    int fd;
    void *handle;
} aionvme_CUfileHandleUnion;

typedef struct {
    int type;
    aionvme_CUfileHandleUnion handle;
    const void *fs_ops;
} aionvme_CUfileDescr_t;

/* typedef struct CUfileDrvProps { struct { unsigned major_version,
 * minor_version; size_t poll_thresh_size, max_direct_io_size; unsigned
 * dstatusflags, dcontrolflags; } nvfs; unsigned fflags, max_device_cache_size,
 * per_buffer_cache_size, max_device_pinned_mem_size, max_batch_io_size,
 * max_batch_io_timeout_msecs; } CUfileDrvProps_t;
 * Older libraries know fewer trailing fields and newer ones may add some:
 * _gds.pxi passes a larger zeroed buffer and reads these fields from it. */
typedef struct {
    unsigned int major_version;
    unsigned int minor_version;
    size_t poll_thresh_size;
    size_t max_direct_io_size;
    unsigned int dstatusflags;
    unsigned int dcontrolflags;
} aionvme_CUfileNvfsProps;

typedef struct {
    aionvme_CUfileNvfsProps nvfs;
    unsigned int fflags;
    unsigned int max_device_cache_size;
    unsigned int per_buffer_cache_size;
    unsigned int max_device_pinned_mem_size;
    unsigned int max_batch_io_size;
    unsigned int max_batch_io_timeout_msecs;
} aionvme_CUfileDrvProps_t;

typedef void *aionvme_CUfileHandle_t;

/* The entry points, as function-pointer types for dlsym. */
typedef aionvme_CUfileError_t (*aionvme_cuFileDriverOpen_t)(void);
typedef aionvme_CUfileError_t (*aionvme_cuFileDriverClose_t)(void);   /* also _v2 */
typedef aionvme_CUfileError_t (*aionvme_cuFileHandleRegister_t)(aionvme_CUfileHandle_t *fh,
                                                               aionvme_CUfileDescr_t *descr);
typedef void (*aionvme_cuFileHandleDeregister_t)(aionvme_CUfileHandle_t fh);
typedef aionvme_CUfileError_t (*aionvme_cuFileBufRegister_t)(const void *bufPtr_base, size_t length,
                                                            int flags);
typedef aionvme_CUfileError_t (*aionvme_cuFileBufDeregister_t)(const void *bufPtr_base);
typedef ssize_t (*aionvme_cuFileRead_t)(aionvme_CUfileHandle_t fh, void *bufPtr_base, size_t size,
                                        off_t file_offset, off_t bufPtr_offset);
typedef ssize_t (*aionvme_cuFileWrite_t)(aionvme_CUfileHandle_t fh, const void *bufPtr_base,
                                         size_t size, off_t file_offset, off_t bufPtr_offset);
typedef aionvme_CUfileError_t (*aionvme_cuFileGetVersion_t)(int *version);
typedef aionvme_CUfileError_t (*aionvme_cuFileDriverGetProperties_t)(aionvme_CUfileDrvProps_t *props);
typedef long (*aionvme_cuFileUseCount_t)(void);

/* The CUDA driver API, for the context a worker thread needs current before
 * it calls cuFile with a device pointer (kvikio does the same per task):
 * CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute,
 * CUdeviceptr ptr) with CU_POINTER_ATTRIBUTE_CONTEXT = 1 (cuda.h), and
 * CUresult cuCtxSetCurrent(CUcontext ctx). CUdeviceptr is 64-bit. */
#define AIONVME_CU_POINTER_ATTRIBUTE_CONTEXT 1
typedef int (*aionvme_cuPointerGetAttribute_t)(void *data, int attribute, unsigned long long ptr);
typedef int (*aionvme_cuCtxSetCurrent_t)(void *ctx);

_Static_assert(sizeof(aionvme_CUfileError_t) == 8, "CUfileError_t is two ints");
_Static_assert(offsetof(aionvme_CUfileDescr_t, handle) == 8, "CUfileDescr_t.handle at 8");
_Static_assert(offsetof(aionvme_CUfileDescr_t, fs_ops) == 16, "CUfileDescr_t.fs_ops at 16");
_Static_assert(sizeof(aionvme_CUfileDescr_t) == 24, "CUfileDescr_t is 24 bytes");
_Static_assert(offsetof(aionvme_CUfileDrvProps_t, fflags) == 32, "CUfileDrvProps_t.fflags at 32");
_Static_assert(sizeof(aionvme_CUfileDrvProps_t) == 56, "CUfileDrvProps_t is 56 bytes");
_Static_assert(sizeof(off_t) == 8, "cuFile takes 64-bit off_t");

#endif
