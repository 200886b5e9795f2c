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
import stat
from typing import Any

__all__ = [
    "AionvmeError",
    "BlockingCallError",
    "BufferTypeError",
    "ClosedFileError",
    "CuFileError",
    "DeviceError",
    "EngineClosedError",
    "InvalidOffsetError",
    "InvalidSettingError",
    "NonContiguousBufferError",
    "ReadOnlyBufferError",
    "SettingTypeError",
    "ShortReadError",
    "ShortWriteError",
    "TorchNotInstalledError",
    "UnsafeSymlinkError",
    "UnsupportedOperation",
    "cufile_error",
    "import_torch",
    "os_error",
]


class AionvmeError(Exception):
    """Root of the errors aionvme defines."""


class TorchNotInstalledError(AionvmeError, ModuleNotFoundError):
    """torch tensors were asked for (``like="torch"``, the default, or a
    checkpoint that holds torch tensors), but torch is not installed."""


def import_torch(hint: str) -> Any:
    """The torch module, or TorchNotInstalledError saying what to do instead."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name not in ("torch", None):
            raise  # torch is there but one of its own dependencies is missing
        raise TorchNotInstalledError(f"torch is not installed: {hint}", name="torch") from None
    return torch


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


class BlockingCallError(AionvmeError, RuntimeError):
    """A blocking call (``sync_load``, ``File.sync_pread``, ``Handle.sync_pwrite``...)
    was made on a thread whose event loop is running: it would stall every
    task of that loop for the whole transfer. ``await`` the async form there,
    or make the call from another thread.

    Attributes
    ----------
    call : str
        The blocking call (``"aionvme.sync_load"``, ``"File.sync_pread"``).
    instead : str
        Its async form.
    """

    def __init__(self, call: str, instead: str) -> None:
        short = call.rsplit(".", 1)[-1]
        super().__init__(
            f"{call}() blocks, and this thread runs an event loop: use `await {instead}(...)` "
            f"(or call {short} from another thread)"
        )
        self.call = call
        self.instead = instead

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.instead))


class EngineClosedError(AionvmeError, RuntimeError):
    """The runtime serving this event loop was closed."""


class UnsupportedOperation(AionvmeError, io.UnsupportedOperation):
    """Writing to a file opened read-only, or reading one opened write-only.

    ``filename`` names the file (it is an OSError, like io's, without an
    errno: the message is the library's own).
    """

    def __init__(self, message: str, filename: object = None) -> None:
        super().__init__(message)
        if filename is not None:
            self.filename = filename

    def __str__(self) -> str:
        msg = str(self.args[0]) if self.args else "unsupported operation"
        name = self.filename
        if name is not None and repr(name) not in msg and str(name) not in msg:
            msg = f"{msg}: {name!r}"
        return msg

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0] if self.args else "", self.filename))


class UnsafeSymlinkError(AionvmeError, PermissionError):
    """A whole-file write (:func:`aionvme.atomic_write`, ``save``...) refused
    to follow a symbolic link that the kernel's ``fs.protected_symlinks`` rule
    refuses: a link in a sticky, world-writable directory (like /tmp) owned
    neither by the writing user nor by the directory's owner, which another
    user may have planted to redirect the write.

    A ``PermissionError`` with errno EACCES (what ``open(2)`` gives for such a
    link when the sysctl is on); ``filename`` is the link, ``link_uid`` its
    owner.
    """

    def __init__(self, filename: object, link_uid: int) -> None:
        super().__init__(
            _errno.EACCES,
            f"{os.strerror(_errno.EACCES)} (refusing to follow a symbolic link owned by uid "
            f"{link_uid} in a sticky world-writable directory: fs.protected_symlinks)",
            filename,
        )
        self.link_uid = link_uid

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.filename, self.link_uid))


class InvalidSettingError(AionvmeError, ValueError):
    """A knob or mode aionvme cannot use: a block size that is not a positive
    multiple of 4096, a negative parallelism, an unknown engine, a bad
    ``AIONVME_*`` environment value, an invalid open mode...

    Every entry point (the path functions, :class:`~aionvme.File`,
    :class:`~aionvme.Handle`, :mod:`~aionvme.defaults`, the DeepSpeed handle)
    checks its knobs with the same rules and raises this, or
    :class:`SettingTypeError` for a value of the wrong type.

    Attributes
    ----------
    name : str or None
        The setting (``"block_size"``, ``"parallelism"``, ``"mode"``...).
    value : object
        The value given.
    variable : str or None
        The environment variable it came from, if any.
    """

    def __init__(
        self, message: str, *, name: str | None = None, value: object = None, variable: str | None = None
    ) -> None:
        super().__init__(message)
        self.name = name
        self.value = value
        self.variable = variable

    @classmethod
    def of_type(cls, name: str, value: object, wanted: str) -> SettingTypeError:
        """The error for a value of the wrong type."""
        return SettingTypeError(
            f"{name} must be {wanted}, not {type(value).__name__} ({value!r})", name=name, value=value
        )


class SettingTypeError(InvalidSettingError, TypeError):
    """A knob of the wrong type (a float or bool where an int is needed, an
    unknown setting name): both an :class:`InvalidSettingError` and a TypeError."""


class ShortReadError(AionvmeError, EOFError):
    """The file ended before the buffer was filled.

    Attributes
    ----------
    filename, offset : where the read started.
    expected : bytes asked for.
    received : bytes that arrived, contiguously from ``offset``.
    segment : index of the (buffer, offset) pair, for batched reads; else None.
    file_size : the file's size when the error was made, when it agrees with
        what the read found (the file may have grown since): from the open
        file, or for a path-based call (whose file is closed by then) from
        the path; None where neither can say (an fd that was closed).
    """

    def __init__(
        self,
        filename: object,
        offset: int,
        expected: int,
        received: int,
        segment: int | None = None,
        file_size: int | None = None,
    ) -> None:
        self.filename = filename
        self.offset = offset
        self.expected = expected
        self.received = received
        self.segment = segment
        if file_size is None:
            file_size = _size_by_name(filename, offset + received)
        self.file_size = file_size
        where = f" (item {segment})" if segment is not None else ""
        if file_size is not None:
            ends = f"the file is {file_size} bytes long"
        elif received:
            ends = f"the file ends at {offset + received}"
        else:
            ends = f"the file ends at or before {offset}"
        super().__init__(
            f"short read{where}: {received} of {expected} bytes at offset {offset} of {filename!r}: {ends}"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # keep pickling working (multiprocessing, loaders)
        return (
            type(self),
            (self.filename, self.offset, self.expected, self.received, self.segment, self.file_size),
        )


def _size_by_name(filename: object, end: int) -> int | None:
    """The size of the regular file at path ``filename``, if no more than
    ``end`` (where the short read stopped); else None. The engine measures an
    open file itself (fstat); a path-based call's file is closed by the time
    the error is made, so its size is taken from the name."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return None
    if isinstance(filename, str) and filename.startswith("<fd "):  # an fd's stand-in name
        return None
    try:
        st = os.stat(filename)
    except (OSError, ValueError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_size <= end else None


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
    """A cuFile (GPUDirect Storage) call failed.

    ``code`` is cuFile's ``CUfileOpError`` (5001 and up), ``code_name`` its
    ``CU_FILE_*`` name, ``cu_err`` the CUDA driver's ``CUresult`` when cuFile
    reports one (``CU_FILE_CUDA_DRIVER_ERROR``). ``errno`` is EIO.
    """

    def __init__(
        self,
        code: int,
        code_name: str,
        message: str,
        filename: object = None,
        err: int = _errno.EIO,
        cu_err: int | None = None,
    ) -> None:
        cuda = f", CUDA driver error {cu_err}" if cu_err else ""
        super().__init__(err, f"{message}: cuFile error {code} ({code_name}{cuda})", filename)
        self.code = code
        self.code_name = code_name
        self.cu_err = cu_err
        self._message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.code, self.code_name, self._message, self.filename, self.errno, self.cu_err),
        )


# cuFile's status codes: CUfileOpError in cufile.h (CUFILEOP_STATUS_ENTRIES,
# cuFile 1.15), CUFILEOP_BASE_ERR (5000) + n. Name and cuFile's own text.
CUFILEOP_BASE_ERR = 5000
CUFILE_ERRORS: dict[int, tuple[str, str]] = {
    5001: (
        "CU_FILE_DRIVER_NOT_INITIALIZED",
        "nvidia-fs driver is not loaded. Set allow_compat_mode to true in cufile.json file "
        "to enable compatible mode",
    ),
    5002: ("CU_FILE_DRIVER_INVALID_PROPS", "invalid property"),
    5003: ("CU_FILE_DRIVER_UNSUPPORTED_LIMIT", "property range error"),
    5004: ("CU_FILE_DRIVER_VERSION_MISMATCH", "nvidia-fs driver version mismatch"),
    5005: ("CU_FILE_DRIVER_VERSION_READ_ERROR", "nvidia-fs driver version read error"),
    5006: ("CU_FILE_DRIVER_CLOSING", "driver shutdown in progress"),
    5007: ("CU_FILE_PLATFORM_NOT_SUPPORTED", "GPUDirect Storage not supported on current platform"),
    5008: ("CU_FILE_IO_NOT_SUPPORTED", "GPUDirect Storage not supported on current file"),
    5009: ("CU_FILE_DEVICE_NOT_SUPPORTED", "GPUDirect Storage not supported on current GPU"),
    5010: ("CU_FILE_NVFS_DRIVER_ERROR", "nvidia-fs driver ioctl error"),
    5011: ("CU_FILE_CUDA_DRIVER_ERROR", "CUDA Driver API error"),
    5012: ("CU_FILE_CUDA_POINTER_INVALID", "invalid device pointer"),
    5013: ("CU_FILE_CUDA_MEMORY_TYPE_INVALID", "invalid pointer memory type"),
    5014: ("CU_FILE_CUDA_POINTER_RANGE_ERROR", "pointer range exceeds allocated address range"),
    5015: ("CU_FILE_CUDA_CONTEXT_MISMATCH", "cuda context mismatch"),
    5016: ("CU_FILE_INVALID_MAPPING_SIZE", "access beyond maximum pinned size"),
    5017: ("CU_FILE_INVALID_MAPPING_RANGE", "access beyond mapped size"),
    5018: ("CU_FILE_INVALID_FILE_TYPE", "unsupported file type"),
    5019: ("CU_FILE_INVALID_FILE_OPEN_FLAG", "unsupported file open flags"),
    5020: ("CU_FILE_DIO_NOT_SET", "fd direct IO not set"),
    5022: ("CU_FILE_INVALID_VALUE", "invalid arguments"),
    5023: ("CU_FILE_MEMORY_ALREADY_REGISTERED", "device pointer already registered"),
    5024: ("CU_FILE_MEMORY_NOT_REGISTERED", "device pointer lookup failure"),
    5025: ("CU_FILE_PERMISSION_DENIED", "driver or file access error"),
    5026: ("CU_FILE_DRIVER_ALREADY_OPEN", "driver is already open"),
    5027: ("CU_FILE_HANDLE_NOT_REGISTERED", "file descriptor is not registered"),
    5028: ("CU_FILE_HANDLE_ALREADY_REGISTERED", "file descriptor is already registered"),
    5029: ("CU_FILE_DEVICE_NOT_FOUND", "GPU device not found"),
    5030: ("CU_FILE_INTERNAL_ERROR", "internal error"),
    5031: ("CU_FILE_GETNEWFD_FAILED", "failed to obtain new file descriptor"),
    5033: ("CU_FILE_NVFS_SETUP_ERROR", "NVFS driver initialization error"),
    5034: ("CU_FILE_IO_DISABLED", "GPUDirect Storage disabled by config on current file"),
    5035: ("CU_FILE_BATCH_SUBMIT_FAILED", "failed to submit batch operation"),
    5036: ("CU_FILE_GPU_MEMORY_PINNING_FAILED", "failed to allocate pinned GPU Memory"),
    5037: ("CU_FILE_BATCH_FULL", "queue full for batch operation"),
    5038: ("CU_FILE_ASYNC_NOT_SUPPORTED", "cuFile stream operation not supported"),
    5039: ("CU_FILE_INTERNAL_BATCH_SETUP_ERROR", "batch setup internal error - retry later"),
    5040: ("CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR", "batch submit internal error - retry later"),
    5041: ("CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR", "batch get status internal error - retry later"),
    5042: ("CU_FILE_INTERNAL_BATCH_CANCEL_ERROR", "batch cancel internal error - retry later"),
    5043: ("CU_FILE_NOMEM_ERROR", "cufile no memory error - retry later"),
    5044: ("CU_FILE_IO_ERROR", "cufile io error"),
    5045: ("CU_FILE_INTERNAL_BUF_REGISTER_ERROR", "cufile buf registration error"),
    5046: ("CU_FILE_HASH_OPR_ERROR", "cufile hash operation error"),
    5047: ("CU_FILE_INVALID_CONTEXT_ERROR", "cufile invalid context error"),
    5048: ("CU_FILE_NVFS_INTERNAL_DRIVER_ERROR", "nvfs internal driver error"),
    5049: ("CU_FILE_BATCH_NOCOMPAT_ERROR", "compat mode off error"),
}


def cufile_error(
    code: int,
    filename: object = None,
    *,
    offset: int | None = None,
    nbytes: int | None = None,
    op: str | None = None,
    cu_err: int | None = None,
) -> OSError:
    """The exception for a failed cuFile call.

    ``code`` is what the call reported, in either sign: a ``CUfileOpError``
    (cuFile's own failures, >= 5000) gives :class:`CuFileError` with its
    ``CU_FILE_*`` name; anything smaller is an errno (cuFileRead/cuFileWrite
    return -1 and set errno for filesystem errors) and goes through
    :func:`os_error`, so a missing file is still a ``FileNotFoundError``.
    """
    code = abs(code)
    if code < CUFILEOP_BASE_ERR:
        return os_error(code or _errno.EIO, filename, offset=offset, nbytes=nbytes, op=op)
    name, text = CUFILE_ERRORS.get(code, ("CU_FILE_UNKNOWN_ERROR", "unknown cuFile error"))
    where = op or "cuFile"
    if nbytes is not None:
        where += f" of {nbytes} bytes"
    if offset is not None:
        where += f" failed at offset {offset}"
    exc = CuFileError(code, name, f"{text} ({where})", filename, cu_err=cu_err)
    exc.offset = offset  # type: ignore[attr-defined]
    exc.nbytes = nbytes  # type: ignore[attr-defined]
    exc.op = op  # type: ignore[attr-defined]
    return exc


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
