"""Errors raised by aionvme.

Every error is a subclass of the builtin it resembles, so existing handlers
keep working: a missing file is a ``FileNotFoundError``, a full disk an
``OSError`` with ``errno.ENOSPC``. The library's own conditions also derive
from :class:`AionvmeError`. OS errors carry ``filename``, and where a transfer
failed, ``offset`` (the file offset of the failing part), ``nbytes`` and ``op``.
"""

from __future__ import annotations

import errno as _errno
import io
import os
from typing import Any

__all__ = [
    "AionvmeError",
    "BufferTypeError",
    "ClosedFileError",
    "CuFileError",
    "DeviceError",
    "EngineClosedError",
    "InvalidOffsetError",
    "NonContiguousBufferError",
    "ReadOnlyBufferError",
    "ShortReadError",
    "ShortWriteError",
    "UnsupportedOperation",
    "os_error",
]


class AionvmeError(Exception):
    """Root of the errors aionvme defines."""


class BufferTypeError(AionvmeError, TypeError):
    """The object is not a buffer aionvme can move bytes into or out of."""


class ReadOnlyBufferError(AionvmeError, BufferError):
    """A read was asked to fill a read-only buffer."""


class NonContiguousBufferError(AionvmeError, ValueError):
    """The buffer's bytes are not contiguous in memory."""


class InvalidOffsetError(AionvmeError, ValueError):
    """A file offset is negative, or offset + size overflows 64 bits."""


class DeviceError(AionvmeError, ValueError):
    """The buffer lives on a device this call cannot reach (e.g. CUDA without CUDA)."""


class ClosedFileError(AionvmeError, ValueError):
    """I/O on a closed aionvme file (ValueError, like I/O on a closed Python file)."""


class EngineClosedError(AionvmeError, RuntimeError):
    """The runtime serving this event loop was closed."""


class UnsupportedOperation(AionvmeError, io.UnsupportedOperation):
    """Writing to a file opened read-only, or reading one opened write-only."""


class ShortReadError(AionvmeError, EOFError):
    """The file ended before the buffer was filled.

    Attributes
    ----------
    filename, offset : where the read started.
    expected : bytes asked for.
    received : bytes that arrived, contiguously from ``offset``.
    segment : index of the (buffer, offset) pair, for batched reads; else None.
    """

    def __init__(
        self, filename: object, offset: int, expected: int, received: int, segment: int | None = None
    ) -> None:
        self.filename = filename
        self.offset = offset
        self.expected = expected
        self.received = received
        self.segment = segment
        where = f" (item {segment})" if segment is not None else ""
        super().__init__(
            f"short read{where}: {received} of {expected} bytes at offset {offset} "
            f"of {filename!r}: the file ends at {offset + received}"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # keep pickling working (multiprocessing, loaders)
        return (type(self), (self.filename, self.offset, self.expected, self.received, self.segment))


class ShortWriteError(AionvmeError, OSError):
    """The kernel accepted fewer bytes than asked and gave no errno.

    ``offset`` is the first byte that was not written.
    """

    def __init__(self, filename: object, offset: int, nbytes: int) -> None:
        super().__init__(
            _errno.EIO, f"short write: stopped at offset {offset} of a {nbytes}-byte write", filename
        )
        self.offset = offset
        self.nbytes = nbytes


class CuFileError(AionvmeError, OSError):
    """A cuFile (GPUDirect Storage) call failed; ``code`` and ``code_name`` are cuFile's."""

    def __init__(
        self, code: int, code_name: str, message: str, filename: object = None, err: int = _errno.EIO
    ) -> None:
        super().__init__(err, f"{message}: cuFile error {code} ({code_name})", filename)
        self.code = code
        self.code_name = code_name


def os_error(
    err: int,
    filename: object = None,
    *,
    offset: int | None = None,
    nbytes: int | None = None,
    op: str | None = None,
) -> OSError:
    """The one errno-to-exception conversion.

    ``OSError(err, strerror, filename)`` picks the matching subclass
    (FileNotFoundError, PermissionError, IsADirectoryError, ...) by itself;
    the transfer that failed is added to the message and as attributes.
    """
    msg = os.strerror(err)
    if op is not None:
        where = f"{op}"
        if nbytes is not None:
            where += f" of {nbytes} bytes"
        if offset is not None:
            where += f" failed at offset {offset}"
        msg = f"{msg} ({where})"
    exc = OSError(err, msg, filename) if filename is not None else OSError(err, msg)
    exc.offset = offset  # type: ignore[attr-defined]
    exc.nbytes = nbytes  # type: ignore[attr-defined]
    exc.op = op  # type: ignore[attr-defined]
    return exc
