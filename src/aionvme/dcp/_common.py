"""What the writer and the reader share: running aionvme coroutines from DCP's
blocking calls, the file names, and the pieces of torch's on-disk format."""

from __future__ import annotations

import asyncio
import concurrent.futures
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


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end from blocking code (DCP's storage calls are
    blocking). On a thread with no running event loop it gets a loop of its
    own; called from inside a running loop (a blocking call in async code),
    it runs on a fresh loop in a helper thread rather than fail."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aionvme-dcp") as ex:
        return ex.submit(asyncio.run, coro).result()
