# Transfer: what an async call returns for a request queued on an event loop's
# engine: a future-like object and a coroutine in one. The engine still never
# imports asyncio: the reactor hands over the few names it needs
# (bind_asyncio) and owns the policy (when to pump, _cancel).
#
# Why not an asyncio.Future (or one inside): each read then paid for making
# the Future (its __init__ calls loop.get_debug()), and for its completion,
# which schedules the waiting Task's wakeup through loop.call_soon (a Handle
# made, queued, run and freed) to run one loop iteration later. A Transfer
# keeps its done callbacks itself, and deliver() runs them right where the
# reactor reaped the completions when that is a loop callback with no task
# running (what the loop would do with the Handle, one iteration earlier), in
# the context each callback was registered with; the requests the woken tasks
# make go to the kernel in the flush that follows at once. Callbacks added
# after completion, and every delivery made from elsewhere (a task calling
# flush_now, the reactor closing), go through call_soon as asyncio's do.
# Counted with callgrind (bench/probes/gather_cpu.py's pattern, uvloop), per 4 KiB
# read: 9.96k instructions with an exact Future inside, 8.31k without
# (bench/JOURNAL.md, 2026-12-02).
#
# A Task awaiting a Transfer waits on the Transfer itself (asyncio's protocol
# for future-likes: _asyncio_future_blocking, get_loop, add_done_callback), so
# cancelling the Task calls Transfer.cancel: the request stops issuing chunks
# and the Transfer finishes, cancelled, once those in flight have landed; only
# then does CancelledError reach the awaiting code. An exception thrown into
# an awaiting coroutine by other means (throw) stops the request the same way
# and is raised once the chunks have landed. So when an await ends, the kernel
# no longer writes into the buffer.

@cython.final
cdef class _LoopRef:
    """Holds a loop; ``ref.get`` is a builtin method of no arguments that
    returns it, which the interpreter calls without making an argument tuple
    (Transfer.get_loop hands out one per loop)."""
    cdef object loop

    def __cinit__(self, loop):
        self.loop = loop

    @cython.binding(False)
    def get(self):
        return self.loop


# A transfer's byte count: reads of one size in a row share one int object
# instead of allocating one each (4096 is past the small-int cache).
cdef object _count_obj = 0
cdef int64_t _count_n = 0

cdef inline object _count(int64_t n):
    global _count_obj, _count_n
    if n != _count_n:
        _count_obj = n
        _count_n = n
    return _count_obj


cdef object _CancelledError = None
cdef object _InvalidStateError = None
cdef object _current_task = None
cdef object _done_ok = None   # an exact asyncio.Future, done with None: see _call_in


def bind_asyncio(cancelled_error, invalid_state_error, current_task, done_ok):
    """asyncio's CancelledError, InvalidStateError and current_task, and an
    exact asyncio.Future already done with a result (set by the reactor: the
    engine does not import asyncio)."""
    global _CancelledError, _InvalidStateError, _current_task, _done_ok
    _CancelledError = cancelled_error
    _InvalidStateError = invalid_state_error
    _current_task = current_task
    _done_ok = done_ok


cdef enum:
    T_PENDING = 0
    T_OK = 1
    T_FAILED = 2
    T_CANCELLED = 3


@cython.freelist(128)
@cython.auto_pickle(False)   # an await in progress: nothing to pickle
cdef class Transfer:
    """The awaitable of one request: a future-like object and a coroutine.

    ``await``, ``asyncio.create_task``/``TaskGroup.create_task`` (as a
    coroutine), ``gather``, ``ensure_future``, ``wait_for``, ``shield`` and
    ``wait`` (as a future, no Task made) all accept it, with asyncio's Future
    API for reading it: ``done``, ``cancelled``, ``result``, ``exception``,
    ``add_done_callback``, ``remove_done_callback``, ``get_loop``.
    ``cancel()`` stops the request and completes only once its chunks in
    flight have landed.
    """

    def __await__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        return self._step()

    def send(self, value):
        return self._step()

    cdef object _step(self):
        if not self.finished:
            self.blocking = True
            return self
        if self.thrown is not None:
            exc = self.thrown
            self.thrown = None
            raise exc
        raise StopIteration(self._result())

    cdef object _result(self):
        if self.state == T_OK:
            return self.value
        if self.state == T_FAILED:
            self.log_exc = False
            raise (<BaseException>self.value).with_traceback(self.tb)
        if self.state == T_CANCELLED:
            raise self._cancelled_error()
        raise _InvalidStateError("Result is not set.")

    cdef object _cancelled_error(self):
        if self.cancel_message is None:
            return _CancelledError()
        return _CancelledError(self.cancel_message)

    def throw(self, typ, val=None, tb=None):
        if val is None:
            exc = typ() if isinstance(typ, type) else typ
        else:
            exc = val if isinstance(val, BaseException) else typ(val)
        if tb is not None:
            exc = exc.with_traceback(tb)
        if self.finished:
            if self.thrown is not None:   # drained: what was thrown in, not the wakeup's CancelledError
                exc = self.thrown
                self.thrown = None
            raise exc
        # Interrupted by other means than Transfer.cancel: stop the request
        # and wait for the chunks in flight before letting exc out.
        self.thrown = exc
        self._stop()
        self.blocking = True
        return self

    def close(self):
        # The awaiting coroutine is closed: it cannot wait, but the request
        # stops issuing chunks (its buffer stays referenced until they land).
        if not self.finished:
            self._stop()

    cdef int _stop(self) except -1:
        cdef Request req = self.req
        if req is not None and not req.cancel_requested:
            req.cancel_requested = True
            self.hub.cancel_cb(req)
        return 0

    # -- asyncio's Future API ----------------------------------------------------

    def cancel(self, msg=None):
        """Stop the request; the transfer finishes cancelled once its chunks
        in flight have landed. False if it is done already."""
        if self.finished:
            return False
        self.cancel_message = msg
        self._stop()
        return True

    def done(self):
        return self.finished

    def cancelled(self):
        return self.state == T_CANCELLED

    def result(self):
        return self._result()

    def exception(self):
        if self.state == T_OK:
            return None
        if self.state == T_FAILED:
            self.log_exc = False
            return self.value
        if self.state == T_CANCELLED:
            raise self._cancelled_error()
        raise _InvalidStateError("Exception is not set.")

    @property
    def get_loop(self):
        """The loop (asyncio's Future API: ``transfer.get_loop()``). A Task
        awaiting a future-like looks this up and calls it at every await: a
        method would be bound anew each time (~160 instructions); this gives
        one callable per loop, made once by its Hub."""
        cdef Hub hub = _hot_hub
        if hub is not None and hub.loop is self.loop:
            return hub.get_loop
        return _LoopRef(self.loop).get

    @cython.binding(False)
    def add_done_callback(self, fn, *, context=None):
        if context is None:
            context = PyContext_CopyCurrent()
        if self.finished:
            self.loop.call_soon(fn, self, context=context)
        elif self.cb0 is None and not self.cbs:
            self.cb0 = fn
            self.ctx0 = context
        else:
            if self.cbs is None:
                self.cbs = []
            self.cbs.append((fn, context))

    def remove_done_callback(self, fn):
        cdef list keep = []
        cdef Py_ssize_t n = 0
        if self.cb0 is not None:
            if self.cb0 == fn:
                n += 1
            else:
                keep.append((self.cb0, self.ctx0))
        if self.cbs:
            for pair in self.cbs:
                if (<tuple>pair)[0] == fn:
                    n += 1
                else:
                    keep.append(pair)
        if n:
            self.cb0 = None
            self.ctx0 = None
            self.cbs = keep or None
        return n

    # What asyncio's gather reads from the futures it gathers (3.11-3.13).
    @property
    def _cancel_message(self):
        return self.cancel_message

    @_cancel_message.setter
    def _cancel_message(self, value):
        self.cancel_message = value

    def _make_cancelled_error(self):
        return self._cancelled_error()

    @property
    def _loop(self):
        return self.loop

    @property
    def _asyncio_future_blocking(self):
        return self.blocking

    @_asyncio_future_blocking.setter
    def _asyncio_future_blocking(self, value):
        self.blocking = bool(value)

    def __dealloc__(self):
        # What asyncio's futures log, from tp_dealloc rather than a finalizer
        # (a finalizer cost ~230 instructions per read, called for every one).
        if self.log_exc and self.loop is not None:
            _log_unretrieved(self.loop, self.value)

    def __repr__(self):
        if not self.finished:
            state = "pending, cancelling" if (self.req is not None and self.req.cancel_requested) else "pending"
        elif self.state == T_OK:
            state = f"finished result={self.value!r}"
        elif self.state == T_FAILED:
            state = f"finished exception={self.value!r}"
        else:
            state = "cancelled"
        return f"<aionvme.Transfer {state}>"

    # -- completion (the reactor's deliver) --------------------------------------

    cdef int _settle(self, Request req, object closed_error) except -1:
        self.req = None
        self.finished = True
        self.blocking = False
        if closed_error is not None and (req.c.flags & RF_CANCELLED) and not req.cancel_requested:
            self._fail(closed_error())
        elif req.cancel_requested:
            # the request stopped early and its chunks have landed: now it
            # may count as cancelled
            self.state = T_CANCELLED
        elif ((req.c.flags & RF_FINISHED) and not (req.c.flags & (RF_CANCELLED | RF_SHORT_WRITE))
                and req.c.err == 0 and req.c.short_seg < 0):
            self.state = T_OK
            self.value = _count(_req_nbytes(req))
        else:
            self._fail(req.exception())
        return 0

    cdef int _fail(self, object exc) except -1:
        self.state = T_FAILED
        self.value = exc
        self.tb = (<BaseException>exc).__traceback__
        self.log_exc = True
        return 0

    cdef int _schedule_callbacks(self) except -1:
        # through the loop, as asyncio's futures do
        fn = self.cb0
        if fn is not None:
            self.cb0 = None
            self.loop.call_soon(fn, self, context=self.ctx0)
            self.ctx0 = None
        cbs = self.cbs
        if cbs:
            self.cbs = None
            for pair in cbs:
                self.loop.call_soon((<tuple>pair)[0], self, context=(<tuple>pair)[1])
        return 0


cdef int _transfer_am_send(PyObject *o, PyObject *arg, PyObject **presult) except -1:
    # Transfer's am_send (PyIter_Send, what an awaiting coroutine's SEND
    # calls): PYGEN_NEXT (1) with the Transfer while it is pending,
    # PYGEN_RETURN (0) with the byte count once it finished ok, so resuming
    # raises and catches no StopIteration (~500 instructions per read on
    # 3.11); anything else raises from _step (PYGEN_ERROR, -1).
    cdef Transfer t = <Transfer>o
    if not t.finished:
        t.blocking = True
        Py_INCREF(t)
        presult[0] = <PyObject *>t
        return 1
    if t.state == T_OK and t.thrown is None:
        value = t.value
        Py_INCREF(value)
        presult[0] = <PyObject *>value
        return 0
    r = t._step()   # raises
    Py_INCREF(r)
    presult[0] = <PyObject *>r
    return 1


aionvme_set_am_send(Transfer, <aionvme_sendfunc>_transfer_am_send)


cdef PyObject *_transfer_next(object o) except NULL:
    # Transfer's tp_iternext (next(), and awaits on interpreters that do not
    # use am_send): am_send's answer, with the result raised as StopIteration
    # in C, without Cython's traceback for it (~3k instructions per await: a
    # frame, a traceback, a function object).
    cdef PyObject *r = NULL
    if _transfer_am_send(<PyObject *>o, NULL, &r) == 1:
        return r
    value = <object>r
    Py_XDECREF(r)   # am_send's reference; ``value`` holds its own
    PyErr_SetObject(StopIteration, value)   # an int: no exception object is made
    return NULL


aionvme_set_iternext(Transfer, <iternextfunc>_transfer_next)


cdef inline int64_t _req_nbytes(Request req) noexcept:
    cdef int i
    cdef int64_t n = 0
    for i in range(req.c.nsegs):
        n += req.c.segs[i].nbytes
    return n
