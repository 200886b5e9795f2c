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


cdef extern from *:
    """
    /* Is fn the wakeup of a C asyncio Task (what Task passes to
       add_done_callback of what it awaits)? On 3.11 an object of type
       TaskWakeupMethWrapper, on 3.12+ a builtin function named task_wakeup
       bound to the task. Either way it only asks the future for its result()
       and steps the task. */
    static PyTypeObject *aionvme_wakeup_type = NULL;
    static PyMethodDef *aionvme_wakeup_def = NULL;
    static int aionvme_is_task_wakeup(PyObject *fn) {
        PyTypeObject *tp = Py_TYPE(fn);
        if (tp == aionvme_wakeup_type) return 1;
        if (PyCFunction_Check(fn)) {
            PyMethodDef *ml = ((PyCFunctionObject *)fn)->m_ml;
            if (ml == aionvme_wakeup_def) return 1;
            if (aionvme_wakeup_def == NULL && ml != NULL && ml->ml_name != NULL
                    && strcmp(ml->ml_name, "task_wakeup") == 0) {
                PyObject *self = PyCFunction_GET_SELF(fn);
                if (self != NULL && strcmp(Py_TYPE(self)->tp_name, "_asyncio.Task") == 0) {
                    aionvme_wakeup_def = ml;
                    return 1;
                }
            }
            return 0;
        }
        if (aionvme_wakeup_type == NULL && strcmp(tp->tp_name, "TaskWakeupMethWrapper") == 0) {
            aionvme_wakeup_type = tp;
            return 1;
        }
        return 0;
    }
    """
    bint aionvme_is_task_wakeup(object fn)


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

    cdef object loop
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
            req.engine.owner._cancel(req)
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


cdef extern from *:
    """
    static int aionvme_finalizing(void) {
    #if PY_VERSION_HEX >= 0x030D0000
        return Py_IsFinalizing();
    #else
        return _Py_IsFinalizing();
    #endif
    }
    """
    PyObject *PyObject_CallMethodOneArg(object obj, object name, object arg)   # NULL: raised
    void PyErr_WriteUnraisable(object obj)
    bint aionvme_finalizing()


cdef void _log_unretrieved(object loop, object exc) noexcept:
    # From a Transfer's dealloc, which may run while an exception is raised:
    # that exception is kept as it is, and one from the handler itself goes
    # to sys.unraisablehook (a dealloc cannot raise). Not while the
    # interpreter shuts down: a dealloc runs after the garbage collector
    # cleared the cycle it was in, loop included (unlike a finalizer), so the
    # loop cannot report anything then.
    cdef PyObject *et
    cdef PyObject *ev
    cdef PyObject *etb
    if aionvme_finalizing():
        return
    PyErr_Fetch(&et, &ev, &etb)
    r = PyObject_CallMethodOneArg(loop, "call_exception_handler", {
        "message": "Transfer exception was never retrieved",
        "exception": exc,
    })
    if r == NULL:
        PyErr_WriteUnraisable(loop)
    else:
        Py_XDECREF(r)
    PyErr_Restore(et, ev, etb)


cdef int _call_in(object fn, Transfer t, object ctx) except -1:
    # What the loop's Handle would do with the callback, without the Handle.
    try:
        PyContext_Enter(ctx)
    except RuntimeError:   # that context is entered already: let the loop run it
        t.loop.call_soon(fn, t, context=ctx)
        return 0
    try:
        if t.state == T_OK and aionvme_is_task_wakeup(fn):
            # A Task's wakeup only asks what it was handed for result(),
            # and on success resumes the coroutine with send(None), which
            # takes the byte count from the Transfer itself. Handed an
            # exact Future it reads the result in C; handed the Transfer it
            # looks result() up by a C string and calls it (~1.1k
            # instructions per read on 3.11, callgrind). Failures and cancellations
            # still hand over the Transfer, whose result() raises.
            fn(_done_ok)
        else:
            fn(t)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        t.loop.call_exception_handler({
            "message": f"Exception in callback {fn!r}({t!r})",
            "exception": e,
            "future": t,
        })
    finally:
        PyContext_Exit(ctx)
    return 0


# How long _wake runs woken tasks inside one reactor callback before it leaves
# the rest to the loop (call_soon, in order): the loop then runs whatever else
# is ready between them. A burst of 64 woken tasks takes ~0.5 ms here; on a
# busy VM the same burst sometimes took 3-8 ms (bench/JOURNAL.md, 2026-12-03).
cdef int64_t _wake_budget_ns = 2 * 1000 * 1000
cdef Py_ssize_t WAKE_CHECK_EVERY = 8   # tasks between two clock reads


def _set_wake_budget(long long ns):
    """For tests and experiments: the time budget of one callback's wakeups
    (ns; 0: every wakeup after the first clock check goes through the loop).
    Returns the previous budget."""
    global _wake_budget_ns
    old = _wake_budget_ns
    _wake_budget_ns = ns if ns > 0 else 0
    return old


cdef int _wake(list woken) except -1:
    # Run the done callbacks of delivered transfers (the awaiting tasks'
    # wakeups), in order. SystemExit or KeyboardInterrupt from one goes on
    # up, as from the loop; the callbacks not run yet are left to the loop.
    # Past the time budget, the rest are left to the loop as well.
    cdef Transfer t
    cdef Py_ssize_t i = 0, n = len(woken)
    cdef int64_t t0 = _now_ns() if n > WAKE_CHECK_EVERY else 0
    while i < n:
        if i and i % WAKE_CHECK_EVERY == 0 and _now_ns() - t0 > _wake_budget_ns:
            while i < n:
                (<Transfer>woken[i])._schedule_callbacks()
                i += 1
            return 0
        t = <Transfer>woken[i]
        i += 1
        try:
            fn = t.cb0
            if fn is not None:
                ctx = t.ctx0
                t.cb0 = None
                t.ctx0 = None
                _call_in(fn, t, ctx)
            while t.cbs:
                pair = t.cbs.pop(0)
                _call_in((<tuple>pair)[0], t, (<tuple>pair)[1])
        except BaseException:
            t._schedule_callbacks()
            while i < n:
                (<Transfer>woken[i])._schedule_callbacks()
                i += 1
            raise
    return 0


cdef extern from *:
    """
    typedef int (*aionvme_sendfunc)(PyObject *, PyObject *, PyObject **);
    /* Give a type with an am_await slot (Cython made its PyAsyncMethods) an
       am_send: what an awaiting coroutine calls instead of tp_iternext, and
       which returns the result without raising StopIteration. */
    static int aionvme_set_am_send(PyObject *t, aionvme_sendfunc f) {
        PyTypeObject *tp = (PyTypeObject *)t;
        if (tp->tp_as_async == NULL) return 0;
        tp->tp_as_async->am_send = (sendfunc)f;
    #ifdef Py_TPFLAGS_HAVE_AM_SEND
        tp->tp_flags |= Py_TPFLAGS_HAVE_AM_SEND;
    #endif
        PyType_Modified(tp);
        return 1;
    }
    """
    ctypedef int (*aionvme_sendfunc)(PyObject *, PyObject *, PyObject **)
    int aionvme_set_am_send(object t, aionvme_sendfunc f)


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


@cython.auto_pickle(False)
cdef class Hub:
    """The submitting half of a reactor, in C: wraps each queued request in
    its Transfer and schedules the flush that hands this loop iteration's
    requests to the kernel together (``flush_cb``, the reactor's, through
    ``loop.call_soon``). Every ``early`` requests queued while a flush is
    scheduled are handed over at once (submit_batch): tasks woken by a burst
    of completions queue their next reads one by one, and the device restarts
    after a few task steps instead of after all of them (64 coroutines doing
    4 KiB reads: 56k -> 70-77k IOPS here; groups of 4 rather than 12 gave
    another ~5%, at the same CPU per read on uvloop: 1.05x over 40 paired
    rounds, bench/JOURNAL.md. Each call is a VM exit on a virtio disk, and the host
    starts on a group only when it arrives). Requests that finished during such
    an early flush wait in ``held`` for the scheduled one to deliver them.

    ``hub_transfer`` is File.pread/pwrite's whole path below Python: a
    request, its Transfer and the scheduling in one call.
    """

    cdef readonly Engine engine
    cdef object loop
    cdef object get_loop          # a callable returning loop (Transfer.get_loop): _LoopRef(loop).get
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
        self.loop = loop
        self.get_loop = _LoopRef(loop).get
        self.call_soon = loop.call_soon
        self.flush_cb = flush_cb
        self.held = []
        self.early = early if early > 0 else (<int64_t>1 << 62)

    cdef Transfer _queued(self, Request req):
        cdef Transfer t = Transfer.__new__(Transfer)
        t.loop = self.loop
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


def deliver(list finished, object closed_error=None, object loop=None):
    """Resolve the Transfers of finished requests (on the loop's thread) and
    run the requests' own callbacks. closed_error: makes the exception for
    requests the engine cancelled while closing (the reactor's close), else
    None. loop: given when this is a callback of that loop: the transfers'
    done callbacks (the awaiting tasks' wakeups) then run here, unless a task
    is running; otherwise, and without loop, they go through loop.call_soon."""
    cdef Request req
    cdef Transfer t
    cdef bint direct = loop is not None and _current_task(loop) is None
    cdef list woken = None
    for obj in finished:
        req = <Request>obj
        fut = req.future
        if fut is not None:
            req.future = None
            if type(fut) is Transfer:
                t = <Transfer>fut
                t._settle(req, closed_error)
                if t.cb0 is not None or t.cbs:
                    if not direct:
                        t._schedule_callbacks()
                    elif woken is None:
                        woken = [t]
                    else:
                        woken.append(t)
        cb = req.callback
        if cb is not None:
            req.callback = None
            cb(req)
    if woken is not None:
        _wake(woken)


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
