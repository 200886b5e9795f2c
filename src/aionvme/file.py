"""Files: the :class:`File` object for hot loops, and the path-based calls.

How a file is opened (O_DIRECT or buffered, alignment, kernel AIO or worker
threads) is decided in ``aionvme._runtime.opening``; every transfer goes
through the one dispatch, ``aionvme._runtime.transfer``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import warnings
from collections.abc import Awaitable, Iterable
from typing import Any

from . import defaults
from ._engine import Route, file_pread, hub_transfer
from ._runtime import scatter, transfer
from ._runtime.blocking import thread_engine
from ._runtime.opening import FS_NAMES, FileBase, OpenInfo, PathLike, open_handle, parse_mode
from ._runtime.reactor import failed, get_reactor
from ._runtime.transfer import FDATASYNC, FSYNC, READ, READROWS, READV, WRITE, WRITEROWS, WRITEV
from .exceptions import BlockingCallError, UnsupportedOperation, os_error

__all__ = [
    "FS_NAMES",
    "File",
    "OpenInfo",
    "PathLike",
    "fsync",
    "open",
    "pread",
    "pread_many",
    "pread_rows",
    "pwrite",
    "pwrite_many",
    "pwrite_rows",
]


class File(FileBase):
    """An open file for repeated transfers: fds opened once, alignment known.

    Parameters
    ----------
    path : str or os.PathLike
    mode : {'r', 'r+', 'w', 'w+', 'x', 'x+'}
        As for :func:`open`; positional I/O never truncates except 'w' at open.
        A ``'b'`` may be added (``'rb'``, ``'r+b'``): files are always binary.
    direct : bool, optional
        O_DIRECT (default from :mod:`aionvme.defaults`). Filesystems that
        refuse it are served buffered; ``info.reason`` says which and why.
    block_size, parallelism : int, optional
        Chunk size (a positive multiple of 4096, or ``"1M"``) and chunks in
        flight per request (0: up to the queue depth), instead of the
        defaults; checked like :func:`aionvme.defaults.set` checks them
        (:class:`~aionvme.InvalidSettingError`).

    Notes
    -----
    Transfers of any alignment are correct. With O_DIRECT the aligned middle
    of a request moves straight between the device and your buffer; an
    unaligned head or tail, or a buffer whose address is not aligned, goes
    through small aligned bounce buffers, and partial blocks of writes are
    read-modify-written under a per-file lock. Use :func:`aionvme.empty` for
    buffers that are always on the fast path.

    Closing with transfers in flight is safe: the fd closes when they end.
    Opening is synchronous (an open(2) and a statx, no waiting on the
    device), like the builtin ``open``: its errors raise from the
    constructor. Every transfer method follows :func:`aionvme.pread`'s rule:
    errors arrive at the await.
    """

    def __init__(
        self,
        path: PathLike,
        mode: str = "r",
        *,
        direct: bool | None = None,
        block_size: int | str | None = None,
        parallelism: int | None = None,
    ) -> None:
        self._start(path, mode, direct, block_size, parallelism)

    def _start(
        self,
        path: PathLike,
        mode: str,
        direct: bool | None,
        block_size: int | str | None,
        parallelism: int | None,
        dir_fd: int | None = None,
        display: str | None = None,
    ) -> None:
        self._h = None
        flags, readable, writable = parse_mode(mode)
        self.mode = mode
        self.block_size, self.parallelism = defaults.check_call(block_size, parallelism)
        if dir_fd is not None:
            flags |= os.O_NOFOLLOW
        self._h, self.info = open_handle(
            path, flags, readable, writable, direct, owner=self, dir_fd=dir_fd, display=display
        )
        self._route = Route(self._h, self.block_size, self.parallelism)
        self.path = self._h.path

    @classmethod
    def _open_at(cls, dir_fd: int, name: str, mode: str, *, display: str, direct: bool | None) -> File:
        """A File on ``name`` in the directory open as ``dir_fd`` (openat, the
        last component never followed if it is a symbolic link: O_NOFOLLOW);
        errors and ``path`` name it ``display``. For :mod:`aionvme.atomic`."""
        f = cls.__new__(cls)
        f._start(name, mode, direct, None, None, dir_fd, display)
        return f

    # -- state -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._h is None or self._h.closed or self._h.closing

    @property
    def direct(self) -> bool:
        return bool(self._handle().direct)

    def fileno(self) -> int:
        return int(self._handle().fd)

    def size(self) -> int:
        """Current size in bytes (fstat)."""
        return os.fstat(self._handle().fd).st_size

    def truncate(self, size: int) -> None:
        h = self._handle()
        try:
            os.ftruncate(h.fd, size)
        except OSError as e:
            raise os_error(e.errno or errno.EIO, self.path, offset=size, op="ftruncate") from None
        h.inode.reset_size(size)

    def _params(self) -> transfer.Params:
        """(chunk size, chunks in flight per request, engine mode bits) for a
        call: this File's knobs, the rest from the defaults (followed when
        defaults.set() replaces them after the open)."""
        return self._route.current_params()

    def __repr__(self) -> str:
        state = (
            "closed"
            if self.closed
            else ("O_DIRECT" if self._h is not None and self._h.direct else "buffered")
        )
        return f"<aionvme.File {self.path!r} mode={self.mode!r} {state}>"

    # -- async I/O -----------------------------------------------------------------

    # pread(buf, offset=0) -> Awaitable[int]: fill all of buf from offset. In C
    # (the hot path of random reads): through this File's Route to the running
    # loop's Hub, else the long way, transfer.submit_file.
    pread = file_pread

    def pwrite(self, buf: Any, offset: int = 0) -> Awaitable[int]:
        """Write all of buf at offset (the file grows as needed; never truncated)."""
        route = self._route
        p = route.current_params()
        h = route.handle
        if h.direct:
            p = scatter.params_for_one(h.fd, buf, p)
        t = hub_transfer(route, buf, offset, p, True)
        return t if t is not None else transfer.submit_file(WRITE, self, buf, offset, p)

    def pread_many(self, items: Iterable[tuple[Any, int]]) -> Awaitable[int]:
        """Fill each (buffer, offset) pair; one future for the whole batch.

        The batch succeeds or raises as a unit; a short read names the item.
        """
        return transfer.submit(get_reactor, READV, self, items, 0, self._params())

    def pread_rows(self, buf: Any, offsets: Any) -> Awaitable[int]:
        """Fill row i of buf from offsets[i], for every i; one future for all.

        buf's bytes are split into ``len(offsets)`` equal rows, in order (a
        ``(n, row)`` array, or any buffer of n equal records). offsets: a 1-D
        int64 array (read in place) or any sequence of ints. The batch of
        :meth:`pread_many` without a Python object per read: one buffer export
        and the offsets taken in C. Succeeds or raises as a unit; a short read
        names the row (``ShortReadError.segment``).
        """
        return transfer.submit(get_reactor, READROWS, self, (buf, offsets), 0, self._params())

    def pwrite_many(self, items: Iterable[tuple[Any, int]]) -> Awaitable[int]:
        """Write each (buffer, offset) pair; one future for the whole batch."""
        return transfer.submit(get_reactor, WRITEV, self, items, 0, self._params())

    def pwrite_rows(self, buf: Any, offsets: Any) -> Awaitable[int]:
        """Write row i of buf at offsets[i], for every i; one future for all
        (buf split into rows as :meth:`pread_rows` splits it)."""
        return transfer.submit(get_reactor, WRITEROWS, self, (buf, offsets), 0, self._params())

    def fsync(self) -> Awaitable[int]:
        """fsync on a worker thread (the loop keeps running)."""
        return transfer.submit(get_reactor, FSYNC, self)

    def fdatasync(self) -> Awaitable[int]:
        """fdatasync on a worker thread (the loop keeps running)."""
        return transfer.submit(get_reactor, FDATASYNC, self)

    # -- blocking I/O (no event loop needed; waits with the GIL released) ----------
    #
    # On a thread whose event loop is running they raise BlockingCallError (they
    # would stall the loop), as aionvme.sync_load does; a call that would fail
    # anyway (closed file, wrong mode) raises that error first.

    _loop_ok = False  # True: this File's blocking calls are allowed on a loop thread

    def _blocking(self, name: str, instead: str, write: bool | None) -> None:
        if self._loop_ok or asyncio._get_running_loop() is None:
            return
        h = self._handle()
        if write is not None and not (h.writable if write else h.readable):
            what = "writing" if write else "reading"
            raise UnsupportedOperation(f"file not open for {what}: {self.path!r}", self.path)
        raise BlockingCallError(f"File.{name}", f"File.{instead}")

    def sync_pread(self, buf: Any, offset: int = 0) -> int:
        """Blocking :meth:`pread`: the byte count, or the error raised here.

        Raises BlockingCallError on a thread whose event loop is running."""
        self._blocking("sync_pread", "pread", False)
        return transfer.run(thread_engine(), READ, self, buf, offset, self._params())

    def sync_pwrite(self, buf: Any, offset: int = 0) -> int:
        """Blocking :meth:`pwrite`."""
        self._blocking("sync_pwrite", "pwrite", True)
        return transfer.run(thread_engine(), WRITE, self, buf, offset, self._params())

    def sync_pread_many(self, items: Iterable[tuple[Any, int]]) -> int:
        """Blocking :meth:`pread_many`."""
        self._blocking("sync_pread_many", "pread_many", False)
        return transfer.run(thread_engine(), READV, self, items, 0, self._params())

    def sync_pread_rows(self, buf: Any, offsets: Any) -> int:
        """Blocking :meth:`pread_rows`."""
        self._blocking("sync_pread_rows", "pread_rows", False)
        return transfer.run(thread_engine(), READROWS, self, (buf, offsets), 0, self._params())

    def sync_pwrite_many(self, items: Iterable[tuple[Any, int]]) -> int:
        """Blocking :meth:`pwrite_many`."""
        self._blocking("sync_pwrite_many", "pwrite_many", True)
        return transfer.run(thread_engine(), WRITEV, self, items, 0, self._params())

    def sync_pwrite_rows(self, buf: Any, offsets: Any) -> int:
        """Blocking :meth:`pwrite_rows`."""
        self._blocking("sync_pwrite_rows", "pwrite_rows", True)
        return transfer.run(thread_engine(), WRITEROWS, self, (buf, offsets), 0, self._params())

    def sync_fsync(self) -> None:
        """Blocking :meth:`fsync`."""
        self._blocking("sync_fsync", "fsync", None)
        transfer.run(thread_engine(), FSYNC, self)

    # -- closing ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the file. Transfers in flight finish first (the fd is closed
        when the last one ends); new ones raise ClosedFileError."""
        if self._h is not None:
            self._h.close()

    async def aclose(self) -> None:
        """Close, and return once this file's transfers in flight have ended
        and its fd is closed.

        Notes
        -----
        Transfers already queued are not cancelled: they finish (or fail) as
        they would have. Waiting polls every millisecond or so; a transfer
        queued on another event loop that no longer runs keeps it waiting.
        """
        self.close()
        h = self._h
        delay = 0.0005
        while h is not None and not h.closed:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    def __enter__(self) -> File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> File:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        h = getattr(self, "_h", None)
        if h is not None and not h.closed and not h.closing:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)
            h.close()


def open(
    path: PathLike,
    mode: str = "r",
    *,
    direct: bool | None = None,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> File:
    """Open path for aionvme I/O; usable with ``with`` and ``async with``."""
    return File(path, mode, direct=direct, block_size=block_size, parallelism=parallelism)


def pread(
    buf: Any,
    file: File | PathLike | int,
    offset: int = 0,
    *,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> Awaitable[int]:
    """Fill all of buf from file at offset. Awaitable; gives the byte count.

    Parameters
    ----------
    buf : numpy array, torch tensor (CPU or CUDA), bytearray, memoryview, mmap, ...
        Contiguous and writable. CUDA tensors go through cuFile (GPUDirect
        Storage) or pinned bounce buffers: see :mod:`aionvme.gpu`.
    file : path, :class:`File` or fd
        A path is opened for this call (O_DIRECT) and closed after it.
    offset : int
        File offset of buf[0]; any alignment.

    Raises
    ------
    ShortReadError
        The file ends before buf is full (``received`` says how much arrived).
    OSError
        The matching subclass (FileNotFoundError, PermissionError, ...), with
        filename and, for failed transfers, offset.

    Notes
    -----
    The call returns at once and the transfer starts now, awaited or not. The
    awaitable is a future-like object (``asyncio.isfuture`` is true; it has
    ``asyncio.Future``'s methods for reading and cancelling) that is also a
    coroutine: ``await`` it or pass it to ``asyncio.create_task``,
    ``TaskGroup.create_task``, ``ensure_future``, ``gather`` (no Task is made
    there), ``wait_for``, ``asyncio.timeout``, ``shield`` or anyio's task
    groups. It is not an instance of ``asyncio.Future``: test with
    ``asyncio.isfuture``. Done-callbacks receive the awaitable.

    Every error arrives at the await, never from the call: file-system and
    data errors (open failures, EISDIR, EACCES, ENOSPC, EIO, short reads, a
    closed File) and argument errors alike (a buffer of the wrong type,
    a read-only buffer, a negative offset, a bad ``block_size``). The call
    itself never raises. Made outside a running loop (``asyncio.run(pread(...))``)
    it returns a coroutine that starts the transfer when the loop runs it.
    Every async entry point of aionvme follows this rule.

    Cancelling the awaiting task stops issuing the rest of the transfer and
    waits for the parts in flight before CancelledError is raised: once the
    await ends, the kernel no longer writes into buf. ``asyncio.gather``
    does not cancel the other awaitables when one fails; use a TaskGroup, or
    wait for the rest, before reusing their buffers. ``asyncio.wait``
    refuses coroutines (Python 3.11+), so it refuses these too: wait with
    ``gather(..., return_exceptions=True)`` or on ``create_task`` of them.
    """
    return _call(READ, file, buf, offset, block_size, parallelism)


def pwrite(
    buf: Any,
    file: File | PathLike | int,
    offset: int = 0,
    *,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> Awaitable[int]:
    """Write all of buf to file at offset, creating the file if needed.

    Never truncates: bytes beyond the write are kept. Use :func:`save`-style
    whole-file writes when the old content must survive a crash.
    """
    return _call(WRITE, file, buf, offset, block_size, parallelism)


def pread_many(
    items: Iterable[tuple[Any, int]],
    file: File | PathLike | int,
    *,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> Awaitable[int]:
    """Fill each (buffer, offset) pair from one file; one future for all."""
    return _call(READV, file, items, 0, block_size, parallelism)


def pread_rows(
    buf: Any,
    offsets: Any,
    file: File | PathLike | int,
    *,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> Awaitable[int]:
    """Fill row i of buf from offsets[i] of one file (buf split into
    len(offsets) equal rows); one future for all. See :meth:`File.pread_rows`."""
    return _call(READROWS, file, (buf, offsets), 0, block_size, parallelism)


def pwrite_many(
    items: Iterable[tuple[Any, int]],
    file: File | PathLike | int,
    *,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> Awaitable[int]:
    """Write each (buffer, offset) pair to one file; one future for all."""
    return _call(WRITEV, file, items, 0, block_size, parallelism)


def pwrite_rows(
    buf: Any,
    offsets: Any,
    file: File | PathLike | int,
    *,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> Awaitable[int]:
    """Write row i of buf at offsets[i] of one file (buf split into
    len(offsets) equal rows); one future for all. See :meth:`File.pwrite_rows`."""
    return _call(WRITEROWS, file, (buf, offsets), 0, block_size, parallelism)


def _call(op: int, file: Any, data: Any, offset: int, block_size: Any, parallelism: Any) -> Awaitable[int]:
    """The path functions' one body: their knobs checked (an error arrives at
    the await), then the dispatch on the running loop."""
    try:
        p = transfer.params(block_size, parallelism)
    except Exception as e:
        return failed(e)
    return transfer.submit(get_reactor, op, file, data, offset, p)


def fsync(file: File | PathLike | int, *, datasync: bool = False) -> Awaitable[int]:
    """fsync (or fdatasync) on a worker thread."""
    return transfer.submit(get_reactor, FDATASYNC if datasync else FSYNC, file)
