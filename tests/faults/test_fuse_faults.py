"""Files on a FUSE filesystem (faultfs.c): served O_DIRECT by the worker pool
(io_submit would wait for the daemon), every byte right; EIO inside a byte
range surfaces as OSError(EIO) at the failing part, never as a short read."""

from __future__ import annotations

import asyncio
import errno
import os

import numpy as np
import pytest

import aionvme as nvme

MiB = 1 << 20


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def test_fuse_files_are_direct_on_worker_threads(faultfs):
    path = str(faultfs.mnt / "a.bin")
    data = _data(3 * MiB + 11, 1)
    assert await nvme.pwrite(data, path, 5) == data.nbytes
    with nvme.open(path, "r+") as f:
        assert f.direct and f.info.fs_name == "fuse" and "worker threads" in f.info.reason, f.info
        out = np.zeros_like(data)
        before = nvme.stats()["thread_jobs"]
        assert await f.pread(out, 5) == out.nbytes
        assert nvme.stats()["thread_jobs"] > before
    assert np.array_equal(out, data)


@pytest.mark.usefixtures("kernel_engine")
@pytest.mark.parametrize("direct", [True, False])
async def test_eio_in_a_byte_range(faultfs, direct):
    path = str(faultfs.mnt / "e.bin")
    data = _data(4 * MiB, 2)
    await nvme.pwrite(data, path)
    # Mid-chunk: the kernel splits a 1 MiB chunk into several FUSE requests,
    # the first ones succeed, so the chunk's pread returns a partial count
    # and the next one EIO. That must be EIO, not "the file ends here".
    bad = (3 * MiB // 2 + 4096, 3 * MiB // 2 + 4106)
    faultfs.set(eio=bad)
    with nvme.open(path, "r+", direct=direct, block_size="1M") as f:
        # the whole file: EIO, reported in the chunk that holds the bad bytes
        out = nvme.empty(4 * MiB)
        with pytest.raises(OSError) as ei:
            await f.pread(out, 0)
        e = ei.value
        assert not isinstance(e, nvme.ShortReadError), e
        assert e.errno == errno.EIO and e.filename == path
        assert bad[0] - MiB < e.offset <= bad[0], e.offset
        # around the range: fine
        head = np.zeros(bad[0], np.uint8)
        assert await f.pread(head, 0) == bad[0]
        assert np.array_equal(head, data[: bad[0]])
        tail = np.zeros(MiB, np.uint8)
        assert await f.pread(tail, 3 * MiB) == MiB
        assert np.array_equal(tail, data[3 * MiB :])
        # a small unaligned read right on it, and writes across it
        with pytest.raises(OSError) as ei:
            await f.pread(np.zeros(3, np.uint8), bad[0] + 2)
        assert ei.value.errno == errno.EIO
        with pytest.raises(OSError) as ei:
            await f.pwrite(np.ones(100, np.uint8), bad[0] - 50)
        assert ei.value.errno == errno.EIO
    faultfs.set()
    # A failed write may have written the part before the failure (as
    # pwrite(2) may); nothing outside the write's own range is touched.
    back = np.fromfile(path, np.uint8)
    assert np.array_equal(back[: bad[0] - 50], data[: bad[0] - 50])
    assert np.array_equal(back[bad[0] + 50 :], data[bad[0] + 50 :])


async def test_a_failing_close_after_the_last_request_loses_nothing(faultfs):
    # The file is closed while its reads run; its fd closes when the last one
    # ends, and close(2) fails (as NFS does after failed write-back). Every
    # read still completes; the one that closed the fd reports the EIO.
    path = str(faultfs.mnt / "c.bin")
    data = _data(4 * MiB, 3)
    await nvme.pwrite(data, path)
    faultfs.set(delay_us=20_000, flush_eio=True)
    try:
        f = nvme.open(path, block_size="256K")
        outs = [nvme.empty(MiB) for _ in range(4)]
        futs = [f.pread(outs[i], i * MiB) for i in range(4)]
        f.close()  # deferred: the reads hold the fd
        got = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30)
    finally:
        faultfs.set()
    errors = [g for g in got if isinstance(g, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], OSError), got
    assert errors[0].errno == errno.EIO and errors[0].filename == path
    for i in range(4):
        assert np.array_equal(outs[i], data[i * MiB : (i + 1) * MiB]), i
    assert f.closed


async def test_an_o_direct_fd_on_fuse_goes_to_the_workers_too(faultfs):
    # an fd the caller opened is routed like a path: io_submit on FUSE waits
    # for the daemon, so the worker pool serves it
    path = str(faultfs.mnt / "d.bin")
    data = _data(2 * MiB, 4)
    await nvme.pwrite(data, path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        out = nvme.empty(2 * MiB)
        before = nvme.stats()
        assert await nvme.pread(out, fd) == out.nbytes
        after = nvme.stats()
    finally:
        os.close(fd)
    assert np.array_equal(out, data)
    assert after["submitted"] == before["submitted"] and after["thread_jobs"] > before["thread_jobs"]
