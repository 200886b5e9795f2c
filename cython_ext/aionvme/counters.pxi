# Counters for leak checks, and the debug build's checks.
#
# Always on: one atomic add per allocation or fd, never per chunk, so they
# cost nothing measurable (live engines and their eventfds, AlignedBuffers,
# bounce buffers). The debug build (AIONVME_DEBUG=1 at build time, `make
# build-debug`) adds per-chunk counting and invariant checks on the hot path;
# a release build compiles those branches out (AIONVME_DEBUG is a C constant 0).

cdef extern from *:
    """
    #ifndef AIONVME_DEBUG
    #define AIONVME_DEBUG 0
    #endif
    """
    const bint AIONVME_DEBUG

cdef int64_t _live_engines = 0          # Engines not yet torn down
cdef int64_t _engine_fds = 0            # eventfds owned by engines
cdef int64_t _live_refill = 0           # engines with a refill thread not yet torn down (each owns a second eventfd)
cdef int64_t _live_aligned = 0          # AlignedBuffers mapped
cdef int64_t _live_aligned_bytes = 0
cdef int64_t _live_bounce = 0           # engine bounce buffers allocated (kept per chunk slot)
cdef int64_t _live_bounce_bytes = 0
cdef int64_t _dbg_chunks = 0            # debug: chunk slots in use, all engines
cdef int64_t _dbg_failed = 0            # debug: invariant checks that failed
cdef int64_t _dbg_completed = 0         # debug: chunks completed, all engines


cdef inline void _dbg_check(bint ok) noexcept nogil:
    if not ok:
        aionvme_atomic_add(&_dbg_failed, 1)


def counters():
    """Process-wide counters for leak checks (tests assert they come back).

    Keys: debug (a debug build), engines, engine_fds, refill_threads (engines with a refill
    thread, each holding a second eventfd), open_handles (FileHandles
    holding an fd), aligned_buffers, aligned_bytes, bounce_buffers,
    bounce_bytes; in a debug build also chunks_in_flight, chunks_completed and
    checks_failed (hot-path invariant checks that failed: must stay 0)."""
    out = dict(debug=bool(AIONVME_DEBUG), engines=aionvme_atomic_load(&_live_engines),
               engine_fds=aionvme_atomic_load(&_engine_fds), refill_threads=aionvme_atomic_load(&_live_refill),
               open_handles=_open_handles,
               aligned_buffers=aionvme_atomic_load(&_live_aligned),
               aligned_bytes=aionvme_atomic_load(&_live_aligned_bytes),
               bounce_buffers=aionvme_atomic_load(&_live_bounce),
               bounce_bytes=aionvme_atomic_load(&_live_bounce_bytes))
    if AIONVME_DEBUG:
        out.update(chunks_in_flight=aionvme_atomic_load(&_dbg_chunks),
                   chunks_completed=aionvme_atomic_load(&_dbg_completed),
                   checks_failed=aionvme_atomic_load(&_dbg_failed))
    return out


cdef dict _engine_stats(Engine e):
    cdef Submitter *sub = e.sub
    cdef RingCounters *rc = &e.ringc
    cdef int32_t i
    cdef int64_t bounce_live = 0
    if e.chunks != NULL:
        for i in range(e.queue_depth):
            bounce_live += e.chunks[i].bounce != NULL
    return dict(submit_calls=(aionvme_atomic_load(&sub.n_calls) if sub != NULL else 0) + rc.n_calls,
                submitted=(aionvme_atomic_load(&sub.n_submitted) if sub != NULL else 0) + rc.n_submitted,
                eagain=(aionvme_atomic_load(&sub.n_eagain) if sub != NULL else 0) + rc.n_eagain,
                ring_submit_calls=rc.n_calls, ring_submitted=rc.n_submitted,
                inline_submits=e.n_inline_submits, thread_submits=e.n_thread_submits,
                inflight_bytes=e.inflight_bytes, max_inflight_bytes=e.max_inflight_bytes,
                adaptive=bool(e.adaptive), window_bytes=e.win if e.win else e.win_kept,
                completed=e.n_completed, thread_jobs=e.n_thread_jobs,
                requests=e.n_requests, live_requests=e.n_live_requests,
                inflight=e.queue_depth - e.nfree, bounce_buffers=e.n_bounce_buffers,
                ring_reaps=e.n_ring_reaps, use_aio=e.use_aio, use_uring=e.use_uring,
                uring_direct=e.uring_direct, uring_lazy=e.uring_lazy, backlog=e.backlog,
                backend=e.backend,
                more=bool(e.more), submit_budget=e.submit_budget,
                submit_ramp=sub.ramp if sub != NULL else rc.ramp,
                ring_reap=e.ring_reap, threads=e.threads_started,
                refill_thread=bool(e.refill_thread), refill_wakeups=e.n_refill_wakeups,
                owner_wakeups=e.n_owner_wakeups,
                bounce_live=bounce_live,
                closed=bool(e.closed))
