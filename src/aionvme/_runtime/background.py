"""One event loop in a daemon thread, shared by the whole process.

Blocking code reaches aionvme's coroutines through it: the formats' blocking
twins (``sync_save``, ``sync_load``, ...), ``sync_save_in_background``, the
DeepSpeed handle, the DCP storage reader and writer, ``SyncTieredStore`` and
the offload optimizer and streamer. One thread and one engine serve them all,
instead of one of each per module (or per object).

A fresh loop per call (``asyncio.run``) costs ~35 ms here, mostly making and
closing the loop's I/O engine; a hop to a loop that is already running costs
a few tens of microseconds.

- Started on first use. A forked child gets a fresh one on its first use
  (threads are not copied by fork; the parent's engines are abandoned in the
  child by the reactor's fork hook).
- :meth:`BackgroundLoop.run` blocks; Ctrl-C (or any exception raised in the
  waiting thread) cancels the coroutine and waits until it has ended, so no
  transfer still fills the caller's memory when the exception propagates.
- :meth:`BackgroundLoop.submit` returns a ``concurrent.futures.Future``.
- At interpreter exit, what still runs is finished (a background save writes
  its file), except tasks marked with :func:`cancel_at_exit`, which are
  cancelled; then the loop and its engine are closed.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..exceptions import BlockingCallError
from .reactor import serve_blocking_callers

__all__ = [
    "THREAD_NAME",
    "BackgroundLoop",
    "background",
    "cancel_at_exit",
    "current",
    "is_background",
    "no_running_loop",
    "run",
]

T = TypeVar("T")

THREAD_NAME = "aionvme-background"


def no_running_loop(name: str, instead: str) -> None:
    """Refuse a blocking call on a thread whose event loop is running: it
    would stall every task of that loop for the whole transfer."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise BlockingCallError(f"aionvme.{name}", f"aionvme.{instead}")


class BackgroundLoop:
    """An asyncio loop running in a daemon thread."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        # Ctrl-C in a waiting caller cancels and waits for the reads in flight:
        # the loop's engine keeps them to what the device completes in ~0.25 s.
        serve_blocking_callers(self.loop)
        self._daemon_tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()  # closes the loop's aionvme engine

    def _check_caller(self) -> None:
        if threading.current_thread() is self.thread:
            # waiting here for the loop would wait for ourselves
            raise RuntimeError("a blocking aionvme call was made on aionvme's background loop thread")

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop's thread and return what it returns.

        If an exception (Ctrl-C) interrupts the wait, it is raised once ``fn``
        has either run to its end or can no longer run: a caller that cleans
        up after it knows that nothing of ``fn`` is still to come.
        """
        self._check_caller()
        box: list[Any] = []
        ready = threading.Event()

        def step() -> None:
            if ready.is_set():  # abandoned before it was reached
                return
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller's thread
                box.append((False, e))
            ready.set()

        try:
            self.loop.call_soon_threadsafe(step)
            ready.wait()
        except BaseException:
            # Callbacks run in order: when this one runs, step() has run or
            # was never scheduled (and then never runs fn).
            self.loop.call_soon_threadsafe(ready.set)
            _wait_uninterrupted(ready)
            raise
        ok, value = box[0]
        if not ok:
            raise value
        result: T = value
        return result

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; its result or error arrives on the
        returned future (``asyncio.run_coroutine_threadsafe``'s contract:
        cancelling the future cancels the task)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it.

        Ctrl-C (or any exception raised in the waiting thread) cancels it and
        waits until it has ended, then raises.
        """
        try:
            self._check_caller()
        except BaseException:
            coro.close()
            raise
        finished = threading.Event()
        box: list[asyncio.Task[T]] = []

        def start() -> None:
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda _: finished.set())
            box.append(task)

        def cancel() -> None:
            # Callbacks run in the order they were scheduled: if start() was
            # scheduled at all, it has run by now.
            if box:
                box[0].cancel()
            else:  # interrupted before start() was scheduled: it never will be
                coro.close()
                finished.set()

        try:
            # The interrupt may arrive at any point, including while start()
            # is being scheduled or right after the task began: in every case
            # the task is cancelled and waited for before the exception goes on.
            self.loop.call_soon_threadsafe(start)
            finished.wait()
        except BaseException:
            self.loop.call_soon_threadsafe(cancel)
            _wait_uninterrupted(finished)
            raise
        return box[0].result()

    def stop(self) -> None:
        """Finish what is running (background saves included; tasks marked by
        :func:`cancel_at_exit` are cancelled), then stop and close the loop."""
        if not self.thread.is_alive() or threading.current_thread() is self.thread:
            return

        async def finish() -> None:
            me = asyncio.current_task()
            for t in list(self._daemon_tasks):
                t.cancel()
            await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not me), return_exceptions=True)

        asyncio.run_coroutine_threadsafe(finish(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def _wait_uninterrupted(event: threading.Event) -> None:
    """Wait for ``event``; a signal's exception is raised once it is set."""
    pending: BaseException | None = None
    while True:
        try:
            event.wait()
            break
        except BaseException as e:
            pending = e
    if pending is not None:
        raise pending


_bg: BackgroundLoop | None = None
_bg_lock = threading.Lock()
_registered = False
_stopped_pid = 0  # the process whose loop the exit hook has stopped: no new one then


def background() -> BackgroundLoop:
    """The process's background loop, started on first use (and again in a
    forked child, or if its thread has ended). RuntimeError once interpreter
    exit has stopped it."""
    global _bg, _registered
    bg = _bg
    if bg is not None and bg.pid == os.getpid() and bg.thread.is_alive():
        return bg
    with _bg_lock:
        bg = _bg
        if bg is None or bg.pid != os.getpid() or not bg.thread.is_alive():
            if _stopped_pid == os.getpid():
                raise RuntimeError("aionvme's background loop has stopped: the interpreter is exiting")
            bg = _bg = BackgroundLoop()
            if not _registered:
                # Registered after aionvme's reactor module: runs before its
                # exit hook (atexit is LIFO), so the loop thread has finished
                # with its engine before engines are closed from the main thread.
                atexit.register(_stop_at_exit)
                _registered = True
        return bg


def current() -> BackgroundLoop | None:
    """The process's background loop if it is running (starts nothing)."""
    bg = _bg
    if bg is not None and bg.pid == os.getpid() and bg.thread.is_alive():
        return bg
    return None


def is_background(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is this process's running background loop (starts nothing)."""
    bg = current()
    return bg is not None and loop is bg.loop


def cancel_at_exit(task: asyncio.Task[Any]) -> None:
    """Have interpreter exit cancel ``task`` instead of waiting for it, if it
    runs on the background loop: for a task that may wait indefinitely (a
    loader's read-ahead waiting for its consumer). Call on the loop's thread."""
    bg = _bg
    if bg is not None and task.get_loop() is bg.loop:
        bg._daemon_tasks.add(task)


def _after_fork_in_child() -> None:
    # The lock may have been held by another thread at fork; the loop object
    # belongs to a thread the child does not have.
    global _bg_lock
    _bg_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _stop_at_exit() -> None:
    global _stopped_pid
    with _bg_lock:
        _stopped_pid = os.getpid()
        bg = _bg
    if bg is not None and bg.pid == os.getpid():
        bg.stop()


def run(name: str, instead: str, coro: Coroutine[Any, Any, T]) -> T:
    """The body of a formats blocking twin: refuse on a thread running an
    event loop, else run ``coro`` on the background loop and wait."""
    try:
        no_running_loop(name, instead)
    except BaseException:
        coro.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    return background().run(coro)
