"""The store's errors: each is an AionvmeError and the builtin it resembles."""

from __future__ import annotations

import errno
import os

from ..exceptions import AionvmeError

__all__ = [
    "AttachError",
    "CorruptValueError",
    "JournalError",
    "OutBufferError",
    "StoreClosedError",
    "StoreCorruptError",
    "StoreError",
    "StoreFullError",
    "StoreKeyError",
    "StoreKeyTypeError",
    "StoreLockedError",
    "StorePinError",
    "StoreTimeoutError",
]


class StoreError(AionvmeError):
    """Root of the TieredStore's own errors."""


class StoreKeyError(StoreError, KeyError):
    """The key is not in the store."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument
        return f"{self.args[0]!r} is not in the store" if self.args else "key not in the store"


class StoreFullError(StoreError, OSError):
    """No room: the NVMe tier (slab or disk) is full, or a value is larger than
    every tier that could take it. ``errno`` is ENOSPC; the store stays usable."""

    def __init__(self, message: str, filename: object = None) -> None:
        if filename is None:
            super().__init__(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {message}")
        else:
            super().__init__(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {message}", filename)


class StoreTimeoutError(StoreError, TimeoutError):
    """Waited longer than ``timeout`` for room in a tier (everything evictable is held)."""


class StoreClosedError(StoreError, RuntimeError):
    """The store is closed, or is used from an event loop other than its own."""


class StoreKeyTypeError(StoreError, TypeError):
    """A key the store cannot keep (a persistent store takes str keys only)."""


class StorePinError(StoreError, ValueError):
    """``unpin`` of a key that holds fewer pins than it is given back."""


class JournalError(StoreError, ValueError):
    """A persistent store's index files are not ones this version can read."""


class StoreCorruptError(JournalError):
    """A persistent store's index (snapshot or journal) is damaged: ``filename``
    and ``offset`` say where. Nothing was changed on disk; ``TieredStore(...,
    recover=True)`` salvages every intact record (see the README)."""

    def __init__(self, message: str, filename: str, offset: int | None = None) -> None:
        where = filename if offset is None else f"{filename} at byte {offset}"
        super().__init__(f"{where}: {message}")
        self.filename = filename
        self.offset = offset


class StoreLockedError(StoreError, BlockingIOError):
    """Another live store (in this or another process) owns the directory of a
    persistent store: ``pid`` is its process (None if it could not be read)."""

    def __init__(self, directory: str, pid: int | None) -> None:
        who = f"process {pid}" if pid is not None else "another process"
        super().__init__(
            errno.EWOULDBLOCK,
            f"the persistent store in {directory} is open in {who}"
            + (" (this one)" if pid == os.getpid() else "")
            + ": one store owns a directory at a time",
            directory,
        )
        self.pid = pid


class CorruptValueError(StoreError, OSError):
    """A value read back from the NVMe tier does not match the checksum taken
    when it was written (``errno`` EIO): no bytes of it are returned."""

    def __init__(self, key: object, path: str, offset: int, expected: int, got: int) -> None:
        super().__init__(
            errno.EIO,
            f"{os.strerror(errno.EIO)}: the value of {key!r} read back from NVMe does not match "
            f"its checksum (xxh3_64 {got:016x}, written {expected:016x}; slab offset {offset})",
            path,
        )
        self.key = key
        self.offset = offset


class OutBufferError(StoreError, ValueError):
    """``out=`` does not fit the value: another byte count, dtype or shape."""


class AttachError(StoreError, ValueError):
    """``TieredStore.attach`` refused: a persistent store, a region outside the
    file, or a shape and dtype that do not match the region's length."""
