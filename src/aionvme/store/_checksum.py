"""Checksums of the values on NVMe: xxh3_64 of a value's bytes, taken when
the NVMe tier writes it and checked when it reads it back.

xxh3_64 (the ``xxhash`` package) hashes about 24 GiB/s on one core here and
releases the GIL for the whole call, so a large value is hashed on a thread
while the loop goes on. Writes: the hash runs on a thread *while* the write
is in flight (the buffer cannot change until the write ends), so a put or
an eviction waits for nothing more. Reads: a verified value of
:data:`SEGMENT_MIN` bytes or more is read as a few segments, each its own
request, all queued at once; as each one lands (in order) the streaming hash
takes it on a thread of its own (the GIL released, the loop free to reap and
refill the other requests), so the hash runs under the read of the next
segments and only the last segment's hash is added to the read. See
bench/README.md for the cost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
        self._last: concurrent.futures.Future[None] | None = None

    def landed(self, k: int, fut: asyncio.Future[Any]) -> None:
        """Done callback of segment k: every segment landed in order, but the
        last, goes to the hashing thread (one thread: the updates of a value
        keep their order). The last one :meth:`finished` hashes on the loop
        thread: it is small, and the reader is waiting for it anyway."""
        if fut.cancelled() or fut.exception() is not None:
            return
        self._done[k] = True
        last = len(self._done) - 1
        while self._next < last and self._done[self._next]:
            a, b = self.ranges[self._next]
            if b > a:
                self._last = _hash_pool().submit(_update, self.hasher, [_host(self.view[a:b])])
            self._next += 1

    async def finished(self) -> int | None:
        """The digest once every segment has landed, else None."""
        last = len(self._done) - 1
        if self._next != last or not self._done[last]:
            return None
        if self._last is not None and not self._last.done():
            await asyncio.wrap_future(self._last)  # the thread is behind: wait for it
        a, b = self.ranges[last]
        if b > a:
            self.hasher.update(_host(self.view[a:b]))  # the tail, at most TAIL bytes: ~10 µs
        self._next += 1
        return int(self.hasher.intdigest())

    def release(self) -> None:
        """Drop the buffers (a result's recycled memory goes back once its caller drops it)."""
        self.jobs.clear()
        self.view = None


def _update(hasher: Any, box: list[Any]) -> None:
    """hasher.update(box's buffer), the box emptied first: the worker's
    reference to its task outlives the result the reader awaits, and must
    not keep the buffer alive (a freed result's memory is recycled)."""
    buf = box.pop()
    hasher.update(buf)
    del buf


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The thread that hashes segments as they land: off the loop thread, so
    the loop goes on reaping and refilling the read's other requests."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aionvme-store-hash")
    return _POOL


async def gather_all(futs: Sequence[Awaitable[Any]]) -> None:
    """Await every request (the buffers stay in use until each ends); the first error is raised."""
    results = await asyncio.gather(*futs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
