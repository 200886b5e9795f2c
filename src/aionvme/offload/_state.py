"""Where the optimizer's state blobs live between steps: a thin adapter, so
the optimizer does not care whether it is a TieredStore or one file.

A *blob* is one chunk's state packed into one page-aligned uint8 tensor; it
is written and read whole (one request each way).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Protocol

import torch

from ..file import File
from ..file import open as nvme_open
from ..memory import empty
from ..store import TieredStore

__all__ = ["BlobStore", "FileBlobStore", "StoreBlobStore", "open_blob_store"]

_ALIGN = 4096


class BlobStore(Protocol):
    """The adapter: blobs by key, read and written whole. Coroutines run on
    the optimizer's loop thread."""

    @property
    def bytes_read(self) -> int: ...  # from the device

    @property
    def bytes_written(self) -> int: ...  # to the device

    caches: bool  # True: it keeps hot blobs in memory itself (the optimizer then keeps none)

    @property
    def host_bytes(self) -> int: ...  # state it holds in memory itself

    async def read(self, key: str, nbytes: int) -> torch.Tensor: ...

    async def write(self, key: str, blob: torch.Tensor) -> None: ...

    async def close(self) -> None: ...


class FileBlobStore:
    """Blobs in one preallocated O_DIRECT file, each in its own aligned
    extent (fixed once written: a chunk's state keeps its size from step to
    step; a blob that grows gets a new extent at the end). The file is
    removed on close."""

    caches = False  # the optimizer keeps chunks resident itself, under its budget
    host_bytes = 0

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"optimizer-state-{os.getpid()}-{id(self):x}.bin")
        self._file: File | None = None
        self._extents: dict[str, tuple[int, int]] = {}
        self._end = 0
        self.bytes_read = 0
        self.bytes_written = 0

    def _open(self) -> File:
        if self._file is None:
            self._file = nvme_open(self.path, "x+")
        return self._file

    async def write(self, key: str, blob: torch.Tensor) -> None:
        f = self._open()
        n = blob.numel()
        ext = self._extents.get(key)
        if ext is None or ext[1] < n:
            off = self._end
            size = (n + _ALIGN - 1) // _ALIGN * _ALIGN
            self._end += size
            # ext4: an O_DIRECT write that extends the file makes io_submit
            # block; allocate the range first (off the loop thread).
            await asyncio.to_thread(os.posix_fallocate, f.fileno(), off, size)
            ext = self._extents[key] = (off, size)
        await f.pwrite(blob, ext[0])
        self.bytes_written += n

    async def read(self, key: str, nbytes: int) -> torch.Tensor:
        off, size = self._extents[key]
        if nbytes > size:
            raise ValueError(f"blob {key!r} holds {size} bytes, {nbytes} asked")
        blob: torch.Tensor = empty(nbytes, "uint8", like="torch")
        await self._open().pread(blob, off)
        self.bytes_read += nbytes
        return blob

    async def close(self) -> None:
        if self._file is not None:
            await self._file.aclose()
            self._file = None
        if os.path.exists(self.path):
            await asyncio.to_thread(os.unlink, self.path)


class StoreBlobStore:
    """Blobs in an :class:`aionvme.TieredStore`: its host tier is the cache of
    chunks kept in memory, its NVMe tier the rest. ``persist=False``: the
    store's files go when it is closed."""

    caches = True  # the optimizer keeps no resident chunks of its own

    def __init__(self, directory: str, host_bytes: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self._store = TieredStore(directory, host=max(host_bytes, 0), gpu=None, persist=False)

    @property
    def host_bytes(self) -> int:
        """Bytes of state the store holds in its host tier now."""
        return int(self._store.stats()["host"]["used"])

    @property
    def bytes_read(self) -> int:
        """Bytes the store read from NVMe (host-tier hits read nothing)."""
        return int(self._store.stats()["nvme"]["bytes_out"])

    @property
    def bytes_written(self) -> int:
        """Bytes the store wrote to NVMe (evictions of the host tier)."""
        return int(self._store.stats()["nvme"]["bytes_in"])

    async def write(self, key: str, blob: torch.Tensor) -> None:
        await self._store.put(key, blob)

    async def read(self, key: str, nbytes: int) -> torch.Tensor:
        blob: torch.Tensor = empty(nbytes, "uint8", like="torch")
        await self._store.get(key, device="cpu", out=blob)  # NVMe -> blob directly on a miss
        return blob

    async def close(self) -> None:
        await self._store.close()


def open_blob_store(directory: str, backend: str, host_bytes: int) -> Any:
    """The blob store for ``backend``: ``"file"`` (one O_DIRECT file), or
    ``"store"``/``"auto"`` (an :class:`aionvme.TieredStore` with ``host_bytes``
    of host tier)."""
    if backend == "file":
        return FileBlobStore(directory)
    if backend in ("auto", "store"):
        return StoreBlobStore(directory, host_bytes)
    raise ValueError(f"backend must be 'auto', 'store' or 'file', got {backend!r}")
