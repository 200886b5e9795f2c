# The engine: one eventfd, a slab of queue_depth chunk slots, and the backends
# that serve them: kernel AIO (kernel_aio.pxi), io_uring (uring.pxi), the
# worker pool (workers.pxi). All per-chunk work happens in C. The Engine class
# is the story of a request: queued (_enqueue), cut into chunks (_generate,
# with chunks.pxi's _gen_chunk, bounce.pxi's buffers and adaptive.pxi's
# window), handed to its backend (_submit), reaped (_reap), folded back into
# the request (chunks.pxi's _complete_chunk), and handed to Python finished
# (_collect). With a refill thread (refill.pxi) the reap-generate-submit part
# also runs on a thread of its own, under the engine's lock (_lock).
#
# Kernel facts this relies on (fs/aio.c, io_submit(2), io_cancel(2); measured
# on kernel 6.18):
# - io_submit may accept a prefix of the batch, then answer EAGAIN: the rest is
#   kept and resubmitted when completions free room; it is never dropped.
# - A misaligned O_DIRECT transfer does not fail io_submit; the event's res is
#   -EINVAL. Every res is checked.
# - With IOCB_FLAG_RESFD the kernel adds 1 to the eventfd per completion; the
#   counts coalesce, so each wakeup drains everything there is.
# - io_cancel cannot stop file I/O (EINVAL, the transfer lands anyway): a
#   cancelled request stops generating chunks and finishes when the ones in
#   flight are reaped.

cdef enum:
    GEN_CHUNK = 0
    GEN_DONE = 1
    GEN_BLOCKED = 2

# Engine.run wakes at least this often to run Python's signal handlers
# (Ctrl-C in a blocking call raises within about this long, plus the time the
# chunks in flight take to land).
cdef int RUN_SIGNAL_CHECK_MS = 100


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class Engine:
    """Kernel AIO context and/or io_uring instance + worker pool, driven by pump().

    Parameters
    ----------
    queue_depth : int
        Chunks in flight at most (AIO iocbs and worker jobs together).
    threads : int
        Worker threads at most, started on first use.
    use_aio : bool
        False forces the worker pool for everything (the fallback engine).
    ring_reap : bool
        Reap completions from the mmapped AIO ring instead of io_getevents.
    submit_budget : int
        Bytes of chunks generated per pump() at most (at least one chunk).
        io_submit pins every page of a transfer before it returns: measured
        here at ~40 µs per MiB, so 128 MiB in one call kept the event loop
        away for 5-30 ms. With a budget, pump() stops early, sets ``more``,
        and the caller pumps again on the next loop iteration.
    max_inflight_bytes : int
        Bytes in flight at most (0: only queue_depth limits). The device has
        a fixed number of request tags (128 on this virtio disk, and a 1 MiB
        transfer takes two): queueing far past them only makes io_submit wait.
    inline_submit_max : int
        Batches of reads up to this many bytes are submitted on the calling
        thread (cheapest for small random reads); writes and bigger batches go
        to the submitter thread, which may block in io_submit in our stead.
    submit_ramp : int
        iocbs in the first io_submit of a batch; each further call of that
        batch takes twice as many (0: the whole batch in one call). The
        device starts on a batch only when its io_submit returns.
    aio_nr : int
        nr_events for io_setup (0: queue_depth). Smaller than queue_depth, the
        kernel context fills before the engine does and io_submit answers
        EAGAIN part way: for tests of that path.
    refill_thread : bool
        While requests wait for chunk slots, a C thread of the engine's own
        reaps their completions and refills the device, without the owner
        (see "The refill thread" below); fileno() then becomes readable when
        requests have finished. Kernel AIO only: ignored (``refill_thread``
        stays False) on an engine without a kernel AIO context.
    uring : int
        0: no io_uring. 1: an io_uring instance beside kernel AIO, for files
        served buffered (a page-cache hit completes inside io_uring_enter
        instead of on a worker), set up by the first read or write of such a
        file (``uring_lazy`` until then). 2: every transfer through io_uring,
        no kernel AIO, set up here. Where io_uring_setup fails,
        ``uring_error`` says why and the engine works as with 0.

    Notes
    -----
    ``backlog`` is true after a pump whose SQEs io_uring refused for now
    (EAGAIN/EBUSY from io_uring_enter: no memory for requests, or the CQ
    overflow list full). They stay queued in the ring; with nothing in
    flight no completion will pump again, so the owner must call pump()
    after a short delay (the reactor does; run() waits at most 1 ms).
    """

    def __cinit__(self, int queue_depth=128, int threads=8, bint use_aio=True, bint ring_reap=True,
                  long long submit_budget=8 << 20, long long max_inflight_bytes=64 << 20,
                  long long inline_submit_max=512 << 10, int aio_nr=0, int submit_ramp=4,
                  int uring=0, bint refill_thread=False):
        cdef int32_t i
        self.efd = -1
        self.tfd = -1
        pthread_mutex_init(&self.mu, NULL)
        if queue_depth < 1 or queue_depth > 65536:
            raise ValueError(f"queue_depth must be in 1..65536, got {queue_depth}")
        if threads < 1 or threads > 1024:
            raise ValueError(f"threads must be in 1..1024, got {threads}")
        self.queue_depth = queue_depth
        self.nthreads_max = threads
        self.submit_budget = submit_budget if submit_budget > 0 else 0
        self.max_inflight_bytes = max_inflight_bytes if max_inflight_bytes > 0 else 0
        self.inline_submit_max = inline_submit_max if inline_submit_max > 0 else 0
        self.pid = getpid()
        self.efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if self.efd < 0:
            _raise_errno(errno)
        self.counted = True
        aionvme_atomic_add(&_live_engines, 1)
        aionvme_atomic_add(&_engine_fds, 1)
        self.chunks = <Chunk *>calloc(queue_depth, sizeof(Chunk))
        self.iocbs = <iocb **>calloc(queue_depth, sizeof(iocb *))
        self.events = <io_event *>calloc(queue_depth, sizeof(io_event))
        self.pushq = <Chunk **>calloc(queue_depth, sizeof(Chunk *))
        self.reapq = <Chunk **>calloc(queue_depth, sizeof(Chunk *))
        self.pool = _pool_new(queue_depth, threads, self.efd)
        if (self.chunks == NULL or self.iocbs == NULL or self.events == NULL
                or self.pushq == NULL or self.reapq == NULL or self.pool == NULL):
            raise MemoryError()
        for i in range(queue_depth):
            self.chunks[i].next_free = i + 1
        self.chunks[queue_depth - 1].next_free = -1
        self.free_head = 0
        self.nfree = queue_depth
        self.use_aio = False
        # uring: 0 none; 1 a ring for buffered files (page-cache hits complete
        # in the submitting call, not on a worker), made by the first request
        # for one (_enqueue): most engines never see a buffered file, and the
        # ring (an fd, three mmaps, a probe, an eventfd registration) cost
        # 40-50 us of every construction; 2 every transfer through it.
        self.ringc.ramp = submit_ramp if submit_ramp > 0 else 0
        if use_aio and uring >= 2:
            _uring_setup(self, submit_ramp, True)
        elif use_aio and uring == 1:
            self.uring_lazy = True
        if use_aio and not self.uring_direct:
            _aio_setup(self, aio_nr if aio_nr > 0 else queue_depth, submit_ramp, ring_reap)
        if refill_thread and self.ctx != 0:
            # only kernel AIO can point a completion at the thread (an
            # io_uring signals its one registered eventfd; workers signal efd)
            _refill_start(self)

    # -- the hot path (C, no GIL) -------------------------------------------

    cdef void _lock(self) noexcept nogil:
        # The engine's state is the refill thread's too while it runs; without
        # one the owner's thread is the only one and this is a branch. A
        # waiting owner is counted in owner_wants: the thread, which would
        # otherwise take the lock again the moment it lets go (a mutex is not
        # fair), yields until the owner has had it (_refill_lock).
        if self.refill_thread and pthread_mutex_trylock(&self.mu) != 0:
            aionvme_atomic_add(&self.owner_wants, 1)
            pthread_mutex_lock(&self.mu)
            aionvme_atomic_add(&self.owner_wants, -1)

    cdef void _lock_held(self) noexcept:
        # _lock from a caller holding the GIL: the GIL is let go only when
        # the refill thread holds the lock (it never waits for the GIL)
        if self.refill_thread and pthread_mutex_trylock(&self.mu) != 0:
            with nogil:
                self._lock()

    cdef void _unlock(self) noexcept nogil:
        if self.refill_thread:
            pthread_mutex_unlock(&self.mu)

    cdef void _pump_c(self, bint reap) noexcept nogil:
        # The owner's pump (reap: after a wakeup) or flush, under the lock.
        self._lock()
        if reap:
            if self.refill_thread:
                self.rt_notified = False   # _reap resets efd: the thread writes it again for what it finishes
                self.n_owner_wakeups += 1
            self._reap()
        self._generate()
        self._submit()
        self._unlock()

    cdef void _finish(self, ReqC *r) noexcept nogil:
        # The pending and finished lists share the links: leave one first.
        if r.flags & RF_QUEUED:
            _list_remove(&self.pend_head, &self.pend_tail, r)
            r.flags &= ~RF_QUEUED
        r.flags |= RF_FINISHED | RF_GEN_DONE
        _list_append(&self.done_head, &self.done_tail, r)

    cdef void _stop_generating(self, ReqC *r) noexcept nogil:
        if r.flags & RF_QUEUED:
            _list_remove(&self.pend_head, &self.pend_tail, r)
            r.flags &= ~RF_QUEUED
        r.flags |= RF_GEN_DONE

    cdef void _reaped_aio(self, Chunk *ch, int64_t res) noexcept nogil:
        ch.res = res
        if ch.ring and ch.req.path == PATH_THREAD and (
                0 <= res < ch.len or res == -EAGAIN or res == -EOPNOTSUPP):
            # A buffered transfer through io_uring that would have waited
            # (EAGAIN: not in the page cache; EOPNOTSUPP: a filesystem without
            # RWF_NOWAIT, such as FUSE) or came back short (at EOF, or cut by
            # the page cache): a worker redoes the whole chunk with its
            # retrying loop, which tells EOF from a short copy.
            ch.kind = KIND_THREAD
            self.pushq[self.n_push] = ch
            self.n_push += 1
        elif ch.op == CH_READ and ch.user != NULL and ch.ulen > COPY_INLINE_MAX and res > ch.uskip:
            ch.phase = PH_DRAIN          # a worker copies it out, then it completes
            self.pushq[self.n_push] = ch
            self.n_push += 1
        else:
            _complete_chunk(self, ch)

    cdef void _generate(self) noexcept nogil:
        cdef ReqC *r = self.pend_head
        cdef ReqC *nxt
        cdef Chunk *ch
        cdef int32_t slot
        cdef int rc
        cdef int64_t budget = self.submit_budget if self.submit_budget > 0 else 0x7fffffffffffffff
        cdef int64_t cap = self.max_inflight_bytes
        self.more = False
        if self.adaptive and r != NULL:
            cap = _adapt_cap(self, r, cap)
        while r != NULL and self.nfree > 0:
            nxt = r.next
            if (r.flags & RF_NO_OVERLAP) and r.inflight > 0:
                r = nxt   # batch-and-wait: its window is still out
                continue
            while self.nfree > 0 and r.inflight < r.max_inflight and not (r.flags & RF_GEN_DONE):
                if budget <= 0:
                    self.more = True
                    return
                if cap and self.inflight_bytes > 0 and self.inflight_bytes + r.block > cap:
                    return   # completions will free room and pump again
                slot = self.free_head
                ch = &self.chunks[slot]
                rc = _gen_chunk(self, r, ch)
                if rc == GEN_DONE or rc == GEN_BLOCKED:
                    ch.req = NULL
                    break
                self.free_head = ch.next_free
                self.nfree -= 1
                r.inflight += 1
                if AIONVME_DEBUG:
                    _dbg_check(self.nfree >= 0 and not (r.flags & RF_FINISHED))
                    aionvme_atomic_add(&_dbg_chunks, 1)
                ch.acct = ch.len if (ch.op == CH_READ or ch.op == CH_WRITE or ch.op == CH_RMW) else 0
                self.inflight_bytes += ch.acct
                budget -= ch.acct
                if rc < 0:
                    # could not get a bounce buffer: fail this chunk right here
                    ch.res = rc
                    ch.op = CH_READ if r.op == OP_READ else CH_WRITE
                    ch.uskip = 0
                    _complete_chunk(self, ch)
                    break
                if ch.kind == KIND_AIO and ch.phase != PH_FILL:
                    _queue_iocb(self, ch)
                else:
                    self.pushq[self.n_push] = ch
                    self.n_push += 1
            if (r.flags & RF_GEN_DONE) and (r.flags & RF_QUEUED):
                _list_remove(&self.pend_head, &self.pend_tail, r)
                r.flags &= ~RF_QUEUED
                if r.inflight == 0 and not (r.flags & RF_FINISHED):
                    self._finish(r)
            r = nxt

    cdef void _submit(self) noexcept nogil:
        if self.uring != NULL:
            _uring_submit_queued(self)
        if self.n_iocbs > 0:
            _aio_submit_queued(self)
        if self.n_push > 0:
            _pool_run(self.pool, self.pushq, self.n_push)
            self.n_thread_jobs += self.n_push
            self.n_push = 0

    cdef void _reap(self) noexcept nogil:
        cdef uint64_t val
        read(self.efd, &val, 8)   # reset first: a completion after this re-arms it
        if self.tfd >= 0 and not self.refill_thread:
            read(self.tfd, &val, 8)   # the thread stopped (close): its eventfd is ours
        self._reap_events()

    cdef void _reap_events(self) noexcept nogil:
        cdef int32_t i, n
        if self.uring != NULL:
            _uring_reap(self)
        if self.ctx != 0:
            _aio_reap(self)
        n = _pool_take_done(self.pool, self.reapq)
        for i in range(n):
            if self.reapq[i].phase == PH_FILLED and self.reapq[i].kind == KIND_AIO:
                _queue_iocb(self, self.reapq[i])   # bounce filled by a worker: now the write
            else:
                _complete_chunk(self, self.reapq[i])
        if self.win > 0:
            _adapt(self)

    cdef list _collect(self):
        cdef ReqC *r
        cdef ReqC *nxt
        cdef Request req
        cdef list out = []
        # Detached under the lock, handed to Python after it: nothing below
        # runs with the refill thread shut out (a Request's release may run
        # arbitrary finalizers).
        self._lock_held()
        r = self.done_head
        self.done_head = NULL
        self.done_tail = NULL
        self._unlock()
        while r != NULL:
            nxt = r.next
            r.next = NULL
            r.prev = NULL
            req = <Request>r.owner
            Py_DECREF(req)          # the engine's reference; `req` holds one now
            req._release()
            self.n_live_requests -= 1
            f = req.file
            f.active -= 1
            if f.closing and f.active == 0:
                try:
                    f._close_fd()
                except OSError as e:
                    # The file was closed while this request ran; close(2)
                    # failed (write-back EIO on NFS, say): this request
                    # reports it unless it failed already. Raising here would
                    # lose the requests still on the list.
                    if req.c.err == 0 and e.errno:
                        req.c.err = e.errno
                        req.c.err_off = req.c.segs[0].offset if req.c.nsegs > 0 else 0
            out.append(req)
            r = nxt
        return out

    cdef int _enqueue(self, Request req) except -1:
        if self.closed or self.abandoned:
            raise _exc.EngineClosedError("the I/O engine is closed")
        if (self.uring_lazy and (req.c.flags & RF_RING_OK) and not (req.c.flags & RF_GDS)
                and (req.c.op == OP_READ or req.c.op == OP_WRITE)):
            # The first transfer of a file io_uring may serve buffered: make
            # the ring now. If io_uring_setup fails, uring_error says why and
            # the workers serve buffered files, as with uring=0.
            self._lock_held()
            try:
                _uring_setup(self, self.ringc.ramp, False)
            finally:
                self._unlock()
        Py_INCREF(req)
        req.engine = self
        self._lock_held()
        req.c.flags |= RF_QUEUED
        _list_append(&self.pend_head, &self.pend_tail, &req.c)
        self._unlock()
        req.file.active += 1
        self.n_requests += 1
        self.n_live_requests += 1
        return 0

    # -- Python API -----------------------------------------------------------

    def read(self, FileHandle f, object buf, object offset=0, long long block=1 << 20,
             int max_inflight=0, int mode=0):
        """Queue a read of all of buf from offset. Returns the Request.

        block: chunk size; max_inflight: chunks of this request in flight at
        once (0: no cap beyond queue_depth); mode: MODE_SINGLE_SUBMIT and/or
        MODE_NO_OVERLAP."""
        cdef Request req = _new_request(f, OP_READ, 1, block, max_inflight, mode)
        req._add_segment(buf, offset, True)
        self._enqueue(req)
        return req

    def write(self, FileHandle f, object buf, object offset=0, long long block=1 << 20,
              int max_inflight=0, int mode=0):
        """Queue a write of all of buf at offset. Returns the Request (see read)."""
        cdef Request req = _new_request(f, OP_WRITE, 1, block, max_inflight, mode)
        req._add_segment(buf, offset, False)
        self._enqueue(req)
        return req

    def readv(self, FileHandle f, object items, long long block=1 << 20, int max_inflight=0,
              int mode=0):
        """Queue one request made of (buf, offset) pairs, each filled whole."""
        return self._vector(f, OP_READ, items, block, max_inflight, mode)

    def readrows(self, FileHandle f, object buf, object offsets, long long block=1 << 20,
                 int max_inflight=0, int mode=0):
        """Queue one request that fills row i of buf (buf's bytes split into
        len(offsets) equal rows, in order) from offsets[i], each whole: a
        batch of equal-sized reads without a Python object per read."""
        cdef Request req = _rows_request(f, OP_READ, buf, offsets, block, max_inflight, mode)
        self._enqueue(req)
        return req

    def writerows(self, FileHandle f, object buf, object offsets, long long block=1 << 20,
                  int max_inflight=0, int mode=0):
        """Queue one request that writes row i of buf (as readrows splits it)
        at offsets[i]."""
        cdef Request req = _rows_request(f, OP_WRITE, buf, offsets, block, max_inflight, mode)
        self._enqueue(req)
        return req

    def writev(self, FileHandle f, object items, long long block=1 << 20, int max_inflight=0,
               int mode=0):
        """Queue one request writing each (buf, offset) pair."""
        return self._vector(f, OP_WRITE, items, block, max_inflight, mode)

    def _vector(self, FileHandle f, int op, object items, long long block, int max_inflight,
                int mode):
        cdef list lst = items if type(items) is list else list(items)
        cdef Request req = _new_request(f, op, len(lst), block, max_inflight, mode)
        for item in lst:
            buf, offset = item
            req._add_segment(buf, offset, op == OP_READ)
        if req.c.nsegs:
            req.c.pos = req.c.segs[0].offset
        self._enqueue(req)
        return req

    def fsync(self, FileHandle f, bint datasync=False):
        """Queue fsync (or fdatasync) of f on a worker."""
        cdef Request req = _new_request(f, OP_FDATASYNC if datasync else OP_FSYNC, 0, 0, 0, 0)
        self._enqueue(req)
        return req

    def cancel(self, Request req):
        """Stop generating req's chunks. It finishes (cancelled) once the ones
        in flight are reaped; returns False if it had already finished."""
        cdef bint ok = False
        with nogil:
            self._lock()
            if not (req.c.flags & RF_FINISHED):
                ok = True
                req.c.flags |= RF_CANCELLED
                self._stop_generating(&req.c)
                if req.c.inflight == 0:
                    self._finish(&req.c)
            self._unlock()
        return ok

    def pump(self):
        """Reap completions, generate and submit chunks; return the requests
        that finished. Call on the owner's thread when fileno() is readable
        and after queueing requests."""
        if self.closed or self.abandoned:
            return []
        with nogil:
            self._pump_c(True)
        if self.done_head == NULL:
            return []
        return self._collect()

    def flush(self):
        """Generate and submit what is queued, without reaping: the cheap half
        of pump() for right after requests were queued. Returns the requests
        that finished meanwhile (cancelled before submission, or empty)."""
        if self.closed or self.abandoned:
            return []
        with nogil:
            self._pump_c(False)
        if self.done_head == NULL:
            return []
        return self._collect()

    def wait(self, double timeout=-1.0):
        """Block (GIL released) until fileno() signals or timeout seconds pass."""
        cdef pollfd pfd
        cdef int ms = -1 if timeout < 0 else <int>(timeout * 1000)
        pfd.fd = self.efd
        pfd.events = POLLIN
        pfd.revents = 0
        with nogil:
            poll(&pfd, 1, ms)

    def run(self, Request req):
        """Drive the engine until req finishes (for callers without a loop).

        The wait releases the GIL and wakes at least every
        ``RUN_SIGNAL_CHECK_MS`` to run Python's signal handlers: a handler that
        raises (KeyboardInterrupt on Ctrl-C) cancels req, and the chunks
        already in flight are still waited for before the exception
        propagates: the caller's buffer is never left to the kernel. On an
        ``adaptive`` engine those are what the device completes in about
        ADAPT_SPAN_NS."""
        try:
            while not (req.c.flags & RF_FINISHED):
                self.pump()
                if req.c.flags & RF_FINISHED:
                    break
                if not self.more:
                    with nogil:
                        self._wait_efd(1 if self.backlog else RUN_SIGNAL_CHECK_MS)
                    # A signal interrupts poll (EINTR) only in the thread it
                    # is delivered to, which may be a worker: the timeout
                    # bounds the delay in that case.
                    PyErr_CheckSignals()
        except BaseException:
            self.cancel(req)
            with nogil:
                while not (req.c.flags & RF_FINISHED):
                    self._pump_c(True)
                    if not (req.c.flags & RF_FINISHED) and not self.more:
                        self._wait_efd(1 if self.backlog else 100)
            raise
        finally:
            if self.done_head != NULL:
                self._collect()
        return req

    def fileno(self):
        """The eventfd that is readable when pump() has work (completions,
        or with a refill thread: requests it finished)."""
        return self.efd

    def _uring_refuse(self, int n):
        """For tests: the next n io_uring_enter submissions answer EAGAIN, as
        the kernel does when it cannot allocate requests (never seen on an idle
        machine). The SQEs stay queued, as they would then."""
        self.ringc.refuse = n if n > 0 else 0

    @property
    def backend(self):
        """What serves O_DIRECT chunks: "io_uring", "aio" (kernel AIO) or "thread"
        (workers). Buffered files go through io_uring whenever use_uring."""
        return "io_uring" if self.uring_direct else ("aio" if self.use_aio else "thread")

    @property
    def inflight(self):
        """Chunks submitted and not yet reaped."""
        return self.queue_depth - self.nfree

    @property
    def pending(self):
        """Requests that still have chunks to generate."""
        cdef int n = 0
        cdef ReqC *r
        with nogil:
            self._lock()
            r = self.pend_head
            while r != NULL:
                n += 1
                r = r.next
            self._unlock()
        return n

    @property
    def threads_started(self):
        return self.pool.nthreads if self.pool != NULL else 0

    @property
    def is_closed(self):
        return bool(self.closed)

    def stats(self):
        """Counters and state, as a dict (what aionvme.stats() reports per engine)."""
        return _engine_stats(self)

    # -- lifecycle ------------------------------------------------------------

    def close(self):
        """Stop accepting requests, let everything queued or in flight finish
        (pending requests are cancelled, in-flight chunks are waited for, so no
        buffer is touched afterwards), stop the workers and free the context.
        Returns the requests that finished during the drain."""
        cdef list out = []
        cdef ReqC *r
        cdef ReqC *nxt
        if self.closed:
            return out
        if self.abandoned:
            self.closed = True
            return out
        self.closed = True
        _refill_stop(self)   # from here on this thread is the engine's only one
        r = self.pend_head
        while r != NULL:
            nxt = r.next
            r.flags |= RF_CANCELLED
            self._stop_generating(r)
            if r.inflight == 0:
                self._finish(r)
            r = nxt
        with nogil:
            self._submit()   # iocbs already generated must go in: their requests wait for them
            while self.nfree < self.queue_depth:
                self._reap()
                self._submit()
                if self.nfree < self.queue_depth:
                    self._wait_efd(1 if self.backlog else 100)
        out = self._collect()
        self._teardown()
        return out

    cdef void _wait_efd(self, int ms) noexcept nogil:
        cdef pollfd pfd[2]
        pfd[0].fd = self.efd
        pfd[0].events = POLLIN
        pfd[0].revents = 0
        # once the refill thread has stopped (close), the completions it was
        # to see signal its eventfd: wait on both
        pfd[1].fd = self.tfd
        pfd[1].events = POLLIN
        pfd[1].revents = 0
        poll(pfd, 2 if (self.tfd >= 0 and not self.refill_thread) else 1, ms)

    cdef void _teardown(self) noexcept:
        cdef int32_t i
        _aio_release_submitter(self)
        if self.pool != NULL:
            if not self.abandoned:
                with nogil:
                    _pool_stop(self.pool)
            _pool_free(self.pool, self.abandoned)
            self.pool = NULL
        _aio_release_context(self)
        _uring_release(self)
        if self.chunks != NULL:
            for i in range(self.queue_depth):
                _free_bounce(&self.chunks[i])
            free(self.chunks)
            self.chunks = NULL
        free(self.iocbs)
        free(self.events)
        free(self.pushq)
        free(self.reapq)
        self.iocbs = NULL
        self.events = NULL
        self.pushq = NULL
        self.reapq = NULL
        if self.efd >= 0:
            close(self.efd)
            self.efd = -1
            aionvme_atomic_add(&_engine_fds, -1)
        if self.tfd >= 0:
            close(self.tfd)
            self.tfd = -1
            aionvme_atomic_add(&_engine_fds, -1)
            aionvme_atomic_add(&_live_refill, -1)
        if self.counted:
            self.counted = False
            aionvme_atomic_add(&_live_engines, -1)

    def abandon(self):
        """In a forked child: forget the parent's context, threads and requests
        without touching them (io_* on the parent's context gives EINVAL there,
        and its workers do not exist)."""
        if self.closed:
            return
        self.abandoned = True
        self.closed = True
        self.refill_thread = False   # not in this process: fork copies only the calling thread
        pthread_mutex_init(&self.mu, NULL)
        self.use_aio = False
        self.use_uring = False
        self.uring_direct = False
        self._teardown()

    def __dealloc__(self):
        # Normally closed by its owner; this is the last resort, and it still
        # drains: the kernel must be done with every buffer before we let go.
        if not self.closed and self.chunks != NULL and not self.abandoned and self.pid == getpid():
            self.close()
        elif self.chunks != NULL or self.efd >= 0:
            self.refill_thread = False   # a forked child's copy: the thread is the parent's
            self.abandoned = True
            self._teardown()
