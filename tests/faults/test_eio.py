"""I/O errors from a real kernel: a filesystem shut down under running
transfers (the shutdown ioctl on ext4 and xfs) and a loop device whose size
limit is cut under a file. Every failure is an OSError(EIO) with the file and
offset; a transfer that does not fail delivers correct bytes; requests on other
files go on; the runtime stays usable."""

from __future__ import annotations

import asyncio
import errno
import os

import numpy as np
import pytest

import aionvme as nvme
from aionvme._runtime import reactor as _reactor

from .faultkit import SHUTDOWN_NOLOGFLUSH, blkio_throttle, fiemap

MiB = 1 << 20


def _rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _is_eio(x: object, path: str) -> bool:
    return isinstance(x, OSError) and x.errno == errno.EIO and x.filename == path


async def _until_in_flight(min_chunks: int = 1, timeout: float = 5.0) -> None:
    eng = _reactor.get_reactor().engine
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while eng.inflight < min_chunks:
        assert loop.time() < end, "transfers never went in flight"
        await asyncio.sleep(0.001)


@pytest.mark.usefixtures("kernel_engine")
async def test_shutdown_under_running_transfers(shutdown_fs, make_file):
    fs = shutdown_fs
    path = str(fs.mnt / "a.bin")
    data = _rand(16 * MiB, 1)
    await nvme.pwrite(data, path)
    await nvme.fsync(path)
    other, other_data = make_file(8 * MiB, seed=2)  # on the machine's own disk

    with blkio_throttle(fs.dev, read_bps=16 * MiB, write_bps=16 * MiB), nvme.open(path, "r+") as f:
        rbufs = [nvme.empty(MiB) for _ in range(8)]
        wbufs = [np.full(MiB, 0x77, np.uint8) for _ in range(4)]
        obufs = [nvme.empty(MiB) for _ in range(8)]
        stream = nvme.empty(8 * MiB)  # issued two chunks at a time: most of it after the shutdown
        stream[:] = 0xEE
        reads = [f.pread(b, i * MiB) for i, b in enumerate(rbufs)]
        streaming = nvme.pread(stream, path, 8 * MiB, block_size="256K", parallelism=2)
        writes = [f.pwrite(b, (16 + i) * MiB + 3) for i, b in enumerate(wbufs)]
        await _until_in_flight(4)
        fs.shutdown(SHUTDOWN_NOLOGFLUSH)
        others = [nvme.pread(b, other, i * MiB) for i, b in enumerate(obufs)]
        results = await asyncio.gather(*reads, streaming, *writes, *others, return_exceptions=True)

        got_reads, got_stream, got_writes, got_others = results[:8], results[8], results[9:13], results[13:]
        # What the kernel does (6.18, ext4 and xfs alike): reads already at the
        # block layer complete with their data; anything issued after the
        # shutdown fails with EIO. Either way, never a silent partial result.
        for i, (r, b) in enumerate(zip(got_reads, rbufs)):
            if isinstance(r, BaseException):
                assert _is_eio(r, path), repr(r)
                assert i * MiB <= r.offset < (i + 1) * MiB
            else:
                assert r == MiB and np.array_equal(b, data[i * MiB : (i + 1) * MiB])
        assert _is_eio(got_stream, path), repr(got_stream)
        # it failed where it was: at the first chunk the kernel refused, which
        # may be its first (the submit budget can leave all of it queued)
        assert 8 * MiB <= got_stream.offset < 16 * MiB
        landed = stream == data[8 * MiB : 16 * MiB]
        assert (landed | (stream == 0xEE)).all()  # no byte from anywhere else
        for i, w in enumerate(got_writes):
            if isinstance(w, BaseException):
                assert _is_eio(w, path), repr(w)
                assert (16 + i) * MiB <= w.offset < (17 + i) * MiB + 3
            else:
                assert w == MiB
        # the other filesystem's requests, in the same engine, are unaffected
        assert got_others == [MiB] * 8
        for i, b in enumerate(obufs):
            assert np.array_equal(b, other_data[i * MiB : (i + 1) * MiB])

        # new requests on the dead filesystem: every kind fails with EIO
        for op in (
            f.pread(nvme.empty(4096), 0),
            f.pread(np.zeros(100, np.uint8), 5),  # bounce
            f.pwrite(nvme.empty(4096), 0),
            f.pwrite(np.zeros(100, np.uint8), 5),  # read-modify-write on a worker
            f.pwrite(nvme.empty(4096), 64 * MiB),  # extending: fallocate on a worker
            f.fsync(),
        ):
            with pytest.raises(OSError) as ei:
                await op
            assert ei.value.errno == errno.EIO and ei.value.filename == path
        with pytest.raises(OSError) as ei:
            nvme.open(fs.mnt / "new.bin", "w")
        assert ei.value.errno == errno.EIO

    # the runtime is fine
    s = nvme.stats()
    assert s["live_requests"] == 0 and s["inflight"] == 0
    buf = nvme.empty(8 * MiB)
    await nvme.pread(buf, other)
    assert np.array_equal(buf, other_data)
    # after a remount the fsynced file is whole
    fs.remount()
    back = nvme.empty(16 * MiB)
    await nvme.pread(back, path)
    assert np.array_equal(back, data)


@pytest.mark.usefixtures("kernel_engine")
async def test_shrunk_loop_device_fails_exactly_past_the_limit(loopfs, drop_caches):
    fs = loopfs("ext4", 64 * MiB)
    path = str(fs.mnt / "big.bin")
    size = 40 * MiB
    data = _rand(size, 3)
    await nvme.pwrite(data, path)
    await nvme.fsync(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        extents = fiemap(fd, size)
    finally:
        os.close(fd)
    limit = 24 * MiB

    def past_limit(lo: int, hi: int) -> bool:
        """Whether file bytes [lo, hi) touch a device block at or past limit."""
        for logical, physical, length in extents:
            a, b = max(lo, logical), min(hi, logical + length)
            if a < b and physical + (b - logical) > limit:
                return True
        return False

    assert past_limit(0, size) and not past_limit(0, MiB), extents  # the layout the test needs

    fs.set_size_limit(limit)
    drop_caches()
    try:
        assert fs.device_size() == limit
        with nvme.open(path, "r+") as f:
            bufs = [nvme.empty(MiB) for _ in range(size // MiB)]
            results = await asyncio.gather(
                *(f.pread(b, i * MiB) for i, b in enumerate(bufs)), return_exceptions=True
            )
            failed = 0
            for i, (r, b) in enumerate(zip(results, bufs)):
                if past_limit(i * MiB, (i + 1) * MiB):
                    assert _is_eio(r, path), f"MiB {i}: {r!r}"
                    assert i * MiB <= r.offset < (i + 1) * MiB
                    failed += 1
                else:
                    assert r == MiB, f"MiB {i}: {r!r}"
                    assert np.array_equal(b, data[i * MiB : (i + 1) * MiB])
            assert failed > 0
            # one request over the whole file: EIO, at an offset past the limit
            whole = nvme.empty(size)
            with pytest.raises(OSError) as ei:
                await f.pread(whole, 0)
            assert _is_eio(ei.value, path)
            assert past_limit(ei.value.offset, ei.value.offset + MiB)
            # an unaligned read whose head is fine and whose tail is past the limit
            bad = next(i for i in range(size // MiB) if past_limit(i * MiB, (i + 1) * MiB))
            with pytest.raises(OSError) as ei:
                await f.pread(np.zeros(2 * MiB, np.uint8), bad * MiB - MiB + 5)
            assert ei.value.errno == errno.EIO
            # writes there fail too, and say where
            with pytest.raises(OSError) as ei:
                await f.pwrite(nvme.empty(MiB), bad * MiB)
            assert _is_eio(ei.value, path) and ei.value.offset == bad * MiB
    finally:
        fs.set_size_limit(0)

    # limit lifted: everything reads back as written (nothing was damaged)
    assert fs.device_size() == 64 * MiB
    drop_caches()
    back = nvme.empty(size)
    await nvme.pread(back, path)
    assert np.array_equal(back, data)


@pytest.mark.usefixtures("kernel_engine")
async def test_limit_cut_while_a_read_is_in_flight(loopfs):
    # The block layer checks a bio against the device size when it is
    # submitted, so the cut fails the chunks issued after it: two chunks in
    # flight at a time on a throttled device keep most of them still to come.
    fs = loopfs("ext4", 64 * MiB)
    path = str(fs.mnt / "big.bin")
    data = _rand(32 * MiB, 4)
    await nvme.pwrite(data, path)
    await nvme.fsync(path)
    buf = nvme.empty(32 * MiB)
    buf[:] = 0xEE
    try:
        with blkio_throttle(fs.dev, read_bps=32 * MiB):
            fut = nvme.pread(buf, path, block_size="256K", parallelism=2)
            await _until_in_flight(2)
            await asyncio.to_thread(fs.set_size_limit, 8 * MiB)
            with pytest.raises(OSError) as ei:
                await fut
        assert ei.value.errno == errno.EIO and ei.value.filename == path
        assert ei.value.offset >= 256 << 10
    finally:
        fs.set_size_limit(0)
    # Bytes that arrived are the file's; the rest still hold the sentinel.
    landed = buf == data
    assert (landed | (buf == 0xEE)).all()
    assert landed[: 256 << 10].all()  # the first chunk was read before the cut
    s = nvme.stats()
    assert s["live_requests"] == 0 and s["inflight"] == 0
