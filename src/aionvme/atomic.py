"""Whole-file writes that survive a crash: the new content goes to a temporary
file in the same directory, is fsynced, renamed over the target, and the
directory is fsynced. Before the rename the old file is untouched; after the
``async with`` block (or ``with``) returns, the new one is durable.

The temporary file is created with mode 0600, so no other user can open it
while it is being written (a descriptor opened then would keep reading the
new content after any later chmod); it gets the target's permissions (or
``0666 & ~umask`` for a new file) just before the commit. A target that is a
symbolic link is written through: the link stays, the file it points to is
replaced, as editors do.

Nothing is resolved by name twice: the target's directory is opened once and
the temporary file is created, renamed and fsynced relative to that
descriptor (openat, renameat, fsync of the directory fd), so a directory
swapped for a symbolic link meanwhile cannot redirect the write. A symbolic
link as the last component is followed by this module, one hop at a time,
under the kernel's ``fs.protected_symlinks`` rule (fs/namei.c,
may_follow_link): a link in a sticky world-writable directory is followed
only when the writer or the directory's owner owns it, whatever the sysctl
says; otherwise :class:`~aionvme.exceptions.UnsafeSymlinkError`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import stat
from types import TracebackType

from .exceptions import UnsafeSymlinkError, os_error
from .file import File, PathLike

__all__ = ["AtomicWriter", "atomic_write", "fsync_dir"]

_NAME_MAX = 255  # when pathconf cannot say (Linux filesystems: 255 bytes)
_MAXSYMLINKS = 40  # the kernel's limit on links followed in one lookup (include/linux/namei.h)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # O_RDONLY, not O_PATH: fsync needs it


def fsync_dir(directory: str | int) -> None:
    """fsync a directory (a path, or an open directory fd) so a rename or
    create in it is durable.

    An fd is opened again as ``"."`` relative to itself: the same directory,
    no name resolved, and a fresh open reports a filesystem shut down under
    us (EIO), where xfs's fsync of a directory already open returns 0 though
    the rename was lost (tests/faults/test_crash.py)."""
    name = f"<dir fd {directory}>" if isinstance(directory, int) else directory
    try:
        if isinstance(directory, int):
            fd = os.open(".", _DIR_FLAGS, dir_fd=directory)
        else:
            fd = os.open(directory, _DIR_FLAGS)
    except OSError as e:
        raise os_error(e.errno or errno.EIO, name, op="open (directory)") from None
    try:
        os.fsync(fd)
    except OSError as e:
        raise os_error(e.errno or errno.EIO, name, op="fsync (directory)") from None
    finally:
        os.close(fd)


def _open_dir(path: str, dir_fd: int | None, shown: str) -> int:
    try:
        return os.open(path or ".", _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise os_error(e.errno or errno.EIO, shown, op="open (directory)") from None


def _split(path: str, shown: str) -> tuple[str, str]:
    parent, name = os.path.split(path)
    if name in ("", ".", ".."):  # "dir/", "." : what open(2) with O_CREAT says
        raise os_error(errno.EISDIR, shown, op="open")
    return parent, name


def _may_follow(dir_fd: int, link: os.stat_result, shown: str) -> None:
    """The kernel's fs.protected_symlinks rule (fs/namei.c, may_follow_link)
    for a link in the directory open as dir_fd: follow when the follower owns
    the link, when the directory is not both sticky and world-writable, or
    when the directory's owner owns the link."""
    if link.st_uid == os.geteuid():  # the fsuid, which Python cannot read; equal unless setfsuid
        return
    d = os.fstat(dir_fd)
    if d.st_mode & (stat.S_ISVTX | stat.S_IWOTH) != (stat.S_ISVTX | stat.S_IWOTH):
        return
    if d.st_uid == link.st_uid:
        return
    raise UnsafeSymlinkError(shown, link.st_uid)


def _resolve_at(path: PathLike) -> tuple[int, str, str, os.stat_result | None]:
    """Where a whole-file write of path goes: (directory fd, name in it,
    the path shown in messages, the target's lstat or None if it is new).

    The directory is opened by the kernel (which applies its own rules to
    every component but the last); a symbolic link as the last component is
    read and followed here, hop by hop, each under :func:`_may_follow`. The
    caller owns the returned fd.
    """
    text = os.fsdecode(path)
    shown = os.path.abspath(text)
    parent, name = _split(text, shown)
    dfd = _open_dir(parent, None, os.path.dirname(shown))
    try:
        for _ in range(_MAXSYMLINKS + 1):
            # The entry itself (O_PATH|O_NOFOLLOW): its owner and its target
            # are read from one inode, not from whatever the name holds later.
            try:
                lfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                return dfd, name, shown, None
            except OSError as e:
                raise os_error(e.errno or errno.EIO, shown, op="open") from None
            try:
                st = os.fstat(lfd)
                if not stat.S_ISLNK(st.st_mode):
                    return dfd, name, shown, st
                _may_follow(dfd, st, shown)
                target = os.readlink("", dir_fd=lfd)  # readlinkat(fd, ""): the link open as fd
            finally:
                os.close(lfd)
            shown = os.path.normpath(os.path.join(os.path.dirname(shown), target))
            parent, name = _split(target, shown)
            if parent:  # relative to the link's directory; an absolute one ignores dir_fd
                nfd = _open_dir(parent, dfd, os.path.dirname(shown))
                os.close(dfd)
                dfd = nfd
        raise os_error(errno.ELOOP, shown, op="open")
    except BaseException:
        os.close(dfd)
        raise


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it,
    which races with other threads creating files)."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc (or a kernel before 4.7): the racy way
    os.umask(old)
    return old


def _temp_name(directory: str | int, base: str) -> str:
    """``.{base}.{random}.tmp``, with ``base`` shortened (and marked with ``~``)
    where the whole would pass the directory's name limit: any legal target
    name gets a legal temporary name."""
    token = secrets.token_hex(6)
    try:
        limit = os.pathconf(directory if isinstance(directory, int) else directory or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = _NAME_MAX
    if limit <= 0:
        limit = _NAME_MAX
    name = f".{base}.{token}.tmp"
    if len(os.fsencode(name)) <= limit:
        return name
    keep = len(base)
    while keep > 0:
        keep -= 1
        name = f".{base[:keep]}~.{token}.tmp"
        if len(os.fsencode(name)) <= limit:
            return name
    return f".{token}.tmp"


class AtomicWriter:
    """Write a file as a whole, crash-safely. Use :func:`atomic_write`.

    ``file`` is an aionvme :class:`File` (opened read-write) on the temporary
    name: write to it with ``pwrite``/``pwrite_many`` at any offsets. Leaving
    the block normally commits (fsync, rename, directory fsync); an
    exception, including cancellation, removes the temporary file and keeps
    the old one.

    Attributes
    ----------
    path : str
        The file that is replaced, as shown in messages: the absolute target,
        with a symbolic link as its last component followed (a link is
        written through, not replaced). Known once the block is entered.
    tmp_path : str
        The temporary file, in ``path``'s directory, mode 0600 until the commit.
    """

    def __init__(
        self, path: PathLike, *, direct: bool | None = None, durable: bool = True, mode: int | None = None
    ) -> None:
        self._target = path
        self.path = os.path.abspath(os.fsdecode(path))
        self.directory = os.path.dirname(self.path)
        self.durable = durable
        self._direct = direct
        self.tmp_path = ""
        self.file: File | None = None
        self._mode = 0o600
        self._dir_fd = -1
        self._name = ""
        self._tmp_name = ""
        self._want = mode

    def _open(self) -> File:
        # The directory is opened once; every later step is relative to it.
        dfd, self._name, self.path, st = _resolve_at(self._target)
        self._dir_fd = dfd
        self.directory = os.path.dirname(self.path)
        try:
            if self._want is not None:
                self._mode = self._want  # the caller's permissions, whatever the target had
            else:
                # keep the target's permissions; a new file gets what open(2) would give it
                self._mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()
            self._tmp_name = _temp_name(dfd, self._name)
            self.tmp_path = os.path.join(self.directory, self._tmp_name)
            # Private from the first moment: created 0600, given its final mode
            # only at the commit (see _set_mode). O_EXCL never follows a link.
            try:
                fd = os.open(
                    self._tmp_name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=dfd
                )
            except OSError as e:
                raise os_error(e.errno or errno.EIO, self.tmp_path, op="open (temporary file)") from None
        except BaseException:
            self._close_dir()
            raise
        try:
            f = File._open_at(dfd, self._tmp_name, "r+", display=self.tmp_path, direct=self._direct)
            self.file = f
            a, b = os.fstat(fd), os.fstat(f.fileno())
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # replaced between the two opens
                raise os_error(errno.EEXIST, self.tmp_path, op="open (temporary file was replaced)")
        except BaseException:
            self._discard()  # no temporary file left behind
            raise
        finally:
            os.close(fd)
        return f

    def _set_mode(self, f: File) -> None:
        """The final permissions, before the fsync that makes them durable."""
        if self._mode == 0o600:
            return
        try:
            os.fchmod(f.fileno(), self._mode)
        except OSError as e:
            raise os_error(e.errno or errno.EIO, self.tmp_path, op="fchmod") from None

    def _close_dir(self) -> None:
        fd, self._dir_fd = self._dir_fd, -1
        if fd >= 0:
            os.close(fd)

    def _discard(self) -> None:
        try:
            if self.file is not None:
                self.file.close()
            if self._dir_fd >= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._tmp_name, dir_fd=self._dir_fd)
        finally:
            self._close_dir()  # even when the unlink fails (EIO): an open fd keeps a mount busy

    def _rename(self) -> None:
        try:
            os.replace(self._tmp_name, self._name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as e:
            self._discard()
            raise os_error(e.errno or errno.EIO, self.path, op="rename") from None

    def _sync_dir(self) -> None:
        try:
            fsync_dir(self._dir_fd)
        except OSError as e:
            e.filename = self.directory  # the directory by name, not "<dir fd N>"
            raise

    def _publish(self) -> None:
        try:
            self._rename()
            if self.durable:
                self._sync_dir()
        finally:
            self._close_dir()

    # -- async -----------------------------------------------------------------

    async def __aenter__(self) -> File:
        return self._open()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        f = self.file
        if f is None:
            return
        if et is not None:
            self._discard()
            return
        try:
            self._set_mode(f)
            if self.durable:
                await f.fsync()
        except BaseException:
            self._discard()
            raise
        f.close()
        # The rename is the commit point (one metadata operation: done here).
        # The directory fsync that makes it durable runs on a thread and is
        # seen through even if this task is cancelled meanwhile: a caller that
        # gets CancelledError from here has its new file in place and durable.
        self._rename()
        try:
            if self.durable:
                sync = asyncio.ensure_future(asyncio.to_thread(self._sync_dir))
                try:
                    await asyncio.shield(sync)
                except asyncio.CancelledError:
                    await sync
                    raise
        finally:
            self._close_dir()

    # -- sync ------------------------------------------------------------------

    def __enter__(self) -> File:
        f = self._open()
        # The plain ``with`` form is blocking code by the caller's choice (and
        # how library code writes its small files): its File's sync_* calls
        # are not refused on a thread whose event loop runs.
        f._loop_ok = True
        return f

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        f = self.file
        if f is None:
            return
        if et is not None:
            self._discard()
            return
        try:
            self._set_mode(f)
            if self.durable:
                f.sync_fsync()
        except BaseException:
            self._discard()
            raise
        f.close()
        self._publish()


def atomic_write(
    path: PathLike, *, direct: bool | None = None, durable: bool = True, mode: int | None = None
) -> AtomicWriter:
    """Crash-safe whole-file write::

        async with nvme.atomic_write("/nvme/ckpt.bin") as f:
            await f.pwrite(header, 0)
            await f.pwrite(tensor, 4096)
        # here the new file is durable; until the rename the old one is intact

    Also usable as a plain ``with`` block with ``f.sync_pwrite``.
    ``durable=False`` skips the fsyncs (still atomic against concurrent readers).

    Notes
    -----
    Permissions: the new file gets the target's mode (a new target:
    ``0666 & ~umask``), but only at the commit; until then the temporary file
    is 0600, so other users cannot open it and read a private file's new
    content. ``mode=`` gives the new file these permissions instead (not
    masked by the umask). Owner and group are those of the writing process.

    Symbolic links: when ``path`` is a symlink, the file it points to is
    replaced (in its own directory) and the link is kept, as editors do; a
    dangling link creates its target. A link that the kernel's
    ``fs.protected_symlinks`` rule would not follow (in a sticky
    world-writable directory such as /tmp, owned neither by you nor by the
    directory's owner) raises :class:`~aionvme.exceptions.UnsafeSymlinkError`
    (a ``PermissionError``), whatever the sysctl is set to, and nothing is
    written. The target's directory is opened once and everything after is
    relative to it: renaming or replacing it meanwhile cannot redirect the
    write. Any legal file name works: the temporary name is shortened where
    the 18 bytes it adds would pass the directory's name limit.
    """
    return AtomicWriter(path, direct=direct, durable=durable, mode=mode)
