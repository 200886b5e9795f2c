"""A filesystem that refuses O_DIRECT (ramfs: EINVAL at open) is served
buffered by the worker pool, every byte right, without blocking the loop."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import aionvme as nvme

from .faultkit import responsiveness

MiB = 1 << 20


def test_ramfs_really_refuses_o_direct(ramfs_dir):
    with pytest.raises(OSError) as ei:
        os.open(ramfs_dir / "probe", os.O_CREAT | os.O_RDWR | os.O_DIRECT)
    assert ei.value.errno == errno.EINVAL


async def test_ramfs_large_transfers_do_not_block_the_loop(ramfs_dir):
    path = str(ramfs_dir / "big.bin")
    src = np.random.default_rng(5).integers(0, 256, 48 * MiB + 77, dtype=np.uint8)
    dst = np.zeros_like(src)
    with nvme.open(path, "w+") as f:
        assert not f.direct and f.info.fs_name == "ramfs" and "O_DIRECT" in f.info.reason

        async def work() -> None:
            assert await f.pwrite(src, 3) == src.nbytes
            assert await f.pread(dst, 3) == dst.nbytes

        fig = await responsiveness(work)
        print("ramfs 2 x 48 MiB:", fig)
        assert np.array_equal(src, dst)
        assert f.size() == src.nbytes + 3
    s = nvme.stats()
    assert s["thread_jobs"] > 0 and s["inflight"] == 0


async def test_ramfs_many_small_unaligned_requests(ramfs_dir):
    import asyncio

    path = str(ramfs_dir / "small.bin")
    model = np.random.default_rng(6).integers(0, 256, 4 * MiB, dtype=np.uint8)
    await nvme.pwrite(model, path)
    rng = np.random.default_rng(7)
    offs = rng.integers(0, 4 * MiB - 5000, 2000)
    sizes = rng.integers(0, 5000, 2000)
    bufs = [np.zeros(int(n), np.uint8) for n in sizes]
    with nvme.open(path) as f:
        got = await asyncio.gather(*(f.pread(b, int(o)) for b, o in zip(bufs, offs)))
    assert got == [int(n) for n in sizes]
    for b, o in zip(bufs, offs):
        assert np.array_equal(b, model[o : o + b.nbytes])
