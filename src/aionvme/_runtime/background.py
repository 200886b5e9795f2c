"""One event loop in a daemon thread, shared by the whole process: the formats'
blocking twins and the DeepSpeed handle's async operations run their
coroutines on it.

A fresh loop per call (``asyncio.run``) costs ~35 ms here, mostly making and
closing the loop's I/O engine; a hop to a loop that is already running costs
a few tens of microseconds. The same loop owns the writes that
:func:`aionvme.sync_save_in_background` leaves running.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundLoop", "background", "no_running_loop", "run"]

T = TypeVar("T")


def no_running_loop(name: str, instead: str) -> None:
    """Refuse a blocking call on a thread whose event loop is running: it
    would stall every task of that loop for the whole transfer."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"aionvme.{name}() blocks, and this thread runs an event loop: use `await aionvme.{instead}(...)` "
        f"(or call {name} from another thread)"
    )


class BackgroundLoop:
    """An asyncio loop running in a daemon thread."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="aionvme-background", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()  # closes the loop's aionvme engine

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop's thread and return what it returns."""
        box: list[Any] = []
        ready = threading.Event()

        def step() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller's thread
                box.append((False, e))
            ready.set()

        self.loop.call_soon_threadsafe(step)
        _wait_uninterrupted(ready)
        ok, value = box[0]
        if not ok:
            raise value
        result: T = value
        return result

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it.

        Ctrl-C (or any exception raised in the waiting thread) cancels it and
        waits until it has ended, so no transfer still fills the caller's
        memory when the exception propagates.
        """
        finished = threading.Event()

        def start() -> asyncio.Task[T]:
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda _: finished.set())
            return task

        task = self.call(start)
        try:
            finished.wait()
        except BaseException:
            self.loop.call_soon_threadsafe(task.cancel)
            _wait_uninterrupted(finished)
            raise
        return task.result()

    def stop(self) -> None:
        """Finish what is running (background saves included), then stop."""
        if not self.thread.is_alive():
            return

        async def finish() -> None:
            me = asyncio.current_task()
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


def background() -> BackgroundLoop:
    """The process's background loop (a new one after fork: threads are not copied)."""
    global _bg
    with _bg_lock:
        if _bg is None or _bg.pid != os.getpid() or not _bg.thread.is_alive():
            first = _bg is None
            _bg = BackgroundLoop()
            if first:
                # registered after aionvme's runtime: runs before it at exit
                # (atexit is LIFO), so the writes left running finish first.
                atexit.register(_stop_at_exit)
        return _bg


def _stop_at_exit() -> None:
    bg = _bg
    if bg is not None and bg.pid == os.getpid():
        bg.stop()


def run(name: str, instead: str, coro: Coroutine[Any, Any, T]) -> T:
    """The blocking twin's body: refuse on a loop thread, else run ``coro``
    on the background loop and wait."""
    try:
        no_running_loop(name, instead)
    except BaseException:
        coro.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    return background().run(coro)
