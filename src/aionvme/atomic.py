"""Whole-file writes that survive a crash: the new content goes to a temporary
file in the same directory, is fsynced, renamed over the target, and the
directory is fsynced. Before the rename the old file is untouched; after the
``async with`` block (or ``with``) returns, the new one is durable.

The temporary file is created with mode 0600, so no other user can open it
while it is being written (a descriptor opened then would keep reading the
new content after any later chmod); it gets the target's permissions (or
``0666 & ~umask`` for a new file) just before the commit. A target that is a
symbolic link is written through: the link stays, the file it points to is
replaced, as editors do."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import stat
from types import TracebackType

from .exceptions import os_error
from .file import File, PathLike

__all__ = ["AtomicWriter", "atomic_write", "fsync_dir"]

_NAME_MAX = 255  # when pathconf cannot say (Linux filesystems: 255 bytes)


def fsync_dir(directory: str) -> None:
    """fsync a directory so a rename or create in it is durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        raise os_error(e.errno or 5, directory, op="fsync (directory)") from None
    finally:
        os.close(fd)


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


def _temp_name(directory: str, base: str) -> str:
    """``.{base}.{random}.tmp``, with ``base`` shortened (and marked with ``~``)
    where the whole would pass the directory's name limit: any legal target
    name gets a legal temporary name."""
    token = secrets.token_hex(6)
    try:
        limit = os.pathconf(directory or ".", "PC_NAME_MAX")
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
        The file that is replaced: the absolute target, with symbolic links
        resolved (a link is written through, not replaced).
    tmp_path : str
        The temporary file, in ``path``'s directory, mode 0600 until the commit.
    """

    def __init__(
        self, path: PathLike, *, direct: bool | None = None, durable: bool = True, mode: int | None = None
    ) -> None:
        # realpath: a symlinked target (or directory) is written through, and
        # the temporary file lands on the filesystem the rename happens on.
        self.path = os.path.realpath(os.path.abspath(os.fsdecode(path)))
        self.directory = os.path.dirname(self.path)
        self.durable = durable
        self._direct = direct
        self.tmp_path = os.path.join(self.directory, _temp_name(self.directory, os.path.basename(self.path)))
        self.file: File | None = None
        self._mode = 0o600
        self._want = mode

    def _open(self) -> File:
        try:
            if self._want is not None:
                self._mode = self._want  # the caller's permissions, whatever the target had
            else:
                # keep the target's permissions; a new file gets what open(2) would give it
                self._mode = stat.S_IMODE(os.stat(self.path).st_mode)
        except FileNotFoundError:
            self._mode = 0o666 & ~_umask()
        except OSError as e:
            raise os_error(e.errno or errno.EIO, self.path, op="stat") from None
        # Private from the first moment: created 0600, given its final mode
        # only at the commit (see _set_mode).
        try:
            fd = os.open(self.tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise os_error(e.errno or errno.EIO, self.tmp_path, op="open (temporary file)") from None
        try:
            f = File(self.tmp_path, "r+", direct=self._direct)
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

    def _discard(self) -> None:
        if self.file is not None:
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp_path)

    def _rename(self) -> None:
        try:
            os.replace(self.tmp_path, self.path)
        except OSError as e:
            self._discard()
            raise os_error(e.errno or 5, self.path, op="rename") from None

    def _publish(self) -> None:
        self._rename()
        if self.durable:
            fsync_dir(self.directory)

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
        if self.durable:
            sync = asyncio.ensure_future(asyncio.to_thread(fsync_dir, self.directory))
            try:
                await asyncio.shield(sync)
            except asyncio.CancelledError:
                await sync
                raise

    # -- sync ------------------------------------------------------------------

    def __enter__(self) -> File:
        return self._open()

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
    dangling link creates its target. Any legal file name works: the
    temporary name is shortened where the 18 bytes it adds would pass the
    directory's name limit.
    """
    return AtomicWriter(path, direct=direct, durable=durable, mode=mode)
