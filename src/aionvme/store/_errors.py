"""The store's errors: each is an AionvmeError and the builtin it resembles."""

from __future__ import annotations

import errno
import os

from ..exceptions import AionvmeError

__all__ = [
    "AttachError",
    "JournalError",
    "StoreClosedError",
    "StoreError",
    "StoreFullError",
    "StoreKeyError",
    "StoreKeyTypeError",
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


class JournalError(StoreError, ValueError):
    """A persistent store's index files are not ones this version can read."""


class AttachError(StoreError, ValueError):
    """``TieredStore.attach`` refused: a persistent store, a region outside the
    file, or a shape and dtype that do not match the region's length."""
