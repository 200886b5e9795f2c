# The Hub (a reactor's submitting half, in C) and the Route (what the C side
# knows of an open File), and the hot path that joins them: File.pread's
# request, its Transfer and the scheduling of the flush in one C call.

@cython.auto_pickle(False)
cdef class Hub:
    """The submitting half of a reactor, in C: wraps each queued request in
    its Transfer and schedules the flush that hands this loop iteration's
    requests to the kernel together (``flush_cb``, the reactor's, through
    ``loop.call_soon``), and stops requests their Transfers cancel
    (``cancel_cb``, the reactor's). Every ``early`` requests queued while a flush is
    scheduled are handed over at once (submit_batch): tasks woken by a burst
    of completions queue their next reads one by one, and the device restarts
    after a few task steps instead of after all of them (64 coroutines doing
    4 KiB reads: 56k -> 70-77k IOPS here; groups of 4 rather than 12 gave
    another ~5%, at the same CPU per read on uvloop: 1.05x over 40 paired
    rounds, bench/JOURNAL.md. Each call is a VM exit on a virtio disk, and the
    host starts on a group only when it arrives). Requests that finished during such
    an early flush wait in ``held`` for the scheduled one to deliver them.

    ``hub_transfer`` (from a File's Route) is File.pread/pwrite's whole path
    below Python: a request, its Transfer and the scheduling in one call.
    """

    def __cinit__(self, Engine engine not None, object loop, object flush_cb, long long early,
                  object cancel_cb):
        self.engine = engine
        self.cancel_cb = cancel_cb
        self.live = True
        self.loop = loop
        self.get_loop = _LoopRef(loop).get
        self.call_soon = loop.call_soon
        self.flush_cb = flush_cb
        self.held = []
        self.early = early if early > 0 else (<int64_t>1 << 62)

    cdef Transfer _queued(self, Request req):
        cdef Transfer t = Transfer.__new__(Transfer)
        t.loop = self.loop
        t.hub = self
        t.req = req
        req.future = t
        if not self.scheduled:
            self.scheduled = True
            self.queued = 0
            self.call_soon(self.flush_cb)
        else:
            self.queued += 1
            if self.queued >= self.early:
                self.queued = 0
                fin = self.engine.flush()
                if fin:
                    self.held.extend(fin)
        return t

    def hold(self):
        """Count as scheduled without scheduling a flush: the reactor is about
        to wake tasks (deliver) and flush what they queue right after."""
        self.scheduled = True
        self.queued = 0

    def submit(self, Request req not None):
        """The Transfer of req (queued on this hub's engine); its chunks go
        out this loop iteration."""
        return self._queued(req)

    cdef Transfer _submit_new(self, Request req):
        self.engine._enqueue(req)
        return self._queued(req)

    def retire(self):
        """No more submissions through hub_transfer's cache: the reactor
        closed, or this is a forked child's copy of the parent's."""
        global _hot_owner, _hot_hub
        self.live = False
        if _hot_hub is self:
            _hot_owner = None
            _hot_hub = None


# The route's cache of hubs: the loop it saw last and that loop's Hub, so the
# common call finds its Hub with one pointer comparison instead of three
# attribute lookups (the loop's, its reactor's ``live`` and ``hub``). The
# strong reference to the loop keeps its address from being reused while
# cached. Hub.retire drops both when the reactor closes (loop.close() closes
# it); a loop dropped without close() stays alive until another loop's read
# replaces it here (the Hub holds its loop anyway). One entry for the process,
# not one per Route: a File may serve several loops, and a retired Hub must
# not stay reachable from every File that once used it.
cdef object _hot_owner = None
cdef Hub _hot_hub = None

# What the runtime hands over once (bind_routes): the engine imports nothing
# of the layers above it.
cdef str _reactor_attr = None   # the loop attribute holding its Reactor
cdef object _params_of = None   # (block_size, parallelism) -> (block, max_inflight, mode)
cdef object _long_way = None    # (op, file, buf, offset, params) -> awaitable: the one dispatch
cdef object _read_op = None     # the dispatch's READ
# Bumped by settings_changed() (the runtime subscribes it to the defaults):
# a Route's params are good while their generation is the current one.
cdef int64_t _settings_gen = 0


def bind_routes(str reactor_attr, params_of, long_way, read_op):
    """What routes need from the runtime: the loop attribute holding a
    Reactor, the function computing a call's parameters from a File's knobs,
    the long way (the one dispatch's entrance for an open File) and its READ."""
    global _reactor_attr, _params_of, _long_way, _read_op
    _reactor_attr = reactor_attr
    _params_of = params_of
    _long_way = long_way
    _read_op = read_op


def settings_changed():
    """The defaults changed: every Route recomputes its parameters on next use."""
    global _settings_gen
    _settings_gen += 1


@cython.auto_pickle(False)
cdef class Route:
    """What the C side knows of an open File, built by the runtime at open:
    its engine handle, its knobs, and the parameters they give under the
    current defaults (recomputed when the defaults change). The way to the
    kernel goes from here through the running loop's Hub."""

    def __cinit__(self, FileHandle handle not None, block_size=None, parallelism=None):
        self.handle = handle
        self.block_size = block_size
        self.parallelism = parallelism
        self.gen = -1

    cdef tuple _params(self):
        cdef int64_t gen = _settings_gen
        if self.gen != gen:
            self.params = <tuple?>_params_of(self.block_size, self.parallelism)
            self.gen = gen   # the generation read before computing: a change meanwhile is seen next time
        return self.params

    def current_params(self):
        """(chunk size, chunks in flight per request, engine mode bits) of a
        call: the File's knobs, the rest from the current defaults."""
        return self._params()


@cython.auto_pickle(False)
cdef class Routed:
    """The base of the objects whose calls take a Route (aionvme.File): the
    engine reads the route from its own field, never from the subclass."""


cdef Request _one_segment(FileHandle f, object buf, object offset, tuple p, bint write):
    """A request of one segment, not queued yet: raises for a bad buffer or offset."""
    cdef Request req = _new_request(f, OP_WRITE if write else OP_READ, 1, p[0], p[1], p[2])
    req._add_segment(buf, offset, not write)
    return req


def hub_transfer(Route route not None, object buf, object offset, tuple p, bint write):
    """File.pread/pwrite's common case in one call: the Transfer of a read
    (or write) of buf at offset through route, submitted through the Hub of
    the running loop's reactor, or None when the long way must take it (no
    running loop or reactor yet, a reactor that is not ``live``, a closed
    File, a CUDA tensor, a bad buffer or offset: then nothing was queued, and
    the long way reports the error or serves it)."""
    return _hub_transfer(route, buf, offset, p, write)


def file_pread(self, buf, offset=0):
    """Fill all of buf from offset; the awaitable gives len(buf) in bytes or raises.

    Raises (at the await) ShortReadError if the file ends first, OSError
    subclasses for I/O errors (with filename and offset), ClosedFileError
    on a closed file. See :func:`aionvme.pread` for what the awaitable
    accepts and when errors arrive.
    """
    # File.pread, in C: a Python frame here cost ~1.2k instructions per read
    # on top of hub_transfer's (callgrind, bench/gather_cpu.py's pattern)
    cdef Route route = (<Routed?>self)._route
    cdef tuple p
    if route is None:   # never opened: the long way says so
        return _long_way(_read_op, self, buf, offset, None)
    p = route._params()
    t = _hub_transfer(route, buf, offset, p, False)
    if t is not None:
        return t
    return _long_way(_read_op, self, buf, offset, p)


cdef object _hub_transfer(Route route, object buf, object offset, tuple p, bint write):
    global _hot_owner, _hot_hub
    cdef PyObject *owner = aionvme_hook_owner()
    cdef Hub hub
    if owner == NULL:
        return None
    if owner == <PyObject *>_hot_owner and _hot_hub.live:
        hub = _hot_hub
    else:
        r = getattr(<object>owner, _reactor_attr, None)
        if r is None or not r.live:
            return None
        hub = <Hub?>r.hub
        if not hub.live:
            return None
        _hot_owner = <object>owner
        _hot_hub = hub
    try:
        req = _one_segment(route.handle, buf, offset, p, write)
    except Exception:
        return None   # the long way raises it again, at the await
    # Queued from here on: an error now must not send the caller down the long
    # way, which would queue the same transfer a second time.
    return hub._submit_new(req)


def loop_attr(str name):
    """Attribute ``name`` of the event loop running in this thread (the owner
    of its async-generator hook), or None. What asyncio.get_running_loop()
    finds, without its getpid() syscall on Python < 3.12 and without
    sys.get_asyncgen_hooks(), which builds a tuple per call (~1.2k
    instructions of every File.pread)."""
    cdef PyObject *owner = aionvme_hook_owner()
    if owner == NULL:
        return None
    return getattr(<object>owner, name, None)
