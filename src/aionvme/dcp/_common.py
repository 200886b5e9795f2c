"""What the writer and the reader share: running aionvme coroutines from DCP's
blocking calls, the file names, and the pieces of torch's on-disk format."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["METADATA", "PAGE", "SUFFIX", "align_up", "run"]

# torch.distributed.checkpoint.filesystem: the metadata file of a checkpoint
# saved with collectives, and the suffix of its data files.
METADATA = ".metadata"
SUFFIX = ".distcp"
# Data starts on page boundaries: the largest O_DIRECT alignment in common use.
PAGE = 4096


def align_up(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


_lock = threading.Lock()
_service: tuple[int, asyncio.AbstractEventLoop, threading.Thread] | None = None


def _service_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for DCP calls, on a daemon thread: made on
    first use (and again in a forked child), then kept, so a save or a load
    does not pay for setting up and tearing down an engine (~60 ms here)."""
    global _service
    with _lock:
        s = _service
        if s is None or s[0] != os.getpid() or not s[2].is_alive():
            loop = asyncio.new_event_loop()
            t = threading.Thread(target=loop.run_forever, name="aionvme-dcp", daemon=True)
            t.start()
            s = _service = (os.getpid(), loop, t)
        return s[1]


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end from blocking code (DCP's storage calls are
    blocking) on the service loop, and return its result or raise its error.
    Works from any thread, including one running an event loop of its own."""
    return asyncio.run_coroutine_threadsafe(coro, _service_loop()).result()
