# What the Python layer needs to know about an open file to choose its path.

def fstatx(int fd):
    """statx(fd) with STATX_DIOALIGN: a dict of dev, ino, size, mode,
    dio_reported (whether the kernel filled STATX_DIOALIGN), dio_mem_align and
    dio_offset_align (both 0 when not reported, or when reported and the file
    cannot do direct I/O)."""
    cdef aionvme_statx st
    cdef int rc
    with nogil:
        rc = aionvme_fstatx(fd, &st)
    if rc < 0:
        _raise_errno(-rc)
    dio = bool(st.stx_mask & AIONVME_STATX_DIOALIGN)
    return dict(dev=(st.stx_dev_major, st.stx_dev_minor), ino=st.stx_ino, size=st.stx_size,
                mode=st.stx_mode, blksize=st.stx_blksize,
                dio_reported=dio, dio_mem_align=st.stx_dio_mem_align if dio else 0,
                dio_offset_align=st.stx_dio_offset_align if dio else 0)


def fs_type(int fd):
    """statfs f_type of the filesystem holding fd (e.g. 0xEF53 for ext4)."""
    cdef statfs sf
    cdef int rc
    with nogil:
        rc = fstatfs(fd, &sf)
    if rc != 0:
        _raise_errno(errno)
    return <unsigned long>sf.f_type


def aio_probe():
    """Try io_setup(1)/io_destroy: None if kernel AIO works here, else the OSError."""
    cdef aio_context_t ctx = 0
    cdef long rc
    with nogil:
        rc = syscall(SYS_io_setup, <unsigned>1, &ctx)
    if rc < 0:
        return _os_error(errno, None, None, None, "io_setup")
    with nogil:
        syscall(SYS_io_destroy, ctx)
    return None


def uring_probe():
    """Set up an io_uring instance as the engine does (IORING_OP_READ/WRITE, a
    registered eventfd) and tear it down: None if that works here, else the
    OSError (ENOSYS, EPERM from seccomp or kernel.io_uring_disabled, EOPNOTSUPP
    before 5.6)."""
    cdef aionvme_uring u
    cdef int rc
    cdef int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
    if efd < 0:
        return _os_error(errno, None, None, None, "eventfd")
    with nogil:
        rc = aionvme_uring_init(&u, 1, efd, 0)
        if rc == 0:
            aionvme_uring_free(&u, 0)
        close(efd)
    if rc < 0:
        return _os_error(-rc, None, None, None, "io_uring_setup")
    return None


PAGE_SIZE = _PAGE
KERNEL_AIO = PATH_AIO  # FileHandle path_kind values
WORKER_POOL = PATH_THREAD
