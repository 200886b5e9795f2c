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

    async def read(self, key: str, nbytes: int) -> torch.Tensor: ...

    async def read_into(self, key: str, out: torch.Tensor) -> None: ...  # fill out (len(out) bytes)

    async def write(self, key: str, blob: torch.Tensor) -> None: ...

    async def close(self) -> None: ...


class FileBlobStore:
    """Blobs in one preallocated O_DIRECT file, each in its own aligned
    extent (fixed once written: a chunk's state keeps its size from step to
    step; a blob that grows gets a new extent at the end). The file is
    removed on close."""

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
            self._end += size  # before the await: concurrent writes of new keys get their own ranges
            # ext4: an O_DIRECT write that extends the file makes io_submit
            # block; allocate the range first (off the loop thread).
            try:
                await asyncio.to_thread(os.posix_fallocate, f.fileno(), off, size)
            except OSError as e:
                e.filename = e.filename or self.path  # posix_fallocate names no file
                raise
            ext = self._extents[key] = (off, size)
        await f.pwrite(blob, ext[0])
        self.bytes_written += n

    async def read(self, key: str, nbytes: int) -> torch.Tensor:
        blob: torch.Tensor = empty(nbytes, "uint8", like="torch")
        await self.read_into(key, blob)
        return blob

    async def read_into(self, key: str, out: torch.Tensor) -> None:
        off, size = self._extents[key]
        nbytes = out.numel()
        if nbytes > size:
            raise ValueError(f"blob {key!r} holds {size} bytes, {nbytes} asked")
        await self._open().pread(out, off)
        self.bytes_read += nbytes

    async def close(self) -> None:
        if self._file is not None:
            await self._file.aclose()
            self._file = None
        if os.path.exists(self.path):
            await asyncio.to_thread(os.unlink, self.path)


class StoreBlobStore:
    """Blobs in the NVMe tier of an :class:`aionvme.TieredStore` with no host
    tier: a put writes straight from the optimizer's buffer, a get reads
    straight into it (O_DIRECT, no copy). The optimizer keeps chunks in memory
    itself: it knows the order of the next step, where an LRU host tier
    smaller than the state would miss on every chunk (and copy each one in
    and out). ``persist=False``: the store's files go when it is closed."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self._store = TieredStore(directory, host=0, gpu=None, persist=False)

    @property
    def bytes_read(self) -> int:
        """Bytes the store read from NVMe."""
        return int(self._store.stats()["nvme"]["bytes_out"])

    @property
    def bytes_written(self) -> int:
        """Bytes the store wrote to NVMe."""
        return int(self._store.stats()["nvme"]["bytes_in"])

    async def write(self, key: str, blob: torch.Tensor) -> None:
        await self._store.put(key, blob)

    async def read(self, key: str, nbytes: int) -> torch.Tensor:
        blob: torch.Tensor = empty(nbytes, "uint8", like="torch")
        await self.read_into(key, blob)
        return blob

    async def read_into(self, key: str, out: torch.Tensor) -> None:
        await self._store.get(key, device="cpu", out=out)  # NVMe -> out, no host tier

    async def close(self) -> None:
        await self._store.close()


def open_blob_store(directory: str, backend: str) -> Any:
    """The blob store for ``backend``: ``"file"`` (one O_DIRECT file), or
    ``"store"``/``"auto"`` (the NVMe tier of an :class:`aionvme.TieredStore`)."""
    if backend == "file":
        return FileBlobStore(directory)
    if backend in ("auto", "store"):
        return StoreBlobStore(directory)
    raise ValueError(f"backend must be 'auto', 'store' or 'file', got {backend!r}")
