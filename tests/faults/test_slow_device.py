"""A slow device: ext4 on a loop device throttled with the blkio cgroup
(cgroup v1 on these machines; every chunk waits in the throttle, as on a
saturated disk). The event loop must stay responsive: no callback of aionvme
holds it for 5 ms or more while transfers crawl.

How aionvme's stalls are told apart from machine noise: every reactor
callback is timed on the loop thread, and the time the thread spent waiting
for a CPU (run delay, /proc/thread-self/schedstat) is subtracted; what is
left is aionvme computing or asleep in a syscall. A noisy attempt is retried
(three in all); a stall that aionvme causes happens on every attempt. Buffers
are touched before the measurement: faulting in fresh memory is the kernel's
cost of the first touch, paid inside io_submit (measured: 6 ms per fresh
64 MiB here), and is reported separately.
"""

from __future__ import annotations

import asyncio

import numpy as np

import aionvme as nvme

from .faultkit import blkio_throttle, responsiveness

MiB = 1 << 20


def _touched(n: int) -> np.ndarray:
    b = nvme.empty(n)
    b[:] = 1
    return b


async def test_loop_stays_responsive_on_a_throttled_device(loopfs, drop_caches):
    fs = loopfs("ext4", 64 * MiB)
    path = str(fs.mnt / "slow.bin")
    data = np.random.default_rng(8).integers(0, 256, 16 * MiB, dtype=np.uint8)
    await nvme.pwrite(data, path)
    await nvme.fsync(path)
    drop_caches()
    big = _touched(8 * MiB)
    small = [_touched(4096) for _ in range(256)]
    odd = np.zeros(3 * MiB + 5, np.uint8)
    wsrc = _touched(2 * MiB)
    # what is already there: a noisy attempt is run again by responsiveness(),
    # and its reads must find the file as the first attempt did
    wsrc[:] = data[12 * MiB : 14 * MiB]
    offs = np.random.default_rng(9).integers(0, 4095, 256) * 4096

    async def work() -> None:
        with nvme.open(path, "r+") as f:
            await f.pread(big, 0)  # 1 MiB chunks, many in flight
            await nvme.pread(big, path, 8 * MiB, block_size="64K")  # 128 chunks at a time
            await asyncio.gather(*(f.pread(b, int(o)) for b, o in zip(small, offs)))
            await f.pread(odd, 5 * MiB + 7)  # bounce head and tail
            await f.pwrite(wsrc, 12 * MiB)
            await f.pwrite(wsrc[: MiB + 3], 17 * MiB + 1)  # extends the file: fallocate + RMW

    with blkio_throttle(fs.dev, read_bps=48 * MiB, write_bps=48 * MiB):
        fig = await responsiveness(work)
    print("throttled loop device:", fig)
    assert fig["seconds"] > 0.2, "the throttle did not slow the transfers down: not a slow device"
    assert np.array_equal(big, data[8 * MiB :])
    assert np.array_equal(odd, data[5 * MiB + 7 : 8 * MiB + 12])
    for b, o in zip(small, offs):
        assert np.array_equal(b, data[o : o + 4096])


async def test_loop_stays_responsive_with_a_slow_fuse_daemon(faultfs):
    # Every FUSE read and write sleeps 20 ms in the daemon.
    path = str(faultfs.mnt / "fuse.bin")
    data = np.random.default_rng(10).integers(0, 256, 4 * MiB, dtype=np.uint8)
    await nvme.pwrite(data, path)
    faultfs.set(delay_us=20_000)
    out = _touched(4 * MiB)
    wsrc = _touched(MiB)
    # responsiveness() runs a noisy attempt again, and a second attempt's read
    # finds the first attempt's write: what each attempt read is checked
    # against the file as that attempt found it
    written = data.copy()
    written[64 << 10 : (64 << 10) + MiB] = wsrc
    differ: list[int] = []  # per attempt: bytes of out that differ from the file

    async def work() -> None:
        expect = written if differ else data
        await nvme.pread(out, path, block_size="128K")
        differ.append(int(np.count_nonzero(out != expect)))
        await nvme.pwrite(wsrc, path, 64 << 10, block_size="64K")

    fig = await responsiveness(work)
    print("FUSE, 20 ms per request:", fig, "attempts:", len(differ))
    assert fig["seconds"] > 0.04
    assert not any(differ), f"bytes read that differ from the file, per attempt: {differ}"
    back = np.zeros(MiB, np.uint8)
    faultfs.set()
    await nvme.pread(back, path, 64 << 10)
    assert np.array_equal(back, wsrc)
