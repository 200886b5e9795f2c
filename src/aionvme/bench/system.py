"""What a benchmark needs from the machine: a scratch directory on a real
disk, a cold page cache, and an event loop to run on."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import shutil
import tempfile
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from ._internal import is_memory_fs

__all__ = [
    "cached_bytes",
    "drop_caches",
    "evict",
    "local_scratch_dir",
    "make_cold",
    "resolve_loop",
    "run_loop",
    "scratch_dir",
]

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
        return (
            f"cannot drop the page cache ({e.strerror}); O_DIRECT reads bypass it, and the buffered "
            "loads evict the files they read"
        )


def evict(*paths: str) -> None:
    """Write back these files and drop their pages from the page cache, as
    root's :func:`drop_caches` would, for any user who can open them
    (``posix_fadvise(POSIX_FADV_DONTNEED)`` drops a file's clean pages that
    no process has mapped: man 2 posix_fadvise)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages are written back, not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc: ctypes.CDLL | None = None


def _mincore() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


def cached_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache now (``mincore`` on a mapping of
    the file, which faults nothing in: man 2 mincore), to the page."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = _mincore()
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        try:
            vec = (ctypes.c_ubyte * -(-size // page))()
            if libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), path)
            return sum(b & 1 for b in bytes(vec)) * page
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def make_cold(*paths: str) -> int:
    """Make the reads of ``paths`` cold: the page cache dropped (root), and
    these files' pages evicted (anyone: :func:`evict`). Returns the bytes of
    them still cached (0: every timed read of them goes to the device)."""
    drop_caches()
    evict(*paths)
    return sum(cached_bytes(p) for p in paths)


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
