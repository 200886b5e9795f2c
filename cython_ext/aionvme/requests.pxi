# The objects Python code holds: Inode (per-file lock and size hint shared by
# every open of one file), FileHandle (an fd and how to serve it) and Request
# (one awaited call: a list of segments, its buffers pinned until finished).


cdef int64_t _INT64_MAX = 0x7fffffffffffffff
cdef long long _open_handles = 0   # FileHandles whose fd is still open (leak checks)
# Linux transfers at most this many bytes per read/write/AIO (MAX_RW_COUNT).
cdef int64_t _MAX_RW_COUNT = 0x7ffff000

cdef enum:
    # Engine.read/write mode bits; C constants, so that testing them per
    # request costs no Python integers (~200 instructions per read when they
    # were module globals)
    _MODE_SINGLE_SUBMIT = 1
    _MODE_NO_OVERLAP = 2
    _MODE_COPY = 4       # writes: every chunk through the engine's own buffers (see RF_COPY)
MODE_SINGLE_SUBMIT = _MODE_SINGLE_SUBMIT
MODE_NO_OVERLAP = _MODE_NO_OVERLAP
MODE_COPY = _MODE_COPY


def open_handles():
    """How many FileHandles hold an open fd (tests check this returns to its start)."""
    return _open_handles


# Every live InodeC, linked through all_next/all_prev under _inodes_mu: a
# forked child re-initialises their locks (fork.pxi), since a lock held by a
# parent's thread at fork() stays held in the child, where no thread will
# ever release it.
cdef pthread_mutex_t _inodes_mu
pthread_mutex_init(&_inodes_mu, NULL)
cdef InodeC *_inodes_head = NULL


cdef class Inode:
    """Per (st_dev, st_ino) state shared by all FileHandles of one file."""

    def __cinit__(self, long long known_size=0):
        global _inodes_head
        pthread_mutex_init(&self.c.lock, NULL)
        self.c.known_size = known_size
        with nogil:
            pthread_mutex_lock(&_inodes_mu)
            self.c.all_prev = NULL
            self.c.all_next = _inodes_head
            if _inodes_head != NULL:
                _inodes_head.all_prev = &self.c
            _inodes_head = &self.c
            pthread_mutex_unlock(&_inodes_mu)

    def __dealloc__(self):
        global _inodes_head
        with nogil:
            pthread_mutex_lock(&_inodes_mu)
            if self.c.all_prev != NULL:
                self.c.all_prev.all_next = self.c.all_next
            else:
                _inodes_head = self.c.all_next
            if self.c.all_next != NULL:
                self.c.all_next.all_prev = self.c.all_prev
            pthread_mutex_unlock(&_inodes_mu)
        pthread_mutex_destroy(&self.c.lock)

    @property
    def known_size(self):
        return self.c.known_size

    def reset_size(self, long long size):
        """Record the size the file has now (fstat at open, or after a truncate).

        known_size must never exceed the real size: a write believed to stay
        inside the file skips its preparation, and a read-modify-write that
        then trims the file back can cut off another write's bytes. A file
        shrinks behind our back when it is truncated, rewritten by another
        program, or deleted and its inode number reused.

        Called on the event loop's thread by every open: it never waits for
        a worker that holds the lock across disk I/O (a read-modify-write of
        an unaligned write's edge block: measured, an open stalled the loop
        for 258 ms behind a storm of them). Then the lock's holder records the
        size its own write leaves, and only a file that shrank (size below
        what is known) must wait to lower known_size."""
        if pthread_mutex_trylock(&self.c.lock) == 0:
            self.c.known_size = size
            pthread_mutex_unlock(&self.c.lock)
        elif size < aionvme_atomic_load(&self.c.known_size):
            with nogil:
                pthread_mutex_lock(&self.c.lock)
                self.c.known_size = size
                pthread_mutex_unlock(&self.c.lock)


cdef bint _ring_file(int fd) noexcept:
    """Whether io_uring may serve a buffered fd: a file with positions (a
    regular file or block device) whose "device" is not memory. On tmpfs and
    ramfs every read is a memcpy that io_uring would do inside io_uring_enter,
    on the event loop's thread: the worker pool copies those in parallel."""
    cdef stat st
    cdef statfs sf
    if fstat(fd, &st) != 0 or not (S_ISREG(st.st_mode) or S_ISBLK(st.st_mode)):
        return False
    if S_ISREG(st.st_mode):
        if fstatfs(fd, &sf) != 0:
            return False
        if sf.f_type == 0x01021994 or sf.f_type == 0x858458F6:   # TMPFS_MAGIC, RAMFS_MAGIC
            return False
    return True


cdef class FileHandle:
    """An open fd and the way the engine serves it.

    path_kind is PATH_AIO (O_DIRECT fd, kernel AIO) or PATH_THREAD (worker
    pool); align and mem_align are the O_DIRECT constraints (1 for a buffered
    fd). Closing with requests in flight is deferred until the last one
    finishes, so an fd number is never reused under a running transfer.
    """

    def __cinit__(self, int fd, object path, int path_kind, bint direct, bint readable,
                  bint writable, long long align, long long mem_align, Inode inode,
                  object owner=None):
        if align < 1 or mem_align < 1:
            raise ValueError("alignment must be >= 1")
        self.fd = fd
        self.path = path
        self.path_kind = path_kind
        self.direct = direct
        self.readable = readable
        self.writable = writable
        self.align = align
        self.mem_align = mem_align
        self.inode = inode
        self.owner = owner
        cdef stat st
        if fd >= 0:
            if fstat(fd, &st) == 0:
                self.st_dev = st.st_dev
                self.st_ino = st.st_ino
            global _open_handles
            _open_handles += 1
            if align == 1:
                # Only files with positions go to io_uring: on a pipe or a
                # character device IORING_OP_READ would consume data where
                # pread(2) refuses with ESPIPE (the worker path's answer).
                self.ring_ok = _ring_file(fd)

    def __dealloc__(self):
        # Last resort: a handle nobody closed (its File warned already). If the
        # fd was closed behind our back and its number now refers to another
        # file (a pipe, an eventfd, someone's open file), it is not ours to close.
        cdef stat st
        if self.fd >= 0 and not self.closed:
            _gds_drop_file(self)
            if fstat(self.fd, &st) == 0 and st.st_dev == self.st_dev and st.st_ino == self.st_ino:
                close(self.fd)
            self.fd = -1
            global _open_handles
            _open_handles -= 1

    cdef int _close_fd(self) except -1:
        global _open_handles
        cdef int fd = self.fd
        self.closed = True
        self.closing = False
        self.fd = -1
        if fd >= 0:
            _open_handles -= 1
            _gds_drop_file(self)   # cuFile lets go of the fd before it can be reused
            with nogil:
                rc = close(fd)
            if rc != 0 and errno != EINTR:
                _raise_errno(errno, self.path)
        return 0

    def close(self):
        """Close now, or when the last request on this fd finishes.
        Returns True if the fd is closed on return."""
        if self.closed:
            return True
        if self.active > 0:
            self.closing = True
            return False
        self._close_fd()
        return True

    def detach(self):
        """Forget the fd without closing it (a forked child's copy)."""
        global _open_handles
        if self.fd >= 0 and not self.closed:
            _open_handles -= 1
        self.fd = -1
        self.closed = True


@cython.freelist(128)
cdef class Request:
    """One call's worth of I/O on one FileHandle. Created by Engine methods."""

    def __dealloc__(self):
        self._release()
        if self.c.segs != NULL and self.c.segs != &self.seg0:
            free(self.c.segs)
        self.c.segs = NULL

    cdef void _release(self) noexcept:
        # The kernel is done with every segment: let the exporters go.
        cdef int i
        if self.views != NULL:
            for i in range(self.nviews):
                if <PyObject *>self.views[i].obj != NULL:
                    PyBuffer_Release(&self.views[i])
            if self.views != &self.view0:
                free(self.views)
            self.views = NULL
        self.keep = None

    cdef int _add_segment(self, object buf, object offset, bint writable) except -1:
        cdef int i = self.c.nsegs
        cdef char *addr
        cdef int64_t n
        cdef int64_t off = _file_offset(offset)
        memset(&self.views[i], 0, sizeof(Py_buffer))
        if _buffer_address(buf, writable, &self.views[i], &addr, &n):
            if self.keep is None:
                self.keep = []
            self.keep.append(buf)   # a tensor without the buffer protocol
        self.nviews = i + 1
        return self._put_segment(addr, 0, n, off)

    cdef int _put_segment(self, char *addr, int64_t boff, int64_t n, int64_t off) except -1:
        cdef int i = self.c.nsegs
        cdef Seg *s = &self.c.segs[i]
        if n > _INT64_MAX - off:
            raise _exc.InvalidOffsetError(f"offset {off} + {n} bytes overflows a 64-bit file offset")
        s.addr = addr
        s.boff = boff
        s.nbytes = n
        s.offset = off
        if i == 0:
            self.c.pos = off
        if n > 0 and off + n > self.c.end_max:   # an empty item extends nothing (like pwrite(2))
            self.c.end_max = off + n
        self.c.nsegs = i + 1
        return 0

    @property
    def nbytes(self):
        cdef int i
        cdef int64_t n = 0
        for i in range(self.c.nsegs):
            n += self.c.segs[i].nbytes
        return n

    @property
    def nsegments(self):
        return self.c.nsegs

    @property
    def op(self):
        return ("read", "write", "fsync", "fdatasync")[self.c.op]

    @property
    def finished(self):
        return bool(self.c.flags & RF_FINISHED)

    @property
    def cancelled(self):
        return bool(self.c.flags & RF_CANCELLED)

    @property
    def ok(self):
        return (self.c.flags & RF_FINISHED) and not (self.c.flags & (RF_CANCELLED | RF_SHORT_WRITE)) \
            and self.c.err == 0 and self.c.short_seg < 0

    def exception(self):
        """The error this finished request raises, or None."""
        cdef Seg *s
        cdef stat st
        cdef int fd = self.file.fd if self.file is not None else -1
        path = self.file.path if self.file is not None else None
        if self.c.err:
            if self.c.flags & RF_GDS:
                return _gds_error(self.c.err, path, self.c.err_off, self.nbytes,
                                  "cuFileWrite" if self.c.op == OP_WRITE else "cuFileRead")
            exc = _os_error(self.c.err, path, self.c.err_off, self.nbytes, self.op)
            if self.c.err in (EBADF, ESPIPE, EINVAL, EAGAIN) and fd >= 0:
                _explain_lost_fd(exc, fd)
            return exc
        if self.c.flags & RF_SHORT_WRITE:
            return _exc.ShortWriteError(path, self.c.err_off, self.nbytes)
        if self.c.short_seg >= 0:
            s = &self.c.segs[self.c.short_seg]
            size = None
            # The file's size now, when it agrees with what the read found
            # (the file may have grown since): the message states it.
            if fd >= 0 and fstat(fd, &st) == 0 and S_ISREG(st.st_mode) and st.st_size <= self.c.short_at:
                size = st.st_size
            return _exc.ShortReadError(path, s.offset, s.nbytes, self.c.short_at - s.offset,
                                       segment=self.c.short_seg if self.c.nsegs > 1 else None,
                                       file_size=size)
        return None


cdef int _explain_lost_fd(object exc, int fd) except -1:
    """EBADF, ESPIPE ("Illegal seek"), EINVAL or EAGAIN from a transfer whose fd no
    longer refers to a file (closed behind our back with os.close, its number
    maybe reused by a pipe, socket or eventfd): say so, as EBADF."""
    cdef stat st
    cdef int rc = fstat(fd, &st)
    if rc == 0 and (S_ISREG(st.st_mode) or S_ISBLK(st.st_mode)):
        return 0   # still a file: the errno stands (a misaligned transfer, say)
    what = "is closed" if rc != 0 else "now refers to something else (not a file)"
    exc.errno = EBADF
    exc.strerror = (f"{os.strerror(EBADF)}: the file descriptor was closed behind aionvme's back "
                    f"(fd {fd} {what}; was: {exc.strerror})")
    return 0


cdef int64_t _file_offset(object offset) except -1:
    """A file offset from an int (or numpy int): >= 0 and within 64 bits."""
    cdef int64_t off
    try:
        if type(offset) is not int:
            offset = _index(offset)   # ints and numpy ints, not floats
        off = offset
    except OverflowError:
        raise _exc.InvalidOffsetError(f"offset {offset} does not fit in a 64-bit file offset") from None
    except TypeError:
        raise TypeError(f"offset must be an int, got {type(offset).__name__}") from None
    if off < 0:
        raise _exc.InvalidOffsetError(f"offset must be >= 0, got {off}")
    return off


cdef bint _int64_format(const char *fmt) noexcept:
    """A buffer format of native 64-bit signed ints ('q', 'l' on LP64; '@'/'=' allowed)."""
    if fmt == NULL:
        return False
    if fmt[0] == b'@' or fmt[0] == b'=':
        fmt += 1
    return (fmt[0] == b'q' or (fmt[0] == b'l' and sizeof(long) == 8)) and fmt[1] == 0


cdef Request _rows_request(FileHandle f, int op, object buf, object offsets, int64_t block,
                           int max_inflight, int mode):
    """One request that moves row i of buf (buf.nbytes / len(offsets) bytes,
    in order) at offsets[i]: one buffer export for all of them, the offsets
    read in place from a contiguous 1-D array of 64-bit ints (any other
    sequence of ints is read item by item)."""
    cdef Py_buffer ov
    cdef const int64_t *o64 = NULL
    cdef Py_ssize_t n, i
    cdef int64_t row, off, nbytes
    cdef char *addr
    cdef Request req
    cdef list seq = None
    memset(&ov, 0, sizeof(Py_buffer))
    if PyObject_CheckBuffer(offsets):
        try:
            PyObject_GetBuffer(offsets, &ov, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT)
        except (BufferError, ValueError, TypeError):
            memset(&ov, 0, sizeof(Py_buffer))   # strided, say: read item by item
        else:
            if not (ov.ndim == 1 and ov.itemsize == 8 and _int64_format(ov.format)):
                PyBuffer_Release(&ov)
                memset(&ov, 0, sizeof(Py_buffer))
    try:
        if <PyObject *>ov.obj != NULL:
            o64 = <const int64_t *>ov.buf
            n = ov.len // 8
        else:
            seq = list(offsets)
            n = len(seq)
        if n > 0x7fffffff:
            raise ValueError(f"{n} rows in one request; at most {0x7fffffff}")
        # one segment per row, one view for all of them
        req = _new_request(f, op, 1, block, max_inflight, mode)
        if n > 1:
            req.c.segs = <Seg *>calloc(n, sizeof(Seg))
            if req.c.segs == NULL:
                raise MemoryError()
        memset(&req.view0, 0, sizeof(Py_buffer))
        if _buffer_address(buf, op == OP_READ, &req.view0, &addr, &nbytes):
            req.keep = [buf]   # a tensor without the buffer protocol
        req.nviews = 1
        if n == 0:
            if nbytes != 0:
                raise ValueError(f"no offsets for a buffer of {nbytes} bytes")
            return req
        if nbytes % n != 0:
            raise ValueError(f"a buffer of {nbytes} bytes does not split into {n} rows of equal size")
        row = nbytes // n
        for i in range(n):
            if o64 != NULL:
                off = o64[i]
                if off < 0:
                    raise _exc.InvalidOffsetError(f"offset must be >= 0, got {off} (row {i})")
            else:
                off = _file_offset(seq[i])
            req._put_segment(addr + i * row, 0, row, off)
        return req
    finally:
        if <PyObject *>ov.obj != NULL:
            PyBuffer_Release(&ov)


cdef Request _new_request(FileHandle f, int op, int nsegs, int64_t block, int max_inflight, int mode):
    if f.closed or f.closing:
        raise _exc.ClosedFileError(f"I/O on a closed file: {f.path!r}")
    if op == OP_READ and not f.readable:
        raise _exc.UnsupportedOperation(f"file not open for reading: {f.path!r}")
    if op == OP_WRITE and not f.writable:
        raise _exc.UnsupportedOperation(f"file not open for writing: {f.path!r}")
    cdef Request req = Request.__new__(Request)
    req.file = f
    memset(&req.c, 0, sizeof(ReqC))
    req.c.owner = <PyObject *>req
    req.c.op = op
    req.c.fd = f.fd
    req.c.path = f.path_kind
    if f.ring_ok:
        req.c.flags |= RF_RING_OK
    req.c.align = f.align
    req.c.mem_align = f.mem_align
    if block < f.align:
        block = f.align
    if block > _MAX_RW_COUNT:
        block = _MAX_RW_COUNT   # the kernel cuts every transfer there: chunks would come back short
    req.c.block = block - block % f.align
    req.c.max_inflight = max_inflight if max_inflight > 0 else 0x7fffffff
    req.c.inode = &f.inode.c if f.inode is not None else NULL
    req.c.short_seg = -1
    if mode & _MODE_SINGLE_SUBMIT:
        req.c.flags |= RF_SINGLE_SUBMIT
    if mode & _MODE_NO_OVERLAP:
        req.c.flags |= RF_NO_OVERLAP
    if mode & _MODE_COPY:
        req.c.flags |= RF_COPY
    if nsegs <= 1:
        req.c.segs = &req.seg0
        req.views = &req.view0
    else:
        req.c.segs = <Seg *>calloc(nsegs, sizeof(Seg))
        req.views = <Py_buffer *>calloc(nsegs, sizeof(Py_buffer))
        if req.c.segs == NULL or req.views == NULL:
            raise MemoryError()
    return req


# The engine's pending and finished lists of requests (doubly linked through ReqC).

cdef inline void _list_append(ReqC **head, ReqC **tail, ReqC *r) noexcept nogil:
    r.next = NULL
    r.prev = tail[0]
    if tail[0] != NULL:
        tail[0].next = r
    else:
        head[0] = r
    tail[0] = r


cdef inline void _list_remove(ReqC **head, ReqC **tail, ReqC *r) noexcept nogil:
    if r.prev != NULL:
        r.prev.next = r.next
    else:
        head[0] = r.next
    if r.next != NULL:
        r.next.prev = r.prev
    else:
        tail[0] = r.prev
    r.next = NULL
    r.prev = NULL
