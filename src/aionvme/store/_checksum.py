"""Checksums of the values on NVMe: xxh3_64 of a value's bytes, taken when
the NVMe tier writes it and checked when it reads it back.

xxh3_64 (the ``xxhash`` package) hashes about 24 GiB/s on one core here and
releases the GIL for the whole call, so a large value is hashed on a thread
while the loop goes on. Writes: the hash runs on a thread *while* the write
is in flight (the buffer cannot change until the write ends), so a put or
an eviction waits for nothing more. Reads: a verified value of
:data:`SEGMENT_MIN` bytes or more is read as a few segments, each its own
request, all queued at once; as each one lands (in order) the streaming hash
takes it on the loop thread (at most :data:`SEGMENT_MAX` bytes, ~0.2 ms, at
a time), so the hash runs under the read of the next segments and only the
last segment's hash is added to the read. See bench/README.md for the cost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np
import xxhash

from ._alloc import ALIGN, round_up
from ._values import is_cuda

__all__ = ["Segmented", "digest", "digest_later"]

INLINE_MAX = 1 << 20  # values hashed on the loop thread at once below this; on a thread from it
SEGMENT_MIN = 1 << 20  # verified reads from this size are split into segments hashed as they land
SEGMENT_MAX = 4 << 20
SEGMENTS = 8  # about this many segments per value (each at least 256 KiB, at most SEGMENT_MAX)


def _host(buf: Any) -> Any:
    """The bytes of a flat uint8 buffer as something xxhash reads (a CUDA
    tensor is copied to host memory first)."""
    if isinstance(buf, np.ndarray):
        return buf
    if is_cuda(buf):
        return buf.cpu().numpy()
    return buf.numpy()


def digest(buf: Any, n: int) -> int:
    """xxh3_64 of the first n bytes of a flat uint8 buffer."""
    return int(xxhash.xxh3_64_intdigest(_host(buf[:n])))


async def digest_later(buf: Any, n: int) -> int:
    """:func:`digest`, on a thread for large or CUDA buffers (the loop never stalls)."""
    if n < INLINE_MAX and not is_cuda(buf):
        return digest(buf, n)
    return await asyncio.get_running_loop().run_in_executor(None, digest, buf, n)


def segment_size(n: int) -> int:
    return min(SEGMENT_MAX, max(256 << 10, round_up(-(-n // SEGMENTS))))


class Segmented:
    """A verified read of one value split into segments, hashed in order as
    they land. ``jobs`` are the NVMe tier's read jobs of the segments (one
    request each); ``view`` the value's bytes; ``ranges`` the part of
    ``view`` each segment completes."""

    def __init__(self, key: Any, expected: int, ext: Any, buf: Any, whole: bool) -> None:
        self.key = key
        self.expected = expected
        self.ext = ext
        self.hasher = xxhash.xxh3_64()
        self.jobs: list[tuple[Any, Any]] = []
        self.ranges: list[tuple[int, int]] = []
        ((i, off, _boff, n),) = ext
        if whole:  # buf: the page-aligned pages of the span; the value starts at off's phase in them
            p = off % ALIGN
            base, total = off - p, round_up(p + n)
            self.view = buf[p : p + n]
        else:  # buf: the value's bytes (and maybe the rest of its last page), off page-aligned
            p, base, total = 0, off, n
            self.view = buf[:n]
        step = segment_size(n)
        for a in range(0, total, step):
            b = min(a + step, total)
            if whole:
                self.jobs.append(([(i, base + a, 0, b - a)], buf[a:b]))
            else:
                self.jobs.append(([(i, base + a, 0, b - a)], buf[a:]))
            self.ranges.append((max(a - p, 0), min(b - p, n)))
        self._next = 0
        self._done: list[bool] = [False] * len(self.jobs)

    def landed(self, k: int, fut: asyncio.Future[Any]) -> None:
        """Done callback of segment k: hash every segment landed in order."""
        if fut.cancelled() or fut.exception() is not None:
            return
        self._done[k] = True
        while self._next < len(self._done) and self._done[self._next]:
            a, b = self.ranges[self._next]
            if b > a:
                self.hasher.update(_host(self.view[a:b]))
            self._next += 1

    def finished(self) -> int | None:
        """The digest once every segment has been hashed, else None."""
        return self.hasher.intdigest() if self._next == len(self._done) else None


async def gather_all(futs: Sequence[Awaitable[Any]]) -> None:
    """Await every request (the buffers stay in use until each ends); the first error is raised."""
    results = await asyncio.gather(*futs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
