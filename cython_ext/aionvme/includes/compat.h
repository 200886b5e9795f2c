/* Small C helpers that must not depend on the build machine's headers being
 * recent: statx (STATX_DIOALIGN, Linux 6.1) through the raw syscall with our
 * own copy of the kernel's struct layout, and the memory barriers used to reap
 * completions from the mmapped AIO ring in user space. */
#ifndef AIONVME_COMPAT_H
#define AIONVME_COMPAT_H

#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/syscall.h>

#ifndef SYS_statx
#define SYS_statx 332 /* x86-64; other architectures define it in their headers */
#endif

/* struct statx as in include/uapi/linux/stat.h (Linux 6.1+), 256 bytes. */
struct aionvme_statx_timestamp { int64_t tv_sec; uint32_t tv_nsec; int32_t __reserved; };
struct aionvme_statx {
    uint32_t stx_mask, stx_blksize;
    uint64_t stx_attributes;
    uint32_t stx_nlink, stx_uid, stx_gid;
    uint16_t stx_mode, __spare0;
    uint64_t stx_ino, stx_size, stx_blocks, stx_attributes_mask;
    struct aionvme_statx_timestamp stx_atime, stx_btime, stx_ctime, stx_mtime;
    uint32_t stx_rdev_major, stx_rdev_minor, stx_dev_major, stx_dev_minor;
    uint64_t stx_mnt_id;
    uint32_t stx_dio_mem_align, stx_dio_offset_align;
    uint64_t __spare3[12];
};

#define AIONVME_STATX_BASIC 0x000007ffU
#define AIONVME_STATX_DIOALIGN 0x00002000U
#define AIONVME_AT_EMPTY_PATH 0x1000

/* statx(fd, "", AT_EMPTY_PATH): returns 0 or -errno. */
static inline int aionvme_fstatx(int fd, struct aionvme_statx *out) {
    memset(out, 0, sizeof(*out));
    long r = syscall(SYS_statx, fd, "", AIONVME_AT_EMPTY_PATH,
                     AIONVME_STATX_BASIC | AIONVME_STATX_DIOALIGN, out);
    return r < 0 ? -errno : 0;
}

/* The AIO completion ring that io_setup maps at the context address
 * (fs/aio.c, struct aio_ring). User space may consume events itself by
 * advancing head, which the kernel re-reads when it accounts free slots
 * (fs/aio.c: user_refill_reqs_available). */
struct aionvme_aio_ring {
    unsigned id, nr, head, tail, magic, compat_features, incompat_features, header_length;
};
#define AIONVME_AIO_RING_MAGIC 0xa10a10a1U

/* errno is thread-local: a worker clears it before a call that reports
 * failures as -1 + errno (Cython cannot assign the macro itself). */
static inline void aionvme_clear_errno(void) { errno = 0; }

#define aionvme_load_acquire(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define aionvme_atomic_load(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define aionvme_atomic_add(p, v) ((void)__atomic_fetch_add((p), (v), __ATOMIC_ACQ_REL))
#define aionvme_store_release(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

#endif
