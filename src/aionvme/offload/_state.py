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

__all__ = ["BlobStore", "FileBlobStore", "open_blob_store"]

_ALIGN = 4096


class BlobStore(Protocol):
    """The adapter: blobs by key, read and written whole. Coroutines run on
    the optimizer's loop thread."""

    bytes_read: int
    bytes_written: int

    async def read(self, key: str, nbytes: int) -> torch.Tensor: ...

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


def open_blob_store(directory: str, backend: str, budget: int) -> Any:
    """The blob store for ``backend``: ``"file"`` (one O_DIRECT file) or
    ``"auto"`` (the same until a TieredStore is available here)."""
    if backend in ("auto", "file"):
        return FileBlobStore(directory)
    raise ValueError(f"backend must be 'auto' or 'file', got {backend!r}")
