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
