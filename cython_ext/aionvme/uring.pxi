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
