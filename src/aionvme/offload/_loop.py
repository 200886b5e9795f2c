"""A private event loop on a daemon thread, for synchronous callers.

A model's ``forward`` and an optimizer's ``step`` are synchronous, but
aionvme's transfers are awaitables. The loop thread runs the reads and
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

T = TypeVar("T")

__all__ = ["LoopThread"]


class LoopThread:
    """One event loop running forever on its own daemon thread."""

    def __init__(self, name: str = "aionvme-offload") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop thread; its result or error arrives on the future."""
        if self._closed:
            coro.close()
            raise RuntimeError("the offload loop thread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and wait for it (GIL released while waiting)."""
        return self.submit(coro).result()

    def close(self) -> None:
        """Drain aionvme's runtime on the loop, stop it, join the thread. Idempotent."""
        if self._closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.close() called from its own thread")
        from ..runtime import aclose

        try:
            asyncio.run_coroutine_threadsafe(aclose(), self._loop).result()
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
