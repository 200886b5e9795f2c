"""aionvme: asyncio-native NVMe I/O for tensors.

::

    import aionvme as nvme
    await nvme.pread(tensor, "/nvme/w.bin")                      # fills the tensor, or raises
    await asyncio.gather(*(nvme.pread(t, p) for t, p in jobs))   # many transfers, one loop

Every transfer is an awaitable backed by kernel AIO with O_DIRECT (or a C
worker pool where AIO or O_DIRECT is not available): the requests of a loop
iteration are submitted together (in io_submit calls of 4, 8, 16, ... so the
device starts early), each split into chunks in flight in parallel.
"""

# No ``from __future__ import annotations`` and no names imported for typing
# only: dir(aionvme) lists the API and nothing else (see the ``del`` below).
from typing import Any

from . import data, defaults, gpu, offload
from ._engine import AlignedBuffer
from ._version import __version__
from .atomic import atomic_write
from .exceptions import (
    AionvmeError,
    BlockingCallError,
    BufferTypeError,
    ClosedFileError,
    CuFileError,
    DeviceError,
    EngineClosedError,
    InvalidOffsetError,
    InvalidSettingError,
    NonContiguousBufferError,
    ReadOnlyBufferError,
    SettingTypeError,
    ShortReadError,
    ShortWriteError,
    UnsafeSymlinkError,
    UnsupportedOperation,
)
from .file import File, fsync, open, pread, pread_many, pread_rows, pwrite, pwrite_many, pwrite_rows
from .formats import (
    BackgroundSave,
    SafetensorsError,
    TensorNotFoundError,
    TorchNotInstalledError,
    load,
    load_safetensors,
    load_safetensors_sharded,
    save,
    save_in_background,
    save_safetensors,
    sync_load,
    sync_load_safetensors,
    sync_save,
    sync_save_in_background,
    sync_save_safetensors,
)
from .gpu import deregister, register
from .handle import Handle
from .memory import empty, is_aligned
from .runtime import aclose, stats
from .store import (
    StoreClosedError,
    StoreError,
    StoreFullError,
    StoreKeyError,
    StoreTimeoutError,
    SyncTieredStore,
    TieredStore,
)


def info(path: str | None = None, *, init_cuda: bool = False) -> dict[str, Any]:
    """What this machine offers aionvme (``aionvme info`` as a dict); see :func:`aionvme.diagnostics.info`."""
    from .diagnostics import info as _info

    return _info(path, init_cuda=init_cuda)


del Any  # only the annotation above needed it

__all__ = [
    "AionvmeError",
    "AlignedBuffer",
    "BackgroundSave",
    "BlockingCallError",
    "BufferTypeError",
    "ClosedFileError",
    "CuFileError",
    "DeviceError",
    "EngineClosedError",
    "File",
    "Handle",
    "InvalidOffsetError",
    "InvalidSettingError",
    "NonContiguousBufferError",
    "ReadOnlyBufferError",
    "SafetensorsError",
    "SettingTypeError",
    "ShortReadError",
    "ShortWriteError",
    "StoreClosedError",
    "StoreError",
    "StoreFullError",
    "StoreKeyError",
    "StoreTimeoutError",
    "SyncTieredStore",
    "TensorNotFoundError",
    "TieredStore",
    "TorchNotInstalledError",
    "UnsafeSymlinkError",
    "UnsupportedOperation",
    "__version__",
    "aclose",
    "atomic_write",
    "data",
    "defaults",
    "deregister",
    "empty",
    "fsync",
    "gpu",
    "info",
    "is_aligned",
    "load",
    "load_safetensors",
    "load_safetensors_sharded",
    "offload",
    "open",
    "pread",
    "pread_many",
    "pread_rows",
    "pwrite",
    "pwrite_many",
    "pwrite_rows",
    "register",
    "save",
    "save_in_background",
    "save_safetensors",
    "stats",
    "sync_load",
    "sync_load_safetensors",
    "sync_save",
    "sync_save_in_background",
    "sync_save_safetensors",
]
