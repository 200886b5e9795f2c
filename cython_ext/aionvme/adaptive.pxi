# The adaptive window of the engines of blocking calls (Engine.adaptive).
#
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


cdef int64_t _adapt_cap(Engine e, ReqC *r, int64_t cap) noexcept nogil:
    """The bytes-in-flight cap of a generate pass (cap: max_inflight_bytes,
    0 for none), starting a busy period with r when the engine was idle."""
    cdef int64_t now
    if e.win == 0:   # a busy period begins
        now = _now_ns()
        e.win = ADAPT_START
        if (e.win_kept > ADAPT_START and now - e.idle_ns < ADAPT_KEEP_NS
                and r.inode == e.win_inode and r.op == e.win_op and r.inode != NULL):
            e.win = e.win_kept
        e.win_inode = r.inode
        e.win_op = r.op
        e.mark_ns = now
        e.mark_bytes = e.done_bytes
    if cap == 0 or e.win < cap:
        return e.win
    return cap


cdef void _adapt(Engine e) noexcept nogil:
    """The adaptive window after a reap (see ADAPT_SPAN_NS)."""
    cdef int64_t now = _now_ns()
    cdef int64_t db = e.done_bytes - e.mark_bytes
    cdef int64_t dt = now - e.mark_ns
    cdef int64_t target
    # Judge once a window's worth has completed, or a whole span has
    # passed with less: earlier is too early to tell.
    if db >= e.win or dt >= ADAPT_SPAN_NS:
        # bytes the device completes in a span at the rate measured
        # (double: db * span overflows int64 past ~36 GiB)
        target = <int64_t>(<double>db * <double>ADAPT_SPAN_NS / <double>(dt if dt > 0 else 1))
        if db >= e.win:
            if target > 2 * e.win:
                target = 2 * e.win
            if e.max_inflight_bytes and target > e.max_inflight_bytes:
                target = e.max_inflight_bytes
            e.win = target if target > ADAPT_FLOOR else ADAPT_FLOOR
        elif target < e.win:
            e.win = target if target > ADAPT_FLOOR else ADAPT_FLOOR
        if db > 0:
            # a span without completions keeps its start: the next
            # completion must not look like a burst
            e.mark_ns = now
            e.mark_bytes = e.done_bytes
    if e.inflight_bytes == 0 and e.pend_head == NULL:
        e.win_kept = e.win   # idle: the next request starts a new busy period
        e.idle_ns = now
        e.win = 0
