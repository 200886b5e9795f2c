/* What io_uring's registered files, registered buffers and SQ polling save on
 * 4 KiB random reads, below aionvme's engine: the kernel side alone, in C, so
 * the difference is not lost in the Python layer's ~8 us per read.
 *
 *   cc -O2 -o /tmp/uring_registered bench/c/uring_registered.c
 *   /tmp/uring_registered FILE cached|direct QD NOPS plain|files|bufs|both|sqpoll
 *
 * Keeps QD reads of 4 KiB at random aligned offsets in flight (one
 * io_uring_enter per refill: submit what was reaped, wait for one), and prints
 * IOPS and CPU per read (getrusage of the whole process, so an SQPOLL thread's
 * CPU is counted). "cached" reads the page cache (warm the file first),
 * "direct" opens with O_DIRECT. Variants: plain (IORING_OP_READ on the fd, as
 * the engine does), files (the fd registered, IOSQE_FIXED_FILE), bufs
 * (IORING_REGISTER_BUFFERS + IORING_OP_READ_FIXED), both, sqpoll (plain with
 * IORING_SETUP_SQPOLL). Needs kernel headers with linux/io_uring.h (5.6+). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *sq_flags, *cq_head, *cq_tail, *cq_mask;
static struct io_uring_sqe *sqes;
static struct io_uring_cqe *cqes;
static unsigned local_tail;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double cpu(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_stime.tv_sec + (r.ru_utime.tv_usec + r.ru_stime.tv_usec) * 1e-6;
}

static uint64_t rng = 88172645463325252ULL;
static uint64_t next_block(uint64_t nblocks) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng % nblocks;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s FILE cached|direct QD NOPS plain|files|bufs|both|sqpoll\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    int direct = strcmp(argv[2], "direct") == 0;
    unsigned qd = (unsigned)atoi(argv[3]);
    long nops = atol(argv[4]);
    const char *v = argv[5];
    int ffile = !strcmp(v, "files") || !strcmp(v, "both");
    int fbuf = !strcmp(v, "bufs") || !strcmp(v, "both");
    int sqpoll = !strcmp(v, "sqpoll");

    int fd = open(path, O_RDONLY | (direct ? O_DIRECT : 0));
    if (fd < 0) die("open");
    struct stat st;
    fstat(fd, &st);
    uint64_t nblocks = (uint64_t)st.st_size / 4096;

    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = qd * 2;
    if (sqpoll) {
        p.flags |= IORING_SETUP_SQPOLL;
        p.sq_thread_idle = 50;   /* ms */
    }
    int rfd = (int)syscall(__NR_io_uring_setup, qd, &p);
    if (rfd < 0) die("io_uring_setup");
    size_t sqsz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cqsz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (cqsz > sqsz) sqsz = cqsz;   /* IORING_FEAT_SINGLE_MMAP (5.4+) */
    char *sq = mmap(NULL, sqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, rfd, IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) die("mmap sq");
    sqes = mmap(NULL, p.sq_entries * sizeof(*sqes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, rfd,
                IORING_OFF_SQES);
    if (sqes == MAP_FAILED) die("mmap sqes");
    sq_head = (unsigned *)(sq + p.sq_off.head);
    sq_tail = (unsigned *)(sq + p.sq_off.tail);
    sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    sq_array = (unsigned *)(sq + p.sq_off.array);
    sq_flags = (unsigned *)(sq + p.sq_off.flags);
    cq_head = (unsigned *)(sq + p.cq_off.head);
    cq_tail = (unsigned *)(sq + p.cq_off.tail);
    cq_mask = (unsigned *)(sq + p.cq_off.ring_mask);
    cqes = (struct io_uring_cqe *)(sq + p.cq_off.cqes);
    local_tail = *sq_tail;

    char *bufs;
    if (posix_memalign((void **)&bufs, 4096, (size_t)qd * 4096)) die("posix_memalign");
    memset(bufs, 0, (size_t)qd * 4096);
    if (fbuf) {
        struct iovec iov = {bufs, (size_t)qd * 4096};
        if (syscall(__NR_io_uring_register, rfd, IORING_REGISTER_BUFFERS, &iov, 1) < 0) die("register buffers");
    }
    if (ffile) {
        if (syscall(__NR_io_uring_register, rfd, IORING_REGISTER_FILES, &fd, 1) < 0) die("register files");
    }

    long issued = 0, done = 0;
    unsigned to_submit = 0;
#define PUSH(slot)                                                                    \
    do {                                                                              \
        struct io_uring_sqe *e = &sqes[local_tail & *sq_mask];                        \
        memset(e, 0, sizeof(*e));                                                     \
        e->opcode = fbuf ? IORING_OP_READ_FIXED : IORING_OP_READ;                     \
        e->fd = ffile ? 0 : fd;                                                       \
        e->flags = ffile ? IOSQE_FIXED_FILE : 0;                                      \
        e->addr = (uint64_t)(uintptr_t)(bufs + (size_t)(slot) * 4096);                \
        e->len = 4096;                                                                \
        e->off = next_block(nblocks) * 4096;                                          \
        e->buf_index = 0;                                                             \
        e->user_data = (slot);                                                        \
        sq_array[local_tail & *sq_mask] = local_tail & *sq_mask;                      \
        local_tail++;                                                                 \
        to_submit++;                                                                  \
        issued++;                                                                     \
    } while (0)

    double t0 = now(), c0 = cpu();
    for (unsigned i = 0; i < qd && issued < nops; i++)
        PUSH(i);
    while (done < nops) {
        unsigned flags = IORING_ENTER_GETEVENTS;
        __atomic_store_n(sq_tail, local_tail, __ATOMIC_RELEASE);
        if (sqpoll) {
            if (__atomic_load_n(sq_flags, __ATOMIC_ACQUIRE) & IORING_SQ_NEED_WAKEUP)
                flags |= IORING_ENTER_SQ_WAKEUP;
            to_submit = 0;
        }
        unsigned head = *cq_head, tail = __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE);
        if (head == tail || to_submit) {
            int r = (int)syscall(__NR_io_uring_enter, rfd, to_submit, head == tail ? 1 : 0, flags, NULL, 0);
            if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) die("io_uring_enter");
            to_submit = 0;
        }
        tail = __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail) {
            struct io_uring_cqe *c = &cqes[head & *cq_mask];
            if (c->res != 4096) {
                fprintf(stderr, "read returned %d\n", c->res);
                return 1;
            }
            unsigned slot = (unsigned)c->user_data;
            head++;
            done++;
            if (issued < nops)
                PUSH(slot);
        }
        __atomic_store_n(cq_head, head, __ATOMIC_RELEASE);
    }
    double dt = now() - t0, dc = cpu() - c0;
    printf("%-6s %-6s qd=%-3u %9.0f IOPS %6.3f us CPU/read\n", argv[2], v, qd, nops / dt, dc / nops * 1e6);
    return 0;
}
