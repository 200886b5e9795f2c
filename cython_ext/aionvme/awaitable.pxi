# Transfer: what an async call returns for a request queued on an event loop's
# engine. The engine still never imports asyncio: the reactor hands over the
# Future type (set_future_type) and owns the policy (when to pump, _cancel).
#
# Why a class of its own instead of a subclass of asyncio.Future: a Task waits
# on what its coroutine yields, and takes C's fast path only for an exact
# asyncio.Future; a subclass goes through attribute lookups and Python-level
# calls (get_loop, add_done_callback, setting _asyncio_future_blocking), and
# making a Python subclass instance costs as much again. Counted with
# callgrind on bench/asyncio_floor.py's pattern: 7.1k instructions per await
# with exact futures, 11.4k with the subclass the runtime used before.
#
# So a Transfer holds an exact Future (``fut``) that the reactor resolves, and
# awaiting it yields that Future. A Task cancelled while waiting cancels
# ``fut`` itself (it does not go through Transfer.cancel): the exception it
# then throws into the await stops the request, and the await yields a second
# Future (``drain``) that the reactor resolves when the request's chunks have
# landed; only then does the exception reach the awaiting code. So when an
# await ends, the kernel no longer writes into the buffer, as before.

cdef extern from *:
    """
    static void aionvme_set_iternext(PyObject *t, iternextfunc f) {
        ((PyTypeObject *)t)->tp_iternext = f;
        PyType_Modified((PyTypeObject *)t);
    }
    """
    ctypedef PyObject *(*iternextfunc)(PyObject *)
    void aionvme_set_iternext(object t, iternextfunc f)


cdef extern from *:
    """
    /* The owner of this thread's async-generator firstiter hook: asyncio's and
       uvloop's loops install bound methods of themselves while they run. */
    static PyObject *aionvme_hook_owner(void) {
        PyObject *h = PyThreadState_Get()->async_gen_firstiter;
        if (h != NULL && PyMethod_Check(h)) return PyMethod_GET_SELF(h);
        return NULL;
    }
    """
    PyObject *aionvme_hook_owner()


cdef object _future_type = None
cdef object _fut_done = None         # _future_type.done, unbound: no method lookup per delivery
cdef object _fut_set_result = None   # _future_type.set_result, unbound
cdef tuple _no_args = ()


def set_future_type(t):
    """The Future class Transfers wait on (asyncio.Future; set by the reactor)."""
    global _future_type, _fut_done, _fut_set_result
    _future_type = t
    _fut_done = t.done
    _fut_set_result = t.set_result


@cython.auto_pickle(False)   # an await in progress: nothing to pickle
cdef class Transfer:
    """The awaitable of one request: a future-like object and a coroutine.

    ``await``, ``asyncio.create_task``/``TaskGroup.create_task`` (as a
    coroutine), ``gather``, ``ensure_future``, ``wait_for`` and ``shield`` (as
    a future, no Task made) all accept it. Future methods not defined here are
    those of the exact Future it wraps (``fut``); done-callbacks receive that
    Future. ``cancel()`` stops the request and completes only once its chunks
    in flight have landed.
    """

    cdef readonly object fut      # the exact Future: result, exception or cancellation
    cdef object drain             # resolved when the request finished, after fut was cancelled under it
    cdef object thrown            # the exception thrown into a draining await, raised after the drain
    cdef public Request req       # the request, until the reactor delivered it
    cdef object kw                # {"loop": loop}, one dict per reactor: Future(**kw) allocates none
    cdef object result            # the byte count once finished ok
    cdef readonly bint finished   # delivered by the reactor
    cdef bint ok

    def __await__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        return self._step()

    def send(self, value):
        return self._step()

    cdef object _step(self):
        if self.finished:
            if self.thrown is not None:
                exc = self.thrown
                self.thrown = None
                raise exc
            if self.ok:
                raise StopIteration(self.result)
            raise StopIteration(self.fut.result())   # result() raises its exception or CancelledError
        fut = self.drain if self.drain is not None else self.fut
        fut._asyncio_future_blocking = True
        return fut

    def throw(self, typ, val=None, tb=None):
        if val is None:
            exc = typ() if isinstance(typ, type) else typ
        else:
            exc = val if isinstance(val, BaseException) else typ(val)
        if tb is not None:
            exc = exc.with_traceback(tb)
        if self.finished:
            raise exc
        # The awaiting task is being cancelled (or interrupted): stop the
        # request and wait for the chunks in flight before letting exc out.
        self.thrown = exc
        self._stop()
        if self.drain is None or self.drain.done():   # done: a second cancel cancelled it
            self.drain = PyObject_Call(_future_type, _no_args, self.kw)
        self.drain._asyncio_future_blocking = True
        return self.drain

    def close(self):
        # The awaiting coroutine is closed: it cannot wait, but the request
        # stops issuing chunks (its buffer stays referenced until they land).
        if not self.finished:
            self._stop()

    cdef int _stop(self) except -1:
        cdef Request req = self.req
        if req is not None and not req.cancel_requested:
            req.cancel_requested = True
            req.engine.owner._cancel(req)
        return 0

    def cancel(self, msg=None):
        """Stop the request; the future is cancelled once its chunks in
        flight have landed. False if it is done already."""
        cdef Request req = self.req
        if self.finished or self.fut.done():
            return False
        req.cancel_msg = msg
        self._stop()
        return True

    @property
    def _asyncio_future_blocking(self):
        return self.fut._asyncio_future_blocking

    @_asyncio_future_blocking.setter
    def _asyncio_future_blocking(self, value):
        self.fut._asyncio_future_blocking = value

    def __getattr__(self, name):
        return getattr(self.fut, name)

    def __repr__(self):
        return f"<aionvme.Transfer {self.fut!r}>"


cdef PyObject *_transfer_next(object o) except NULL:
    # Transfer's tp_iternext (what an awaiting coroutine calls): the two common
    # steps in C without Cython's traceback for a raised StopIteration, which
    # cost ~3k instructions per await (a frame, a traceback, a function object).
    cdef Transfer t = <Transfer>o
    if not t.finished:
        fut = t.drain if t.drain is not None else t.fut
        fut._asyncio_future_blocking = True
        Py_INCREF(fut)
        return <PyObject *>fut
    if t.ok and t.thrown is None:
        PyErr_SetObject(StopIteration, t.result)   # an int: no exception object is made
        return NULL
    r = t._step()   # raises
    Py_INCREF(r)
    return <PyObject *>r


aionvme_set_iternext(Transfer, <iternextfunc>_transfer_next)


@cython.auto_pickle(False)
cdef class Hub:
    """The submitting half of a reactor, in C: wraps each queued request in
    its Transfer and schedules the flush that hands this loop iteration's
    requests to the kernel together (``flush_cb``, the reactor's, through
    ``loop.call_soon``). Every ``early`` requests queued while a flush is
    scheduled are handed over at once (submit_batch): tasks woken by a burst
    of completions queue their next reads one by one, and the device restarts
    after a few task steps instead of after all of them (64 coroutines doing
    4 KiB reads: 56k -> 70-77k IOPS here). Requests that finished during such
    an early flush wait in ``held`` for the scheduled one to deliver them.

    ``hub_transfer`` is File.pread/pwrite's whole path below Python: a
    request, its Transfer and the scheduling in one call.
    """

    cdef readonly Engine engine
    cdef dict kw                  # {"loop": loop}: Future(**kw) allocates no dict
    cdef object call_soon
    cdef object flush_cb
    cdef public list held         # finished during an early flush, not delivered yet
    cdef public bint scheduled    # a flush is scheduled on the loop
    cdef int64_t queued
    cdef int64_t early
    cdef readonly bint live       # False once retired (its reactor closed, or a forked child)

    def __cinit__(self, Engine engine not None, object loop, object flush_cb, long long early):
        self.engine = engine
        self.live = True
        self.kw = {"loop": loop}
        self.call_soon = loop.call_soon
        self.flush_cb = flush_cb
        self.held = []
        self.early = early if early > 0 else (<int64_t>1 << 62)

    cdef Transfer _queued(self, Request req):
        cdef Transfer t = Transfer.__new__(Transfer)
        t.fut = PyObject_Call(_future_type, _no_args, self.kw)
        t.kw = self.kw
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


# hub_transfer's cache: the loop it saw last and that loop's Hub, so the common
# call finds its Hub with one pointer comparison instead of three attribute
# lookups (the loop's, its reactor's ``live`` and ``hub``). The strong reference
# to the loop keeps its address from being reused while cached. Hub.retire drops
# both when the reactor closes (loop.close() closes it); a loop dropped without
# close() stays alive until another loop's read replaces it here (the Hub holds
# its loop anyway). It is not keyed by ``attr``: every caller passes the
# reactor's one attribute (REACTOR_ATTR).
cdef object _hot_owner = None
cdef Hub _hot_hub = None


cdef Request _one_segment(FileHandle f, object buf, object offset, tuple p, bint write):
    """A request of one segment, not queued yet: raises for a bad buffer or offset."""
    cdef Request req = _new_request(f, OP_WRITE if write else OP_READ, 1, p[0], p[1], p[2])
    req._add_segment(buf, offset, not write)
    return req


def hub_transfer(str attr, object file, object buf, object offset, tuple p, bint write):
    """File.pread/pwrite's common case in one call: the Transfer of a read
    (or write) of buf at offset on ``file._h``, submitted through the Hub of
    the reactor that the running loop holds as ``attr``, or None when the
    long way must take it (no running loop or reactor yet, a reactor that is
    not ``live``, a closed File, a CUDA tensor, a bad buffer or offset: then
    nothing was queued, and the long way reports the error or serves it)."""
    return _hub_transfer(attr, file, buf, offset, p, write)


cdef object _defaults = None    # aionvme.defaults (File params are cached per settings)
cdef str _reactor_attr = None   # the loop attribute holding its Reactor
cdef object _long_way = None    # transfer.submit_file
cdef object _read_op = None     # transfer.READ


def bind_file_pread(defaults_module, str reactor_attr, long_way, read_op):
    """What file_pread needs from the Python side (set by aionvme.file at import)."""
    global _defaults, _reactor_attr, _long_way, _read_op
    _defaults = defaults_module
    _reactor_attr = reactor_attr
    _long_way = long_way
    _read_op = read_op


def file_pread(self, buf, offset=0):
    """Fill all of buf from offset; the awaitable gives len(buf) in bytes or raises.

    Raises (at the await) ShortReadError if the file ends first, OSError
    subclasses for I/O errors (with filename and offset), ClosedFileError
    on a closed file. See :func:`aionvme.pread` for what the awaitable
    accepts and when errors arrive.
    """
    # File.pread, in C: the hot path of random reads had ~1.2k instructions of
    # Python frame on top of hub_transfer's (callgrind, 4 KiB reads by gather)
    cached = self._p
    if (type(cached) is tuple and len(<tuple>cached) == 2
            and (<tuple>cached)[0] is _defaults.settings):
        p = (<tuple>cached)[1]
    else:
        p = self._params()
    if type(p) is tuple:
        t = _hub_transfer(_reactor_attr, self, buf, offset, <tuple>p, False)
        if t is not None:
            return t
    return _long_way(_read_op, self, buf, offset, p)


cdef object _hub_transfer(str attr, object file, object buf, object offset, tuple p,
                          bint write):
    global _hot_owner, _hot_hub
    cdef PyObject *owner = aionvme_hook_owner()
    cdef Hub hub
    if owner == NULL:
        return None
    if owner == <PyObject *>_hot_owner and _hot_hub.live:
        hub = _hot_hub
    else:
        r = getattr(<object>owner, attr, None)
        if r is None or not r.live:
            return None
        hub = <Hub?>r.hub
        if not hub.live:
            return None
        _hot_owner = <object>owner
        _hot_hub = hub
    h = file._h
    if type(h) is not FileHandle:
        return None
    try:
        req = _one_segment(<FileHandle>h, buf, offset, p, write)
    except Exception:
        return None   # the long way raises it again, at the await
    # Queued from here on: an error now must not send the caller down the long
    # way, which would queue the same transfer a second time.
    return hub._submit_new(req)


cdef inline int64_t _req_nbytes(Request req) noexcept:
    cdef int i
    cdef int64_t n = 0
    for i in range(req.c.nsegs):
        n += req.c.segs[i].nbytes
    return n


def deliver(list finished, object closed_error=None):
    """Resolve the Transfers of finished requests (on the loop's thread); run
    their callbacks. closed_error: makes the exception for requests the engine
    cancelled while closing (the reactor's close), else None."""
    cdef Request req
    cdef Transfer t
    cdef bint ok
    for obj in finished:
        req = <Request>obj
        fut = req.future
        if fut is not None:
            req.future = None
            if type(fut) is Transfer:
                t = <Transfer>fut
                t.req = None
                t.finished = True
                fut = t.fut
                ok = ((req.c.flags & RF_FINISHED) and not (req.c.flags & (RF_CANCELLED | RF_SHORT_WRITE))
                      and req.c.err == 0 and req.c.short_seg < 0)
                if not _fut_done(fut):
                    if closed_error is not None and (req.c.flags & RF_CANCELLED) and not req.cancel_requested:
                        fut.set_exception(closed_error())
                    elif ok and not req.cancel_requested:
                        t.result = _req_nbytes(req)
                        t.ok = True
                        _fut_set_result(fut, t.result)
                    elif req.cancel_requested:
                        # the request stopped early and its chunks have
                        # landed: now the future may be cancelled
                        fut.cancel(req.cancel_msg)
                    else:
                        fut.set_exception(req.exception())
                if t.drain is not None:
                    if not t.drain.done():
                        t.drain.set_result(None)
                    t.drain = None
        cb = req.callback
        if cb is not None:
            req.callback = None
            cb(req)


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
