"""What the writer and the reader share: running aionvme coroutines from DCP's
blocking calls, the file names, and the pieces of torch's on-disk format."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from .._runtime.background import background

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
    blocking) on aionvme's background loop, and return its result or raise
    its error. Works from any thread, including one running an event loop of
    its own. The loop is kept, so a save or a load does not pay for setting
    up and tearing down an engine (~60 ms here); Ctrl-C cancels the transfer
    and waits for it to end."""
    return background().run(coro)
