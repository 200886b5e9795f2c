"""The io_uring engine (engine='uring': every transfer through io_uring) and
the io_uring instance that engine='auto' keeps beside kernel AIO for files
served buffered. Same semantics as kernel AIO: all bytes or an exception,
ShortReadError at EOF, cancellation waits for what is in flight."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import aionvme as nvme
from aionvme._engine import Engine
from aionvme._runtime import blocking as _blocking
from aionvme._runtime import reactor as _reactor

MiB = 1 << 20


def _uring_works() -> str | None:
    e = Engine(queue_depth=4, uring=2)
    try:
        return None if e.uring_direct else f"io_uring is unavailable here: {e.uring_error}"
    finally:
        e.close()


_why = _uring_works()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


@pytest.fixture
def uring():
    with nvme.defaults.set(engine="uring"):
        yield


def test_engine_modes():
    for mode, backend, ring, direct, lazy in (
        (0, "aio", False, False, False),
        (1, "aio", False, False, True),  # the ring comes with the first buffered file
        (2, "io_uring", True, True, False),
    ):
        e = Engine(queue_depth=8, uring=mode)
        try:
            assert (e.backend, e.use_uring, e.uring_direct, e.uring_lazy) == (backend, ring, direct, lazy)
            s = e.stats()
            assert s["backend"] == backend and s["use_uring"] is ring and s["uring_lazy"] is lazy
            assert e.backlog is False
        finally:
            e.close()


def test_auto_makes_the_ring_on_the_first_buffered_request(make_file):
    path, data = make_file(MiB)

    async def main():
        eng = _reactor.get_reactor().engine
        seen = [(eng.use_uring, eng.uring_lazy)]
        out = np.zeros(MiB, np.uint8)
        await nvme.pread(out, path)  # O_DIRECT: kernel AIO, no ring
        seen.append((eng.use_uring, eng.uring_lazy))
        back = np.zeros(MiB, np.uint8)
        async with nvme.open(path, direct=False) as f:
            await f.pread(back, 0)
        seen.append((eng.use_uring, eng.uring_lazy))
        return seen, eng.stats()["ring_submitted"], out, back

    with nvme.defaults.set(engine="auto"):
        seen, ring_submitted, out, back = asyncio.run(main())
    assert seen == [(False, True), (False, True), (True, False)]
    assert ring_submitted >= 1
    assert np.array_equal(out, data) and np.array_equal(back, data)


@pytest.mark.parametrize("mode", ["auto", "uring"])
def test_refused_sqes_complete_without_another_request(mode, make_file):
    # io_uring_enter answers EAGAIN (no memory for requests) more often than
    # one flush retries: the SQEs stay queued and nothing is in flight, so no
    # completion will wake the loop. The reactor must pump again by itself.
    path, data = make_file(MiB)

    async def main():
        eng = _reactor.get_reactor().engine
        bufs = [np.zeros(4096, np.uint8) for _ in range(16)]
        async with nvme.open(path, direct=mode == "uring") as f:
            await f.pread(bufs[0], 0)  # engine='auto' makes its ring here
            before = eng.stats()
            eng._uring_refuse(90)  # about ten flushes' worth of tries (early flushes take some)
            reads = asyncio.gather(*(f.pread(b, i * 8192) for i, b in enumerate(bufs)))
            await asyncio.sleep(0)
            stuck = eng.backlog
            try:
                await asyncio.wait_for(asyncio.shield(reads), 10)
            finally:
                eng._uring_refuse(0)
            after = eng.stats()
        return bufs, stuck, before, after

    with nvme.defaults.set(engine=mode):
        bufs, stuck, before, after = asyncio.run(main())
    assert stuck  # the first flush gave up with SQEs queued
    assert after["eagain"] - before["eagain"] >= 90 and not after["backlog"]
    assert after["ring_submitted"] - before["ring_submitted"] == 16
    assert all(np.array_equal(b, data[i * 8192 : i * 8192 + 4096]) for i, b in enumerate(bufs))


@pytest.mark.parametrize("engine", ["uring"], indirect=True)
def test_refused_sqes_blocking_call(engine, make_file):
    path, data = make_file(MiB)
    eng = _blocking.thread_engine()
    out = np.zeros(MiB, np.uint8)
    with nvme.open(path) as f:
        before = eng.stats()
        eng._uring_refuse(40)
        f.sync_pread(out, 0)
        after = eng.stats()
    assert after["eagain"] - before["eagain"] >= 40 and not after["backlog"]
    assert np.array_equal(out, data)


async def test_direct_round_trip_through_the_ring(uring, make_file, tmp_dir):
    path, data = make_file(9 * MiB + 123)
    out = np.zeros(9 * MiB + 100, np.uint8)
    await nvme.pread(out, path, 23)  # unaligned head and tail: bounce buffers
    assert np.array_equal(out, data[23:])
    w = str(tmp_dir / "w.bin")
    await nvme.pwrite(data, w, 4095)
    back = np.zeros_like(data)
    await nvme.pread(back, w, 4095)
    assert np.array_equal(back, data)
    s = nvme.stats()
    assert s["backend"] == "io_uring" and s["ring_submitted"] > 0
    assert s["ring_submitted"] == s["submitted"]  # no iocb went to kernel AIO


async def test_many_small_reads_in_flight(uring, make_file):
    path, data = make_file(8 * MiB)
    offs = np.random.default_rng(3).integers(0, 8 * MiB // 4096, 3000) * 4096
    bufs = [nvme.empty(4096) for _ in range(len(offs))]
    async with nvme.open(path) as f:
        await asyncio.gather(*(f.pread(b, int(o)) for b, o in zip(bufs, offs)))
    assert all(np.array_equal(b, data[o : o + 4096]) for b, o in zip(bufs, offs))


async def test_short_read_at_eof(uring, make_file):
    path, data = make_file(10_000)
    buf = nvme.empty(3 * 4096)
    with pytest.raises(nvme.ShortReadError) as ei:
        await nvme.pread(buf, path, 4096)
    assert ei.value.received == 10_000 - 4096
    assert np.array_equal(buf[: 10_000 - 4096], data[4096:])


@pytest.mark.parametrize("engine", ["auto", "uring"])
async def test_buffered_files_go_through_the_ring(engine, make_file):
    path, data = make_file(2 * MiB + 5)
    with nvme.defaults.set(engine=engine):
        out = np.zeros(2 * MiB, np.uint8)
        async with nvme.open(path, direct=False) as f:
            assert not f.direct
            await f.pread(out, 5)
            # a read past EOF comes back short from the ring; a worker redoes
            # it and tells EOF from a short page-cache copy
            tail = np.zeros(100, np.uint8)
            with pytest.raises(nvme.ShortReadError) as ei:
                await f.pread(tail, 2 * MiB - 20)
        s = nvme.stats()
    assert np.array_equal(out, data[5:])
    assert ei.value.received == 25 and np.array_equal(tail[:25], data[-25:])
    assert s["ring_submitted"] >= 2


async def test_cancellation_waits_for_the_ring(uring, make_file):
    path, _ = make_file(32 * MiB)
    buf = nvme.empty(32 * MiB)
    task = asyncio.ensure_future(nvme.pread(buf, path, block_size="256K"))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    snap = buf.copy()
    await asyncio.sleep(0.05)
    assert np.array_equal(buf, snap)  # nothing lands after the await ended
    assert nvme.stats()["inflight"] == 0


def test_blocking_calls_and_fork(uring, make_file):
    path, data = make_file(3 * MiB)
    with nvme.open(path, "r+") as f:
        out = np.zeros(3 * MiB, np.uint8)
        f.sync_pread(out, 0)
        assert np.array_equal(out, data)
        pid = os.fork()
        if pid == 0:  # the child gets a ring of its own (the parent's is not even mapped here)
            code = 1
            try:
                with nvme.open(path) as g:
                    b = np.zeros(MiB, np.uint8)
                    g.sync_pread(b, MiB)
                    code = 0 if np.array_equal(b, data[MiB : 2 * MiB]) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        f.sync_pwrite(data[:4097], 1)
        back = np.zeros(4097, np.uint8)
        f.sync_pread(back, 1)
        assert np.array_equal(back, data[:4097])
