"""The awaitable of a queued transfer (``aionvme._engine.Transfer``): a
coroutine and a future-like object over an exact ``asyncio.Future``.

A Task awaiting one waits on the exact Future (asyncio's C fast path), so a
cancelled Task cancels that Future directly, without going through
``Transfer.cancel``; the await must still end only once the kernel has let go
of the buffer. Every test runs on asyncio and uvloop (conftest).
"""

from __future__ import annotations

import asyncio
import collections.abc

import numpy as np
import pytest

import aionvme as nvme

MiB = 1 << 20
SENTINEL = 0xA5


async def _landed_nothing_after(buf: np.ndarray) -> bool:
    buf.fill(SENTINEL)
    await asyncio.sleep(0.3)
    return bool((buf == SENTINEL).all())


async def test_a_file_read_is_a_future_like_coroutine(make_file):
    path, data = make_file(64 * 4096)
    buf = np.zeros(4096, np.uint8)
    done: list[object] = []
    with nvme.open(path) as f:
        t = f.pread(buf, 4096)
        assert asyncio.isfuture(t) and isinstance(t, collections.abc.Coroutine)
        assert t.get_loop() is asyncio.get_running_loop()
        assert not t.done()
        t.add_done_callback(done.append)
        assert await t == 4096
        assert t.done() and not t.cancelled() and t.exception() is None and t.result() == 4096
        await asyncio.sleep(0)
        assert len(done) == 1 and done[0].result() == 4096  # type: ignore[attr-defined]
        assert await t == 4096  # awaiting a finished one again gives the result again
        assert np.array_equal(buf, data[4096:8192])
        assert await asyncio.wait_for(f.pread(buf, 0), timeout=30) == 4096
        assert await asyncio.shield(f.pread(buf, 8192)) == 4096
        assert await asyncio.create_task(f.pread(buf, 0)) == 4096


async def test_a_failed_file_read_raises_at_the_await_and_keeps_its_exception(make_file):
    path, _ = make_file(4096)
    with nvme.open(path) as f:
        t = f.pread(np.zeros(8192, np.uint8), 0)  # the file ends first
        with pytest.raises(nvme.ShortReadError):
            await t
        assert isinstance(t.exception(), nvme.ShortReadError)
        with pytest.raises(nvme.ShortReadError):
            t.result()


async def test_a_task_cancelled_in_a_file_read_waits_for_the_kernel(make_file):
    path, _ = make_file(32 * MiB)
    buf = np.zeros(32 * MiB, np.uint8)
    with nvme.open(path, block_size="64K", parallelism=1) as f:

        async def reader() -> int:
            return await f.pread(buf)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _landed_nothing_after(buf)


async def test_cancelling_again_while_the_kernel_is_draining_still_waits(make_file):
    # The second cancel lands on the drain future the await yields meanwhile.
    path, _ = make_file(32 * MiB)
    buf = np.zeros(32 * MiB, np.uint8)
    with nvme.open(path, block_size="64K", parallelism=1) as f:
        task = asyncio.create_task(f.pread(buf))  # the Transfer itself as the Task's coroutine
        await asyncio.sleep(0.01)
        for _ in range(3):
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _landed_nothing_after(buf)


async def test_cancel_through_the_transfer_and_through_a_timeout(make_file):
    path, _ = make_file(32 * MiB)
    buf = np.zeros(32 * MiB, np.uint8)
    with nvme.open(path, block_size="64K", parallelism=1) as f:
        t = f.pread(buf)
        await asyncio.sleep(0.01)
        assert t.cancel()
        assert not t.done()  # done only once the chunks in flight have landed
        with pytest.raises(asyncio.CancelledError):
            await t
        assert t.cancelled() and not t.cancel()
        assert await _landed_nothing_after(buf)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await f.pread(buf)
        assert await _landed_nothing_after(buf)


async def test_a_closed_coroutine_stops_its_transfer(make_file):
    # Closing the coroutine that awaits cannot wait for the kernel; the
    # transfer stops issuing chunks and still holds the buffer until they land.
    path, _ = make_file(32 * MiB)
    buf = np.zeros(32 * MiB, np.uint8)
    with nvme.open(path, block_size="64K", parallelism=1) as f:
        t = f.pread(buf)
        await asyncio.sleep(0.01)
        t.close()
        with pytest.raises(asyncio.CancelledError):
            await t  # finished as cancelled once the chunks in flight are reaped
        assert await _landed_nothing_after(buf)


async def test_tasks_of_transfers_have_a_repr_in_debug_mode(make_file):
    path, _ = make_file(4096)
    loop = asyncio.get_running_loop()
    debug = loop.get_debug()
    loop.set_debug(True)
    try:
        with nvme.open(path) as f:
            task = asyncio.create_task(f.pread(np.zeros(4096, np.uint8)))
            assert "Transfer" in repr(task)
            assert await task == 4096
            assert "Transfer" in repr(task)
    finally:
        loop.set_debug(debug)


def test_file_reads_follow_the_running_loop_across_loops_and_threads(make_file):
    # File.pread finds its loop's hub through a one-entry cache (the loop seen
    # last): a new loop, another thread's loop and a closed loop must each get
    # their own hub, and a closed loop must not be kept alive by the cache.
    import gc
    import threading
    import weakref

    path, data = make_file(256 * 4096)
    expect = np.frombuffer(data, np.uint8)

    async def read_all(f: nvme.File, step: int) -> list[weakref.ref[asyncio.AbstractEventLoop]]:
        bufs = [np.zeros(4096, np.uint8) for _ in range(16)]
        for start in range(0, 256, 16):
            blocks = [(start + k * step) % 256 for k in range(16)]
            await asyncio.gather(*(f.pread(b, i * 4096) for b, i in zip(bufs, blocks)))
            for b, i in zip(bufs, blocks):
                np.testing.assert_array_equal(b, expect[i * 4096 : (i + 1) * 4096])
        return [weakref.ref(asyncio.get_running_loop())]

    with nvme.open(path) as f:
        refs = []
        for step in (1, 3, 5):  # a new loop each time, one after the other
            refs += asyncio.run(read_all(f, step))
        errors: list[BaseException] = []

        def in_thread(step: int) -> None:
            try:
                refs.extend(asyncio.run(read_all(f, step)))
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=in_thread, args=(s,)) for s in (7, 11, 13)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        gc.collect()
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} closed loops are still referenced"
