"""Checksums of the values on NVMe: xxh3_64 of a value's bytes, taken when
the NVMe tier writes it and checked when it reads it back.

xxh3_64 (the ``xxhash`` package) hashes 50-60 GB/s on one core here from
cache, 25-40 GB/s from memory just read into, and releases the GIL for the
whole call. Writes: a value of 1 MiB or more is hashed on a thread *while*
its write is in flight (the buffer cannot change until the write ends), so a
put or an eviction waits for nothing more.

Reads: a value is read in one request as an unchecked one is (File.pread,
every chunk in flight at once), then hashed on the loop thread, the loop let
run whenever :data:`SLICE` more bytes would be hashed (no stall longer than
one slice's hash: ~0.1 ms idle, under 1 ms on a contended core). Hashing
segments as they land cannot overlap the read where the device completes
every chunk in flight at about the same time, as the virtual disk of
bench/README.md does once reads land in huge pages (the five segments of a
16 MiB read all landed in one wake-up of the loop): the segments were extra
requests and callbacks with nothing to overlap. The cost is then the hash's
time against the read's, about the read's GB/s over the hash's (2.6-2.9
against 25-40 here): ``bench/suites/bench_store.py --only get-pread``
reports it.

Except for large values (:data:`PIPE_MIN` and up, one page-aligned piece):
those are read in :data:`PIPE_SEG` segments with :data:`PIPE_WINDOW` bytes
in flight, the window refilled as segments land and *then* the landed bytes
hashed, so the hash of all but the last window runs while the device reads
the rest. A window of 32 MiB keeps this virtual disk as busy as the whole
value in flight does (a smaller one did not), and on an NVMe drive that
completes chunks in order it hides all but one segment's hash: there the
hash after the read would cost a quarter of a 7 GB/s read, not a tenth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np

from ._values import is_cuda

__all__ = ["digest", "digest_all", "gather_all", "read_hashed"]

INLINE_MAX = 1 << 20  # values written from this size are hashed on a thread while the write is in flight
SLICE = 4 << 20  # a read's hash runs on the loop thread this many bytes at a time
PIPE_MIN = 40 << 20  # checked values from this size are read in segments, hashed as they land
PIPE_SEG = 8 << 20  # bytes per segment of such a read
PIPE_WINDOW = 32 << 20  # bytes of its segments in flight at once


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


async def digest_all(bufs: Sequence[tuple[Any, int]]) -> list[int]:
    """:func:`digest` of each (buffer, n), on the loop thread, the loop let
    run before more than SLICE bytes are hashed since it last ran (a CUDA
    buffer: on a thread, copied to host memory first)."""
    out: list[int] = []
    since = 0  # bytes hashed since the loop last ran
    for buf, n in bufs:
        if is_cuda(buf):
            out.append(await asyncio.get_running_loop().run_in_executor(None, digest, buf, n))
            continue
        if n <= SLICE:
            if since + n > SLICE:
                await asyncio.sleep(0)
                since = 0
            out.append(digest(buf, n))
            since += n
            continue
        data = _host(buf[:n])
        h = xxhash_module().xxh3_64()
        for a in range(0, n, SLICE):
            piece = data[a : a + SLICE]
            if since + len(piece) > SLICE:
                await asyncio.sleep(0)
                since = 0
            h.update(piece)
            since += len(piece)
        out.append(int(h.intdigest()))
    return out


async def gather_all(futs: Sequence[Awaitable[Any]]) -> None:
    """Await every request (the buffers stay in use until each ends); the first error is raised."""
    results = await asyncio.gather(*futs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def read_hashed(file: Any, mem: Any, offset: int, at: int, n: int) -> int:
    """Fill ``mem`` from ``file`` at ``offset`` (page-aligned) in segments of
    :data:`PIPE_SEG`, :data:`PIPE_WINDOW` bytes in flight, and return the
    xxh3_64 of the value's n bytes, ``mem[at : at + n]`` (what :func:`digest`
    gives), hashed in order as their segments land, each time after the
    window is refilled. Every request has ended when this returns or raises."""
    data = _host(mem)
    segs = [(a, min(PIPE_SEG, len(mem) - a)) for a in range(0, len(mem), PIPE_SEG)]
    window = max(1, PIPE_WINDOW // PIPE_SEG)
    futs: list[Any] = []

    def issue(upto: int) -> None:
        while len(futs) < min(upto, len(segs)):
            a, ln = segs[len(futs)]
            futs.append(file.pread(mem[a : a + ln], a + offset))

    h = xxhash_module().xxh3_64()
    hashed = 0  # value bytes hashed so far
    since = 0  # bytes hashed since the loop last ran
    i = 0  # the first segment not yet known to have landed
    issue(window)
    try:
        while i < len(segs):
            await futs[i]
            i += 1
            while i < len(futs) and futs[i].done():
                futs[i].result()  # raises a failed segment's error here
                i += 1
            issue(i + window)  # the device gets the next segments before the hash runs
            landed = min(n, segs[i - 1][0] + segs[i - 1][1] - at)
            while hashed < landed:
                if since >= SLICE:  # the loop runs between slices of the hash
                    await asyncio.sleep(0)
                    since = 0
                end = min(landed, hashed + SLICE - since)
                h.update(data[at + hashed : at + end])
                since += end - hashed
                hashed = end
    except BaseException:
        # every request ends before the memory can be reused or the error seen
        await asyncio.gather(*futs[i:], return_exceptions=True)
        raise
    return int(h.intdigest())
