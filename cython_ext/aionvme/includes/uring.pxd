# io_uring through raw syscalls: the ring helpers of uring.h (our own copy of
# the kernel ABI, so neither liburing nor recent kernel headers are needed).
from libc.stdint cimport int64_t, uint32_t, uint64_t


cdef extern from "uring.h" nogil:
    ctypedef struct aionvme_uring:
        int fd
        int defer
        unsigned features
        unsigned sq_entries
        unsigned cq_entries

    int aionvme_uring_init(aionvme_uring *u, unsigned entries, int efd, int single_issuer)
    void aionvme_uring_get_events(aionvme_uring *u)
    void aionvme_uring_free(aionvme_uring *u, int forked)
    unsigned aionvme_uring_sq_space(const aionvme_uring *u)
    unsigned aionvme_uring_sq_pending(const aionvme_uring *u)
    void aionvme_uring_push_rw(aionvme_uring *u, int write, int fd, uint64_t addr, uint32_t len,
                               uint64_t off, uint64_t user_data, uint32_t rw_flags)
    enum:
        AIONVME_RWF_NOWAIT
    int aionvme_uring_enter(aionvme_uring *u, unsigned n)
    int aionvme_uring_reap(aionvme_uring *u, uint64_t *user_data, int64_t *res, int max)
