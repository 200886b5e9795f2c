"""Files: opening (O_DIRECT where the filesystem takes it, alignment from
statx), the :class:`File` object for hot loops, and the path-based calls."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import warnings
import weakref
from collections.abc import Awaitable, Iterable
from typing import Any

from . import defaults, gpu
from ._runtime import blocking as _sync
from ._engine import (
    KERNEL_AIO,
    MODE_NO_OVERLAP,
    MODE_SINGLE_SUBMIT,
    WORKER_POOL,
    FileHandle,
    Inode,
    fs_type,
    fstatx,
)
from ._runtime.reactor import get_reactor
from .exceptions import ClosedFileError, os_error

__all__ = ["File", "fsync", "open", "pread", "pread_many", "pwrite", "pwrite_many"]

PathLike = str | bytes | os.PathLike[str] | os.PathLike[bytes]

# statfs f_type of filesystems whose "device" is memory: io_submit would copy
# synchronously there, so the worker pool serves them, buffered.
FS_NAMES = {
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x65735546: "fuse",
    0x6969: "nfs",
    0x794C7630: "overlayfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0x62656572: "sysfs",
    0x9FA0: "proc",
}
_MEMORY_FS = {0x01021994, 0x858458F6}
# FUSE lets a connection queue at most max_background (default 12) async
# requests; past that, io_submit on an O_DIRECT FUSE fd sleeps until the
# daemon answers (measured: 61 ms inside one io_submit, 20 ms daemon, 32 chunks
# in flight). Worker threads serve FUSE files, still O_DIRECT, so the loop
# never waits for a daemon.
_DAEMON_FS = {0x65735546}
_DEFAULT_ALIGN = 4096  # when the kernel does not say: safe for every device we know
_BLKSSZGET = 0x1268
_NO_PREP = (1 << 63) - 1

_MODES = {
    # mode: (flags, readable, writable). Writers open O_RDWR so partial blocks
    # can be read-modify-written under O_DIRECT.
    "r": (os.O_RDONLY, True, False),
    "r+": (os.O_RDWR, True, True),
    "w": (os.O_RDWR | os.O_CREAT | os.O_TRUNC, False, True),
    "w+": (os.O_RDWR | os.O_CREAT | os.O_TRUNC, True, True),
    "x": (os.O_RDWR | os.O_CREAT | os.O_EXCL, False, True),
    "x+": (os.O_RDWR | os.O_CREAT | os.O_EXCL, True, True),
}

_inodes: weakref.WeakValueDictionary[tuple[Any, int], Inode] = weakref.WeakValueDictionary()


class OpenInfo:
    """How a file was opened: what the engine will do with it and why."""

    __slots__ = ("align", "direct", "fs_type", "mem_align", "reason")

    def __init__(self, direct: bool, align: int, mem_align: int, fs: int, reason: str) -> None:
        self.direct = direct
        self.align = align
        self.mem_align = mem_align
        self.fs_type = fs
        self.reason = reason

    @property
    def fs_name(self) -> str:
        return FS_NAMES.get(self.fs_type, hex(self.fs_type))

    def __repr__(self) -> str:
        return (
            f"OpenInfo(direct={self.direct}, align={self.align}, mem_align={self.mem_align}, "
            f"fs={self.fs_name}, reason={self.reason!r})"
        )


def _parse_mode(mode: str) -> tuple[int, bool, bool]:
    m = mode.replace("b", "")
    if m in ("a", "a+"):
        raise ValueError("append mode is not supported: aionvme does positional I/O; open with 'r+' or 'w'")
    if m not in _MODES:
        raise ValueError(f"invalid mode {mode!r}; use 'r', 'r+', 'w', 'w+', 'x' or 'x+'")
    return _MODES[m]


def _os_open(path: PathLike, flags: int) -> int:
    # O_NONBLOCK keeps open() of a FIFO from waiting for a writer; it is
    # cleared again for regular files and block devices.
    try:
        return os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as e:
        raise os_error(e.errno or errno.EIO, os.fsdecode(path), op="open") from None


def open_handle(
    path: PathLike,
    flags: int,
    readable: bool,
    writable: bool,
    direct: bool | None = None,
    owner: object = None,
) -> tuple[FileHandle, OpenInfo]:
    """Open path for the engine: O_DIRECT when asked and possible, else buffered."""
    want_direct = defaults.settings.direct if direct is None else direct
    name = os.fsdecode(path)
    reason = "O_DIRECT" if want_direct else "buffered I/O requested"
    fd = -1
    is_direct = False
    if want_direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
            is_direct = True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise os_error(e.errno or errno.EIO, name, op="open") from None
            reason = "the filesystem refuses O_DIRECT (EINVAL at open)"
    if fd < 0:
        fd = _os_open(path, flags)
    try:
        st = fstatx(fd)
        mode = st["mode"]
        if stat.S_ISDIR(mode):
            raise os_error(errno.EISDIR, name, op="open")
        if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
            raise os_error(errno.ESPIPE, name, op="open (not a regular file or block device)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        fst = fs_type(fd)  # not cached by st_dev: mounts reuse anonymous device numbers
        align, mem_align = st["dio_offset_align"], st["dio_mem_align"]
        # f_type of a block device node is its directory's filesystem
        # (devtmpfs says tmpfs): only regular files live on a memory fs.
        if is_direct and stat.S_ISREG(mode) and fst in _MEMORY_FS:
            # tmpfs takes O_DIRECT but copies inside io_submit: serve it from
            # the worker pool, buffered, where any alignment is fine.
            fd = _reopen_buffered(fd, path, flags)
            is_direct = False
            reason = f"{FS_NAMES[fst]} is memory: buffered I/O on worker threads"
        elif is_direct and st["dio_reported"] and align == 0:
            # statx says this file cannot do direct I/O (inline data, data=journal...)
            fd = _reopen_buffered(fd, path, flags)
            is_direct = False
            reason = "statx reports no direct I/O for this file"
        if is_direct:
            kind, align, mem_align, why = _direct_service(fd, st, fst)
            reason = why or reason
        else:
            align = mem_align = 1
            kind = WORKER_POOL
        h = FileHandle(fd, name, kind, is_direct, readable, writable, align, mem_align, _inode(st), owner)
    except BaseException:
        os.close(fd)
        raise
    return h, OpenInfo(is_direct, align, mem_align, fst, reason)


def _reopen_buffered(fd: int, path: PathLike, flags: int) -> int:
    """path opened again without O_DIRECT (the file exists now); fd is closed."""
    reopened = _os_open(path, flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC))
    os.close(fd)
    fcntl.fcntl(reopened, fcntl.F_SETFL, fcntl.fcntl(reopened, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return reopened


def _direct_service(fd: int, st: dict[str, Any], fst: int) -> tuple[int, int, int, str | None]:
    """How to serve an O_DIRECT fd: (kind, offset alignment, memory alignment,
    why not kernel AIO or None). Shared by paths we open and fds we are given."""
    mode = st["mode"]
    align, mem_align = st["dio_offset_align"], st["dio_mem_align"]
    if align == 0:
        align = _block_device_sector(fd) if stat.S_ISBLK(mode) else _DEFAULT_ALIGN
    if mem_align == 0:
        mem_align = align
    # f_type of a block device node is its directory's filesystem
    # (devtmpfs says tmpfs): only regular files live on these.
    why = None
    if stat.S_ISREG(mode) and fst in _DAEMON_FS:
        why = f"{FS_NAMES[fst]} would make io_submit wait for its daemon"
    elif stat.S_ISREG(mode) and fst in _MEMORY_FS:
        why = f"{FS_NAMES[fst]} is memory, io_submit would copy inline"
    if why is not None:
        return WORKER_POOL, align, mem_align, f"O_DIRECT on worker threads: {why}"
    return KERNEL_AIO, align, mem_align, None


def _inode(st: dict[str, Any]) -> Inode:
    """The shared per-file state, its size hint set to the size fstat saw just
    now: the file may have shrunk since (truncated, rewritten by another
    program, or a new file that got a deleted one's inode number). A block
    device cannot grow and statx says size 0: a hint of "huge" keeps the
    engine from preparing writes there (fallocate mode 0 is EINVAL on it)."""
    key = (st["dev"], st["ino"])
    size = _NO_PREP if stat.S_ISBLK(st["mode"]) else st["size"]
    inode = _inodes.get(key)
    if inode is None:
        inode = Inode(size)
        _inodes[key] = inode
    else:
        inode.reset_size(size)
    return inode


def _block_device_sector(fd: int) -> int:
    try:
        buf = fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4)
        n: int = struct.unpack("i", buf)[0]
        return max(n, 512)
    except OSError:
        return _DEFAULT_ALIGN


def _handle_for(file: File | PathLike | int, write: bool) -> tuple[FileHandle, bool]:
    """(handle, temporary): a File's own handle, or one opened for this call."""
    if isinstance(file, File):
        return file._handle(), False
    if isinstance(file, bool):
        raise TypeError("file must be a path, an aionvme.File or an fd, not a bool")
    if isinstance(file, int):
        return _handle_from_fd(file), True
    if write:
        h, _ = open_handle(file, os.O_RDWR | os.O_CREAT, True, True)
    else:
        h, _ = open_handle(file, os.O_RDONLY, True, False)
    return h, True


def _rmw_capable_fd(fd: int) -> int:
    """A read-write O_DIRECT twin of a write-only O_DIRECT fd, or -1.

    A write whose head or tail is not block-aligned reads the partial block
    first (read-modify-write), which a write-only fd cannot do (EBADF after the
    aligned part had landed). The twin reopens the same file through
    /proc/self/fd; reads through the caller's fd stay refused by the handle.
    Where that is not allowed (no read permission, no /proc), -1: the caller's
    fd is used as it is.
    """
    try:
        twin = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1
    a, b = os.fstat(twin), os.fstat(fd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(twin)
        return -1
    return twin


def _handle_from_fd(fd: int) -> FileHandle:
    """Serve a caller's fd as it is (the caller keeps ownership; we dup it)."""
    try:
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise os_error(e.errno or errno.EIO, f"<fd {fd}>", op="fcntl") from None
    acc = fl & os.O_ACCMODE
    direct = bool(fl & os.O_DIRECT)
    dup = _rmw_capable_fd(fd) if direct and acc == os.O_WRONLY else -1
    if dup < 0:
        dup = os.dup(fd)
    try:
        st = fstatx(dup)
        if stat.S_ISDIR(st["mode"]):
            raise os_error(errno.EISDIR, f"<fd {fd}>")
        if direct:
            kind, align, mem_align, _ = _direct_service(dup, st, fs_type(dup))
        else:
            kind, align, mem_align = WORKER_POOL, 1, 1
        return FileHandle(
            dup,
            f"<fd {fd}>",
            kind,
            direct,
            acc in (os.O_RDONLY, os.O_RDWR),
            acc in (os.O_WRONLY, os.O_RDWR),
            align,
            mem_align,
            _inode(st),
        )
    except BaseException:
        os.close(dup)
        raise


class File:
    """An open file for repeated transfers: fds opened once, alignment known.

    Parameters
    ----------
    path : str or os.PathLike
    mode : {'r', 'r+', 'w', 'w+', 'x', 'x+'}
        As for :func:`open`; positional I/O never truncates except 'w' at open.
    direct : bool, optional
        O_DIRECT (default from :mod:`aionvme.defaults`). Filesystems that
        refuse it are served buffered; ``info.reason`` says which and why.
    block_size, parallelism : int, optional
        Chunk size and chunks in flight per request, instead of the defaults.

    Notes
    -----
    Transfers of any alignment are correct. With O_DIRECT the aligned middle
    of a request moves straight between the device and your buffer; an
    unaligned head or tail, or a buffer whose address is not aligned, goes
    through small aligned bounce buffers, and partial blocks of writes are
    read-modify-written under a per-file lock. Use :func:`aionvme.empty` for
    buffers that are always on the fast path.

    Closing with transfers in flight is safe: the fd closes when they end.
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
        self._h: FileHandle | None = None
        flags, readable, writable = _parse_mode(mode)
        self.mode = mode
        self.block_size = defaults.parse_size(block_size) if block_size is not None else None
        self.parallelism = parallelism
        _check_params(self.block_size, parallelism)
        self._h, self.info = open_handle(path, flags, readable, writable, direct, owner=self)
        self.path = self._h.path

    # -- state -------------------------------------------------------------------

    def _handle(self) -> FileHandle:
        h = self._h
        if h is None or h.closed or h.closing:
            raise ClosedFileError(f"I/O on a closed file: {getattr(self, 'path', None)!r}")
        return h

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

    def _params(self) -> tuple[int, int, int]:
        """(chunk size, chunks in flight per request, engine mode bits) for a call."""
        return _params(self.block_size, self.parallelism)

    def __repr__(self) -> str:
        state = (
            "closed"
            if self.closed
            else ("O_DIRECT" if self._h is not None and self._h.direct else "buffered")
        )
        return f"<aionvme.File {self.path!r} mode={self.mode!r} {state}>"

    # -- async I/O -----------------------------------------------------------------

    def pread(self, buf: Any, offset: int = 0) -> Awaitable[int]:
        """Fill all of buf from offset; the awaitable gives len(buf) in bytes or raises.

        Raises ShortReadError if the file ends first, OSError subclasses for I/O
        errors (with filename and offset). Returns a Future: ``gather`` of
        many needs no Task per call.
        """
        r = get_reactor()
        if gpu.is_cuda(buf):
            return gpu.submit(r, self._handle(), False, False, [(buf, offset)], self._params())
        return r.submit(r.engine.read(self._handle(), buf, offset, *self._params()))

    def pwrite(self, buf: Any, offset: int = 0) -> Awaitable[int]:
        """Write all of buf at offset (the file grows as needed; never truncated)."""
        r = get_reactor()
        if gpu.is_cuda(buf):
            return gpu.submit(r, self._handle(), False, True, [(buf, offset)], self._params())
        return r.submit(r.engine.write(self._handle(), buf, offset, *self._params()))

    def pread_many(self, items: Iterable[tuple[Any, int]]) -> Awaitable[int]:
        """Fill each (buffer, offset) pair; one future for the whole batch.

        The batch succeeds or raises as a unit; a short read names the item.
        """
        r = get_reactor()
        lst = list(items)
        if gpu.any_cuda(lst):
            return gpu.submit(r, self._handle(), False, False, lst, self._params())
        return r.submit(r.engine.readv(self._handle(), lst, *self._params()))

    def pwrite_many(self, items: Iterable[tuple[Any, int]]) -> Awaitable[int]:
        """Write each (buffer, offset) pair; one future for the whole batch."""
        r = get_reactor()
        lst = list(items)
        if gpu.any_cuda(lst):
            return gpu.submit(r, self._handle(), False, True, lst, self._params())
        return r.submit(r.engine.writev(self._handle(), lst, *self._params()))

    def fsync(self) -> Awaitable[int]:
        """fsync on a worker thread (the loop keeps running)."""
        r = get_reactor()
        return r.submit(r.engine.fsync(self._handle(), False))

    def fdatasync(self) -> Awaitable[int]:
        r = get_reactor()
        return r.submit(r.engine.fsync(self._handle(), True))

    # -- blocking I/O (no event loop needed; waits with the GIL released) ----------

    def sync_pread(self, buf: Any, offset: int = 0) -> int:
        if gpu.is_cuda(buf):
            return self._sync(False, [(buf, offset)])
        return _sync.run(_sync.thread_engine().read(self._handle(), buf, offset, *self._params()))

    def sync_pwrite(self, buf: Any, offset: int = 0) -> int:
        if gpu.is_cuda(buf):
            return self._sync(True, [(buf, offset)])
        return _sync.run(_sync.thread_engine().write(self._handle(), buf, offset, *self._params()))

    def sync_pread_many(self, items: Iterable[tuple[Any, int]]) -> int:
        lst = list(items)
        if gpu.any_cuda(lst):
            return self._sync(False, lst)
        return _sync.run(_sync.thread_engine().readv(self._handle(), lst, *self._params()))

    def sync_pwrite_many(self, items: Iterable[tuple[Any, int]]) -> int:
        lst = list(items)
        if gpu.any_cuda(lst):
            return self._sync(True, lst)
        return _sync.run(_sync.thread_engine().writev(self._handle(), lst, *self._params()))

    def _sync(self, write: bool, items: list[tuple[Any, int]]) -> int:
        """A blocking transfer with CUDA tensors among the items."""
        return gpu.run_sync(_sync.thread_engine(), self._handle(), False, write, items, self._params())

    def sync_fsync(self) -> None:
        _sync.run(_sync.thread_engine().fsync(self._handle(), False))

    # -- closing ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the file. Transfers in flight finish first (the fd is closed
        when the last one ends); new ones raise ClosedFileError."""
        if self._h is not None:
            self._h.close()

    async def aclose(self) -> None:
        """Close, waiting for this file's transfers in flight (async)."""
        self.close()

    def __enter__(self) -> File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> File:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

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


def _check_params(block_size: int | None, parallelism: int | None) -> None:
    """Per-call settings get the checks defaults.set() gives the defaults."""
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if parallelism is not None:
        if isinstance(parallelism, bool) or not isinstance(parallelism, int):
            raise TypeError(f"parallelism must be an int, got {type(parallelism).__name__}")
        if parallelism < 0:
            raise ValueError(f"parallelism must be >= 0 (0: no cap), got {parallelism}")


_params_cache: tuple[object, tuple[int, int, int]] = (None, (0, 0, 0))


def _params(block_size: int | str | None, parallelism: int | None) -> tuple[int, int, int]:
    """(chunk size, chunks in flight per request, engine mode bits) for a call."""
    global _params_cache
    s = defaults.settings
    if block_size is None and parallelism is None:
        cached_for, p = _params_cache
        if cached_for is s:  # defaults.set() replaces the object: identity is enough
            return p
    block = defaults.parse_size(block_size) if block_size is not None else None
    _check_params(block, parallelism)
    mode = (MODE_SINGLE_SUBMIT if s.single_submit else 0) | (0 if s.overlap_events else MODE_NO_OVERLAP)
    p = (
        block if block is not None else s.block_size,
        parallelism if parallelism is not None else s.max_inflight,
        mode,
    )
    if block_size is None and parallelism is None:
        _params_cache = (s, p)
    return p


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
    Cancelling the awaiting task stops issuing the rest of the transfer and
    waits for the parts in flight before CancelledError is raised: once the
    await ends, the kernel no longer writes into buf.
    """
    r = get_reactor()
    h, temporary = _handle_for(file, write=False)
    if gpu.is_cuda(buf):
        return gpu.submit(r, h, temporary, False, [(buf, offset)], _params(block_size, parallelism))
    try:
        req = r.engine.read(h, buf, offset, *_params(block_size, parallelism))
    finally:
        if temporary:
            h.close()  # deferred until the request finishes
    return r.submit(req)


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
    r = get_reactor()
    h, temporary = _handle_for(file, write=True)
    if gpu.is_cuda(buf):
        return gpu.submit(r, h, temporary, True, [(buf, offset)], _params(block_size, parallelism))
    try:
        req = r.engine.write(h, buf, offset, *_params(block_size, parallelism))
    finally:
        if temporary:
            h.close()
    return r.submit(req)


def pread_many(
    items: Iterable[tuple[Any, int]],
    file: File | PathLike | int,
    *,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> Awaitable[int]:
    """Fill each (buffer, offset) pair from one file; one future for all."""
    r = get_reactor()
    h, temporary = _handle_for(file, write=False)
    lst = list(items)
    if gpu.any_cuda(lst):
        return gpu.submit(r, h, temporary, False, lst, _params(block_size, parallelism))
    try:
        req = r.engine.readv(h, lst, *_params(block_size, parallelism))
    finally:
        if temporary:
            h.close()
    return r.submit(req)


def pwrite_many(
    items: Iterable[tuple[Any, int]],
    file: File | PathLike | int,
    *,
    block_size: int | str | None = None,
    parallelism: int | None = None,
) -> Awaitable[int]:
    """Write each (buffer, offset) pair to one file; one future for all."""
    r = get_reactor()
    h, temporary = _handle_for(file, write=True)
    lst = list(items)
    if gpu.any_cuda(lst):
        return gpu.submit(r, h, temporary, True, lst, _params(block_size, parallelism))
    try:
        req = r.engine.writev(h, lst, *_params(block_size, parallelism))
    finally:
        if temporary:
            h.close()
    return r.submit(req)


def fsync(file: File | PathLike | int, *, datasync: bool = False) -> Awaitable[int]:
    """fsync (or fdatasync) on a worker thread."""
    r = get_reactor()
    h, temporary = _handle_for(file, write=False)
    try:
        req = r.engine.fsync(h, datasync)
    finally:
        if temporary:
            h.close()
    return r.submit(req)
