/* faultfs: a FUSE passthrough filesystem that injects faults, for aionvme's
 * fault tests. Every file in the mount is the file of the same name in the
 * backing directory; reads and writes can be made slow, fail with EIO inside a
 * byte range.
 *
 *   faultfs BACKING MOUNTPOINT [-f] [-o ...] [--delay-us=N] [--eio-start=A --eio-end=B]
 *
 *   --delay-us=N   sleep N microseconds in every read and write
 *   --eio-start/--eio-end
 *                  reads and writes that touch [A, B) fail with EIO
 *   flush_eio      (control file only) close(2) of a file fails with EIO, as
 *                  NFS does when write-back failed
 *
 * Faults can be changed while mounted by writing "delay_us eio_start eio_end [flush_eio]\n" to BACKING/.faultfs-control and then stat()ing MOUNTPOINT/.reload.
 *
 * (No short-read fault: FUSE's contract is that a short answer means EOF, and
 * the kernel pads the page cache with zeros after one, so a daemon answering
 * short mid-file hands every reader zeros as data; nothing to test there.)
 *
 * Build: gcc -O2 -Wall faultfs.c $(pkg-config --cflags --libs fuse3) -o faultfs
 */
#define FUSE_USE_VERSION 31
#define _GNU_SOURCE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

struct options {
    const char *backing;
    long delay_us;
    long long eio_start;
    long long eio_end;
    int flush_eio;
};

static struct options opt = {NULL, 0, -1, -1, 0};
static int backing_fd = -1;

#define OPTION(t, p) {t, offsetof(struct options, p), 1}
static const struct fuse_opt option_spec[] = {
    OPTION("--delay-us=%ld", delay_us),
    OPTION("--eio-start=%lld", eio_start),
    OPTION("--eio-end=%lld", eio_end),
    FUSE_OPT_END,
};

static void reload(void) {
    char buf[256];
    int fd = openat(backing_fd, ".faultfs-control", O_RDONLY);
    if (fd < 0)
        return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return;
    buf[n] = 0;
    long d;
    long long a, b;
    int f = 0;
    if (sscanf(buf, "%ld %lld %lld %d", &d, &a, &b, &f) >= 3) {
        __atomic_store_n(&opt.delay_us, d, __ATOMIC_RELAXED);
        __atomic_store_n(&opt.eio_start, a, __ATOMIC_RELAXED);
        __atomic_store_n(&opt.eio_end, b, __ATOMIC_RELAXED);
        __atomic_store_n(&opt.flush_eio, f, __ATOMIC_RELAXED);
    }
}

static const char *rel(const char *path) {
    /* FUSE paths start with '/'; the backing directory is opened as backing_fd. */
    return path[1] ? path + 1 : ".";
}

static void delay(void) {
    long us = __atomic_load_n(&opt.delay_us, __ATOMIC_RELAXED);
    if (us > 0) {
        struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
}

static int in_eio_range(off_t off, size_t size) {
    long long a = __atomic_load_n(&opt.eio_start, __ATOMIC_RELAXED);
    long long b = __atomic_load_n(&opt.eio_end, __ATOMIC_RELAXED);
    return a >= 0 && b > a && (long long)off < b && (long long)(off + size) > a;
}

static void *ff_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
    (void)conn;
    cfg->use_ino = 1;
    cfg->entry_timeout = 0;
    cfg->attr_timeout = 0;
    cfg->negative_timeout = 0;
    return NULL;
}

static int ff_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    if (strcmp(path, "/.reload") == 0) {
        reload();
        return -ENOENT;
    }
    int r = fi ? fstat((int)fi->fh, st) : fstatat(backing_fd, rel(path), st, AT_SYMLINK_NOFOLLOW);
    return r == 0 ? 0 : -errno;
}

static int ff_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags) {
    (void)off;
    (void)fi;
    (void)flags;
    int fd = openat(backing_fd, rel(path), O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return -errno;
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -errno;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, ".faultfs", 8) == 0)
            continue;
        if (fill(buf, e->d_name, NULL, 0, 0))
            break;
    }
    closedir(d);
    return 0;
}

static int open_flags(int flags) {
    /* The backing file is opened buffered: O_DIRECT is what the FUSE client
     * asked of this filesystem, not of the backing one. */
    return flags & ~(O_DIRECT | O_NOFOLLOW);
}

static int ff_open(const char *path, struct fuse_file_info *fi) {
    int fd = openat(backing_fd, rel(path), open_flags(fi->flags));
    if (fd < 0)
        return -errno;
    fi->fh = (uint64_t)fd;
    return 0;
}

static int ff_create(const char *path, mode_t mode, struct fuse_file_info *fi) {
    int fd = openat(backing_fd, rel(path), open_flags(fi->flags) | O_CREAT, mode);
    if (fd < 0)
        return -errno;
    fi->fh = (uint64_t)fd;
    return 0;
}

static int ff_read(const char *path, char *buf, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)path;
    delay();
    if (in_eio_range(off, size))
        return -EIO;
    ssize_t r = pread((int)fi->fh, buf, size, off);
    return r < 0 ? -errno : (int)r;
}

static int ff_write(const char *path, const char *buf, size_t size, off_t off,
                    struct fuse_file_info *fi) {
    (void)path;
    delay();
    if (in_eio_range(off, size))
        return -EIO;
    ssize_t r = pwrite((int)fi->fh, buf, size, off);
    return r < 0 ? -errno : (int)r;
}

static int ff_truncate(const char *path, off_t size, struct fuse_file_info *fi) {
    if (fi)
        return ftruncate((int)fi->fh, size) == 0 ? 0 : -errno;
    int fd = openat(backing_fd, rel(path), O_WRONLY);
    if (fd < 0)
        return -errno;
    int r = ftruncate(fd, size) == 0 ? 0 : -errno;
    close(fd);
    return r;
}

static int ff_fallocate(const char *path, int mode, off_t off, off_t len, struct fuse_file_info *fi) {
    (void)path;
    return fallocate((int)fi->fh, mode, off, len) == 0 ? 0 : -errno;
}

static int ff_fsync(const char *path, int datasync, struct fuse_file_info *fi) {
    (void)path;
    int r = datasync ? fdatasync((int)fi->fh) : fsync((int)fi->fh);
    return r == 0 ? 0 : -errno;
}

static int ff_flush(const char *path, struct fuse_file_info *fi) {
    (void)path;
    (void)fi;
    return __atomic_load_n(&opt.flush_eio, __ATOMIC_RELAXED) ? -EIO : 0;
}

static int ff_release(const char *path, struct fuse_file_info *fi) {
    (void)path;
    close((int)fi->fh);
    return 0;
}

static int ff_unlink(const char *path) {
    return unlinkat(backing_fd, rel(path), 0) == 0 ? 0 : -errno;
}

static int ff_rename(const char *from, const char *to, unsigned int flags) {
    return renameat2(backing_fd, rel(from), backing_fd, rel(to), flags) == 0 ? 0 : -errno;
}

static int ff_chmod(const char *path, mode_t mode, struct fuse_file_info *fi) {
    int r = fi ? fchmod((int)fi->fh, mode) : fchmodat(backing_fd, rel(path), mode, 0);
    return r == 0 ? 0 : -errno;
}

static const struct fuse_operations ops = {
    .init = ff_init,
    .getattr = ff_getattr,
    .readdir = ff_readdir,
    .open = ff_open,
    .create = ff_create,
    .read = ff_read,
    .write = ff_write,
    .truncate = ff_truncate,
    .fallocate = ff_fallocate,
    .fsync = ff_fsync,
    .flush = ff_flush,
    .release = ff_release,
    .unlink = ff_unlink,
    .rename = ff_rename,
    .chmod = ff_chmod,
};

int main(int argc, char *argv[]) {
    struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
    if (fuse_opt_parse(&args, &opt, option_spec, NULL) == -1)
        return 1;
    /* The first non-option argument is the backing directory. */
    if (args.argc < 3) {
        fprintf(stderr, "usage: %s BACKING MOUNTPOINT [options]\n", argv[0]);
        return 1;
    }
    opt.backing = args.argv[1];
    backing_fd = open(opt.backing, O_RDONLY | O_DIRECTORY);
    if (backing_fd < 0) {
        perror(opt.backing);
        return 1;
    }
    for (int i = 1; i + 1 < args.argc; i++)
        args.argv[i] = args.argv[i + 1];
    args.argc--;
    int r = fuse_main(args.argc, args.argv, &ops, NULL);
    fuse_opt_free_args(&args);
    return r;
}
