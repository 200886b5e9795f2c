"""The engine's refill thread (Engine(refill_thread=True), defaults.refill_thread):
a C thread reaps completions and refills the device from the queued requests;
the owner is woken only when requests have finished. Real kernel AIO on files
in the test's directory; the engine-parametrized tests (the ``engine`` fixture's
``aio+refill``) run the rest of the suite's transfers through it too."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

import aionvme as nvme
import aionvme._engine as _engine
from aionvme._runtime import reactor as _reactor

pytestmark = pytest.mark.skipif(
    _engine.aio_probe() is not None, reason=f"no kernel AIO: {_engine.aio_probe()}"
)

BS = 4096


def _threads() -> int:
    """This process's refill threads (they name themselves)."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == "aionvme-refill"
        except FileNotFoundError:  # a thread that just ended
            pass
    return n


def _threads_reach(n: int, more: bool) -> bool:
    # a new thread names itself when it starts; close() joins it. (At least /
    # at most: another test's engine collected meanwhile stops its own.)
    deadline = time.monotonic() + 5
    while (_threads() < n if more else _threads() > n) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads() >= n if more else _threads() <= n


def _open_direct(path: str) -> _engine.FileHandle:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    return _engine.FileHandle(
        fd, path, _engine.KERNEL_AIO, True, True, False, BS, BS, _engine.Inode(os.path.getsize(path))
    )


def test_the_thread_refills_and_the_owner_wakes_per_finished_request(make_file):
    path, data = make_file(16 << 20)
    n = 2000
    offs = np.random.default_rng(1).integers(0, (16 << 20) // BS, n) * BS
    bufs = nvme.empty((n, BS))
    before = _threads()
    eng = _engine.Engine(64, 2, refill_thread=True)
    h = _open_direct(path)
    try:
        assert eng.refill_thread and _threads_reach(before + 1, more=True)
        assert eng.tfd >= 0 and eng.fileno() == eng.efd
        t0 = time.monotonic()
        req = eng.run(eng.readrows(h, bufs, offs, BS))
        elapsed = time.monotonic() - t0
        assert req.ok
        for i in range(0, n, 97):
            assert np.array_equal(bufs[i], data[offs[i] : offs[i] + BS])
        s = eng.stats()
        assert s["refill_thread"] and s["completed"] == n and s["inflight"] == 0
        # 2000 reads 64 at a time: the device was refilled dozens of times,
        # by the thread; the owner woke to start, at the end, and at run()'s
        # signal checks (every 0.1 s)
        assert s["refill_wakeups"] >= 10
        assert s["owner_wakeups"] <= 3 + elapsed / 0.1
    finally:
        eng.close()
        h.close()
    assert _threads_reach(before, more=False)  # joined by close
    assert eng.is_closed and eng.fileno() == -1


def test_close_with_requests_in_flight_drains_and_joins(make_file):
    path, _ = make_file(8 << 20)
    before = _threads()
    eng = _engine.Engine(32, 2, refill_thread=True)
    h = _open_direct(path)
    bufs = [nvme.empty(1 << 20) for _ in range(8)]
    for b in bufs:
        b[:] = 0xEE
    reqs = [eng.read(h, b, i << 20, block=BS) for i, b in enumerate(bufs)]
    eng.flush()
    try:
        done = eng.close()  # pending requests cancelled, chunks in flight waited for
    finally:
        h.close()
    assert {id(r) for r in done} <= {id(r) for r in reqs}
    assert all(r.finished for r in reqs)
    snap = [b.copy() for b in bufs]
    time.sleep(0.1)
    assert all(np.array_equal(a, b) for a, b in zip(snap, bufs))  # nothing lands afterwards
    assert eng.stats()["inflight"] == 0
    assert _threads_reach(before, more=False)


def test_an_engine_dropped_unclosed_still_drains_and_joins(make_file):
    path, data = make_file(1 << 20)
    before = _threads()
    eng = _engine.Engine(16, 1, refill_thread=True)
    h = _open_direct(path)
    buf = nvme.empty(1 << 20)
    req = eng.run(eng.read(h, buf, 0, block=64 << 10))
    assert req.ok and np.array_equal(buf, data)
    del eng, req  # __dealloc__ closes: stops the thread first
    assert _threads_reach(before, more=False)
    h.close()


@pytest.mark.parametrize("mode", ["many", "rows"])
async def test_batches_on_a_loop(make_file, mode):
    path, data = make_file(32 << 20)
    n, batch = 4096, 256
    offs = np.random.default_rng(2).integers(0, (32 << 20) // BS, n) * BS
    bufs = nvme.empty((n, BS))
    with nvme.defaults.set(refill_thread=True), nvme.Handle(queue_depth=64) as h:
        async with nvme.open(path) as f:

            async def worker(k: int) -> None:
                for i in range(k * batch, n, 4 * batch):
                    if mode == "many":
                        await h.pread_many([(bufs[j], int(offs[j])) for j in range(i, i + batch)], f)
                    else:
                        await h.pread_rows(bufs[i : i + batch], offs[i : i + batch], f)

            await asyncio.gather(*(worker(k) for k in range(4)))
            s = h.stats()  # its engine on this loop
        assert s["engines"] == 1 and s["refill_thread"], s
        assert s["completed"] >= n and s["refill_wakeups"] > 0
        # one owner wakeup per finished batch at most (n / batch of them), and
        # the refills in between happened on the thread
        assert s["owner_wakeups"] <= n // batch + 4
    for j in range(0, n, 31):
        assert np.array_equal(bufs[j], data[offs[j] : offs[j] + BS])


async def test_cancel_mid_batch_waits_for_the_chunks_in_flight(make_file):
    path, _ = make_file(64 << 20)
    buf = nvme.empty(64 << 20)
    buf[:] = 0xAB
    with nvme.defaults.set(refill_thread=True), nvme.Handle(queue_depth=16, block_size="64K") as h:
        async with nvme.open(path) as f:
            task = asyncio.ensure_future(h.pread(buf, f, 0))
            await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            snapshot = buf.copy()
            await asyncio.sleep(0.2)
            assert np.array_equal(buf, snapshot)  # the await ended: nothing writes into buf any more
            out = nvme.empty(1 << 20)
            assert await h.pread(out, f, 3 << 20) == 1 << 20  # and the engine still serves


async def test_errors_reach_the_await(make_file):
    path, data = make_file(1 << 20)
    with nvme.defaults.set(refill_thread=True), nvme.Handle(queue_depth=8) as h:
        async with nvme.open(path) as f:
            bufs = [nvme.empty(BS) for _ in range(300)]
            items = [(b, (i % 256) * BS) for i, b in enumerate(bufs)]
            items.append((nvme.empty(2 * BS), (1 << 20) - BS))  # runs past the end
            with pytest.raises(nvme.exceptions.ShortReadError) as ei:
                await h.pread_many(items, f)
            assert ei.value.received == BS
            assert await h.pread_many(items[:-1], f) == 300 * BS
            assert np.array_equal(bufs[299], data[43 * BS : 44 * BS])


def test_fork_child_with_a_refill_engine_in_the_parent(make_file):
    path, data = make_file(4 << 20)

    async def read_all() -> np.ndarray:
        buf = nvme.empty(4 << 20)
        await nvme.pread(buf, path, block_size="64K")
        return buf

    with nvme.defaults.set(refill_thread=True):
        loop = asyncio.new_event_loop()
        try:
            assert np.array_equal(loop.run_until_complete(read_all()), data)
            assert loop._aionvme_reactor.engine.refill_thread
            pid = os.fork()
            if pid == 0:  # the child's engines are its own (and have their own threads)
                code = 1
                try:
                    code = 0 if np.array_equal(asyncio.run(read_all()), data) else 1
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            assert np.array_equal(loop.run_until_complete(read_all()), data)  # the parent's still works
        finally:
            loop.close()


def test_setting_from_the_environment(monkeypatch):
    monkeypatch.setenv("AIONVME_REFILL_THREAD", "1")
    assert nvme.defaults._from_env(os.environ).refill_thread is True
    monkeypatch.setenv("AIONVME_REFILL_THREAD", "maybe")
    with pytest.raises(nvme.exceptions.InvalidSettingError):
        nvme.defaults._from_env(os.environ)


async def test_single_reads_never_go_through_the_thread(make_file):
    # every request wholly in flight once submitted: completions wake the loop
    # directly, as without the thread (a hop through it only adds a wakeup)
    path, data = make_file(1 << 20)
    with nvme.defaults.set(refill_thread=True, queue_depth=128):
        async with nvme.open(path) as f:
            bufs = [nvme.empty(BS) for _ in range(64)]
            for r in range(10):
                await asyncio.gather(*(f.pread(b, ((i + r) % 256) * BS) for i, b in enumerate(bufs)))
            s = _reactor.get_reactor().engine.stats()
    assert s["refill_thread"] and s["completed"] >= 640
    assert s["refill_wakeups"] == 0
    assert np.array_equal(bufs[5], data[14 * BS : 15 * BS])


async def test_reads_beyond_the_queue_depth_are_refilled_by_the_thread(make_file):
    path, data = make_file(1 << 20)
    with nvme.defaults.set(refill_thread=True, queue_depth=8):
        async with nvme.open(path) as f:
            bufs = [nvme.empty(BS) for _ in range(256)]
            await asyncio.gather(*(f.pread(b, i * BS) for i, b in enumerate(bufs)))
            s = _reactor.get_reactor().engine.stats()
    assert s["refill_thread"] and s["refill_wakeups"] > 0
    assert all(np.array_equal(b, data[i * BS : (i + 1) * BS]) for i, b in enumerate(bufs))
