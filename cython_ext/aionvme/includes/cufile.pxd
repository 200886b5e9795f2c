# cuFile (GPUDirect Storage) types and entry-point types, declared by layout in
# cufile_abi.h (copied from NVIDIA's cufile.h, cuFile 1.15; see there). No CUDA
# header is needed to build: the library is opened with dlopen (_gds.pxi).
from libc.stddef cimport size_t


cdef extern from "cufile_abi.h" nogil:
    int CUFILEOP_BASE_ERR "AIONVME_CUFILEOP_BASE_ERR"
    int CU_FILE_SUCCESS "AIONVME_CU_FILE_SUCCESS"
    int CU_FILE_DRIVER_NOT_INITIALIZED "AIONVME_CU_FILE_DRIVER_NOT_INITIALIZED"
    int CU_FILE_IO_NOT_SUPPORTED "AIONVME_CU_FILE_IO_NOT_SUPPORTED"
    int CU_FILE_CUDA_DRIVER_ERROR "AIONVME_CU_FILE_CUDA_DRIVER_ERROR"
    int CU_FILE_INVALID_VALUE "AIONVME_CU_FILE_INVALID_VALUE"
    int CU_FILE_INTERNAL_ERROR "AIONVME_CU_FILE_INTERNAL_ERROR"
    int CU_FILE_HANDLE_TYPE_OPAQUE_FD "AIONVME_CU_FILE_HANDLE_TYPE_OPAQUE_FD"
    int CU_FILE_NVME_SUPPORTED "AIONVME_CU_FILE_NVME_SUPPORTED"
    int CU_FILE_NVME_P2P_SUPPORTED "AIONVME_CU_FILE_NVME_P2P_SUPPORTED"
    int CU_FILE_USE_POLL_MODE "AIONVME_CU_FILE_USE_POLL_MODE"
    int CU_FILE_ALLOW_COMPAT_MODE "AIONVME_CU_FILE_ALLOW_COMPAT_MODE"
    int CU_POINTER_ATTRIBUTE_CONTEXT "AIONVME_CU_POINTER_ATTRIBUTE_CONTEXT"

    ctypedef struct CUfileError_t "aionvme_CUfileError_t":
        int err          # CUfileOpError
        int cu_err       # CUresult, when err is CU_FILE_CUDA_DRIVER_ERROR

    ctypedef union CUfileHandleUnion "aionvme_CUfileHandleUnion":
        int fd
        void *handle

    ctypedef struct CUfileDescr_t "aionvme_CUfileDescr_t":
        int type
        CUfileHandleUnion handle
        const void *fs_ops

    ctypedef struct CUfileNvfsProps "aionvme_CUfileNvfsProps":
        unsigned int major_version
        unsigned int minor_version
        size_t poll_thresh_size
        size_t max_direct_io_size
        unsigned int dstatusflags
        unsigned int dcontrolflags

    ctypedef struct CUfileDrvProps_t "aionvme_CUfileDrvProps_t":
        CUfileNvfsProps nvfs
        unsigned int fflags
        unsigned int max_device_cache_size
        unsigned int per_buffer_cache_size
        unsigned int max_device_pinned_mem_size
        unsigned int max_batch_io_size
        unsigned int max_batch_io_timeout_msecs

    ctypedef void *CUfileHandle_t "aionvme_CUfileHandle_t"

    ctypedef CUfileError_t (*cuFileDriverOpen_t "aionvme_cuFileDriverOpen_t")()
    ctypedef CUfileError_t (*cuFileDriverClose_t "aionvme_cuFileDriverClose_t")()
    ctypedef CUfileError_t (*cuFileHandleRegister_t "aionvme_cuFileHandleRegister_t")(
        CUfileHandle_t *fh, CUfileDescr_t *descr)
    ctypedef void (*cuFileHandleDeregister_t "aionvme_cuFileHandleDeregister_t")(CUfileHandle_t fh)
    ctypedef CUfileError_t (*cuFileBufRegister_t "aionvme_cuFileBufRegister_t")(
        const void *buf, size_t length, int flags)
    ctypedef CUfileError_t (*cuFileBufDeregister_t "aionvme_cuFileBufDeregister_t")(const void *buf)
    ctypedef ssize_t (*cuFileRead_t "aionvme_cuFileRead_t")(
        CUfileHandle_t fh, void *buf, size_t size, long file_offset, long buf_offset)
    ctypedef ssize_t (*cuFileWrite_t "aionvme_cuFileWrite_t")(
        CUfileHandle_t fh, const void *buf, size_t size, long file_offset, long buf_offset)
    ctypedef CUfileError_t (*cuFileGetVersion_t "aionvme_cuFileGetVersion_t")(int *version)
    ctypedef CUfileError_t (*cuFileDriverGetProperties_t "aionvme_cuFileDriverGetProperties_t")(
        CUfileDrvProps_t *props)
    ctypedef long (*cuFileUseCount_t "aionvme_cuFileUseCount_t")()

    ctypedef int (*cuPointerGetAttribute_t "aionvme_cuPointerGetAttribute_t")(
        void *data, int attribute, unsigned long long ptr)
    ctypedef int (*cuCtxSetCurrent_t "aionvme_cuCtxSetCurrent_t")(void *ctx)
