"""Whole-file writes that survive a crash: the new content goes to a temporary
file in the same directory, is fsynced, renamed over the target, and the
directory is fsynced. Before the rename the old file is untouched; after the
``async with`` block (or ``with``) returns, the new one is durable."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
from types import TracebackType

from .exceptions import os_error
from .file import File, PathLike

__all__ = ["AtomicWriter", "atomic_write", "fsync_dir"]


def fsync_dir(directory: str) -> None:
    """fsync a directory so a rename or create in it is durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        raise os_error(e.errno or 5, directory, op="fsync (directory)") from None
    finally:
        os.close(fd)


class AtomicWriter:
    """Write a file as a whole, crash-safely. Use :func:`atomic_write`.

    ``file`` is an aionvme :class:`File` (mode 'w+') on the temporary name:
    write to it with ``pwrite``/``pwrite_many`` at any offsets. Leaving the
    block normally commits (fsync, rename, directory fsync); an exception,
    including cancellation, removes the temporary file and keeps the old one.
    """

    def __init__(self, path: PathLike, *, direct: bool | None = None, durable: bool = True) -> None:
        self.path = os.path.abspath(os.fsdecode(path))
        self.directory = os.path.dirname(self.path)
        self.durable = durable
        self._direct = direct
        self.tmp_path = os.path.join(
            self.directory, f".{os.path.basename(self.path)}.{secrets.token_hex(6)}.tmp"
        )
        self.file: File | None = None

    def _open(self) -> File:
        f = File(self.tmp_path, "x+", direct=self._direct)
        self.file = f
        try:
            try:
                mode = stat.S_IMODE(os.stat(self.path).st_mode)  # keep the target's permissions
            except FileNotFoundError:
                mode = None
            if mode is not None:
                os.fchmod(f.fileno(), mode)
        except BaseException:
            self._discard()  # no temporary file left behind
            raise
        return f

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
            if self.durable:
                f.sync_fsync()
        except BaseException:
            self._discard()
            raise
        f.close()
        self._publish()


def atomic_write(path: PathLike, *, direct: bool | None = None, durable: bool = True) -> AtomicWriter:
    """Crash-safe whole-file write::

        async with nvme.atomic_write("/nvme/ckpt.bin") as f:
            await f.pwrite(header, 0)
            await f.pwrite(tensor, 4096)
        # here the new file is durable; until the rename the old one is intact

    Also usable as a plain ``with`` block with ``f.sync_pwrite``.
    ``durable=False`` skips the fsyncs (still atomic against concurrent readers).
    """
    return AtomicWriter(path, direct=direct, durable=durable)
