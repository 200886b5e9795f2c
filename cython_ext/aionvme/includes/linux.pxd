# Extern declarations for the Linux interfaces the engine calls directly.
# Kernel AIO goes through syscall(2) with <linux/aio_abi.h>: no libaio needed.
from libc.stdint cimport int16_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t


cdef extern from "<linux/aio_abi.h>" nogil:
    ctypedef unsigned long aio_context_t

    enum:
        IOCB_CMD_PREAD
        IOCB_CMD_PWRITE
        IOCB_CMD_FSYNC
        IOCB_CMD_FDSYNC
        IOCB_FLAG_RESFD

    struct io_event:
        uint64_t data
        uint64_t obj
        int64_t res
        int64_t res2

    struct iocb:
        uint64_t aio_data
        uint32_t aio_key
        int aio_rw_flags
        uint16_t aio_lio_opcode
        int16_t aio_reqprio
        uint32_t aio_fildes
        uint64_t aio_buf
        uint64_t aio_nbytes
        int64_t aio_offset
        uint64_t aio_reserved2
        uint32_t aio_flags
        uint32_t aio_resfd


cdef extern from "<sys/syscall.h>" nogil:
    enum:
        SYS_io_setup
        SYS_io_destroy
        SYS_io_submit
        SYS_io_getevents


cdef extern from "<unistd.h>" nogil:
    long syscall(long number, ...)
    ssize_t pread(int fd, void *buf, size_t count, long offset)
    ssize_t pwrite(int fd, const void *buf, size_t count, long offset)
    ssize_t read(int fd, void *buf, size_t count)
    ssize_t write(int fd, const void *buf, size_t count)
    int close(int fd)
    int fsync(int fd)
    int fdatasync(int fd)
    int dup2(int oldfd, int newfd)
    int ftruncate(int fd, long length)
    long sysconf(int name)
    int getpid()
    enum:
        _SC_PAGESIZE


cdef extern from "<fcntl.h>" nogil:
    int fallocate(int fd, int mode, long offset, long len)
    int fcntl(int fd, int cmd, ...)
    enum:
        F_GETFD
        F_DUPFD_CLOEXEC


cdef extern from "<sys/stat.h>" nogil:
    struct stat:
        long st_size
        unsigned int st_mode
        unsigned long st_dev
        unsigned long st_ino
    int fstat(int fd, stat *buf)
    bint S_ISREG(unsigned int mode)
    bint S_ISBLK(unsigned int mode)


cdef extern from "<sys/vfs.h>" nogil:
    struct statfs:
        long f_type
    int fstatfs(int fd, statfs *buf)


cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    enum:
        EFD_NONBLOCK
        EFD_CLOEXEC


cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum:
        POLLIN


cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int nanosleep(const timespec *req, timespec *rem)
    int clock_gettime(int clk_id, timespec *tp)
    enum:
        CLOCK_MONOTONIC


cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)
    int mlock(const void *addr, size_t len)
    int munlock(const void *addr, size_t len)
    void *MAP_FAILED
    enum:
        PROT_READ
        PROT_WRITE
        MAP_PRIVATE
        MAP_ANONYMOUS
        MADV_HUGEPAGE


cdef extern from "compat.h" nogil:
    struct aionvme_statx:
        uint32_t stx_mask
        uint32_t stx_blksize
        uint16_t stx_mode
        uint64_t stx_ino
        uint64_t stx_size
        uint32_t stx_dev_major
        uint32_t stx_dev_minor
        uint32_t stx_dio_mem_align
        uint32_t stx_dio_offset_align
    int aionvme_fstatx(int fd, aionvme_statx *out)
    void aionvme_clear_errno()
    unsigned AIONVME_STATX_DIOALIGN

    struct aionvme_aio_ring:
        unsigned nr
        unsigned head
        unsigned tail
        unsigned magic
        unsigned incompat_features
        unsigned header_length
    unsigned AIONVME_AIO_RING_MAGIC
    unsigned aionvme_load_acquire(unsigned *p)
    int64_t aionvme_atomic_load(int64_t *p)
    void aionvme_atomic_add(int64_t *p, int64_t v)
    void aionvme_store_release(unsigned *p, unsigned v)


cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)
