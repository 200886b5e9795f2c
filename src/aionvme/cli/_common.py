"""Shared pieces of the subcommands: where to put scratch files, loops, output."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_MEMORY_FS = {0x01021994, 0x858458F6}


def local_scratch_dir(preferred: str | None = None) -> str:
    """A directory on a real disk: $TMPDIR unless it is tmpfs/ramfs, else cwd."""
    from aionvme._engine import fs_type

    for cand in ([preferred] if preferred else []) + [tempfile.gettempdir(), os.getcwd()]:
        if cand is None:
            continue
        try:
            fd = os.open(cand, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            if preferred or fs_type(fd) not in _MEMORY_FS:
                return cand
        finally:
            os.close(fd)
    return os.getcwd()


@contextlib.contextmanager
def scratch_dir(parent: str | None = None, keep: bool = False) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="aionvme-", dir=local_scratch_dir(parent))
    try:
        yield d
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)  # ours: made above, with whatever ran in it


def resolve_loop(loop: str) -> str:
    """The loop that run_loop will use for ``loop``: uvloop only where installed."""
    if loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
    return loop


def run_loop(coro: Coroutine[Any, Any, T], loop: str = "uvloop") -> T:
    """Run coro on uvloop (when installed and asked for) or asyncio's loop.
    Callers that print the loop's name resolve it first (:func:`resolve_loop`)."""
    if resolve_loop(loop) == "uvloop":
        import uvloop

        return uvloop.run(coro)  # type: ignore[no-any-return]
    return asyncio.run(coro)


def drop_caches() -> str | None:
    """Drop the page cache (root only). Returns None, or why it could not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"cannot drop the page cache ({e.strerror}); O_DIRECT reads bypass it anyway"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
