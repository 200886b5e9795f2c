"""One owner per persistent store directory.

Each directory of a ``persist=True`` store holds ``aionvme-store.lock``; the
owner keeps an exclusive ``flock`` on it for as long as the store is open and
writes its pid into it. flock belongs to the open file description, so a
second store in the same process conflicts just like one in another process,
and the kernel drops the lock when its holder dies: a lock file left by a
killed process never blocks. (A fork()ed child shares its parent's open file
description, and so its lock, until both have closed it.)

Scratch stores (``persist=False``) take no lock: their slab files have names
of their own (pid and a random tag), so any number of them, and one
persistent owner, share a directory without touching each other's files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Sequence

from ._errors import StoreLockedError

__all__ = ["LOCKNAME", "DirLock", "make_dirs", "own_dirs"]

LOCKNAME = "aionvme-store.lock"
_PIDLEN = 24


def _holder(fd: int) -> int | None:
    """The pid written in a lock file, or None (being written, or unreadable)."""
    try:
        raw = os.pread(fd, _PIDLEN, 0).split(b"\n", 1)[0]
        return int(raw) if raw else None
    except (OSError, ValueError):
        return None


class DirLock:
    """Exclusive ownership of directories; ``release()`` is idempotent."""

    def __init__(self, dirs: Sequence[str], mode: int = 0o600) -> None:
        self.fds: list[int] = []
        try:
            for d in dict.fromkeys(dirs):
                self.fds.append(self._take(d, mode))
        except BaseException:
            self.release()
            raise

    @staticmethod
    def _take(directory: str, mode: int) -> int:
        path = os.path.join(directory, LOCKNAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise StoreLockedError(directory, _holder(fd)) from None
                raise OSError(e.errno, e.strerror, path) from None
            # ours now: the pid of the holder, for the error another opener gets
            # (in place, in a fixed width: rewriting a block on a full disk
            # needs no new one; the lock works even where this write fails)
            with contextlib.suppress(OSError):
                os.pwrite(fd, f"{os.getpid()}\n".ljust(_PIDLEN).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # drops the flock (the file stays: removing it would race a new owner)

    def __del__(self) -> None:
        self.release()


def make_dirs(d: str, mode: int) -> None:
    """os.makedirs with the store's permissions: a directory it creates is
    0700 by default (``mode`` with x where it has r); existing ones are left alone."""
    dmode = mode | (mode & 0o444) >> 2
    try:
        os.makedirs(d, dmode, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, e.strerror, d) from None


def own_dirs(paths: Sequence[str], mode: int) -> DirLock:
    """The directories of a persistent store, created with its permissions,
    and owned: StoreLockedError if another live store holds one."""
    for d in paths:
        make_dirs(d, mode)
    return DirLock(paths, mode)
