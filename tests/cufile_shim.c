/* A stand-in for libcufile.so.0 that honours cuFile's documented contract
 * (cufile.h, cuFile 1.15) with host memory and POSIX I/O, so the engine's GDS
 * path (loading, driver reference count, handle registration, chunked
 * cuFileRead/cuFileWrite on workers, the three return conventions) is
 * exercised on machines without a GPU. Built by tests/test_gpu_cpu_side.py.
 *
 * Fault injection through the environment (read at each call):
 *   SHIM_FAIL="OFFSET:CODE"  a read/write covering file OFFSET returns -CODE
 *                            (CODE >= 5000: a CUfileOpError) or -1 with
 *                            errno = CODE (CODE < 5000)
 *   SHIM_OPEN_FAIL=CODE      cuFileDriverOpen fails with CODE
 *   SHIM_CLOSE_STDIN=1       cuFileDriverOpen closes fd 0 (seen in the wild)
 *   SHIM_COMPAT=1            the driver reports no nvidia-fs (compatibility mode)
 *   SHIM_DELAY_US=N          each read/write sleeps N microseconds first
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef struct { int err; int cu_err; } CUfileError_t;
typedef struct { int type; union { int fd; void *handle; } handle; const void *fs_ops; } CUfileDescr_t;
typedef struct {
    struct { unsigned major_version, minor_version; size_t poll_thresh_size, max_direct_io_size;
             unsigned dstatusflags, dcontrolflags; } nvfs;
    unsigned fflags, max_device_cache_size, per_buffer_cache_size, max_device_pinned_mem_size,
        max_batch_io_size, max_batch_io_timeout_msecs;
} CUfileDrvProps_t;

struct shim_handle { int fd; };

static long n_open, n_close, n_handles, n_bufs, n_reads, n_writes, inflight, max_inflight;
static void *bufs[64];

static CUfileError_t status(int err) { CUfileError_t e = {err, 0}; return e; }

static int env_int(const char *name) { const char *v = getenv(name); return v ? atoi(v) : 0; }

void shim_counts(long *out) {
    out[0] = n_open; out[1] = n_close; out[2] = n_handles; out[3] = n_bufs;
    out[4] = n_reads; out[5] = n_writes; out[6] = __atomic_load_n(&inflight, __ATOMIC_SEQ_CST);
    out[7] = max_inflight;
}

void shim_reset(void) { n_open = n_close = n_reads = n_writes = max_inflight = 0; }

CUfileError_t cuFileGetVersion(int *version) { *version = 1150; return status(0); }

CUfileError_t cuFileDriverOpen(void) {
    int fail = env_int("SHIM_OPEN_FAIL");
    if (env_int("SHIM_CLOSE_STDIN")) close(0);
    if (fail) return status(fail);
    n_open++;
    return status(0);
}

CUfileError_t cuFileDriverClose_v2(void) { n_close++; return status(0); }

CUfileError_t cuFileDriverGetProperties(CUfileDrvProps_t *p) {
    memset(p, 0, sizeof(*p));
    if (!env_int("SHIM_COMPAT")) { p->nvfs.major_version = 2; p->nvfs.minor_version = 17; }
    p->nvfs.dstatusflags = 1u << 4;                 /* CU_FILE_NVME_SUPPORTED */
    p->nvfs.dcontrolflags = 1u << 1;                /* CU_FILE_ALLOW_COMPAT_MODE */
    p->max_device_pinned_mem_size = 33554432;
    return status(0);
}

CUfileError_t cuFileHandleRegister(void **fh, CUfileDescr_t *d) {
    char path[64];
    int fl, fd;
    if (d->type != 1) return status(5022);                          /* CU_FILE_INVALID_VALUE */
    fl = fcntl(d->handle.fd, F_GETFL);
    if (fl < 0) return status(5022);
    if (!(fl & O_DIRECT)) return status(5019);                      /* CU_FILE_INVALID_FILE_OPEN_FLAG */
    snprintf(path, sizeof(path), "/proc/self/fd/%d", d->handle.fd);  /* host memory: no O_DIRECT */
    fd = open(path, (fl & O_ACCMODE) | O_CLOEXEC);
    if (fd < 0) return status(5030);
    struct shim_handle *h = malloc(sizeof(*h));
    h->fd = fd;
    *fh = h;
    n_handles++;
    return status(0);
}

void cuFileHandleDeregister(void *fh) {
    struct shim_handle *h = fh;
    close(h->fd);
    free(h);
    n_handles--;
}

CUfileError_t cuFileBufRegister(const void *buf, size_t length, int flags) {
    (void)length; (void)flags;
    for (int i = 0; i < 64; i++) if (bufs[i] == buf) return status(5023);  /* already registered */
    for (int i = 0; i < 64; i++) if (!bufs[i]) { bufs[i] = (void *)buf; n_bufs++; return status(0); }
    return status(5043);
}

CUfileError_t cuFileBufDeregister(const void *buf) {
    for (int i = 0; i < 64; i++) if (bufs[i] == buf) { bufs[i] = NULL; n_bufs--; return status(0); }
    return status(5022);
}

static ssize_t fault(off_t off, size_t size) {
    const char *v = getenv("SHIM_FAIL");
    long long at; int code;
    if (!v || sscanf(v, "%lld:%d", &at, &code) != 2) return 0;
    if (at < off || at >= off + (long long)size) return 0;
    if (code >= 5000) return -code;
    errno = code;
    return -1;
}

static void enter(void) {
    long now = __atomic_add_fetch(&inflight, 1, __ATOMIC_SEQ_CST), m;
    while ((m = __atomic_load_n(&max_inflight, __ATOMIC_SEQ_CST)) < now &&
           !__atomic_compare_exchange_n(&max_inflight, &m, now, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    if (env_int("SHIM_DELAY_US")) usleep(env_int("SHIM_DELAY_US"));
}

static void leave(void) { __atomic_sub_fetch(&inflight, 1, __ATOMIC_SEQ_CST); }

ssize_t cuFileRead(void *fh, void *base, size_t size, off_t off, off_t boff) {
    struct shim_handle *h = fh;
    ssize_t r;
    __atomic_add_fetch(&n_reads, 1, __ATOMIC_SEQ_CST);
    enter();
    r = fault(off, size);
    if (r == 0) r = pread(h->fd, (char *)base + boff, size, off);
    leave();
    return r;
}

ssize_t cuFileWrite(void *fh, const void *base, size_t size, off_t off, off_t boff) {
    struct shim_handle *h = fh;
    ssize_t r;
    __atomic_add_fetch(&n_writes, 1, __ATOMIC_SEQ_CST);
    enter();
    r = fault(off, size);
    if (r == 0) r = pwrite(h->fd, (const char *)base + boff, size, off);
    leave();
    return r;
}
