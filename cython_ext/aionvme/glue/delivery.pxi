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
