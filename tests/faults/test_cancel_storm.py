"""Hundreds of reads and writes cancelled or timed out at random moments.
Once a cancelled await has returned, the kernel never touches that buffer or
that file range again (snapshot at that moment, compare after everything
would have landed); completed transfers are exact; the debug counters (live
requests, chunks in flight, open fds) are back to where they started."""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest

import aionvme as nvme
from aionvme._engine import open_handles

MiB = 1 << 20
N = 300


@pytest.mark.usefixtures("kernel_engine")
async def test_cancellation_storm(make_file, tmp_dir):
    rpath, rdata = make_file(64 * MiB, seed=1)
    wpath = str(tmp_dir / "w.bin")
    await nvme.pwrite(nvme.empty(N * MiB // 4), wpath)  # the write targets exist
    rnd = random.Random(5)
    fds_before = open_handles()
    outcomes = {"done": 0, "cancelled": 0, "timeout": 0}
    checks: list[tuple[str, int, np.ndarray, bytes]] = []  # (kind, index, buffer, snapshot)
    wfd = os.open(wpath, os.O_RDONLY)

    # Every transfer's size, deadline and buffer is made before the storm, and
    # its chunks go one at a time: the loop then only submits, cancels and
    # checks, and deadlines (up to 50 ms) land while transfers are in flight.
    # The engine's refill thread moves a transfer on while the loop is busy:
    # with the buffers made inside the storm, a loop stalled in allocations let
    # nearly every transfer finish before its deadline.
    plans = []
    for i in range(N):
        size = rnd.choice([4096, 65536, 1 * MiB, MiB // 4 - 4096 + 17])
        block = rnd.choice(["4K", "16K", "64K"])
        delay = rnd.random() * 0.05
        # every fifth is never cancelled, so completions mix with the storm even
        # when a loaded machine lets every other transfer run past its deadline
        how = "none" if i % 5 == 4 else rnd.choice(["cancel", "timeout"])
        start = rnd.random() * 0.05  # staggered starts
        if i % 2 == 0:  # a read into its own buffer
            buf = nvme.empty(size) if i % 4 == 0 else np.zeros(size, np.uint8)  # aligned or not
            buf[:] = 0xEE
            off = rnd.randrange(0, 64 * MiB - size)
        else:  # a write into its own range of the write file
            off = (i // 2) * (MiB // 4) + rnd.randrange(0, 4096)
            size = min(size, (i // 2 + 1) * (MiB // 4) - off)
            buf = np.full(size, i % 250 + 1, np.uint8)
        plans.append((size, block, delay, how, start, buf, off))

    async def one(i: int) -> None:
        size, block, delay, how, start, buf, off = plans[i]
        await asyncio.sleep(start)
        if i % 2 == 0:
            coro_fut = nvme.pread(buf, rpath, off, block_size=block, parallelism=1)
        else:
            coro_fut = nvme.pwrite(buf, wpath, off, block_size=block, parallelism=1)
        try:
            if how == "none":
                n = await coro_fut
            elif how == "timeout":
                n = await asyncio.wait_for(coro_fut, delay)
            else:
                task = asyncio.ensure_future(coro_fut)
                asyncio.get_running_loop().call_later(delay, task.cancel)
                n = await task
        except (asyncio.CancelledError, TimeoutError):
            outcomes["cancelled" if how == "cancel" else "timeout"] += 1
            # The await has ended: from this instant nothing may change.
            if i % 2 == 0:
                checks.append(("read", i, buf, buf.tobytes()))
            else:
                checks.append(("write", off, buf, os.pread(wfd, size, off)))
            return
        outcomes["done"] += 1
        assert n == size
        if i % 2 == 0:
            assert np.array_equal(buf, rdata[off : off + size]), i
        else:
            assert os.pread(wfd, size, off) == buf.tobytes(), i

    try:
        await asyncio.gather(*(one(i) for i in range(N)))
        s = nvme.stats()
        assert s["inflight"] == 0 and s["live_requests"] == 0, s
        await asyncio.sleep(0.5)  # long after anything still queued would have landed
        for kind, where, buf, snap in checks:
            if kind == "read":
                assert buf.tobytes() == snap, f"read {where}: buffer written after its await ended"
            else:
                assert os.pread(wfd, len(snap), where) == snap, f"write at {where} landed after cancel"
    finally:
        os.close(wfd)
    print(outcomes)
    # the storm hit transfers, and left others to finish
    assert outcomes["cancelled"] + outcomes["timeout"] > N // 10 and outcomes["done"] > N // 10, outcomes
    assert open_handles() == fds_before
    s = nvme.stats()
    assert s["inflight"] == 0 and s["live_requests"] == 0


@pytest.mark.usefixtures("kernel_engine")
async def test_cancel_after_partial_progress_keeps_what_landed(make_file):
    # A long read cancelled part way: the bytes that arrived are the file's,
    # the rest keep the sentinel; nothing arrives later.
    path, data = make_file(64 * MiB, seed=2)
    buf = nvme.empty(64 * MiB)
    buf[:] = 0xEE
    task = asyncio.ensure_future(nvme.pread(buf, path, block_size="64K", parallelism=1))
    await asyncio.sleep(0.01)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        return  # the machine read 64 MiB in 10 ms: nothing to check
    snap = buf.copy()
    # One chunk at a time, in order: what landed is a prefix of whole chunks,
    # the file's bytes; everything after it still holds the sentinel.
    landed = (buf == data).reshape(-1, 64 << 10).all(axis=1)
    n_landed = int(landed.argmin()) if not landed.all() else landed.size
    assert (buf[n_landed * (64 << 10) :] == 0xEE).all()
    await asyncio.sleep(0.3)
    assert np.array_equal(buf, snap)
