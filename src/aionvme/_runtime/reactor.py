"""One Reactor per event loop: the bridge between the engine and asyncio.

The engine's eventfd is registered with ``loop.add_reader``; every wakeup
drains all completions (eventfd counts coalesce). Requests made during one
loop iteration are queued in the engine and go to the kernel together, in one
``io_submit``, from a single ``call_soon`` callback. Transfers are created,
resolved and cancelled on the loop's thread only.

Every request is awaited through a ``Transfer`` (the engine's
awaitable.pxi): a future-like coroutine with its own done callbacks, made
and scheduled by the reactor's ``Hub`` and resolved by ``deliver``. When the
eventfd wakes the loop, ``_pump`` reaps, ``deliver`` runs the waiting tasks'
wakeups in place, and the flush right after submits what they asked for next.

Cancellation: kernel AIO cannot cancel file I/O (io_cancel answers EINVAL and
the transfer still lands). So ``Transfer.cancel()`` does not complete the
transfer at once: it stops the request from issuing more chunks and the
transfer finishes cancelled when the chunks in flight have been reaped; a
Task cancelled while awaiting one cancels it the same way. When an awaiting
task sees CancelledError, the kernel no longer touches its buffer.
"""

from __future__ import annotations

import asyncio
import atexit
import collections.abc
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Awaitable
from typing import Any

from .. import defaults
from .._engine import Engine, Hub, Request, Transfer, bind_asyncio, deliver, loop_attr
from ..exceptions import EngineClosedError

__all__ = [
    "REACTOR_ATTR",
    "AsCoroutine",
    "Reactor",
    "adopt",
    "current_pid",
    "failed",
    "get_reactor",
    "new_engine",
    "serve_blocking_callers",
]

_ATTR = "_aionvme_reactor"
REACTOR_ATTR = _ATTR  # the loop attribute holding its Reactor (hot paths read it with loop_attr)
# os.getpid() is a real syscall (glibc stopped caching it): one per request
# showed as 19% of CPU in 4 KiB random reads. The fork hook keeps this current.
_pid = os.getpid()
_FAST_LOOKUP = sys.version_info < (3, 12)
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()  # every live engine, for fork and exit
_owners: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()  # engine -> thread ident


# How an engine uses io_uring, by defaults.engine: "uring" sends every transfer
# through it; "auto" keeps kernel AIO for O_DIRECT and takes io_uring for files
# served buffered, where a page-cache hit then completes in the submitting call
# instead of on a worker thread. Measured (bench/README.md, page-cache reads):
# O_DIRECT through the ring was 0.93-0.99x kernel AIO (4 KiB random reads,
# sequential reads), cached 4 KiB reads 2.0x the worker pool at a third of the CPU.
_URING_MODE = {"uring": 2, "auto": 1}
_clock_ns = time.perf_counter_ns  # the reactor times its callbacks with it
# Pump again this long after io_uring refused SQEs (Engine.backlog), doubling
# up to _RETRY_MAX while it keeps refusing.
_RETRY_FIRST = 0.001
_RETRY_MAX = 0.1


def new_engine(settings: defaults.Settings | None = None) -> Engine:
    """An engine shaped by settings (the current defaults if None)."""
    s = settings or defaults.settings
    eng = Engine(
        s.queue_depth,
        s.threads,
        s.engine != "thread",
        s.ring_reap,
        s.submit_budget,
        s.inflight_bytes,
        submit_ramp=s.submit_ramp,
        uring=_URING_MODE.get(s.engine, 0),
        refill_thread=s.refill_thread,
    )
    if s.engine == "uring" and not eng.uring_direct:
        err = eng.uring_error or OSError("io_uring is unavailable")
        eng.close()
        raise err
    if s.engine == "aio" and not eng.use_aio:
        err = eng.aio_error or OSError("kernel AIO is unavailable")
        eng.close()
        raise err
    _engines.add(eng)
    _owners[eng] = threading.get_ident()
    return eng


class AsCoroutine:
    """The coroutine protocol over a future's own ``__await__`` iterator.

    With ``send``/``throw``/``close`` and registered as
    ``collections.abc.Coroutine``, a future is accepted where asyncio wants a
    coroutine (``create_task``, ``TaskGroup.create_task``, anyio), while
    ``await``, ``gather``, ``ensure_future``, ``wait_for`` and ``shield`` still
    take it as the future it is: no Task per call. A Task running it sees the
    future itself yielded, so cancelling that Task cancels the future.
    """

    __slots__ = ()
    _it: Any

    def __await_iter(self) -> Any:
        it = getattr(self, "_it", None)  # unset until a Task first runs it: no __init__ per future
        if it is None:
            it = self._it = self.__await__()  # type: ignore[attr-defined]
        return it

    def send(self, value: Any) -> Any:
        return self.__await_iter().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        it = self.__await_iter()
        if val is None and tb is None:
            return it.throw(typ)
        return it.throw(typ, val, tb)

    def close(self) -> None:
        self._it = None


class _FailedFuture(AsCoroutine, asyncio.Future):  # type: ignore[type-arg]
    """What :func:`failed` returns: a Future that is also a coroutine."""

    __slots__ = ("_it",)


collections.abc.Coroutine.register(_FailedFuture)


class _NoLoop:
    # The loop of _DONE_OK: a Future asks its loop get_debug() when made, and
    # schedules nothing when a result is set with no callbacks added.
    def get_debug(self) -> bool:
        return False


# Handed to a Task's wakeup in place of a Transfer that finished ok (see
# _call_in in awaitable.pxi): done, with a result, and never given callbacks.
_DONE_OK: asyncio.Future[None] = asyncio.Future(loop=_NoLoop())  # type: ignore[arg-type]
_DONE_OK.set_result(None)
# What Reactor.submit returns: a future-like coroutine that keeps its own
# done callbacks (see cython_ext/aionvme/awaitable.pxi for why no Future).
bind_asyncio(asyncio.CancelledError, asyncio.InvalidStateError, asyncio.current_task, _DONE_OK)
collections.abc.Coroutine.register(Transfer)


async def _raise(exc: BaseException) -> Any:
    raise exc


_future_cancel = asyncio.Future.cancel


def failed(exc: BaseException, loop: asyncio.AbstractEventLoop | None = None) -> Awaitable[Any]:
    """A future that raises exc when awaited: how an error found while a
    transfer is being set up (open failed, closed file, bad buffer) reaches
    the await instead of the call. Outside a running loop (asyncio.run(call))
    a coroutine that raises it."""
    if loop is None:
        loop = asyncio._get_running_loop()
        if loop is None:
            return _raise(exc)
    fut = _FailedFuture(loop=loop)
    fut.set_exception(exc)
    return fut


class Reactor:
    """Serves one event loop: owns an Engine, pumps it from the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, settings: defaults.Settings | None = None) -> None:
        self.loop = loop
        self.pid = _pid
        self.engine = new_engine(settings)
        self.engine.owner = self
        self.closed = False
        # False once closed or in a forked child: what the hot paths check on
        # the reactor loop_attr() finds (no pid comparison per call).
        self.live = True
        # submitting and scheduling the flush, in C (see Hub)
        self.hub = Hub(
            self.engine, loop, self._flush, (settings or defaults.settings).submit_batch, self._cancel
        )
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = _RETRY_FIRST
        self._fd = self.engine.fileno()
        # The longest of this reactor's loop callbacks (a pump or a flush,
        # with the tasks it wakes: they run inside it), in ns: how long
        # aionvme held the loop at most. Costs two clock reads per wakeup,
        # where a timer that watches the loop from outside wakes it every
        # interval (a few percent of 4 KiB random-read IOPS: bench/JOURNAL.md, 2026-12-03).
        self.longest_ns = 0
        loop.add_reader(self._fd, self._pump)

    # -- submitting ------------------------------------------------------------

    def submit(self, req: Request) -> Transfer:
        """Wrap a queued request in its awaitable (a :class:`Transfer`); its
        chunks go out this loop iteration, or earlier (see Hub)."""
        return self.hub.submit(req)

    def flush_now(self) -> None:
        """Hand the requests queued so far in this loop iteration to the
        kernel now instead of at the flush scheduled for its end: for a
        caller that queued a write behind and goes on without suspending (the
        device would sit idle until the loop next runs its callbacks)."""
        if self.hub.scheduled:
            self._flush_from(None)  # called from a task: wakeups go through the loop

    def _flush(self) -> None:
        # Requests queued during this loop iteration go to the kernel together
        # (a loop callback: the tasks their completions wake run right here).
        t0 = _clock_ns()
        try:
            self._flush_from(self.loop)
        finally:
            self._timed(t0)

    def _timed(self, t0: int) -> None:
        # the end of a loop callback that began at t0 (_clock_ns)
        t = _clock_ns() - t0
        if t > self.longest_ns:
            self.longest_ns = t

    def _flush_from(self, loop: asyncio.AbstractEventLoop | None) -> None:
        hub = self.hub
        hub.scheduled = False
        eng = self.engine
        finished = eng.flush()
        if hub.held:
            finished = hub.held + finished
            hub.held = []
        if eng.more:
            self._schedule()
        if eng.backlog:
            self._retry_later()
        if finished:
            deliver(finished, None, loop)  # resolves their Transfers, in Cython

    def _pump(self) -> None:
        # The eventfd is readable (a loop callback, or the retry timer's):
        # reap everything, refill, resolve the transfers.
        t0 = _clock_ns()
        eng = self.engine
        try:
            finished = eng.pump()
            if finished:
                # The tasks waiting on these run inside deliver and queue their
                # next requests; those go to the kernel together in the flush
                # right after, not one loop iteration later: the device refills
                # as soon as the woken tasks have asked.
                hub = self.hub
                hub.hold()
                try:
                    deliver(finished, None, self.loop)
                except BaseException:  # SystemExit/KeyboardInterrupt from a callback
                    hub.scheduled = False
                    self._schedule()
                    raise
                self._flush_from(self.loop)
            elif eng.more:
                # The submit budget stopped this pump: continue next iteration,
                # after the loop has run what else is ready.
                self._schedule()
            if eng.backlog:
                self._retry_later()
        finally:
            self._timed(t0)

    def _retry_later(self) -> None:
        # io_uring refused SQEs for now (EAGAIN/EBUSY: no memory for requests):
        # they wait in the ring, and with nothing in flight no completion
        # wakes the loop, so pump again after a delay that doubles while the
        # kernel keeps refusing (1 ms .. 100 ms): no busy spin on the loop.
        if self._retry is None and not self.closed:
            self._retry = self.loop.call_later(self._retry_delay, self._retry_pump)
            self._retry_delay = min(self._retry_delay * 2, _RETRY_MAX)

    def _retry_pump(self) -> None:
        self._retry = None
        if self.closed:
            return
        self._pump()
        if not self.engine.backlog:
            self._retry_delay = _RETRY_FIRST

    def _schedule(self) -> None:
        if not self.hub.scheduled:
            self.hub.scheduled = True
            self.loop.call_soon(self._flush)

    def _cancel(self, req: Request) -> None:
        self.engine.cancel(req)
        self._schedule()

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Drain: pending requests are cancelled, in-flight chunks waited for
        (GIL released), then the engine is freed. Safe on a closed loop."""
        if self.closed:
            return
        self.closed = True
        self._retire()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                self.loop.remove_reader(self._fd)
        finished = self.hub.held + self.engine.close()  # held: finished before, not delivered yet
        self.hub.held = []
        if self.loop.is_closed():
            for req in finished:  # no one can await these any more: just let go
                req.future = None
            return
        deliver(finished, _engine_closed)

    def _retire(self) -> None:
        # No more submissions through this reactor: get_reactor checks
        # ``live``, File.pread's C path (hub_transfer) its Hub's.
        self.live = False
        self.hub.retire()

    def stats(self) -> dict[str, Any]:
        out = dict(self.engine.stats())
        out["longest_callback_s"] = self.longest_ns / 1e9
        return out


def longest_callback(loop: asyncio.AbstractEventLoop, reset: bool = False) -> float:
    """The longest loop callback (seconds) of every reactor serving ``loop``
    (its shared one and those of Handles); ``reset`` starts them afresh."""
    while True:
        try:
            engines = list(_engines)
            break
        except RuntimeError:  # another thread's loop made an engine meanwhile
            continue
    longest = 0
    for eng in engines:
        r = eng.owner
        if isinstance(r, Reactor) and r.loop is loop:
            longest = max(longest, r.longest_ns)
            if reset:
                r.longest_ns = 0
    return longest / 1e9


def _engine_closed() -> EngineClosedError:
    return EngineClosedError("the aionvme runtime of this loop was closed")


def _hook_close(loop: asyncio.AbstractEventLoop) -> None:
    """Drain the loop's reactor when the loop closes (asyncio.run, loop.close()).

    Event loops have no close hook, so the bound method is wrapped on the
    instance; both asyncio's loops and uvloop's accept instance attributes.
    Where that fails the reactor is still drained at garbage collection or exit.
    """
    original = loop.close

    def close() -> None:
        r = getattr(loop, _ATTR, None)
        if r is not None:
            r.close()
        original()

    with contextlib.suppress(AttributeError, TypeError):
        loop.close = close  # type: ignore[method-assign]
        loop._aionvme_close_hooked = True  # type: ignore[attr-defined]


def running_loop() -> asyncio.AbstractEventLoop:
    """asyncio.get_running_loop() without its getpid() syscall on Python < 3.12
    (see get_reactor): the owner of this thread's async-generator hooks, when
    that is a running loop."""
    if _FAST_LOOKUP:
        owner = getattr(sys.get_asyncgen_hooks().firstiter, "__self__", None)
        if isinstance(owner, asyncio.AbstractEventLoop) and owner.is_running():
            return owner
    return asyncio.get_running_loop()


_BLOCKING_ATTR = "_aionvme_serves_blocking_callers"


def serve_blocking_callers(loop: asyncio.AbstractEventLoop) -> None:
    """Mark loop as one that runs blocking callers' transfers (a background
    loop behind ``sync_*`` functions): its engines get the adaptive window of
    the thread engines (see :mod:`aionvme._runtime.blocking`), so Ctrl-C in
    the waiting thread, which cancels the transfer and waits for the chunks in
    flight, is not kept waiting by 64 MiB on a slow device. Call it before the
    loop's first transfer, from any thread."""
    setattr(loop, _BLOCKING_ATTR, True)


def get_reactor(loop: asyncio.AbstractEventLoop | None = None) -> Reactor:
    """The reactor of loop (default: the running loop), created on first use."""
    if loop is None:
        # While a loop runs, asyncio and uvloop both install their
        # async-generator hooks in this thread's state, as bound methods of
        # the loop: the owner of the hook is the running loop, found without
        # asyncio.get_running_loop(), which on Python < 3.12 makes a getpid()
        # syscall per call (loop_attr, in C). Only loops carry our attribute,
        # so anything unexpected falls through to asyncio.
        cached: Reactor | None = loop_attr(_ATTR)
        if cached is not None and cached.live:
            return cached
        loop = asyncio.get_running_loop()
    r: Reactor | None = getattr(loop, _ATTR, None)
    if r is not None and not r.closed and r.pid == _pid:
        return r
    if loop.is_closed():
        raise EngineClosedError("the event loop is closed")
    r = Reactor(loop)
    if getattr(loop, _BLOCKING_ATTR, False):
        r.engine.adaptive = True
    setattr(loop, _ATTR, r)
    if not getattr(loop, "_aionvme_close_hooked", False):
        _hook_close(loop)
    return r


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    for eng in list(_engines):
        if isinstance(eng.owner, Reactor):
            eng.owner._retire()  # the parent's: a new one is made on first use
    # The child must not touch the parent's AIO contexts (EINVAL) or wait for
    # worker threads that were not copied: forget them; new engines are made
    # on first use because reactors and sync engines check the pid.
    for eng in list(_engines):
        eng.abandon()
    _engines.clear()


def _at_exit() -> None:
    # Let every transfer still in flight land before the buffers' memory goes.
    # An engine is driven by one thread and has no lock: one whose thread is
    # still running (a daemon thread inside a blocking read, a loop in a
    # daemon thread) is left alone, since closing it from here races with
    # that thread (SIGSEGV, tests/faults/test_lifecycle.py). Its requests hold
    # their buffers, so the memory stays valid until the process is gone.
    alive = {t.ident for t in threading.enumerate()}
    me = threading.get_ident()
    for eng in list(_engines):
        owner = _owners.get(eng)
        if owner is not None and owner != me and owner in alive:
            continue
        with contextlib.suppress(Exception):
            eng.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)


def current_pid() -> int:
    """This process's pid as the runtime knows it (kept by the fork hook,
    without a getpid() syscall): engines made under another pid are stale."""
    return _pid


def adopt(eng: Engine) -> None:
    """Record that the calling thread drives eng now (exit must not close it
    under that thread)."""
    _owners[eng] = threading.get_ident()
