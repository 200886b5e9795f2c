"""How a file is opened: the one place that decides O_DIRECT or buffered,
the alignment (statx STATX_DIOALIGN, the block device's sector, else 4096),
and who serves it: kernel AIO or the engine's worker pool.

The filesystem tables live here too (names for ``aionvme info``, the memory
filesystems, the ones served by a daemon); everything else asks this module.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import weakref
from typing import Any

from .. import defaults
from .._engine import KERNEL_AIO, WORKER_POOL, FileHandle, Inode, Routed, fs_type, fstatx
from ..exceptions import ClosedFileError, InvalidSettingError, os_error

__all__ = [
    "DEFAULT_ALIGN",
    "FS_NAMES",
    "MEMORY_FS",
    "FileBase",
    "OpenInfo",
    "PathLike",
    "fs_name",
    "handle_for",
    "is_memory_fs",
    "open_handle",
    "parse_mode",
]

PathLike = str | bytes | os.PathLike[str] | os.PathLike[bytes]

# statfs f_type (linux/magic.h) -> name, for reports.
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
# Filesystems whose "device" is memory: io_submit would copy synchronously
# there, so the worker pool serves them, buffered.
MEMORY_FS = frozenset({0x01021994, 0x858458F6})
# FUSE lets a connection queue at most max_background (default 12) async
# requests; past that, io_submit on an O_DIRECT FUSE fd sleeps until the
# daemon answers (measured: 61 ms inside one io_submit, 20 ms daemon, 32 chunks
# in flight). Worker threads serve FUSE files, still O_DIRECT, so the loop
# never waits for a daemon.
DAEMON_FS = frozenset({0x65735546})
DEFAULT_ALIGN = 4096  # when the kernel does not say: safe for every device we know
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


def fs_name(fst: int) -> str:
    """A filesystem's name from its statfs f_type (hex when unknown)."""
    return FS_NAMES.get(fst, hex(fst))


def is_memory_fs(fd: int) -> bool:
    """Whether fd (a file or directory) lives on tmpfs/ramfs."""
    return fs_type(fd) in MEMORY_FS


def parse_mode(mode: str) -> tuple[int, bool, bool]:
    """(open flags, readable, writable) of an aionvme mode.

    Modes are ``'r'``, ``'r+'``, ``'w'``, ``'w+'``, ``'x'``, ``'x+'``; one
    ``'b'`` may be added anywhere (``'rb'``, ``'r+b'``): aionvme files are
    always binary. Text (``'t'``) and append (``'a'``) modes are refused.
    """
    if not isinstance(mode, str):
        raise InvalidSettingError.of_type("mode", mode, "a str like 'r' or 'r+'")
    m = mode.replace("b", "", 1) if mode.count("b") == 1 else mode
    if m in ("a", "a+"):
        raise InvalidSettingError(
            "append mode is not supported: aionvme does positional I/O; open with 'r+' or 'w'",
            name="mode",
            value=mode,
        )
    if m not in _MODES:
        raise InvalidSettingError(
            f"invalid mode {mode!r}; use 'r', 'r+', 'w', 'w+', 'x' or 'x+' (a 'b' may be added: "
            "aionvme files are always binary)",
            name="mode",
            value=mode,
        )
    return _MODES[m]


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
        return fs_name(self.fs_type)

    def __repr__(self) -> str:
        return (
            f"OpenInfo(direct={self.direct}, align={self.align}, mem_align={self.mem_align}, "
            f"fs={self.fs_name}, reason={self.reason!r})"
        )


class FileBase(Routed):
    """What the runtime needs of an open :class:`aionvme.File`: its engine
    handle, and (``_route``, a field of the engine's Routed) the Route its
    calls in C take, built at open."""

    _h: FileHandle | None = None
    path: Any = None

    def _handle(self) -> FileHandle:
        h = self._h
        if h is None or h.closed or h.closing:
            raise ClosedFileError(f"I/O on a closed file: {self.path!r}")
        return h


# -- the decision ------------------------------------------------------------------------------


def _service(
    fd: int, st: dict[str, Any], fst: int, reopenable: bool
) -> tuple[str, int, int, int, str | None]:
    """How to serve an O_DIRECT fd: (action, kind, offset alignment, memory
    alignment, why). action 'buffered': open the path again without O_DIRECT
    (only when reopenable); 'direct': keep O_DIRECT, served by kind (kernel
    AIO or the worker pool; why says why not AIO, or None)."""
    mode = st["mode"]
    align, mem_align = st["dio_offset_align"], st["dio_mem_align"]
    # f_type of a block device node is its directory's filesystem
    # (devtmpfs says tmpfs): only regular files live on these.
    regular = stat.S_ISREG(mode)
    if reopenable and regular and fst in MEMORY_FS:
        # tmpfs takes O_DIRECT but copies inside io_submit: serve it from
        # the worker pool, buffered, where any alignment is fine.
        return "buffered", WORKER_POOL, 1, 1, f"{fs_name(fst)} is memory: buffered I/O on worker threads"
    if reopenable and st["dio_reported"] and align == 0:
        # statx says this file cannot do direct I/O (inline data, data=journal...)
        return "buffered", WORKER_POOL, 1, 1, "statx reports no direct I/O for this file"
    if align == 0:
        align = _block_device_sector(fd) if stat.S_ISBLK(mode) else DEFAULT_ALIGN
    if mem_align == 0:
        mem_align = align
    why = None
    if regular and fst in DAEMON_FS:
        why = f"{fs_name(fst)} would make io_submit wait for its daemon"
    elif regular and fst in MEMORY_FS:
        why = f"{fs_name(fst)} is memory, io_submit would copy inline"
    if why is not None:
        return "direct", WORKER_POOL, align, mem_align, f"O_DIRECT on worker threads: {why}"
    return "direct", KERNEL_AIO, align, mem_align, None


def _os_open(path: PathLike, flags: int, dir_fd: int | None = None, name: str | None = None) -> int:
    # O_NONBLOCK keeps open() of a FIFO from waiting for a writer; it is
    # cleared again for regular files and block devices.
    try:
        return os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK, 0o666, dir_fd=dir_fd)
    except OSError as e:
        raise os_error(e.errno or errno.EIO, name or os.fsdecode(path), op="open") from None


def open_handle(
    path: PathLike,
    flags: int,
    readable: bool,
    writable: bool,
    direct: bool | None = None,
    owner: object = None,
    *,
    dir_fd: int | None = None,
    display: str | None = None,
) -> tuple[FileHandle, OpenInfo]:
    """Open path for the engine: O_DIRECT when asked and possible, else buffered.

    ``dir_fd``: path is relative to that open directory (openat), as for
    ``os.open``; ``display``: the name errors and ``File.path`` show instead."""
    want_direct = defaults.settings.direct if direct is None else direct
    name = display if display is not None else os.fsdecode(path)
    reason = "O_DIRECT" if want_direct else "buffered I/O requested"
    fd = -1
    is_direct = False
    if want_direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC | os.O_NONBLOCK, 0o666, dir_fd=dir_fd)
            is_direct = True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise os_error(e.errno or errno.EIO, name, op="open") from None
            reason = "the filesystem refuses O_DIRECT (EINVAL at open)"
            if flags & os.O_CREAT and flags & os.O_EXCL:
                # The exclusive create succeeded before O_DIRECT was refused
                # (the check comes after the inode is made, in do_dentry_open):
                # the file is ours; open it again, without following a link.
                flags = (flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)) | os.O_NOFOLLOW
    if fd < 0:
        fd = _os_open(path, flags, dir_fd, name)
    try:
        st = fstatx(fd)
        mode = st["mode"]
        if stat.S_ISDIR(mode):
            raise os_error(errno.EISDIR, name, op="open")
        if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
            raise os_error(errno.ESPIPE, name, op="open (not a regular file or block device)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        fst = fs_type(fd)  # not cached by st_dev: mounts reuse anonymous device numbers
        kind, align, mem_align = WORKER_POOL, 1, 1
        if is_direct:
            action, kind, align, mem_align, why = _service(fd, st, fst, reopenable=True)
            if action == "buffered":
                fd = _reopen_buffered(fd, path, flags, dir_fd, name)
                is_direct = False
            reason = why or reason
        h = FileHandle(fd, name, kind, is_direct, readable, writable, align, mem_align, _inode(st), owner)
    except BaseException:
        os.close(fd)
        raise
    return h, OpenInfo(is_direct, align, mem_align, fst, reason)


def _reopen_buffered(fd: int, path: PathLike, flags: int, dir_fd: int | None, name: str) -> int:
    """The file open as fd opened again without O_DIRECT; fd is closed.

    Through /proc/self/fd (the same inode, whatever happened to its name since);
    by name where /proc is missing."""
    flags &= ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
    try:
        reopened = os.open(f"/proc/self/fd/{fd}", (flags & ~os.O_NOFOLLOW) | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        reopened = _os_open(path, flags, dir_fd, name)
    os.close(fd)
    fcntl.fcntl(reopened, fcntl.F_SETFL, fcntl.fcntl(reopened, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return reopened


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
        return DEFAULT_ALIGN


def handle_for(file: Any, write: bool, direct: bool | None = None) -> tuple[FileHandle, bool]:
    """(engine handle, temporary) for what a call was given: an open File (its
    own handle; ClosedFileError if closed), an engine handle, an fd (served
    as it is, dup'ed), or a path (opened for this call with ``direct``,
    default from :mod:`aionvme.defaults`; temporary: close it after the call)."""
    if isinstance(file, FileBase):
        return file._handle(), False
    if isinstance(file, FileHandle):
        return file, False
    if isinstance(file, bool):
        raise TypeError("file must be a path, an aionvme.File or an fd, not a bool")
    if isinstance(file, int):
        return _handle_from_fd(file), True
    if not isinstance(file, (str, bytes, os.PathLike)):
        raise TypeError(f"file must be a path, an aionvme.File or an fd, not {type(file).__name__}")
    if write:
        h, _ = open_handle(file, os.O_RDWR | os.O_CREAT, True, True, direct)
    else:
        h, _ = open_handle(file, os.O_RDONLY, True, False, direct)
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
            _, kind, align, mem_align, _ = _service(dup, st, fs_type(dup), reopenable=False)
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
