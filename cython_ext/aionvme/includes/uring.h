/* io_uring through raw syscalls, with our own copy of the kernel ABI
 * (include/uapi/linux/io_uring.h), so the build needs neither liburing nor
 * recent kernel headers.
 *
 * Kernel facts this relies on (io_uring(7), io_uring_setup(2),
 * io_uring_enter(2), io_uring/io_uring.c):
 * - One producer fills SQEs and publishes the SQ tail with a release store;
 *   io_uring_enter(to_submit) consumes at most to_submit entries from the SQ
 *   head and returns how many it took. Entries it did not take stay in the
 *   ring and are consumed by the next call: nothing is lost or reordered.
 * - A request the kernel refuses (bad fd, misaligned O_DIRECT) still
 *   consumes its SQE and completes with a CQE whose res is -errno; the
 *   enter call itself fails only for the ring as a whole (EAGAIN/EBUSY: no
 *   memory or the CQ overflow backlog is full; EINTR).
 * - A registered eventfd (IORING_REGISTER_EVENTFD) is signalled once per
 *   posted CQE, like IOCB_FLAG_RESFD for kernel AIO: the engine's reactor
 *   code works unchanged.
 * - With IORING_FEAT_NODROP (5.5+) the kernel keeps CQEs that do not fit the
 *   CQ ring instead of dropping them.
 * - Submissions of more than two SQEs are plugged until the call returns,
 *   as with io_submit: the engine submits a batch in ramped calls.
 *
 * Not used, measured (bench/c/uring_registered.c: 4 KiB random reads at QD 64
 * in C, the kernel side alone; 2-vCPU VM at load 7-8, so the least CPU of 5-6
 * alternated runs per variant, in us per read):
 * - Registered files (IORING_REGISTER_FILES, IOSQE_FIXED_FILE) and buffers
 *   (IORING_REGISTER_BUFFERS, READ_FIXED): page-cache hits 1.13-1.54 plain,
 *   1.19-1.46 files, 1.25-1.41 buffers, 1.16-1.25 both; O_DIRECT 2.90
 *   plain, 2.99 files, 2.72 buffers, 2.59 both. At most ~0.3 us, within the
 *   noise here, against ~8 us per read in aionvme's gather path. A cached
 *   read's cost is the page-cache lookup and the copy, which fixed buffers do
 *   not avoid; they skip pinning the user page, which only O_DIRECT pays, and
 *   engine='auto' sends O_DIRECT to kernel AIO. Keeping a per-engine file
 *   table in step with every fd (and the pools' buffers registered per
 *   engine, with their lifetimes) is not worth 0-4% on this evidence.
 * - SQ polling (IORING_SETUP_SQPOLL): O_DIRECT 12.8-20 us CPU per read (the
 *   kernel's polling thread spins on one of the two vCPUs) and 0.5x the
 *   IOPS; cached reads no better than plain. Worth trying only where a core
 *   can be given to it. */
#ifndef AIONVME_URING_H
#define AIONVME_URING_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425   /* the same number on every architecture */
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

#define AIONVME_RWF_NOWAIT 0x00000008   /* fail with EAGAIN instead of waiting (include/uapi/linux/fs.h) */
#define AIONVME_IORING_OP_READ 22
#define AIONVME_IORING_OP_WRITE 23
#define AIONVME_IORING_OFF_SQ_RING 0ULL
#define AIONVME_IORING_OFF_CQ_RING 0x8000000ULL
#define AIONVME_IORING_OFF_SQES 0x10000000ULL
#define AIONVME_IORING_FEAT_SINGLE_MMAP (1U << 0)
#define AIONVME_IORING_FEAT_NODROP (1U << 1)
#define AIONVME_IORING_SETUP_CQSIZE (1U << 3)
#define AIONVME_IORING_SETUP_CLAMP (1U << 4)
#define AIONVME_IORING_SETUP_SINGLE_ISSUER (1U << 12)
#define AIONVME_IORING_SETUP_DEFER_TASKRUN (1U << 13)
#define AIONVME_IORING_ENTER_GETEVENTS (1U << 0)
#define AIONVME_IORING_REGISTER_EVENTFD 4
#define AIONVME_IORING_REGISTER_PROBE 8
#define AIONVME_IO_URING_OP_SUPPORTED (1U << 0)

struct aionvme_sqring_offsets {
    uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
    uint64_t user_addr;
};
struct aionvme_cqring_offsets {
    uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
    uint64_t user_addr;
};
struct aionvme_uring_params {
    uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd, resv[3];
    struct aionvme_sqring_offsets sq_off;
    struct aionvme_cqring_offsets cq_off;
};
/* struct io_uring_sqe, 64 bytes, with the fields a read or write uses. */
struct aionvme_sqe {
    uint8_t opcode, flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off;
    uint64_t addr;
    uint32_t len;
    uint32_t rw_flags;
    uint64_t user_data;
    uint16_t buf_index, personality;
    int32_t splice_fd_in;
    uint64_t addr3, pad2;
};
struct aionvme_cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
};
struct aionvme_probe {
    uint8_t last_op, ops_len;
    uint16_t resv;
    uint32_t resv2[3];
    struct { uint8_t op, resv; uint16_t flags; uint32_t resv2; } ops[64];
};

typedef struct aionvme_uring {
    int fd;
    int defer;                       /* DEFER_TASKRUN: completions are posted by get_events */
    unsigned features;
    unsigned sq_entries;
    unsigned cq_entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned sq_local_tail;          /* entries filled, published by aionvme_uring_enter */
    struct aionvme_sqe *sqes;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct aionvme_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_size, cq_size, sqes_size;
} aionvme_uring;

/* Set up a ring of at least `entries` SQEs (CQ twice that), map it, check
 * that IORING_OP_READ/WRITE are supported, and register efd. 0 or -errno;
 * on failure nothing is left open or mapped. */
static inline int aionvme_uring_init(aionvme_uring *u, unsigned entries, int efd, int single_issuer) {
    struct aionvme_uring_params p;
    struct aionvme_probe probe;
    long fd;
    int err;
    memset(u, 0, sizeof(*u));
    u->fd = -1;
    memset(&p, 0, sizeof(p));
    p.flags = AIONVME_IORING_SETUP_CQSIZE | AIONVME_IORING_SETUP_CLAMP;
    p.cq_entries = entries * 2;
    if (single_issuer) {
        /* One thread submits and reaps (an event loop's engine): completions
         * wait as deferred task work until get_events runs it in a batch,
         * instead of interrupting that thread once per completion (6.1+). The
         * eventfd is still signalled when such work is queued. */
        p.flags |= AIONVME_IORING_SETUP_SINGLE_ISSUER | AIONVME_IORING_SETUP_DEFER_TASKRUN;
        fd = syscall(__NR_io_uring_setup, entries, &p);
        if (fd >= 0) {
            u->defer = 1;
        } else {
            memset(&p, 0, sizeof(p));
            p.flags = AIONVME_IORING_SETUP_CQSIZE | AIONVME_IORING_SETUP_CLAMP;
            p.cq_entries = entries * 2;
        }
    } else {
        fd = -1;
    }
    if (fd < 0)
        fd = syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0)
        return -errno;
    u->fd = (int)fd;
    u->features = p.features;
    u->sq_entries = p.sq_entries;
    u->cq_entries = p.cq_entries;
    if (!(p.features & AIONVME_IORING_FEAT_NODROP)) {
        err = -ENOSYS;   /* older than 5.5: completions could be dropped */
        goto fail;
    }
    u->sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    u->cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct aionvme_cqe);
    if (p.features & AIONVME_IORING_FEAT_SINGLE_MMAP) {
        if (u->cq_size > u->sq_size)
            u->sq_size = u->cq_size;
        u->cq_size = u->sq_size;
    }
    u->sq_ptr = mmap(NULL, u->sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                     u->fd, AIONVME_IORING_OFF_SQ_RING);
    if (u->sq_ptr == MAP_FAILED) {
        u->sq_ptr = NULL;
        err = -errno;
        goto fail;
    }
    if (p.features & AIONVME_IORING_FEAT_SINGLE_MMAP) {
        u->cq_ptr = u->sq_ptr;
    } else {
        u->cq_ptr = mmap(NULL, u->cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                         u->fd, AIONVME_IORING_OFF_CQ_RING);
        if (u->cq_ptr == MAP_FAILED) {
            u->cq_ptr = NULL;
            err = -errno;
            goto fail;
        }
    }
    u->sqes_size = p.sq_entries * sizeof(struct aionvme_sqe);
    u->sqes = (struct aionvme_sqe *)mmap(NULL, u->sqes_size, PROT_READ | PROT_WRITE,
                                         MAP_SHARED | MAP_POPULATE, u->fd, AIONVME_IORING_OFF_SQES);
    if (u->sqes == MAP_FAILED) {
        u->sqes = NULL;
        err = -errno;
        goto fail;
    }
    /* A forked child must never write into the parent's rings (they are
     * shared mappings): leave them out of the child's address space. */
    madvise(u->sq_ptr, u->sq_size, MADV_DONTFORK);
    if (u->cq_ptr != u->sq_ptr)
        madvise(u->cq_ptr, u->cq_size, MADV_DONTFORK);
    madvise(u->sqes, u->sqes_size, MADV_DONTFORK);
    u->sq_head = (unsigned *)((char *)u->sq_ptr + p.sq_off.head);
    u->sq_tail = (unsigned *)((char *)u->sq_ptr + p.sq_off.tail);
    u->sq_mask = (unsigned *)((char *)u->sq_ptr + p.sq_off.ring_mask);
    u->sq_array = (unsigned *)((char *)u->sq_ptr + p.sq_off.array);
    u->cq_head = (unsigned *)((char *)u->cq_ptr + p.cq_off.head);
    u->cq_tail = (unsigned *)((char *)u->cq_ptr + p.cq_off.tail);
    u->cq_mask = (unsigned *)((char *)u->cq_ptr + p.cq_off.ring_mask);
    u->cqes = (struct aionvme_cqe *)((char *)u->cq_ptr + p.cq_off.cqes);
    u->sq_local_tail = *u->sq_tail;
    /* IORING_OP_READ/WRITE arrived in 5.6, with the probe. */
    memset(&probe, 0, sizeof(probe));
    if (syscall(__NR_io_uring_register, u->fd, AIONVME_IORING_REGISTER_PROBE, &probe, 64) < 0) {
        err = -errno;
        goto fail;
    }
    if (probe.last_op < AIONVME_IORING_OP_WRITE
            || !(probe.ops[AIONVME_IORING_OP_READ].flags & AIONVME_IO_URING_OP_SUPPORTED)
            || !(probe.ops[AIONVME_IORING_OP_WRITE].flags & AIONVME_IO_URING_OP_SUPPORTED)) {
        err = -EOPNOTSUPP;
        goto fail;
    }
    if (syscall(__NR_io_uring_register, u->fd, AIONVME_IORING_REGISTER_EVENTFD, &efd, 1) < 0) {
        err = -errno;
        goto fail;
    }
    return 0;
fail:
    if (u->sqes) munmap(u->sqes, u->sqes_size);
    if (u->cq_ptr && u->cq_ptr != u->sq_ptr) munmap(u->cq_ptr, u->cq_size);
    if (u->sq_ptr) munmap(u->sq_ptr, u->sq_size);
    if (u->fd >= 0) close(u->fd);
    memset(u, 0, sizeof(*u));
    u->fd = -1;
    return err;
}

/* Unmap and close. In a forked child the mappings do not exist there
 * (MADV_DONTFORK): only the inherited fd is closed. */
static inline void aionvme_uring_free(aionvme_uring *u, int forked) {
    if (!forked) {
        if (u->sqes) munmap(u->sqes, u->sqes_size);
        if (u->cq_ptr && u->cq_ptr != u->sq_ptr) munmap(u->cq_ptr, u->cq_size);
        if (u->sq_ptr) munmap(u->sq_ptr, u->sq_size);
    }
    if (u->fd >= 0) close(u->fd);
    memset(u, 0, sizeof(*u));
    u->fd = -1;
}

/* Free SQ slots (filled but not yet consumed entries count as used). */
static inline unsigned aionvme_uring_sq_space(const aionvme_uring *u) {
    return u->sq_entries - (u->sq_local_tail - __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE));
}

/* Entries published or filled that the kernel has not consumed yet. */
static inline unsigned aionvme_uring_sq_pending(const aionvme_uring *u) {
    return u->sq_local_tail - __atomic_load_n(u->sq_head, __ATOMIC_ACQUIRE);
}

/* Fill the next SQE with a read (write=0) or write; the caller checked space. */
static inline void aionvme_uring_push_rw(aionvme_uring *u, int write, int fd, uint64_t addr, uint32_t len,
                                         uint64_t off, uint64_t user_data, uint32_t rw_flags) {
    unsigned idx = u->sq_local_tail & *u->sq_mask;
    struct aionvme_sqe *e = &u->sqes[idx];
    memset(e, 0, sizeof(*e));
    e->opcode = write ? AIONVME_IORING_OP_WRITE : AIONVME_IORING_OP_READ;
    e->fd = fd;
    e->addr = addr;
    e->len = len;
    e->off = off;
    e->rw_flags = rw_flags;
    e->user_data = user_data;
    u->sq_array[idx] = idx;
    u->sq_local_tail++;
}

/* Publish the filled SQEs and ask the kernel to consume up to n of them.
 * Returns how many it consumed, or -errno. */
static inline int aionvme_uring_enter(aionvme_uring *u, unsigned n) {
    long r;
    __atomic_store_n(u->sq_tail, u->sq_local_tail, __ATOMIC_RELEASE);
    r = syscall(__NR_io_uring_enter, u->fd, n, 0, 0, NULL, 0);
    return r < 0 ? -errno : (int)r;
}

/* With DEFER_TASKRUN: run the completions' deferred task work, which posts
 * their CQEs (io_uring_enter with IORING_ENTER_GETEVENTS and no wait). */
static inline void aionvme_uring_get_events(aionvme_uring *u) {
    if (u->defer)
        syscall(__NR_io_uring_enter, u->fd, 0, 0, AIONVME_IORING_ENTER_GETEVENTS, NULL, 0);
}

/* Copy out up to max completions; returns how many. */
static inline int aionvme_uring_reap(aionvme_uring *u, uint64_t *user_data, int64_t *res, int max) {
    unsigned head = *u->cq_head;
    unsigned tail = __atomic_load_n(u->cq_tail, __ATOMIC_ACQUIRE);
    unsigned mask = *u->cq_mask;
    int n = 0;
    while (head != tail && n < max) {
        struct aionvme_cqe *c = &u->cqes[head & mask];
        user_data[n] = c->user_data;
        res[n] = c->res;
        n++;
        head++;
    }
    __atomic_store_n(u->cq_head, head, __ATOMIC_RELEASE);
    return n;
}

#endif
