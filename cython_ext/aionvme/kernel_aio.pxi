# Kernel AIO submission: io_submit(2) of the engine's iocbs, inline on the
# loop thread or on one submitter thread that may block in the kernel in our
# stead. Completions come back through the eventfd (IOCB_FLAG_RESFD) and are
# reaped by Engine._reap (engine.pxi).
#
# Kernel facts (fs/aio.c, io_submit(2)):
# - io_submit may accept a prefix of the batch, then answer EAGAIN when the
#   context's ring is full; the rest is kept and resubmitted, never dropped.
# - A refused first iocb (EBADF, EINVAL) fails the call: it fails alone.


cdef int32_t _aio_submit(Submitter *s, iocb **cbs, int32_t n, bint wait_for_room) noexcept nogil:
    """io_submit cbs[0:n], in order. Returns how many were dealt with:
    submitted, refused (reported as failed chunks) or handed to the workers.
    Fewer than n only when the context is full and not wait_for_room."""
    cdef int32_t i = 0, k
    cdef long rc
    cdef int err
    cdef Chunk *ch
    cdef timespec pause
    # The block layer holds back every request of one io_submit until the
    # call returns (plugging), so the device idles while the kernel prepares
    # a whole batch. A ramp (4, 8, 16, ... iocbs per call) starts the device
    # after the first few and costs log2(n) calls: 4 KiB random reads at
    # QD 64 here, 72-77k IOPS in one call, 80-84k with the ramp from 2. It
    # starts at 4 (defaults.submit_ramp), the size of a loop's flushes
    # (submit_batch): each is one call, and a refill of 64 starts after 4,
    # not 8 (1.03x the IOPS in C, bench/c/aio_shape.c over 20 alternated
    # rounds; ~1.01x, within the noise, in the Python workloads). A ramp
    # from 2 would split every flush of 4 in two calls.
    cdef int32_t cap = s.ramp if s.ramp > 0 else n
    while i < n:
        # One call for the run up to the next request that asked for one
        # io_submit per iocb (DeepNVMe's single_submit); those go alone.
        k = 1
        if not (<Chunk *>cbs[i]).single:
            while i + k < n and k < cap and not (<Chunk *>cbs[i + k]).single:
                k += 1
            if cap < n:
                cap *= 2
        # Counted as in flight before the call: a completion may be reaped on
        # the loop thread before io_submit even returns here.
        # (And counted as submitted: a caller that reads the counters after
        # its request finished must see every iocb of it.)
        aionvme_atomic_add(&s.inflight, k)
        aionvme_atomic_add(&s.n_submitted, k)
        aionvme_atomic_add(&s.n_calls, 1)
        rc = syscall(SYS_io_submit, s.ctx, <long>k, &cbs[i])
        if rc > 0:
            if rc < k:
                aionvme_atomic_add(&s.inflight, rc - k)
                aionvme_atomic_add(&s.n_submitted, rc - k)
            i += <int32_t>rc
            continue
        err = errno if rc < 0 else EAGAIN
        aionvme_atomic_add(&s.inflight, -k)
        aionvme_atomic_add(&s.n_submitted, -k)
        if err == EINTR:
            continue
        if err == EAGAIN:
            # The context is full: a prefix was taken, the rest must wait for
            # completions. Never dropped.
            aionvme_atomic_add(&s.n_eagain, 1)
            if aionvme_atomic_load(&s.inflight) > 0:
                if not wait_for_room:
                    return i
                pause.tv_sec = 0
                pause.tv_nsec = 100000
                nanosleep(&pause, NULL)
                continue
            # Nothing in flight will free room: the workers run the rest.
            for k in range(i, n):
                (<Chunk *>cbs[k]).kind = KIND_THREAD
            _pool_run(s.pool, <Chunk **>&cbs[i], n - i)
            return n
        # The first iocb was refused (EBADF, EINVAL, ...): it fails alone.
        ch = <Chunk *>cbs[i]
        ch.res = -err
        ch.kind = KIND_THREAD
        ch.phase = PH_NONE
        _pool_push_done(s.pool, ch)
        i += 1
    return n


cdef void *_submitter_main(void *arg) noexcept nogil:
    cdef Submitter *s = <Submitter *>arg
    cdef int32_t n, i
    while True:
        pthread_mutex_lock(&s.mu)
        while s.len == 0 and not s.stopping:
            pthread_cond_wait(&s.cv, &s.mu)
        if s.len == 0:
            pthread_mutex_unlock(&s.mu)
            return NULL
        n = s.len
        for i in range(n):
            s.work[i] = s.q[(s.head + i) % s.cap]
        s.head = (s.head + n) % s.cap
        s.len = 0
        s.busy = 1
        pthread_mutex_unlock(&s.mu)
        _aio_submit(s, s.work, n, True)
        pthread_mutex_lock(&s.mu)
        s.busy = 0
        pthread_mutex_unlock(&s.mu)


cdef Submitter *_submitter_new(aio_context_t ctx, Pool *pool, int32_t cap) noexcept nogil:
    cdef Submitter *s = <Submitter *>calloc(1, sizeof(Submitter))
    if s == NULL:
        return NULL
    s.q = <iocb **>calloc(cap, sizeof(iocb *))
    s.work = <iocb **>calloc(cap, sizeof(iocb *))
    if s.q == NULL or s.work == NULL:
        free(s.q)
        free(s.work)
        free(s)
        return NULL
    s.ctx = ctx
    s.pool = pool
    s.cap = cap
    pthread_mutex_init(&s.mu, NULL)
    pthread_cond_init(&s.cv, NULL)
    return s


cdef bint _submitter_take(Submitter *s, iocb **cbs, int32_t n) noexcept nogil:
    """Queue a batch for the submitter thread (started on first use).
    False if the thread cannot be started: the caller submits inline."""
    cdef int32_t i
    pthread_mutex_lock(&s.mu)
    if not s.started:
        if _start_thread(&s.thread, _submitter_main, <void *>s) != 0:
            pthread_mutex_unlock(&s.mu)
            return False
        s.started = 1
    for i in range(n):
        s.q[(s.head + s.len) % s.cap] = cbs[i]
        s.len += 1
    pthread_cond_signal(&s.cv)
    pthread_mutex_unlock(&s.mu)
    return True


cdef bint _submitter_idle(Submitter *s) noexcept nogil:
    cdef bint idle
    pthread_mutex_lock(&s.mu)
    idle = s.len == 0 and not s.busy
    pthread_mutex_unlock(&s.mu)
    return idle


cdef void _submitter_free(Submitter *s, bint forked) noexcept nogil:
    if s == NULL:
        return
    if not forked:
        pthread_mutex_lock(&s.mu)
        s.stopping = 1
        pthread_cond_signal(&s.cv)
        pthread_mutex_unlock(&s.mu)
        if s.started:
            pthread_join(s.thread, NULL)
        pthread_mutex_destroy(&s.mu)
        pthread_cond_destroy(&s.cv)
    free(s.q)
    free(s.work)
    free(s)


# -- the engine's kernel AIO backend ----------------------------------------------------
#
# One AIO context per engine (io_setup with queue_depth events); chunks become
# iocbs that signal the engine's eventfd (IOCB_FLAG_RESFD); completions are read
# from the context's mmapped ring (struct aio_ring, fs/aio.c) when its layout
# is the one we know, else with io_getevents.

cdef int _aio_setup(Engine e, unsigned nr, int submit_ramp, bint ring_reap) except -1:
    """The engine's kernel AIO context of nr events, and its submitter; where
    io_setup fails, aio_error says why and the worker pool serves everything."""
    cdef long rc
    cdef aionvme_aio_ring *ring
    e.ctx = 0
    with nogil:
        rc = syscall(SYS_io_setup, nr, &e.ctx)
    if rc < 0:
        # ENOSYS (no CONFIG_AIO, gVisor), EPERM (seccomp), EAGAIN
        # (fs.aio-max-nr exhausted)
        e.aio_error = _os_error(errno, None, None, None, "io_setup")
        e.ctx = 0
        return 0
    e.sub = _submitter_new(e.ctx, e.pool, e.queue_depth)
    if e.sub == NULL:
        syscall(SYS_io_destroy, e.ctx)
        e.ctx = 0
        raise MemoryError()
    e.sub.ramp = submit_ramp if submit_ramp > 0 else 0
    e.use_aio = True
    ring = <aionvme_aio_ring *>e.ctx
    e.ring_reap = ring_reap and ring.magic == AIONVME_AIO_RING_MAGIC and ring.incompat_features == 0
    return 0


cdef void _queue_iocb(Engine e, Chunk *ch) noexcept nogil:
    ch.single = (ch.req.flags & RF_SINGLE_SUBMIT) != 0
    memset(&ch.cb, 0, sizeof(iocb))
    ch.cb.aio_data = <uint64_t>(ch - e.chunks)
    ch.cb.aio_lio_opcode = IOCB_CMD_PREAD if ch.op == CH_READ else IOCB_CMD_PWRITE
    ch.cb.aio_fildes = ch.fd
    ch.cb.aio_buf = <uint64_t><uintptr_t>ch.buf
    ch.cb.aio_nbytes = <uint64_t>ch.len
    ch.cb.aio_offset = ch.foff
    ch.cb.aio_flags = IOCB_FLAG_RESFD
    ch.cb.aio_resfd = e.efd
    if ch.ring:
        if ch.req.path == PATH_THREAD:
            # A buffered file: only what completes without waiting (a
            # page-cache hit) is done by the ring; EAGAIN hands the chunk
            # to a worker (_reaped_aio). Without RWF_NOWAIT io_uring would
            # park a read of a file that turned non-blocking (an fd number
            # reused behind our back) on a poll that may never fire.
            ch.cb.aio_rw_flags = AIONVME_RWF_NOWAIT
        e.ringq[e.n_ringq] = &ch.cb
        e.n_ringq += 1
        return
    e.iocbs[e.n_iocbs] = &ch.cb
    e.n_iocbs += 1
    e.iocb_bytes += ch.len
    if ch.op != CH_READ:
        e.iocb_writes = True


cdef void _aio_submit_queued(Engine e) noexcept nogil:
    """The iocbs queued since the last pump, to io_submit: inline, or on the
    submitter thread (writes, big batches), which may block in our stead."""
    cdef int32_t done, k
    cdef bint inline
    cdef int fd
    if e.refill_thread:
        # Requests still wait for slots: these completions wake the
        # refill thread, which submits their chunks. Otherwise (every
        # request wholly in flight: single reads, the last chunks of a
        # batch) they wake the owner, who has to run anyway.
        fd = e.tfd if e.pend_head != NULL else e.efd
        for k in range(e.n_iocbs):
            e.iocbs[k].aio_resfd = fd
    inline = (not e.iocb_writes and e.iocb_bytes <= e.inline_submit_max
              and _submitter_idle(e.sub))
    if not inline and not _submitter_take(e.sub, e.iocbs, e.n_iocbs):
        inline = True
    if inline:
        done = _aio_submit(e.sub, e.iocbs, e.n_iocbs, False)
        e.n_inline_submits += 1
        k = e.n_iocbs - done
        if k > 0 and done > 0:
            memmove(e.iocbs, &e.iocbs[done], k * sizeof(iocb *))
        e.n_iocbs = k   # what the full context refused waits for the next pump
    else:
        e.n_thread_submits += 1
        e.n_iocbs = 0
    if e.n_iocbs == 0:
        e.iocb_bytes = 0
        e.iocb_writes = False


cdef void _aio_reap(Engine e) noexcept nogil:
    """Every completion of the AIO context there is (from its mmapped ring,
    or by io_getevents), each chunk to Engine._reaped_aio."""
    cdef long rc
    cdef int32_t i, n
    cdef timespec zero
    cdef aionvme_aio_ring *ring
    cdef io_event *evs
    cdef unsigned head, tail, nr
    # The ring is checked every time (two loads): gating it on a
    # counter another thread updates could miss a completion for good.
    if e.ring_reap:
        ring = <aionvme_aio_ring *>e.ctx
        evs = <io_event *>((<char *>ring) + ring.header_length)
        nr = ring.nr
        head = ring.head
        tail = aionvme_load_acquire(&ring.tail)
        n = 0
        while head != tail:
            e.events[n] = evs[head]
            n += 1
            head += 1
            if head >= nr:
                head = 0
            if n == e.queue_depth:
                break
        aionvme_store_release(&ring.head, head)
        if n:
            e.n_ring_reaps += 1
        aionvme_atomic_add(&e.sub.inflight, -n)
        for i in range(n):
            e._reaped_aio(&e.chunks[e.events[i].data], e.events[i].res)
    else:
        zero.tv_sec = 0
        zero.tv_nsec = 0
        while aionvme_atomic_load(&e.sub.inflight) > 0:
            rc = syscall(SYS_io_getevents, e.ctx, 0L, <long>e.queue_depth, e.events, &zero)
            if rc < 0:
                if errno == EINTR:
                    continue
                break
            aionvme_atomic_add(&e.sub.inflight, -rc)
            for i in range(rc):
                e._reaped_aio(&e.chunks[e.events[i].data], e.events[i].res)
            if rc < e.queue_depth:
                break


cdef void *_io_destroy_main(void *arg) noexcept nogil:
    syscall(SYS_io_destroy, <aio_context_t>arg)
    return NULL


cdef void _destroy_aio_context(aio_context_t ctx) noexcept nogil:
    """io_destroy(ctx) on a detached thread: with nothing in flight (close
    drains first) it only waits for an RCU grace period, ~30 ms here, which
    every engine close (each asyncio.run(), each Handle with its own engines)
    paid on the caller's thread. Inline when no thread can be started."""
    cdef pthread_t t
    if _start_thread(&t, _io_destroy_main, <void *>ctx) == 0:
        pthread_detach(t)
    else:
        syscall(SYS_io_destroy, ctx)


cdef void _aio_release_submitter(Engine e) noexcept:
    if e.sub != NULL:
        with nogil:
            _submitter_free(e.sub, e.abandoned)
        e.sub = NULL


cdef void _aio_release_context(Engine e) noexcept:
    # after the workers stopped and every chunk was reaped (close drains first)
    if e.ctx != 0:
        if not e.abandoned:
            with nogil:
                _destroy_aio_context(e.ctx)
        e.ctx = 0
