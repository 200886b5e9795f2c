# The engine: one kernel AIO context, one eventfd, a slab of queue_depth chunk
# slots and the worker pool. All per-chunk work happens here in C.
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

# Adaptive window (Engine.adaptive, set on the engines of blocking calls).
# Kernel AIO cannot cancel a transfer, so Ctrl-C in a blocking call waits for
# the bytes in flight: on a device that delivers 4 MiB/s, the 64 MiB the
# engine allows take 16 s. An adaptive engine keeps in flight only what the
# device completes in ADAPT_SPAN_NS, measured from its completions: a busy
# period starts with ADAPT_START bytes; each time a window's worth has
# completed, the window becomes the bytes the measured rate delivers in the
# span (at most twice the old window: slow start), and a span in which less
# than a window completed shrinks it at once. The floor is ADAPT_FLOOR (and
# one chunk is always allowed); max_inflight_bytes still caps it. A window
# learned is kept over an idle gap shorter than ADAPT_KEEP_NS when the next
# busy period starts on the same file and direction (a file read in slices by
# successive calls); any other file may be on a slower device, or throttled
# differently, and starts again from ADAPT_START.
cdef int64_t ADAPT_SPAN_NS = 250 * 1000 * 1000
cdef int64_t ADAPT_START = 2 << 20
cdef int64_t ADAPT_FLOOR = 1 << 20
cdef int64_t ADAPT_KEEP_NS = 1000 * 1000 * 1000


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec

# Bounce copies up to this size run inline on the loop thread (a few µs);
# larger ones go to a worker (see PH_*).
cdef int64_t COPY_INLINE_MAX = 64 * 1024
cdef int64_t HUGE_BOUNCE = 2 * 1024 * 1024   # bounce buffers this large get huge pages


cdef inline void _free_bounce(Chunk *ch) noexcept nogil:
    if ch.bounce != NULL:
        free(ch.bounce)
        aionvme_atomic_add(&_live_bounce, -1)
        aionvme_atomic_add(&_live_bounce_bytes, -ch.bounce_size)
    ch.bounce = NULL
    ch.bounce_size = 0


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
        cdef long rc
        cdef aionvme_aio_ring *ring
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
            self._setup_uring(submit_ramp, True)
        elif use_aio and uring == 1:
            self.uring_lazy = True
        if use_aio and not self.uring_direct:
            self.ctx = 0
            with nogil:
                rc = syscall(SYS_io_setup, <unsigned>(aio_nr if aio_nr > 0 else queue_depth), &self.ctx)
            if rc < 0:
                # ENOSYS (no CONFIG_AIO, gVisor), EPERM (seccomp), EAGAIN
                # (fs.aio-max-nr exhausted): the worker pool serves everything.
                self.aio_error = _os_error(errno, None, None, None, "io_setup")
                self.ctx = 0
            else:
                self.sub = _submitter_new(self.ctx, self.pool, queue_depth)
                if self.sub == NULL:
                    syscall(SYS_io_destroy, self.ctx)
                    self.ctx = 0
                    raise MemoryError()
                self.sub.ramp = submit_ramp if submit_ramp > 0 else 0
                self.use_aio = True
                ring = <aionvme_aio_ring *>self.ctx
                self.ring_reap = (ring_reap and ring.magic == AIONVME_AIO_RING_MAGIC
                                  and ring.incompat_features == 0)
        if refill_thread and self.ctx != 0:
            # only kernel AIO can point a completion at the thread (an
            # io_uring signals its one registered eventfd; workers signal efd)
            # counted before its eventfd and uncounted after it (_teardown), so
            # a leak check on another thread never sees the fd without it
            aionvme_atomic_add(&_live_refill, 1)
            self.tfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
            if self.tfd < 0:
                aionvme_atomic_add(&_live_refill, -1)
                _raise_errno(errno)
            aionvme_atomic_add(&_engine_fds, 1)
            rc = _start_thread(&self.rt, _refill_main, <void *>self)
            if rc != 0:
                raise _os_error(<int>rc, None, None, None, "pthread_create")
            self.refill_thread = True

    cdef int _setup_uring(self, int submit_ramp, bint direct) except -1:
        """An io_uring instance beside (or, direct, instead of) kernel AIO; on
        failure the reason is kept in uring_error and nothing changes."""
        cdef int rc
        cdef aionvme_uring *u = <aionvme_uring *>calloc(1, sizeof(aionvme_uring))
        self.uring_lazy = False
        self.cq_res = <int64_t *>calloc(self.queue_depth, sizeof(int64_t))
        self.cq_data = <uint64_t *>calloc(self.queue_depth, sizeof(uint64_t))
        self.ringq = <iocb **>calloc(self.queue_depth, sizeof(iocb *))
        if u == NULL or self.cq_res == NULL or self.cq_data == NULL or self.ringq == NULL:
            free(u)
            raise MemoryError()
        with nogil:
            rc = aionvme_uring_init(u, <unsigned>self.queue_depth, self.efd, 0)
        if rc < 0:
            # ENOSYS (no io_uring, or older than 5.5), EPERM (seccomp, or
            # kernel.io_uring_disabled), EOPNOTSUPP (no IORING_OP_READ: < 5.6)
            free(u)
            self.uring_error = _os_error(-rc, None, None, None, "io_uring_setup")
            return 0
        self.ringc.ramp = submit_ramp if submit_ramp > 0 else 0
        self.uring = u
        self.use_uring = True
        if direct:
            self.uring_direct = True
            self.use_aio = True   # the kernel-async path for O_DIRECT is the ring
            self.ring_reap = False
        return 0

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

    cdef void _complete_chunk(self, Chunk *ch) noexcept nogil:
        cdef ReqC *r = ch.req
        cdef int64_t res = ch.res
        cdef int64_t got, first_missing
        cdef int32_t slot
        if ch.op == CH_READ or ch.op == CH_GDS_READ:
            if res < 0:
                if r.err == 0:
                    r.err = <int32_t>-res
                    r.err_off = ch.foff + ch.uskip
                self._stop_generating(r)
            else:
                if ch.user != NULL:
                    # bounce read: hand the caller the part of the block it asked for
                    got = _bounce_got(ch, res)
                    if got > 0 and ch.phase != PH_DRAINED:
                        memcpy(ch.user, ch.bounce + ch.uskip, got)
                else:
                    got = res
                if got < ch.ulen:
                    first_missing = ch.foff + ch.uskip + got
                    if (r.short_seg < 0 or ch.seg < r.short_seg
                            or (ch.seg == r.short_seg and first_missing < r.short_at)):
                        r.short_seg = ch.seg
                        r.short_at = first_missing
                    self._stop_generating(r)
        elif ch.op == CH_WRITE or ch.op == CH_RMW or ch.op == CH_GDS_WRITE:
            if res < 0:
                if r.err == 0:
                    r.err = <int32_t>-res
                    r.err_off = ch.foff + ch.uskip
                self._stop_generating(r)
            elif res < ch.len:
                if r.err == 0 and not (r.flags & RF_SHORT_WRITE):
                    r.flags |= RF_SHORT_WRITE
                    r.err_off = ch.foff + res
                self._stop_generating(r)
        elif ch.op == CH_PREP:
            r.flags &= ~RF_PREP_WAIT
            r.flags |= RF_PREP_DONE
            if res < 0:
                if r.err == 0:
                    r.err = <int32_t>-res
                    r.err_off = ch.foff
                self._stop_generating(r)
        else:   # CH_FSYNC / CH_FDATASYNC
            if res < 0 and r.err == 0:
                r.err = <int32_t>-res
                r.err_off = 0
        if AIONVME_DEBUG:
            _dbg_check(r.inflight > 0 and not (r.flags & RF_FINISHED) and self.nfree < self.queue_depth)
            aionvme_atomic_add(&_dbg_chunks, -1)
            aionvme_atomic_add(&_dbg_completed, 1)
        self.n_completed += 1
        self.done_bytes += ch.acct
        self.inflight_bytes -= ch.acct
        ch.acct = 0
        r.inflight -= 1
        slot = <int32_t>(ch - self.chunks)
        ch.req = NULL
        ch.user = NULL
        ch.phase = PH_NONE
        ch.next_free = self.free_head
        self.free_head = slot
        self.nfree += 1
        if r.inflight == 0 and (r.flags & RF_GEN_DONE) and not (r.flags & RF_FINISHED):
            self._finish(r)

    cdef int _gen_chunk(self, ReqC *r, Chunk *ch) noexcept nogil:
        cdef Seg *s
        cdef Plan p
        cdef int64_t need, lo
        cdef int32_t i
        cdef void *mem
        if r.flags & RF_GEN_DONE:
            return GEN_DONE
        ch.req = r
        ch.fd = r.fd
        ch.user = NULL
        ch.phase = PH_NONE
        ch.uskip = 0
        ch.ulen = 0
        ch.seg = 0
        if r.op == OP_FSYNC or r.op == OP_FDATASYNC:
            ch.op = CH_FSYNC if r.op == OP_FSYNC else CH_FDATASYNC
            ch.kind = KIND_THREAD
            ch.foff = 0
            ch.len = 0
            r.flags |= RF_GEN_DONE
            return GEN_CHUNK
        if r.cur >= r.nsegs:
            r.flags |= RF_GEN_DONE
            return GEN_DONE
        if r.op == OP_WRITE and r.align > 1 and r.inode != NULL and not (r.flags & RF_PREP_DONE):
            if r.flags & RF_PREP_WAIT:
                return GEN_BLOCKED
            if r.end_max > r.inode.known_size:
                # Data chunks wait until the range beyond EOF exists (see _job_prep).
                lo = r.end_max
                for i in range(r.nsegs):
                    if r.segs[i].nbytes > 0 and r.segs[i].offset < lo:
                        lo = r.segs[i].offset
                ch.op = CH_PREP
                ch.kind = KIND_THREAD
                ch.foff = lo
                ch.len = r.end_max - lo
                r.flags |= RF_PREP_WAIT
                return GEN_CHUNK
            r.flags |= RF_PREP_DONE
        # skip empty segments
        while r.cur < r.nsegs and r.pos >= r.segs[r.cur].offset + r.segs[r.cur].nbytes:
            r.cur += 1
            if r.cur < r.nsegs:
                r.pos = r.segs[r.cur].offset
        if r.cur >= r.nsegs:
            r.flags |= RF_GEN_DONE
            return GEN_DONE
        s = &r.segs[r.cur]
        _plan_chunk(s.offset, s.nbytes, <uintptr_t>s.addr, r.pos, r.align, r.mem_align,
                    r.block, r.op == OP_WRITE, &p)
        if r.op == OP_READ and p.len > _INT64_MAX - p.foff:
            # The block reaches 2**63: the kernel refuses a transfer whose end
            # overflows loff_t (EINVAL, rw_verify_area), and no file holds a
            # byte there (MAX_LFS_FILESIZE is 2**63 - 1). Read the aligned part
            # that fits; the rest is past the end of any file: a short read.
            p.len = (_INT64_MAX - p.foff) - (_INT64_MAX - p.foff) % r.align
        if ((r.flags & RF_COPY) and r.op == OP_WRITE and not p.bounce and not p.rmw and r.align > 1
                and not (r.flags & RF_GDS)):
            # The caller's pages may be scattered in physical memory: the kernel
            # then builds requests of at most max_segments pages each (~1 MiB on
            # virtio-blk) where the slot's own buffer, physically contiguous in
            # long runs, goes out in requests of max_sectors_kb.
            p.bounce = 1
        ch.seg = r.cur
        ch.foff = p.foff
        ch.len = p.len
        ch.uskip = p.uskip
        ch.ulen = p.ulen
        if r.path == PATH_AIO and self.use_aio and p.len > 0:
            ch.kind = KIND_AIO
            ch.ring = self.uring_direct
        elif self.use_uring and (r.flags & RF_RING_OK) and not (r.flags & RF_GDS) and p.len > 0:
            # Buffered files through io_uring: a page-cache hit completes
            # inside io_uring_enter, with no worker hand-off; a miss goes to
            # io_uring's own workers. (Kernel AIO would copy synchronously.)
            ch.kind = KIND_AIO
            ch.ring = 1
        else:
            ch.kind = KIND_THREAD
            ch.ring = 0
        if p.rmw:
            ch.op = CH_RMW
            ch.kind = KIND_THREAD
        else:
            ch.op = CH_READ if r.op == OP_READ else CH_WRITE
        if p.bounce:
            need = r.block if r.block > r.align else r.align
            if ch.bounce == NULL or ch.bounce_size < need:
                _free_bounce(ch)
                mem = NULL
                if need >= HUGE_BOUNCE:
                    # Huge pages where the kernel gives them: one physically
                    # contiguous 2 MiB run is one segment of a request, so a
                    # transfer goes to the device in requests of max_sectors_kb
                    # (pages faulted by 4 KiB, by threads faulting at once, end
                    # up scattered, and requests hold at most max_segments).
                    if posix_memalign(&mem, HUGE_BOUNCE, need) != 0:
                        return -ENOMEM
                    madvise(mem, need - need % HUGE_BOUNCE, MADV_HUGEPAGE)   # a hint
                elif posix_memalign(&mem, 4096 if r.mem_align <= 4096 else r.mem_align, need) != 0:
                    return -ENOMEM
                ch.bounce = <char *>mem
                ch.bounce_size = need
                self.n_bounce_buffers += 1
                aionvme_atomic_add(&_live_bounce, 1)
                aionvme_atomic_add(&_live_bounce_bytes, need)
            ch.buf = ch.bounce
            ch.user = s.addr + (p.upos - s.offset)
            if ch.op == CH_WRITE:
                if ch.kind == KIND_THREAD or p.ulen > COPY_INLINE_MAX:
                    ch.phase = PH_FILL
                else:
                    memcpy(ch.bounce, ch.user, p.ulen)
        else:
            ch.buf = s.addr + (p.upos - s.offset)
        if r.flags & RF_GDS:
            _gds_chunk(r, s, &p, ch)
        r.pos = p.upos + p.ulen
        if r.pos >= s.offset + s.nbytes:
            r.cur += 1
            if r.cur < r.nsegs:
                r.pos = r.segs[r.cur].offset
            else:
                r.flags |= RF_GEN_DONE
        return GEN_CHUNK

    cdef void _queue_iocb(self, Chunk *ch) noexcept nogil:
        ch.single = (ch.req.flags & RF_SINGLE_SUBMIT) != 0
        memset(&ch.cb, 0, sizeof(iocb))
        ch.cb.aio_data = <uint64_t>(ch - self.chunks)
        ch.cb.aio_lio_opcode = IOCB_CMD_PREAD if ch.op == CH_READ else IOCB_CMD_PWRITE
        ch.cb.aio_fildes = ch.fd
        ch.cb.aio_buf = <uint64_t><uintptr_t>ch.buf
        ch.cb.aio_nbytes = <uint64_t>ch.len
        ch.cb.aio_offset = ch.foff
        ch.cb.aio_flags = IOCB_FLAG_RESFD
        ch.cb.aio_resfd = self.efd
        if ch.ring:
            if ch.req.path == PATH_THREAD:
                # A buffered file: only what completes without waiting (a
                # page-cache hit) is done by the ring; EAGAIN hands the chunk
                # to a worker (_reaped_aio). Without RWF_NOWAIT io_uring would
                # park a read of a file that turned non-blocking (an fd number
                # reused behind our back) on a poll that may never fire.
                ch.cb.aio_rw_flags = AIONVME_RWF_NOWAIT
            self.ringq[self.n_ringq] = &ch.cb
            self.n_ringq += 1
            return
        self.iocbs[self.n_iocbs] = &ch.cb
        self.n_iocbs += 1
        self.iocb_bytes += ch.len
        if ch.op != CH_READ:
            self.iocb_writes = True

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
            self._complete_chunk(ch)

    cdef void _generate(self) noexcept nogil:
        cdef ReqC *r = self.pend_head
        cdef ReqC *nxt
        cdef Chunk *ch
        cdef int32_t slot
        cdef int rc
        cdef int64_t budget = self.submit_budget if self.submit_budget > 0 else 0x7fffffffffffffff
        cdef int64_t cap = self.max_inflight_bytes
        cdef int64_t now
        self.more = False
        if self.adaptive and r != NULL:
            if self.win == 0:   # a busy period begins
                now = _now_ns()
                self.win = ADAPT_START
                if (self.win_kept > ADAPT_START and now - self.idle_ns < ADAPT_KEEP_NS
                        and r.inode == self.win_inode and r.op == self.win_op and r.inode != NULL):
                    self.win = self.win_kept
                self.win_inode = r.inode
                self.win_op = r.op
                self.mark_ns = now
                self.mark_bytes = self.done_bytes
            if cap == 0 or self.win < cap:
                cap = self.win
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
                rc = self._gen_chunk(r, ch)
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
                    self._complete_chunk(ch)
                    break
                if ch.kind == KIND_AIO and ch.phase != PH_FILL:
                    self._queue_iocb(ch)
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
        cdef int32_t done, k
        cdef bint inline
        cdef int fd
        if self.uring != NULL:
            if self.n_ringq > 0:
                done = _uring_submit(self.uring, &self.ringc, self.ringq, self.n_ringq)
                self.n_inline_submits += 1
                k = self.n_ringq - done
                if k > 0 and done > 0:
                    memmove(self.ringq, &self.ringq[done], k * sizeof(iocb *))
                self.n_ringq = k
            elif aionvme_uring_sq_pending(self.uring) > 0:
                _uring_flush(self.uring, &self.ringc)
            # Refused for now (see the class Notes): the owner pumps again soon.
            self.backlog = self.n_ringq > 0 or aionvme_uring_sq_pending(self.uring) > 0
        if self.n_iocbs > 0:
            if self.refill_thread:
                # Requests still wait for slots: these completions wake the
                # refill thread, which submits their chunks. Otherwise (every
                # request wholly in flight: single reads, the last chunks of a
                # batch) they wake the owner, who has to run anyway.
                fd = self.tfd if self.pend_head != NULL else self.efd
                for k in range(self.n_iocbs):
                    self.iocbs[k].aio_resfd = fd
            inline = (not self.iocb_writes and self.iocb_bytes <= self.inline_submit_max
                      and _submitter_idle(self.sub))
            if not inline and not _submitter_take(self.sub, self.iocbs, self.n_iocbs):
                inline = True
            if inline:
                done = _aio_submit(self.sub, self.iocbs, self.n_iocbs, False)
                self.n_inline_submits += 1
                k = self.n_iocbs - done
                if k > 0 and done > 0:
                    memmove(self.iocbs, &self.iocbs[done], k * sizeof(iocb *))
                self.n_iocbs = k   # what the full context refused waits for the next pump
            else:
                self.n_thread_submits += 1
                self.n_iocbs = 0
            if self.n_iocbs == 0:
                self.iocb_bytes = 0
                self.iocb_writes = False
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
        cdef long rc
        cdef int32_t i, n
        cdef timespec zero
        cdef aionvme_aio_ring *ring
        cdef io_event *evs
        cdef unsigned head, tail, nr
        if self.uring != NULL:
            aionvme_uring_get_events(self.uring)
            while True:
                n = aionvme_uring_reap(self.uring, self.cq_data, self.cq_res, self.queue_depth)
                if n:
                    self.n_ring_reaps += 1
                self.ringc.inflight -= n
                for i in range(n):
                    self._reaped_aio(&self.chunks[self.cq_data[i]], self.cq_res[i])
                if n < self.queue_depth:
                    break
        if self.ctx != 0:
            # The ring is checked every time (two loads): gating it on a
            # counter another thread updates could miss a completion for good.
            if self.ring_reap:
                ring = <aionvme_aio_ring *>self.ctx
                evs = <io_event *>((<char *>ring) + ring.header_length)
                nr = ring.nr
                head = ring.head
                tail = aionvme_load_acquire(&ring.tail)
                n = 0
                while head != tail:
                    self.events[n] = evs[head]
                    n += 1
                    head += 1
                    if head >= nr:
                        head = 0
                    if n == self.queue_depth:
                        break
                aionvme_store_release(&ring.head, head)
                if n:
                    self.n_ring_reaps += 1
                aionvme_atomic_add(&self.sub.inflight, -n)
                for i in range(n):
                    self._reaped_aio(&self.chunks[self.events[i].data], self.events[i].res)
            else:
                zero.tv_sec = 0
                zero.tv_nsec = 0
                while aionvme_atomic_load(&self.sub.inflight) > 0:
                    rc = syscall(SYS_io_getevents, self.ctx, 0L, <long>self.queue_depth, self.events, &zero)
                    if rc < 0:
                        if errno == EINTR:
                            continue
                        break
                    aionvme_atomic_add(&self.sub.inflight, -rc)
                    for i in range(rc):
                        self._reaped_aio(&self.chunks[self.events[i].data], self.events[i].res)
                    if rc < self.queue_depth:
                        break
        n = _pool_take_done(self.pool, self.reapq)
        for i in range(n):
            if self.reapq[i].phase == PH_FILLED and self.reapq[i].kind == KIND_AIO:
                self._queue_iocb(self.reapq[i])   # bounce filled by a worker: now the write
            else:
                self._complete_chunk(self.reapq[i])
        if self.win > 0:
            self._adapt()

    cdef void _adapt(self) noexcept nogil:
        """The adaptive window after a reap (see ADAPT_SPAN_NS)."""
        cdef int64_t now = _now_ns()
        cdef int64_t db = self.done_bytes - self.mark_bytes
        cdef int64_t dt = now - self.mark_ns
        cdef int64_t target
        # Judge once a window's worth has completed, or a whole span has
        # passed with less: earlier is too early to tell.
        if db >= self.win or dt >= ADAPT_SPAN_NS:
            # bytes the device completes in a span at the rate measured
            # (double: db * span overflows int64 past ~36 GiB)
            target = <int64_t>(<double>db * <double>ADAPT_SPAN_NS / <double>(dt if dt > 0 else 1))
            if db >= self.win:
                if target > 2 * self.win:
                    target = 2 * self.win
                if self.max_inflight_bytes and target > self.max_inflight_bytes:
                    target = self.max_inflight_bytes
                self.win = target if target > ADAPT_FLOOR else ADAPT_FLOOR
            elif target < self.win:
                self.win = target if target > ADAPT_FLOOR else ADAPT_FLOOR
            if db > 0:
                # a span without completions keeps its start: the next
                # completion must not look like a burst
                self.mark_ns = now
                self.mark_bytes = self.done_bytes
        if self.inflight_bytes == 0 and self.pend_head == NULL:
            self.win_kept = self.win   # idle: the next request starts a new busy period
            self.idle_ns = now
            self.win = 0

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
                self._setup_uring(self.ringc.ramp, False)
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
        cdef Submitter *sub = self.sub
        cdef RingCounters *rc = &self.ringc
        return dict(submit_calls=(aionvme_atomic_load(&sub.n_calls) if sub != NULL else 0) + rc.n_calls,
                    submitted=(aionvme_atomic_load(&sub.n_submitted) if sub != NULL else 0) + rc.n_submitted,
                    eagain=(aionvme_atomic_load(&sub.n_eagain) if sub != NULL else 0) + rc.n_eagain,
                    ring_submit_calls=rc.n_calls, ring_submitted=rc.n_submitted,
                    inline_submits=self.n_inline_submits, thread_submits=self.n_thread_submits,
                    inflight_bytes=self.inflight_bytes, max_inflight_bytes=self.max_inflight_bytes,
                    adaptive=bool(self.adaptive), window_bytes=self.win if self.win else self.win_kept,
                    completed=self.n_completed, thread_jobs=self.n_thread_jobs,
                    requests=self.n_requests, live_requests=self.n_live_requests,
                    inflight=self.queue_depth - self.nfree, bounce_buffers=self.n_bounce_buffers,
                    ring_reaps=self.n_ring_reaps, use_aio=self.use_aio, use_uring=self.use_uring,
                    uring_direct=self.uring_direct, uring_lazy=self.uring_lazy, backlog=self.backlog,
                    backend=self.backend,
                    more=bool(self.more), submit_budget=self.submit_budget,
                    submit_ramp=sub.ramp if sub != NULL else rc.ramp,
                    ring_reap=self.ring_reap, threads=self.threads_started,
                    refill_thread=bool(self.refill_thread), refill_wakeups=self.n_refill_wakeups,
                    owner_wakeups=self.n_owner_wakeups,
                    bounce_live=sum(1 for i in range(self.queue_depth) if self.chunks[i].bounce != NULL)
                    if self.chunks != NULL else 0,
                    closed=bool(self.closed))

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
        self._stop_refill()   # from here on this thread is the engine's only one
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

    cdef void _stop_refill(self) noexcept:
        cdef uint64_t one = 1
        if not self.refill_thread:
            return
        with nogil:
            pthread_mutex_lock(&self.mu)
            self.rt_stop = 1
            pthread_mutex_unlock(&self.mu)
            write(self.tfd, &one, 8)   # wakes its poll
            pthread_join(self.rt, NULL)
        self.refill_thread = False

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
        if self.sub != NULL:
            with nogil:
                _submitter_free(self.sub, self.abandoned)
            self.sub = NULL
        if self.pool != NULL:
            if not self.abandoned:
                with nogil:
                    _pool_stop(self.pool)
            _pool_free(self.pool, self.abandoned)
            self.pool = NULL
        if self.ctx != 0:
            if not self.abandoned:
                with nogil:
                    _destroy_aio_context(self.ctx)
            self.ctx = 0
        if self.uring != NULL:
            # The ring fd is closed after the workers stopped and every chunk
            # was reaped (close drains first); a child only closes its copy.
            aionvme_uring_free(self.uring, self.abandoned)
            free(self.uring)
            self.uring = NULL
        free(self.cq_res)
        free(self.cq_data)
        free(self.ringq)
        self.cq_res = NULL
        self.cq_data = NULL
        self.ringq = NULL
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


# -- The refill thread --------------------------------------------------------
#
# Without it the owner's thread (an event loop) is woken by every burst of
# completions and refills the device itself: a request of many chunks (one
# pread_many of 256 reads) costs a loop wakeup, a Python callback and a pump
# per burst, and the device waits for all of that, and for whatever else the
# loop or another thread holding the GIL is running, before its next reads go
# in. With Engine(refill_thread=True) a C thread of the engine's own does that
# part (DeepNVMe's and fio's shape: the waiter refills): while requests still
# wait for chunk slots, _submit points the new iocbs' IOCB_FLAG_RESFD at the
# thread's eventfd (tfd); the thread sleeps on it, reaps, generates the next
# chunks and submits them, and writes the owner's eventfd only when a request
# has finished. Iocbs submitted when nothing waits (single reads in a gather,
# the last chunks of a batch) signal the owner's eventfd as without the thread:
# the owner has to run for those anyway, and a hop through the thread would only
# add a wakeup (measured: gather at 0.85x when every completion went through it).
#
# The engine's state (chunk slots, pending and finished lists, counters) is
# then shared: every entry point takes ``mu`` (Engine._lock), which the refill
# thread holds only while it reaps and refills, never while it sleeps; it never
# takes the GIL, so an owner that waits for ``mu`` holding the GIL cannot
# deadlock with it. Finished requests are detached under the lock and handed to
# Python after it (_collect). close() stops and joins the thread first, then
# drains as an engine without one (waiting on both eventfds); a forked child
# abandons the engine and never had the thread.


cdef inline void _refill_lock(Engine e) noexcept nogil:
    # The owner first: a mutex is not fair, and the thread, woken again at
    # once by the next completions, could retake the lock before a waiting
    # owner is scheduled, again and again. A guard: under the cancellation
    # storm the owner's longest wait for the lock was 3.7 ms without it.
    while aionvme_atomic_load(&e.owner_wants) > 0:
        sched_yield()
    pthread_mutex_lock(&e.mu)


cdef void _refill_loop(Engine e) noexcept nogil:
    cdef pollfd pfd
    cdef int ms = -1
    cdef uint64_t val
    cdef uint64_t one = 1
    pfd.fd = e.tfd
    pfd.events = POLLIN
    while True:
        pfd.revents = 0
        poll(&pfd, 1, ms)
        _refill_lock(e)
        if e.rt_stop:
            pthread_mutex_unlock(&e.mu)
            return
        read(e.tfd, &val, 8)   # reset first: a completion after this re-arms it
        e.n_refill_wakeups += 1
        e._reap_events()
        e._generate()
        e._submit()
        while e.more and not e.rt_stop:
            # the submit budget bounds a loop's callback; this thread has
            # none, but lets the owner in between budgets
            pthread_mutex_unlock(&e.mu)
            _refill_lock(e)
            e._generate()
            e._submit()
        if e.done_head != NULL and not e.rt_notified:
            e.rt_notified = True
            write(e.efd, &one, 8)
        # io_uring refused SQEs for now: retry in 1 ms (no completion may come)
        ms = 1 if e.backlog else -1
        pthread_mutex_unlock(&e.mu)


cdef void *_refill_main(void *arg) noexcept nogil:
    pthread_setname_np(pthread_self(), "aionvme-refill")   # what top -H and gdb show
    _refill_loop(<Engine>arg)   # a borrowed reference: close() joins this thread first
    return NULL
