# The refill thread --------------------------------------------------------
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


cdef int _refill_start(Engine e) except -1:
    cdef int rc
    # counted before its eventfd and uncounted after it (_teardown), so a leak
    # check on another thread never sees the fd without it
    aionvme_atomic_add(&_live_refill, 1)
    e.tfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
    if e.tfd < 0:
        aionvme_atomic_add(&_live_refill, -1)
        _raise_errno(errno)
    aionvme_atomic_add(&_engine_fds, 1)
    rc = _start_thread(&e.rt, _refill_main, <void *>e)
    if rc != 0:
        raise _os_error(<int>rc, None, None, None, "pthread_create")
    e.refill_thread = True
    return 0


cdef void _refill_stop(Engine e) noexcept:
    cdef uint64_t one = 1
    if not e.refill_thread:
        return
    with nogil:
        pthread_mutex_lock(&e.mu)
        e.rt_stop = 1
        pthread_mutex_unlock(&e.mu)
        write(e.tfd, &one, 8)   # wakes its poll
        pthread_join(e.rt, NULL)
    e.refill_thread = False
