"""Checksums of the values on NVMe: xxh3_64 of a value's bytes, taken when
the NVMe tier writes it and checked when it reads it back.

xxh3_64 (the ``xxhash`` package) hashes about 24 GiB/s on one core here and
releases the GIL for the whole call. Writes: a value of 1 MiB or more is
hashed on a thread *while* its write is in flight (the buffer cannot change
until the write ends), so a put or an eviction waits for nothing more.
Reads: a verified value of :data:`SEGMENT_MIN` bytes or more is read as a
few segments (File.pread each, all queued at once); as each one lands the
streaming hash takes it, in order, on the loop thread (at most
:data:`SEGMENT_MAX` bytes: ~0.2 ms, under 1 ms on a contended core), so the
hash runs under the read of the later segments and only the last segment's
(at most :data:`TAIL` bytes) is added to the read. Hashing the segments on a
thread instead cost more here (6-15% against 4-6% of a 4-16 MiB get, 2
cores): each hand-off is a wake-up on both sides. See bench/README.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np

from ._alloc import ALIGN, round_up
from ._values import is_cuda

__all__ = ["Segmented", "digest", "digest_later"]

INLINE_MAX = 1 << 20  # values hashed on the loop thread at once below this; on a thread from it
SEGMENT_MIN = 1 << 20  # verified reads from this size are split into segments hashed as they land
SEGMENT_MAX = 4 << 20
SEGMENTS = 4  # about this many segments per value (each at least TAIL, at most SEGMENT_MAX)
TAIL = 256 << 10  # the last segment: its hash (~10 µs) is what a read waits for after its I/O


def xxhash_module() -> Any:
    """The xxhash package (a dependency of aionvme), imported at first use:
    ImportError saying what to do if it is missing."""
    try:
        import xxhash
    except ImportError:
        raise ImportError(
            "TieredStore's value checksums need the xxhash package (pip install xxhash), "
            "or pass checksum=False"
        ) from None
    return xxhash


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
    return int(xxhash_module().xxh3_64_intdigest(_host(buf[:n])))


async def digest_later(buf: Any, n: int) -> int:
    """:func:`digest`, on a thread for large or CUDA buffers (the loop never stalls)."""
    if n < INLINE_MAX and not is_cuda(buf):
        return digest(buf, n)
    return await asyncio.get_running_loop().run_in_executor(None, digest, buf, n)


def segment_size(n: int) -> int:
    return min(SEGMENT_MAX, max(TAIL, round_up(-(-n // SEGMENTS))))


def _bounds(total: int, step: int) -> list[tuple[int, int]]:
    """Segments of ``step`` bytes, the last one at most TAIL: its hash is
    the only one the read waits for once every byte has landed."""
    cut = max(0, total - TAIL)
    out = [(a, min(a + step, cut)) for a in range(0, cut, step)]
    return [*out, (cut, total)]


class Segmented:
    """A verified read of one value split into segments, hashed in order as
    they land. ``jobs`` are the segments' (file offset, buffer), each read
    by one File.pread (the C fast path: no Python object per chunk);
    ``view`` the value's bytes; ``ranges`` the part of ``view`` each
    segment completes."""

    def __init__(self, key: Any, expected: int, ext: Any, buf: Any, whole: bool) -> None:
        self.key = key
        self.expected = expected
        self.ext = ext
        self.hasher = xxhash_module().xxh3_64()
        self.jobs: list[tuple[int, Any]] = []
        self.ranges: list[tuple[int, int]] = []
        ((self.slab, off, _boff, n),) = ext
        if whole:  # buf: the page-aligned pages of the span; the value starts at off's phase in them
            p = off % ALIGN
            base, total = off - p, round_up(p + n)
            self.view = buf[p : p + n]
        else:  # buf: the value's bytes (and maybe the rest of its last page), off page-aligned
            p, base, total = 0, off, n
            self.view = buf[:n]
        for a, b in _bounds(total, segment_size(n)):
            if not whole and b == total and len(buf) < round_up(b):
                self.jobs.append((base + a, buf[a:b]))  # the value's end is not page-padded: exact
            else:
                self.jobs.append((base + a, buf[a : round_up(b)]))
            self.ranges.append((max(a - p, 0), min(b - p, n)))
        self._next = 0
        self._done: list[bool] = [False] * len(self.jobs)

    def landed(self, k: int, fut: asyncio.Future[Any]) -> None:
        """Done callback of segment k: hash every segment landed, in order,
        here on the loop thread (at most SEGMENT_MAX bytes at a time)."""
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
        return int(self.hasher.intdigest()) if self._next == len(self._done) else None

    def release(self) -> None:
        """Drop the buffers (a result's recycled memory goes back once its caller drops it)."""
        self.jobs.clear()
        self.view = None


async def gather_all(futs: Sequence[Awaitable[Any]]) -> None:
    """Await every request (the buffers stay in use until each ends); the first error is raised."""
    results = await asyncio.gather(*futs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
