"""Submission pressure: an AIO context that holds fewer iocbs than the engine
has chunks in flight (io_setup(1) holds ~120 here; queue_depth 1024), so
io_submit takes a prefix of each batch and answers EAGAIN. Nothing may be
dropped: every request completes, every byte is right, in any order."""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

import aionvme as nvme
import aionvme._engine as _engine
from aionvme._runtime import reactor as _reactor

MiB = 1 << 20


@pytest.fixture(params=[True, False], ids=["ring-reap", "io_getevents"])
def small_context(request, monkeypatch):
    """Engines made in this test get queue_depth 1024 but io_setup(nr=1)."""
    monkeypatch.setattr(_reactor, "Engine", functools.partial(_engine.Engine, aio_nr=1))
    with nvme.defaults.set(queue_depth=1024, ring_reap=request.param):
        yield


def _eagain_seen() -> int:
    s = nvme.stats()
    assert s["use_aio"], s
    return int(s["eagain"])


async def test_thousands_of_small_reads_under_eagain(small_context, make_file):
    path, data = make_file(16 * MiB)
    rng = np.random.default_rng(1)
    offs = rng.integers(0, 16 * MiB - 4096, 4000)
    bufs = [nvme.empty(4096) for _ in offs]
    async with nvme.open(path) as f:
        got = await asyncio.gather(*(f.pread(b, int(o)) for b, o in zip(bufs, offs)))
    assert got == [4096] * len(offs)
    for b, o in zip(bufs, offs):
        assert np.array_equal(b, data[o : o + 4096])
    assert _eagain_seen() > 0
    s = nvme.stats()
    assert s["submitted"] >= len(offs) and s["inflight"] == 0 and s["live_requests"] == 0


async def test_writes_under_eagain_all_land(small_context, tmp_dir):
    path = str(tmp_dir / "w.bin")
    n = 2000
    await nvme.pwrite(nvme.empty(n * 4096), path)  # allocated: the writes do not extend
    src = [nvme.empty(4096) for _ in range(n)]
    for i, b in enumerate(src):
        b[:] = i % 251
        b[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    order = np.random.default_rng(2).permutation(n)
    async with nvme.open(path, "r+") as f:
        got = await asyncio.gather(*(f.pwrite(src[i], int(i) * 4096) for i in order))
    assert got == [4096] * n
    back = np.fromfile(path, np.uint8).reshape(n, 4096)
    for i in range(n):
        assert np.array_equal(back[i], src[i]), i
    assert _eagain_seen() > 0


async def test_large_requests_of_many_chunks_under_eagain(small_context, make_file):
    path, data = make_file(32 * MiB + 123)
    out = nvme.empty(32 * MiB)
    odd = np.zeros(5 * MiB + 3, np.uint8)  # unaligned: bounce head and tail
    a = nvme.pread(out, path, block_size="16K")  # 2048 chunks
    b = nvme.pread(odd, path, 7, block_size="8K")
    assert await asyncio.gather(a, b) == [32 * MiB, 5 * MiB + 3]
    assert np.array_equal(out, data[: 32 * MiB])
    assert np.array_equal(odd, data[7 : 7 + odd.nbytes])
    assert _eagain_seen() > 0


async def test_cancel_while_chunks_wait_for_room(small_context, make_file):
    path, _ = make_file(32 * MiB)
    bufs = [nvme.empty(4 * MiB) for _ in range(8)]
    for b in bufs:
        b[:] = 0xAB
    futs = [nvme.pread(b, path, i * 4 * MiB, block_size="4K") for i, b in enumerate(bufs)]
    await asyncio.sleep(0)
    await asyncio.sleep(0.001)
    for fut in futs:
        fut.cancel()
    await asyncio.gather(*futs, return_exceptions=True)  # (asyncio.wait refuses coroutines)
    snaps = [b.copy() for b in bufs]
    s = nvme.stats()
    assert s["inflight"] == 0 and s["live_requests"] == 0
    await asyncio.sleep(0.2)
    for b, snap in zip(bufs, snaps):
        assert np.array_equal(b, snap)
