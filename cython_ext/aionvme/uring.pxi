# io_uring submission: the engine's ready chunks (filled in as iocbs by
# Engine._queue_iocb) become SQEs of IORING_OP_READ/WRITE on the same fds and
# buffers, and go to the kernel from the thread that drives the engine (the
# ring has one producer). Completions post CQEs and signal the same eventfd
# as kernel AIO; Engine._reap consumes them (includes/uring.h has the kernel
# facts). No submitter thread: io_uring issues O_DIRECT transfers without
# waiting (IOCB_NOWAIT) and hands those that would block to its own workers,
# where io_submit sleeps on the caller's thread.


cdef int32_t _uring_submit(aionvme_uring *u, RingCounters *s, iocb **cbs, int32_t n) noexcept nogil:
    """Queue cbs[0:n] as SQEs, in order, and have the kernel consume them, in
    calls of s.ramp, 2*s.ramp, ... entries (as _aio_submit does: the block
    layer plugs a call's requests until it returns). Returns how many were
    queued; fewer than n only when the SQ is full (the rest waits for the
    next pump). SQEs the kernel did not consume stay in the ring and go with
    the next flush."""
    cdef int32_t i = 0, k, j
    cdef unsigned space = aionvme_uring_sq_space(u)
    cdef iocb *cb
    cdef int32_t cap = s.ramp if s.ramp > 0 else n
    if <unsigned>n > space:
        n = <int32_t>space
    while i < n:
        k = 1
        if not (<Chunk *>cbs[i]).single:
            while i + k < n and k < cap and not (<Chunk *>cbs[i + k]).single:
                k += 1
            if cap < n:
                cap *= 2
        for j in range(i, i + k):
            cb = cbs[j]
            aionvme_uring_push_rw(u, cb.aio_lio_opcode != IOCB_CMD_PREAD, <int>cb.aio_fildes, cb.aio_buf,
                                  <uint32_t>cb.aio_nbytes, <uint64_t>cb.aio_offset, cb.aio_data,
                                  <uint32_t>cb.aio_rw_flags)
        s.inflight += k
        s.n_submitted += k
        i += k
        _uring_flush(u, s)
    return n


# io_uring_enter answers EAGAIN/EBUSY at most this many times in a row per
# flush (100 us apart, so about 1 ms on the loop thread) before the flush
# leaves the SQEs queued and the engine reports a backlog; its owner pumps
# again after a short delay (the reactor with call_later, run() after 1 ms).
cdef int URING_ENTER_TRIES = 8


cdef void _uring_flush(aionvme_uring *u, RingCounters *s) noexcept nogil:
    """Have the kernel consume every SQE filled so far (see URING_ENTER_TRIES)."""
    cdef int rc
    cdef int tries = 0
    cdef unsigned pending = aionvme_uring_sq_pending(u)
    cdef timespec pause
    while pending > 0:
        if s.refuse > 0:
            s.refuse -= 1
            rc = -EAGAIN   # Engine._uring_refuse: as if the kernel had no memory for requests
        else:
            rc = aionvme_uring_enter(u, pending)
        s.n_calls += 1
        if rc > 0:
            pending = aionvme_uring_sq_pending(u)
            continue
        if rc == -EINTR:
            continue
        if (rc == -EAGAIN or rc == -EBUSY) and tries < URING_ENTER_TRIES:
            # No memory for requests, or the CQ overflow backlog is full: the
            # SQEs stay queued (never dropped); completions make room.
            s.n_eagain += 1
            tries += 1
            pause.tv_sec = 0
            pause.tv_nsec = 100000
            nanosleep(&pause, NULL)
            continue
        if rc == -EAGAIN or rc == -EBUSY:
            s.n_eagain += 1
        return   # still queued in the ring: the next pump's flush retries (Engine.backlog)


# -- the engine's io_uring backend ------------------------------------------------------

cdef int _uring_setup(Engine e, int submit_ramp, bint direct) except -1:
    """An io_uring instance beside (or, direct, instead of) kernel AIO; on
    failure the reason is kept in uring_error and nothing changes."""
    cdef int rc
    cdef aionvme_uring *u = <aionvme_uring *>calloc(1, sizeof(aionvme_uring))
    e.uring_lazy = False
    e.cq_res = <int64_t *>calloc(e.queue_depth, sizeof(int64_t))
    e.cq_data = <uint64_t *>calloc(e.queue_depth, sizeof(uint64_t))
    e.ringq = <iocb **>calloc(e.queue_depth, sizeof(iocb *))
    if u == NULL or e.cq_res == NULL or e.cq_data == NULL or e.ringq == NULL:
        free(u)
        raise MemoryError()
    with nogil:
        rc = aionvme_uring_init(u, <unsigned>e.queue_depth, e.efd, 0)
    if rc < 0:
        # ENOSYS (no io_uring, or older than 5.5), EPERM (seccomp, or
        # kernel.io_uring_disabled), EOPNOTSUPP (no IORING_OP_READ: < 5.6)
        free(u)
        e.uring_error = _os_error(-rc, None, None, None, "io_uring_setup")
        return 0
    e.ringc.ramp = submit_ramp if submit_ramp > 0 else 0
    e.uring = u
    e.use_uring = True
    if direct:
        e.uring_direct = True
        e.use_aio = True   # the kernel-async path for O_DIRECT is the ring
        e.ring_reap = False
    return 0


cdef void _uring_submit_queued(Engine e) noexcept nogil:
    """The SQEs queued since the last pump, to the kernel (what the SQ has room for)."""
    cdef int32_t done, k
    if e.n_ringq > 0:
        done = _uring_submit(e.uring, &e.ringc, e.ringq, e.n_ringq)
        e.n_inline_submits += 1
        k = e.n_ringq - done
        if k > 0 and done > 0:
            memmove(e.ringq, &e.ringq[done], k * sizeof(iocb *))
        e.n_ringq = k
    elif aionvme_uring_sq_pending(e.uring) > 0:
        _uring_flush(e.uring, &e.ringc)
    # Refused for now (see the class Notes): the owner pumps again soon.
    e.backlog = e.n_ringq > 0 or aionvme_uring_sq_pending(e.uring) > 0


cdef void _uring_reap(Engine e) noexcept nogil:
    """Every CQE there is, each chunk to Engine._reaped_aio."""
    cdef int32_t i, n
    aionvme_uring_get_events(e.uring)
    while True:
        n = aionvme_uring_reap(e.uring, e.cq_data, e.cq_res, e.queue_depth)
        if n:
            e.n_ring_reaps += 1
        e.ringc.inflight -= n
        for i in range(n):
            e._reaped_aio(&e.chunks[e.cq_data[i]], e.cq_res[i])
        if n < e.queue_depth:
            break


cdef void _uring_release(Engine e) noexcept:
    if e.uring != NULL:
        # The ring fd is closed after the workers stopped and every chunk
        # was reaped (close drains first); a child only closes its copy.
        aionvme_uring_free(e.uring, e.abandoned)
        free(e.uring)
        e.uring = NULL
    free(e.cq_res)
    free(e.cq_data)
    free(e.ringq)
    e.cq_res = NULL
    e.cq_data = NULL
    e.ringq = NULL
