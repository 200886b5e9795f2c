"""What a benchmark needs from the machine: a scratch directory on a real
disk, a cold page cache, and an event loop to run on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from ._internal import is_memory_fs

__all__ = ["drop_caches", "local_scratch_dir", "resolve_loop", "run_loop", "scratch_dir"]

T = TypeVar("T")


def _is_memory_fs(directory: str) -> bool | None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        return is_memory_fs(fd)
    finally:
        os.close(fd)


def local_scratch_dir(preferred: str | None = None) -> str:
    """A directory on a real disk: ``preferred`` when given, else $TMPDIR
    unless it is tmpfs/ramfs (where O_DIRECT and the device are not
    measured), else the current directory."""
    if preferred is not None:
        return preferred
    for cand in (tempfile.gettempdir(), os.getcwd()):
        if _is_memory_fs(cand) is False:
            return cand
    return os.getcwd()


@contextlib.contextmanager
def scratch_dir(parent: str | None = None, keep: bool = False) -> Iterator[str]:
    """A fresh directory under :func:`local_scratch_dir` (``parent``), removed
    with everything in it on exit unless ``keep``."""
    d = tempfile.mkdtemp(prefix="aionvme-", dir=local_scratch_dir(parent))
    try:
        yield d
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)  # ours: made above, with whatever ran in it


def drop_caches() -> str | None:
    """Write back dirty pages and drop the page cache (root only).

    Returns
    -------
    str or None
        None when the cache was dropped, else why it could not be.
    """
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"cannot drop the page cache ({e.strerror}); O_DIRECT reads bypass it anyway"


def resolve_loop(loop: str) -> str:
    """The loop :func:`run_loop` will use for ``loop``: uvloop only where installed."""
    if loop not in ("uvloop", "asyncio"):
        raise ValueError(f"loop must be 'uvloop' or 'asyncio', got {loop!r}")
    if loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
    return loop


def run_loop(coro: Coroutine[Any, Any, T], loop: str = "uvloop") -> T:
    """Run ``coro`` to completion on a new uvloop (when installed and asked
    for) or asyncio loop. Callers that print the loop's name resolve it first
    (:func:`resolve_loop`)."""
    if resolve_loop(loop) == "uvloop":
        import uvloop

        return uvloop.run(coro)  # type: ignore[no-any-return,unused-ignore]
    return asyncio.run(coro)
