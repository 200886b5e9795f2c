# The worker pool. Workers run chunks that kernel AIO cannot serve without
# blocking the submitter: buffered I/O (io_submit on a buffered fd is fully
# synchronous), read-modify-write of partial blocks, fallocate before extending
# writes, fsync, and everything when io_setup is refused. They finish a job
# exactly as the kernel finishes an iocb: store res, then bump the eventfd.

cdef inline int64_t _full_pread(int fd, char *buf, int64_t n, int64_t off, int64_t align) noexcept nogil:
    # Loops over short counts; stops at EOF. Returns bytes read or -errno.
    # An error after a partial count is still an error: reported as a short
    # count it would read as "the file ends here" (and a read-modify-write
    # would zero-fill the bytes it could not read and write them back).
    # After a short count each retry starts at the `align`-aligned position
    # at or below what arrived (re-reading a few bytes): on an O_DIRECT fd a
    # retry at the unaligned end of a short read gives EINVAL, not EOF. align
    # is the fd's own O_DIRECT offset alignment (the request's; 1 when buffered).
    cdef int64_t done = 0, at
    cdef ssize_t r
    while done < n:
        at = done - done % align
        r = pread(fd, buf + at, n - at, off + at)
        if r < 0:
            if errno == EINTR:
                continue
            return -errno
        if at + r <= done:
            break   # nothing new: the end of the file
        done = at + r
    return done


cdef inline int64_t _full_pwrite(int fd, const char *buf, int64_t n, int64_t off,
                                 int64_t align) noexcept nogil:
    # Loops over short counts like _full_pread, restarting at the aligned
    # position at or below what was written (rewriting a few bytes with the
    # same data): on an O_DIRECT fd a retry at an unaligned position answers
    # EINVAL, which would hide the real cause of the short count (ENOSPC).
    cdef int64_t done = 0, at
    cdef ssize_t r
    while done < n:
        at = done - done % align
        r = pwrite(fd, buf + at, n - at, off + at)
        if r < 0:
            if errno == EINTR:
                continue
            return -errno
        if at + r <= done:
            break   # no progress
        done = at + r
    return done


cdef int64_t _job_prep(Chunk *ch) noexcept nogil:
    # Make [foff, foff+len) part of the file before O_DIRECT writes land there:
    # ext4 runs extending O_DIRECT writes synchronously inside io_submit, so
    # without this the event loop would block for the whole write. fallocate
    # also reports ENOSPC before any data is written.
    cdef InodeC *ino = ch.req.inode
    cdef stat st
    cdef int64_t res = 0
    cdef int64_t start, end = ch.foff + ch.len
    pthread_mutex_lock(&ino.lock)
    if fstat(ch.fd, &st) != 0:
        res = -errno
    elif not S_ISREG(st.st_mode):
        # a block device: its size is fixed and st_size is 0; there is nothing
        # to allocate (writes past its end fail by themselves)
        if end > ino.known_size:
            ino.known_size = end
    elif end > st.st_size:
        start = ch.foff if ch.foff > st.st_size else st.st_size
        if fallocate(ch.fd, 0, start, end - start) != 0:
            if errno == EOPNOTSUPP:
                # e.g. tmpfs without size, NFS < 4.2: a sparse extension still
                # makes the writes non-extending.
                if ftruncate(ch.fd, end) != 0:
                    res = -errno
            else:
                res = -errno
                # ext4 keeps what a failed fallocate managed to allocate and
                # moves i_size to it (measured: ENOSPC left 3.8 MiB of zeros
                # past the old end). Nothing of the caller's was written: give
                # the file back its old size.
                if ftruncate(ch.fd, st.st_size) != 0:
                    pass   # the ENOSPC/EIO already reported says enough
        if res == 0 and end > ino.known_size:
            ino.known_size = end
    elif st.st_size > ino.known_size:
        ino.known_size = st.st_size
    pthread_mutex_unlock(&ino.lock)
    return res


cdef int64_t _job_rmw(Chunk *ch) noexcept nogil:
    # Write ulen user bytes into the middle of one aligned block [foff, foff+len)
    # on an O_DIRECT fd: read the block, merge, write it back. Serialized per
    # inode so two requests that share a boundary block never lose each other's
    # bytes. Writing the whole block may push the size past what anyone asked
    # for (a file ending mid-block): cut it back to the larger of the old size
    # and the end of the user's bytes.
    cdef InodeC *ino = ch.req.inode
    cdef stat st
    cdef int64_t r, size0, uend, want
    cdef int64_t res = ch.len
    pthread_mutex_lock(&ino.lock)
    if fstat(ch.fd, &st) != 0:
        res = -errno
    else:
        size0 = st.st_size
        r = _full_pread(ch.fd, ch.bounce, ch.len, ch.foff, ch.req.align)
        if r < 0:
            res = r
        else:
            if r < ch.len:
                memset(ch.bounce + r, 0, ch.len - r)
            memcpy(ch.bounce + ch.uskip, ch.user, ch.ulen)
            r = _full_pwrite(ch.fd, ch.bounce, ch.len, ch.foff, ch.req.align)
            if r < 0:
                res = r
            elif r < ch.len:
                res = r   # short write: reported by the completion
            elif S_ISREG(st.st_mode):   # (a block device has no size to trim)
                uend = ch.foff + ch.uskip + ch.ulen
                want = size0 if size0 > uend else uend
                if ch.foff + ch.len > want:
                    if ftruncate(ch.fd, want) != 0:
                        res = -errno
                if want > ino.known_size:
                    ino.known_size = want
    pthread_mutex_unlock(&ino.lock)
    return res


cdef inline int64_t _bounce_got(Chunk *ch, int64_t res) noexcept nogil:
    # Of a bounce read that returned res bytes from foff, how many of the
    # caller's ulen bytes (starting uskip into the block) arrived.
    cdef int64_t got = res - ch.uskip
    if got > ch.ulen:
        got = ch.ulen
    return got if got > 0 else 0


cdef inline void _drain(Chunk *ch, int64_t res) noexcept nogil:
    cdef int64_t got = _bounce_got(ch, res)
    if got > 0:
        memcpy(ch.user, ch.bounce + ch.uskip, got)
    ch.phase = PH_DRAINED


cdef int64_t _run_job(Chunk *ch) noexcept nogil:
    cdef int64_t r
    if ch.phase == PH_DRAIN:          # an AIO read landed in the bounce buffer
        _drain(ch, ch.res)
        return ch.res
    if ch.phase == PH_FILL:
        memcpy(ch.bounce, ch.user, ch.ulen)
        ch.phase = PH_FILLED
        if ch.kind == KIND_AIO:
            return 0                  # back to the engine, which submits the write
    if ch.op == CH_GDS_READ or ch.op == CH_GDS_WRITE:
        return _gds_job(ch)
    if ch.op == CH_READ:
        r = _full_pread(ch.fd, ch.buf, ch.len, ch.foff, ch.req.align)
        if ch.user != NULL and r >= 0:
            _drain(ch, r)
        return r
    if ch.op == CH_WRITE:
        return _full_pwrite(ch.fd, ch.buf, ch.len, ch.foff, ch.req.align)
    if ch.op == CH_RMW:
        return _job_rmw(ch)
    if ch.op == CH_PREP:
        return _job_prep(ch)
    if ch.op == CH_FSYNC:
        return 0 if fsync(ch.fd) == 0 else -errno
    if ch.op == CH_FDATASYNC:
        return 0 if fdatasync(ch.fd) == 0 else -errno
    return -EINVAL


cdef void *_worker_main(void *arg) noexcept nogil:
    cdef Pool *p = <Pool *>arg
    cdef Chunk *ch
    cdef uint64_t one = 1
    while True:
        pthread_mutex_lock(&p.mu)
        while p.jobs_len == 0 and not p.stopping:
            pthread_cond_wait(&p.cv, &p.mu)
        if p.jobs_len == 0:
            pthread_mutex_unlock(&p.mu)
            return NULL
        ch = p.jobs[p.jobs_head]
        p.jobs_head = (p.jobs_head + 1) % p.cap
        p.jobs_len -= 1
        pthread_mutex_unlock(&p.mu)

        ch.res = _run_job(ch)

        pthread_mutex_lock(&p.mu)
        p.doneq[(p.doneq_head + p.doneq_len) % p.cap] = ch
        p.doneq_len += 1
        pthread_mutex_unlock(&p.mu)
        write(p.efd, &one, 8)


cdef int _start_thread(pthread_t *t, void *(*main)(void *) noexcept nogil, void *arg) noexcept nogil:
    # Engine threads block every signal (they inherit the mask they are
    # created with), so the kernel delivers a process-directed signal such as
    # SIGINT to a Python thread: a blocking wait in Engine.run is interrupted
    # at once (EINTR) and runs the handler, instead of at its next timeout.
    cdef sigset_t every, old
    cdef int rc
    sigfillset(&every)
    pthread_sigmask(SIG_SETMASK, &every, &old)
    rc = pthread_create(t, NULL, main, arg)
    pthread_sigmask(SIG_SETMASK, &old, NULL)
    return rc


cdef Pool *_pool_new(int32_t cap, int nthreads_max, int efd) noexcept nogil:
    cdef Pool *p = <Pool *>calloc(1, sizeof(Pool))
    if p == NULL:
        return NULL
    p.cap = cap
    p.max_threads = nthreads_max
    p.efd = efd
    p.jobs = <Chunk **>calloc(cap, sizeof(Chunk *))
    p.doneq = <Chunk **>calloc(cap, sizeof(Chunk *))
    p.threads = <pthread_t *>calloc(nthreads_max, sizeof(pthread_t))
    if p.jobs == NULL or p.doneq == NULL or p.threads == NULL:
        free(p.jobs)
        free(p.doneq)
        free(p.threads)
        free(p)
        return NULL
    pthread_mutex_init(&p.mu, NULL)
    pthread_cond_init(&p.cv, NULL)
    return p


cdef int _pool_grow(Pool *p, int more_jobs) noexcept nogil:
    """Start workers for more_jobs new jobs, up to max_threads. Returns the
    number running (0: none could be started)."""
    cdef int want, n
    pthread_mutex_lock(&p.mu)
    want = p.nthreads + more_jobs
    if want > p.max_threads:
        want = p.max_threads
    while p.nthreads < want:
        if _start_thread(&p.threads[p.nthreads], _worker_main, <void *>p) != 0:
            break
        p.nthreads += 1
    n = p.nthreads
    pthread_mutex_unlock(&p.mu)
    return n


cdef void _pool_push_done(Pool *p, Chunk *ch) noexcept nogil:
    # A chunk that ended without running (refused at submission): report it
    # like a finished job.
    cdef uint64_t one = 1
    pthread_mutex_lock(&p.mu)
    p.doneq[(p.doneq_head + p.doneq_len) % p.cap] = ch
    p.doneq_len += 1
    pthread_mutex_unlock(&p.mu)
    write(p.efd, &one, 8)


cdef void _pool_run(Pool *p, Chunk **items, int32_t n) noexcept nogil:
    """Hand jobs to the workers; if no worker can be started they fail with EAGAIN."""
    cdef int32_t i
    if _pool_grow(p, n) == 0:
        for i in range(n):
            items[i].res = -EAGAIN
            items[i].kind = KIND_THREAD
            items[i].phase = PH_NONE
            _pool_push_done(p, items[i])
    else:
        _pool_push(p, items, n)


cdef void _pool_push(Pool *p, Chunk **items, int32_t n) noexcept nogil:
    cdef int32_t i
    pthread_mutex_lock(&p.mu)
    for i in range(n):
        p.jobs[(p.jobs_head + p.jobs_len) % p.cap] = items[i]
        p.jobs_len += 1
    if n == 1:
        pthread_cond_signal(&p.cv)
    else:
        pthread_cond_broadcast(&p.cv)
    pthread_mutex_unlock(&p.mu)


cdef int32_t _pool_take_done(Pool *p, Chunk **out) noexcept nogil:
    cdef int32_t n, i
    pthread_mutex_lock(&p.mu)
    n = p.doneq_len
    for i in range(n):
        out[i] = p.doneq[(p.doneq_head + i) % p.cap]
    p.doneq_head = (p.doneq_head + n) % p.cap
    p.doneq_len = 0
    pthread_mutex_unlock(&p.mu)
    return n


cdef void _pool_stop(Pool *p) noexcept nogil:
    cdef int i
    pthread_mutex_lock(&p.mu)
    p.stopping = 1
    pthread_cond_broadcast(&p.cv)
    pthread_mutex_unlock(&p.mu)
    for i in range(p.nthreads):
        pthread_join(p.threads[i], NULL)
    p.nthreads = 0


cdef void _pool_free(Pool *p, bint forked) noexcept nogil:
    # In a forked child the workers do not exist and the mutex may have been
    # held by one at fork time: free the memory, touch nothing else.
    if p == NULL:
        return
    if not forked:
        pthread_mutex_destroy(&p.mu)
        pthread_cond_destroy(&p.cv)
    free(p.jobs)
    free(p.doneq)
    free(p.threads)
    free(p)
