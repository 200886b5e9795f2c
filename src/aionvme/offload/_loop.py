"""The offload objects' handle on aionvme's background event loop.

A model's ``forward`` and an optimizer's ``step`` are synchronous, but
aionvme's transfers are awaitables. The process's background loop (one
daemon thread, shared with the other blocking twins) runs the reads and
writes; the calling thread hands it coroutines and gets
``concurrent.futures.Future`` objects back, which it may wait on (blocking
itself, never the loop). Nothing CPU-heavy runs on the loop thread: copies and
dtype conversions go to ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .._runtime.background import background

T = TypeVar("T")

__all__ = ["LoopThread"]


class LoopThread:
    """One user's share of the background loop: what it submitted is
    tracked, so :meth:`close` can wait for exactly that (the loop and its
    engine go on serving others)."""

    def __init__(self, name: str = "offload") -> None:
        self._bg = background()
        self._name = name
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._bg.loop

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop thread; its result or error arrives on the future."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"the {self._name} loop is closed")
        fut = self._bg.submit(coro)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and wait for it (GIL released while
        waiting); Ctrl-C cancels it and waits for it to end."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"the {self._name} loop is closed")
        return self._bg.run(coro)

    def close(self) -> None:
        """Wait for what this user submitted and has not collected, then
        refuse new work. Idempotent."""
        if self._closed:
            return
        if threading.current_thread() is self._bg.thread:
            raise RuntimeError("LoopThread.close() called from the loop's own thread")
        self._closed = True
        with self._lock:
            pending = list(self._pending)
        # the outcome no longer matters, but the transfers must have ended
        # before their buffers may be freed
        concurrent.futures.wait(pending)
