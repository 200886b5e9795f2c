/* The device's answer to the shape of a 4 KiB random-read stream, without aionvme.
 *
 * Kernel AIO, O_DIRECT, QD reads always owed to the device; what varies is how a
 * completion is waited for and how its replacement is submitted:
 *
 *   fio          io_getevents(min 1) blocks; one io_submit per replacement
 *                (fio's libaio default: iodepth_batch_submit=1, complete_min=1)
 *   fio-group    io_getevents(min 1) blocks; the replacements of one reap go in
 *                calls of 4, 8, 16, ... (aionvme's ramp)
 *   loop         epoll_wait on an eventfd the iocbs signal, the eventfd read, the
 *                completions reaped from the mmapped ring, the replacements in
 *                calls of 4, 8, 16, ...: what aionvme's reactor does per wakeup
 *   loop-single  the same wakeup, one io_submit per replacement
 *   spin         the mmapped ring polled without sleeping, one io_submit per
 *                replacement (a core burnt for the lowest refill latency)
 *   gather       the loop's wakeup; each completion's replacement is queued after
 *                SPIN_NS of busy work (a task's step: what Python spends per read)
 *                and every 4 queued go in at once, in one call: the shape of 64
 *                coroutines awaiting aionvme reads (submit_batch 4, ramp 4;
 *                GATHER_BATCH=N in the environment queues N instead of 4, 12 being
 *                submit_batch's old default (bench/JOURNAL.md, 2026-12-03);
 *                GATHER_FIRST=F makes each wakeup's first group F, doubling up to N)
 *
 * RAMP=R (default 4, aionvme's submit_ramp; 8 was its old default, bench/JOURNAL.md,
 * 2026-12-03) is the first call's count of iocbs in the grouped shapes,
 * doubling in each next call; RAMP_FIXED=1 keeps every call at R.
 *
 * SPIN_NS (the 6th argument, default 0) is busy work per completion before its
 * replacement is queued, in every mode: what the host spends per read beyond the
 * shape's syscalls. IOPS against SPIN_NS is how much the disk's rate depends on
 * the host's time per read.
 *
 * Prints IOPS, CPU per read (getrusage), context switches, and the block device's
 * own time per read from /sys/block/DEV/stat (reads in the device by Little's law);
 * then the longest step: the time from a wait's return (epoll_wait, io_getevents, or
 * a poll of the ring that found completions) to the next wait, with the thread's CPU
 * time in it, and how many steps took over 5 ms: what an event loop would count as
 * the stall of its callback, for a program with no Python in it.
 *
 *   cc -O2 -o /tmp/aio_shape bench/c/aio_shape.c
 *   /tmp/aio_shape FILE MODE [QD=64] [READS=100000] [DEV=vda] [SPIN_NS=0]
 *
 * Raw syscalls: no libaio needed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct aio_ring {
    unsigned id, nr, head, tail, magic, compat_features, incompat_features, header_length;
    struct io_event events[];
};

static aio_context_t ctx;
static struct iocb *cbs;
static void *bufs;
static int fd, efd;
static long long nblocks;
static uint64_t rng = 88172645463325252ULL;

static long long rnd(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (long long)(rng % (uint64_t)nblocks);
}

static void prep(int i, int resfd) {
    struct iocb *cb = &cbs[i];
    memset(cb, 0, sizeof(*cb));
    cb->aio_lio_opcode = IOCB_CMD_PREAD;
    cb->aio_fildes = fd;
    cb->aio_buf = (uint64_t)(uintptr_t)((char *)bufs + (size_t)i * 4096);
    cb->aio_nbytes = 4096;
    cb->aio_offset = rnd() * 4096;
    cb->aio_data = i;
    if (resfd) {
        cb->aio_flags = IOCB_FLAG_RESFD;
        cb->aio_resfd = efd;
    }
}

static int ramp_fixed;   /* RAMP_FIXED=1: calls of `ramp` iocbs each, not doubling */

static void submit(struct iocb **list, int n, int ramp) {
    int i = 0, cap = ramp > 0 ? ramp : n;
    while (i < n) {
        int k = n - i < cap ? n - i : cap;
        long rc = syscall(SYS_io_submit, ctx, (long)k, &list[i]);
        if (rc <= 0) { perror("io_submit"); exit(1); }
        i += (int)rc;
        if (cap < n && !ramp_fixed) cap *= 2;
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double thread_cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void busy(long ns) {
    if (ns <= 0) return;
    double end = now() + ns * 1e-9;
    while (now() < end) {}
}

static void devstat(const char *dev, long long *ios, long long *ticks) {
    char path[256];
    snprintf(path, sizeof path, "/sys/block/%s/stat", dev);
    FILE *f = fopen(path, "r");
    *ios = *ticks = 0;
    if (!f) return;
    long long v[4];
    if (fscanf(f, "%lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3]) == 4) {
        *ios = v[0];
        *ticks = v[3];
    }
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s FILE fio|fio-group|loop|loop-single|spin|gather [QD] [READS] [DEV] [SPIN_NS]\n", argv[0]);
        return 2;
    }
    const char *mode = argv[2];
    int qd = argc > 3 ? atoi(argv[3]) : 64;
    long long total = argc > 4 ? atoll(argv[4]) : 100000;
    const char *dev = argc > 5 ? argv[5] : "vda";
    long spin_ns = argc > 6 ? atol(argv[6]) : 0;
    int gather = !strcmp(mode, "gather");
    /* RAMP=R: the first call of a group has R iocbs, doubling (4, aionvme's submit_ramp) */
    int ramp = getenv("RAMP") ? atoi(getenv("RAMP")) : 4;
    ramp_fixed = getenv("RAMP_FIXED") && atoi(getenv("RAMP_FIXED"));
    int gather_batch = getenv("GATHER_BATCH") ? atoi(getenv("GATHER_BATCH")) : 4;
    if (gather_batch < 1) gather_batch = 1;
    /* GATHER_FIRST=F: each wakeup's first group is F, doubling up to the batch */
    int gather_first = getenv("GATHER_FIRST") ? atoi(getenv("GATHER_FIRST")) : gather_batch;
    if (gather_first < 1 || gather_first > gather_batch) gather_first = gather_batch;
    int loop = !strncmp(mode, "loop", 4) || gather, spin = !strcmp(mode, "spin");
    int single = !strcmp(mode, "fio") || !strcmp(mode, "loop-single") || spin;
    if (!loop && !spin && strcmp(mode, "fio") && strcmp(mode, "fio-group")) {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    fd = open(argv[1], O_RDONLY | O_DIRECT);
    if (fd < 0) { perror(argv[1]); return 1; }
    struct stat st;
    fstat(fd, &st);
    nblocks = st.st_size / 4096;
    rng ^= (uint64_t)getpid() << 20 ^ (uint64_t)time(NULL);
    if (posix_memalign(&bufs, 4096, (size_t)qd * 4096)) return 1;
    memset(bufs, 0, (size_t)qd * 4096);
    cbs = calloc(qd, sizeof *cbs);
    struct iocb **list = calloc(qd, sizeof *list);
    struct io_event *evs = calloc(qd, sizeof *evs);
    if (syscall(SYS_io_setup, qd, &ctx) < 0) { perror("io_setup"); return 1; }
    struct aio_ring *ring = (struct aio_ring *)ctx;
    int ep = -1;
    if (loop) {
        efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        ep = epoll_create1(0);
        struct epoll_event e = {.events = EPOLLIN};
        epoll_ctl(ep, EPOLL_CTL_ADD, efd, &e);
    }

    struct rusage r0, r1;
    long long ios0, ticks0, ios1, ticks1;
    devstat(dev, &ios0, &ticks0);
    getrusage(RUSAGE_SELF, &r0);
    double t0 = now();
    for (int i = 0; i < qd; i++) { prep(i, loop); list[i] = &cbs[i]; }
    submit(list, qd, single ? 1 : ramp);
    long long issued = qd, done = 0;
    double step_max = 0, step_max_cpu = 0;
    long long steps_over_5ms = 0;
    while (done < total) {
        int n = 0;
        double s0 = 0, c0 = 0;
        if (loop || spin) {
            if (loop) {
                struct epoll_event e;
                uint64_t v;
                if (epoll_wait(ep, &e, 1, -1) < 0) { if (errno == EINTR) continue; perror("epoll_wait"); return 1; }
                s0 = now(), c0 = thread_cpu();
                if (read(efd, &v, 8) < 0 && errno != EAGAIN) { perror("read"); return 1; }
            }
            unsigned head = ring->head, tail = __atomic_load_n(&ring->tail, __ATOMIC_ACQUIRE);
            while (head != tail && n < qd) {
                evs[n++] = ring->events[head];
                if (++head >= ring->nr) head = 0;
            }
            __atomic_store_n(&ring->head, head, __ATOMIC_RELEASE);
            if (spin && n) s0 = now(), c0 = thread_cpu();
        } else {
            long rc = syscall(SYS_io_getevents, ctx, 1L, (long)qd, evs, NULL);
            if (rc < 0) { if (errno == EINTR) continue; perror("io_getevents"); return 1; }
            n = (int)rc;
            s0 = now(), c0 = thread_cpu();
        }
        if (n == 0) continue;   /* a poll or wakeup that found nothing: not a step */
        int k = 0, cur_batch = gather_first;
        for (int j = 0; j < n; j++) {
            if ((long long)evs[j].res != 4096) { fprintf(stderr, "read failed: %lld\n", (long long)evs[j].res); return 1; }
            done++;
            if (issued < total) {
                int i = (int)evs[j].data;
                busy(spin_ns);
                prep(i, loop);
                issued++;
                if (single) submit(&(struct iocb *){&cbs[i]}, 1, 1);
                else list[k++] = &cbs[i];
                if (gather && k == cur_batch) {
                    submit(list, k, ramp);
                    k = 0;
                    if (cur_batch < gather_batch) cur_batch = cur_batch * 2 < gather_batch ? cur_batch * 2 : gather_batch;
                }
            }
        }
        if (k) submit(list, k, ramp);
        double step = now() - s0;
        if (step > 5e-3) steps_over_5ms++;
        if (step > step_max) { step_max = step; step_max_cpu = thread_cpu() - c0; }
    }
    double dt = now() - t0;
    getrusage(RUSAGE_SELF, &r1);
    devstat(dev, &ios1, &ticks1);
    double cpu = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_stime.tv_sec - r0.ru_stime.tv_sec)
               + ((r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) + (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec)) * 1e-6;
    double usr = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) * 1e-6;
    long long dios = ios1 - ios0, dticks = ticks1 - ticks0;
    double devt = dios ? dticks * 1000.0 / dios : 0;   /* µs per read in the device */
    printf("%-12s spin %5ld ns  qd %3d  %8.0f IOPS  cpu %.2f us/read (user %.2f)  csw %ld  device %.0f us/read, %.1f in device\n",
           mode, spin_ns, qd, total / dt, cpu / total * 1e6, usr / total * 1e6,
           (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw),
           devt, devt * 1e-6 * total / dt);
    printf("longest step %.2f ms (thread cpu %.2f ms), steps over 5 ms %lld\n",
           step_max * 1e3, step_max_cpu * 1e3, steps_over_5ms);
    return 0;
}
