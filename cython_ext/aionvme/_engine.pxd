# Layouts of the engine's C state and extension types. Declarations only; the
# code lives in _engine.pyx and the .pxi parts it includes (named for what they hold).
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint64_t

from aionvme.includes.linux cimport aio_context_t, io_event, iocb
from aionvme.includes.pthread cimport pthread_cond_t, pthread_mutex_t, pthread_t
from aionvme.includes.uring cimport aionvme_uring


cdef enum:
    # Request operations (what the caller asked for).
    OP_READ = 0
    OP_WRITE = 1
    OP_FSYNC = 2
    OP_FDATASYNC = 3

    # Chunk operations (what one kernel transfer or worker job does).
    CH_READ = 0        # read [foff, foff+len) into buf
    CH_WRITE = 1       # write buf to [foff, foff+len)
    CH_RMW = 2         # read-modify-write of one partially written block (worker)
    CH_PREP = 3        # make room before extending writes: fallocate (worker)
    CH_FSYNC = 4
    CH_FDATASYNC = 5
    CH_GDS_READ = 6    # cuFileRead into device memory (worker)
    CH_GDS_WRITE = 7   # cuFileWrite from device memory (worker)

    # Who copies a bounce chunk's bytes. Big copies run on a worker so the
    # loop thread never spends more than a few microseconds per chunk.
    PH_NONE = 0        # no copy, or a small one done inline
    PH_FILL = 1        # a worker copies user -> bounce before the write
    PH_FILLED = 2      # copied; an AIO write waits to be submitted
    PH_DRAIN = 3       # a worker copies bounce -> user after the read
    PH_DRAINED = 4     # copied

    # Where a chunk runs.
    KIND_AIO = 0
    KIND_THREAD = 1

    # How a file is served: kernel AIO on an O_DIRECT fd, or the worker pool.
    PATH_AIO = 0
    PATH_THREAD = 1

    # Request flags.
    RF_GEN_DONE = 1      # no more chunks will be generated
    RF_PREP_WAIT = 2     # a CH_PREP chunk is in flight; data chunks wait for it
    RF_PREP_DONE = 4
    RF_CANCELLED = 8
    RF_FINISHED = 16
    RF_QUEUED = 32       # on the engine's pending list
    RF_SHORT_WRITE = 64
    RF_SINGLE_SUBMIT = 128   # each of its iocbs goes in its own io_submit (single_submit)
    RF_NO_OVERLAP = 256      # batch-and-wait: next window after the last is reaped (overlap_events=False)
    RF_GDS = 512             # device memory through cuFile: CH_GDS_* chunks on workers, never bounced
    RF_RING_OK = 1024        # a buffered regular file or block device: io_uring may serve it
    RF_COPY = 2048           # O_DIRECT writes: aligned chunks too go through the slot's bounce buffer


cdef struct Seg:
    char *addr
    int64_t nbytes
    int64_t offset
    int64_t boff           # GDS: the segment's first byte is addr + boff (addr: the cuFile base)
    void *cuctx            # GDS: the CUDA context owning that memory (NULL: leave the thread's)


cdef struct InodeC:
    pthread_mutex_t lock
    int64_t known_size     # a lower bound of the file size, kept to skip fstat
    InodeC *all_next       # every live InodeC, so a forked child can re-initialise its lock
    InodeC *all_prev


cdef struct ReqC:
    PyObject *owner        # the Request object; the engine holds a reference while queued or in flight
    ReqC *next             # pending list / finished list
    ReqC *prev
    Seg *segs
    int32_t nsegs
    int32_t cur            # segment being chunked
    int64_t pos            # next file offset to chunk within segs[cur]
    int32_t op
    int32_t fd
    int32_t path           # PATH_AIO / PATH_THREAD
    int32_t flags
    int64_t align          # file offset / length alignment for this fd (1 when buffered)
    int64_t mem_align      # memory alignment for this fd (1 when buffered)
    int64_t block          # chunk size (multiple of align)
    int32_t max_inflight   # per-request cap on chunks in flight (intra-op parallelism)
    int32_t inflight
    int64_t end_max        # largest file end among the segments (writes: for CH_PREP)
    InodeC *inode
    int32_t err            # first errno seen, 0 if none
    int64_t err_off        # file offset of the chunk that failed
    int32_t short_seg      # first segment that came back short, -1 if none
    int64_t short_at       # file offset of the first missing byte in that segment
    void *cufh             # GDS: the file's cuFile handle


cdef struct Chunk:
    iocb cb                # must stay first: the kernel sees &chunk.cb
    ReqC *req
    char *buf              # memory the kernel transfers to/from (user memory or bounce)
    char *user             # user memory for bounce copies; NULL when direct
    char *bounce           # this slot's bounce buffer (allocated on first use, kept)
    int64_t bounce_size
    int64_t foff
    int64_t len
    int64_t uskip          # where the user's bytes start inside the bounce buffer
    int64_t ulen
    int64_t res            # bytes transferred, or -errno
    int32_t seg
    int32_t op
    int32_t kind
    int32_t fd
    int32_t phase
    int32_t single         # own io_submit (the request's RF_SINGLE_SUBMIT, copied for the submitter)
    int64_t acct           # bytes this chunk adds to the engine's inflight_bytes
    int32_t next_free
    int64_t doff           # GDS: offset from buf (the cuFile base pointer) of the chunk's first byte
    int32_t ring           # KIND_AIO through io_uring (1) or kernel AIO (0)


cdef struct Pool:
    # The worker pool: C threads that run CH_* jobs with plain syscalls and
    # never take the GIL. jobs and doneq are rings of queue_depth entries (at
    # most queue_depth chunks exist), guarded by mu.
    pthread_mutex_t mu
    pthread_cond_t cv
    pthread_t *threads
    int nthreads
    int stopping
    int efd                  # written once per finished job, like IOCB_FLAG_RESFD
    int32_t cap
    Chunk **jobs
    int32_t jobs_head
    int32_t jobs_len
    Chunk **doneq
    int32_t doneq_head
    int32_t doneq_len
    int max_threads


cdef struct Submitter:
    # One C thread that calls io_submit for batches that may block (writes,
    # big transfers), so the event loop never waits in the kernel: io_submit
    # pins every page first (~40 µs per MiB here), sleeps when the device's
    # tags run out, and on ext4 waits for inode locks behind unwritten-extent
    # conversion. Counters shared with the loop thread are atomic.
    pthread_mutex_t mu
    pthread_cond_t cv
    pthread_t thread
    int started
    int stopping
    int busy
    aio_context_t ctx
    Pool *pool
    iocb **q                 # ring of cap entries, guarded by mu
    iocb **work              # the thread's current batch
    int32_t head
    int32_t len
    int32_t cap
    int64_t inflight         # iocbs the kernel holds (atomic)
    int64_t n_calls          # io_submit calls (atomic)
    int64_t n_submitted
    int64_t n_eagain
    int32_t ramp             # iocbs in the first io_submit of a batch, doubling (0: one call)


cdef struct RingCounters:
    # io_uring's counterpart of the Submitter's: only the engine's thread
    # touches them (the ring has one producer and no submitter thread).
    int64_t inflight         # SQEs filled and not reaped yet
    int64_t n_calls          # io_uring_enter calls
    int64_t n_submitted
    int64_t n_eagain
    int32_t ramp
    int32_t refuse           # test hook: answer this many io_uring_enter calls with EAGAIN (Engine._uring_refuse)


cdef class Inode:
    cdef object __weakref__
    cdef InodeC c


cdef class FileHandle:
    cdef readonly int fd
    cdef readonly int path_kind
    cdef readonly bint direct
    cdef readonly bint readable
    cdef readonly bint writable
    cdef readonly long long align
    cdef readonly long long mem_align
    cdef readonly object path
    cdef readonly Inode inode
    cdef readonly int active       # requests queued or in flight on this fd
    cdef readonly bint closing
    cdef readonly bint closed
    cdef public object owner       # the user-facing File, for error messages and close callbacks
    cdef unsigned long long st_dev  # what the fd referred to when the handle took it, so a last-resort
    cdef unsigned long long st_ino  # close never closes a reused fd number (0, 0: fstat failed)
    cdef void *cufh                # cuFile handle, registered on first GDS use (NULL: none)
    cdef readonly object gds_refused   # why cuFile refused this fd (CuFileError), or None
    cdef readonly bint ring_ok         # buffered, positional, not on tmpfs/ramfs: io_uring may serve it
    cdef int _close_fd(self) except -1


cdef class Engine


cdef class Request:
    cdef ReqC c
    cdef Seg seg0
    cdef Py_buffer *views
    cdef Py_buffer view0
    cdef int nviews
    cdef list keep
    cdef readonly FileHandle file
    cdef readonly Engine engine          # set when queued
    cdef public object future
    cdef public object callback
    cdef public bint cancel_requested    # the awaiting side asked to cancel (see the reactor)
    cdef int _add_segment(self, object buf, object offset, bint writable) except -1
    cdef int _put_segment(self, char *addr, int64_t boff, int64_t n, int64_t off) except -1
    cdef void _release(self) noexcept


cdef class Engine:
    cdef object __weakref__
    cdef public object owner             # whoever pumps this engine (a Reactor), for cancellation
    cdef aio_context_t ctx
    cdef readonly bint use_aio
    cdef readonly object aio_error     # why kernel AIO is off (OSError), or None
    cdef aionvme_uring *uring           # the io_uring instance (NULL: kernel AIO or workers)
    cdef readonly bint use_uring        # a ring exists: buffered files go through it
    cdef readonly bint uring_direct     # O_DIRECT chunks go through it too, not kernel AIO
    cdef readonly bint uring_lazy       # engine='auto': the ring is made by the first buffered request
    cdef readonly bint backlog          # SQEs the kernel refused for now (EAGAIN/EBUSY): pump again soon
    cdef RingCounters ringc
    cdef iocb **ringq                   # chunks ready for the ring, in order
    cdef int32_t n_ringq
    cdef readonly object uring_error   # why io_uring was asked for and is off (OSError), or None
    cdef int64_t *cq_res                # completions copied out of the CQ ring
    cdef uint64_t *cq_data
    cdef readonly int efd
    cdef readonly int queue_depth
    cdef bint abandoned                 # set in a forked child: touch nothing of the parent's
    cdef bint counted                   # counted in _live_engines (counters.pxi)
    cdef bint closed
    cdef int pid
    cdef Chunk *chunks
    cdef int32_t free_head
    cdef int32_t nfree
    cdef iocb **iocbs                   # AIO chunks ready for io_submit, in order
    cdef int32_t n_iocbs
    cdef io_event *events
    cdef ReqC *pend_head
    cdef ReqC *pend_tail
    cdef ReqC *done_head                # finished requests not yet handed to Python
    cdef ReqC *done_tail
    cdef Submitter *sub
    cdef int64_t iocb_bytes                 # bytes in self.iocbs
    cdef bint iocb_writes                   # self.iocbs holds a write
    cdef readonly long long inline_submit_max
    cdef readonly long long max_inflight_bytes
    cdef int64_t inflight_bytes
    # The adaptive window (blocking engines, see "Adaptive window" in engine.pxi)
    cdef public bint adaptive           # bytes in flight follow the completion rate
    cdef int64_t win                    # bytes in flight allowed now (0: idle, restart)
    cdef int64_t win_kept               # the window when the engine last went idle
    cdef int64_t idle_ns                # and when
    cdef InodeC *win_inode              # the file and op whose busy period measured it
    cdef int32_t win_op
    cdef int64_t done_bytes             # bytes of chunks completed (the window's meter)
    cdef int64_t mark_bytes             # done_bytes when the current sample began
    cdef int64_t mark_ns                # monotonic time then
    cdef readonly long long submit_budget   # bytes generated per pump at most (0: no cap)
    cdef readonly bint more                 # the budget stopped generation with work left
    cdef bint ring_reap                 # reap from the mmapped completion ring
    cdef Chunk **pushq                  # worker jobs generated in this pump, handed over at once
    cdef int32_t n_push
    cdef Pool *pool
    cdef int nthreads_max
    cdef Chunk **reapq                  # worker completions taken out of the pool in one go
    # counters (cheap; always on so tests can check them in any build)
    cdef readonly long long n_inline_submits
    cdef readonly long long n_thread_submits
    cdef readonly long long n_completed
    cdef readonly long long n_thread_jobs
    cdef readonly long long n_requests
    cdef readonly long long n_live_requests
    cdef readonly long long n_bounce_buffers
    cdef readonly long long n_ring_reaps
    # The refill thread (refill_thread=True, see "The refill thread" in engine.pxi)
    cdef readonly bint refill_thread    # a C thread reaps and refills while requests wait for slots
    cdef pthread_mutex_t mu             # the engine's state, between that thread and the owner's
    cdef pthread_t rt
    cdef int rt_stop
    cdef readonly int tfd               # the thread's eventfd: completions of iocbs it is to refill after
    cdef bint rt_notified               # the thread wrote efd, the owner has not pumped since (under mu)
    cdef int64_t owner_wants            # owner-side callers waiting for mu (atomic): the thread lets them in
    cdef readonly long long n_refill_wakeups
    cdef readonly long long n_owner_wakeups

    cdef void _lock(self) noexcept nogil
    cdef void _lock_held(self) noexcept
    cdef void _unlock(self) noexcept nogil
    cdef void _pump_c(self, bint reap) noexcept nogil
    cdef int _enqueue(self, Request req) except -1
    cdef void _finish(self, ReqC *r) noexcept nogil
    cdef void _reaped_aio(self, Chunk *ch, int64_t res) noexcept nogil
    cdef void _stop_generating(self, ReqC *r) noexcept nogil
    cdef void _wait_efd(self, int ms) noexcept nogil
    cdef void _teardown(self) noexcept
    cdef void _generate(self) noexcept nogil
    cdef void _submit(self) noexcept nogil
    cdef void _reap(self) noexcept nogil
    cdef void _reap_events(self) noexcept nogil
    cdef list _collect(self)


# -- the asyncio glue (glue/*.pxi) ------------------------------------------------

cdef class Hub

cdef class Transfer:
    cdef object loop
    cdef Hub hub                  # the Hub that queued it: cancelling goes through it
    cdef public Request req       # the request, until the reactor delivered it
    cdef object value             # the byte count (ok) or the exception (failed)
    cdef object tb                # the exception's traceback when it was set
    cdef object cancel_message
    cdef object thrown            # an exception thrown into the await, raised once drained
    cdef object cb0               # the first done callback (a waiting Task's wakeup) ...
    cdef object ctx0              # ... and the context it runs in
    cdef list cbs                 # further (callback, context) pairs, in order
    cdef readonly bint finished   # delivered by the reactor: done
    cdef char state
    cdef bint blocking            # _asyncio_future_blocking
    cdef bint log_exc             # failed, and nobody asked for the exception yet

    cdef object _step(self)
    cdef object _result(self)
    cdef object _cancelled_error(self)
    cdef int _stop(self) except -1
    cdef int _settle(self, Request req, object closed_error) except -1
    cdef int _fail(self, object exc) except -1
    cdef int _schedule_callbacks(self) except -1


cdef class Hub:
    cdef readonly Engine engine
    cdef object loop
    cdef object get_loop          # a callable returning loop (Transfer.get_loop): _LoopRef(loop).get
    cdef object call_soon
    cdef object flush_cb
    cdef object cancel_cb         # the reactor's: stop a request, pump soon
    cdef public list held         # finished during an early flush, not delivered yet
    cdef public bint scheduled    # a flush is scheduled on the loop
    cdef int64_t queued
    cdef int64_t early
    cdef readonly bint live       # False once retired (its reactor closed, or a forked child)

    cdef Transfer _queued(self, Request req)
    cdef Transfer _submit_new(self, Request req)


cdef class Route:
    cdef readonly FileHandle handle   # the File's engine handle
    cdef readonly object block_size   # the File's knobs (None: the defaults')
    cdef readonly object parallelism
    cdef tuple params                 # (block, max_inflight, mode) for settings generation gen
    cdef int64_t gen                  # -1: not computed yet

    cdef tuple _params(self)


cdef class Routed:
    cdef public Route _route          # set by the runtime at open; None before (or if it failed)
