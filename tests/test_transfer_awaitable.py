"""The awaitable of a queued transfer (``aionvme._engine.Transfer``): a
coroutine and a future-like object that keeps its own done callbacks.

A Task awaiting one waits on the Transfer itself, so a cancelled Task goes
through ``Transfer.cancel``; the await must still end only once the kernel
has let go of the buffer. The reactor runs the done callbacks (the waiting
tasks' wakeups) where it reaps the completions, each in its own context, so
these tests also hold it to what asyncio's futures promise: contexts, order,
errors reported and not lost. Every async test runs on asyncio and uvloop
(conftest).
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import gc

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


_who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


async def test_tasks_woken_by_completions_run_in_their_own_contexts(make_file):
    # The reactor wakes the waiting tasks itself: each must resume in its own
    # context, and what it sets after an await must still be there after the
    # next one (the task's context, not a copy).
    path, data = make_file(64 * 4096)
    with nvme.open(path) as f:

        async def reader(name: str) -> list[str]:
            _who.set(name)
            seen = []
            buf = np.zeros(4096, np.uint8)
            for i in range(8):
                assert await f.pread(buf, (i * 7 % 64) * 4096) == 4096
                seen.append(_who.get())
                _who.set(f"{name}.{i}")
            return seen

        got = await asyncio.gather(*(reader(f"t{k}") for k in range(16)))
    for k, seen in enumerate(got):
        assert seen == [f"t{k}"] + [f"t{k}.{i}" for i in range(7)]
    assert _who.get() == "nobody"


async def test_done_callbacks_run_in_order_in_their_context_and_can_be_removed(make_file):
    path, _ = make_file(4 * 4096)
    calls: list[tuple[str, str, object]] = []

    def cb(tag: str):
        def f(t: object) -> None:
            calls.append((tag, _who.get(), t))

        return f

    with nvme.open(path) as f:
        t = f.pread(np.zeros(4096, np.uint8), 0)
        first, second, gone = cb("first"), cb("second"), cb("gone")
        ctx = contextvars.copy_context()
        ctx.run(_who.set, "in ctx")
        t.add_done_callback(first)
        t.add_done_callback(gone)
        t.add_done_callback(second, context=ctx)
        t.add_done_callback(gone)
        assert t.remove_done_callback(gone) == 2 and t.remove_done_callback(gone) == 0
        assert await t == 4096
        await asyncio.sleep(0)
        assert calls == [("first", "nobody", t), ("second", "in ctx", t)]
        # Added once done: scheduled with call_soon, as asyncio's futures do.
        late = cb("late")
        t.add_done_callback(late)
        assert len(calls) == 2
        await asyncio.sleep(0)
        assert calls[-1] == ("late", "nobody", t)


async def test_a_failing_done_callback_is_reported_and_the_others_still_run(make_file):
    path, _ = make_file(4 * 4096)
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    ran: list[int] = []
    try:
        with nvme.open(path) as f:
            ts = [f.pread(np.zeros(4096, np.uint8), i * 4096) for i in range(4)]

            def boom(t: object) -> None:
                raise ValueError("callback failed")

            ts[0].add_done_callback(boom)
            for i, t in enumerate(ts):
                t.add_done_callback(lambda _t, i=i: ran.append(i))
            assert await asyncio.gather(*ts) == [4096] * 4
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(old)
    assert sorted(ran) == [0, 1, 2, 3]
    assert len(reported) == 1 and isinstance(reported[0]["exception"], ValueError)


async def test_an_unretrieved_transfer_error_is_logged(make_file):
    path, _ = make_file(4096)
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        with nvme.open(path) as f:
            t = f.pread(np.zeros(8192, np.uint8), 0)  # fails: the file ends first
            while not t.done():
                await asyncio.sleep(0.001)
            retrieved = f.pread(np.zeros(8192, np.uint8), 0)
            with pytest.raises(nvme.ShortReadError):
                await retrieved
            del t, retrieved
            gc.collect()
    finally:
        loop.set_exception_handler(old)
    assert len(reported) == 1, reported
    assert "never retrieved" in reported[0]["message"]
    assert isinstance(reported[0]["exception"], nvme.ShortReadError)


async def test_a_python_task_awaits_transfers_too(make_file):
    # asyncio's pure-Python Task (what a custom task factory may use) takes
    # the generic future-like path, not the C Task's wakeup.
    path, data = make_file(8 * 4096)
    loop = asyncio.get_running_loop()
    with nvme.open(path) as f:

        async def two() -> int:
            buf = np.zeros(4096, np.uint8)
            n = await f.pread(buf, 4096)
            assert np.array_equal(buf, data[4096:8192])
            with pytest.raises(nvme.ShortReadError):
                await f.pread(np.zeros(8 * 4096, np.uint8), 4096)
            return n

        task = asyncio.tasks._PyTask(two(), loop=loop)  # type: ignore[attr-defined]
        assert await task == 4096


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_keyboardinterrupt_from_a_done_callback_leaves_the_others_to_the_loop(make_file, loop_kind):
    # A callback run where completions are reaped raises KeyboardInterrupt:
    # it leaves run_until_complete, as from any loop callback, and the
    # callbacks of the other transfers of that delivery still run later.
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    path, _ = make_file(16 * 4096)
    ran: list[int] = []
    try:
        with nvme.open(path) as f:
            ts: list = []

            async def start() -> None:
                ts.extend(f.pread(np.zeros(4096, np.uint8), i * 4096) for i in range(16))

                def interrupt(t: object) -> None:
                    raise KeyboardInterrupt

                for i, t in enumerate(ts):
                    if i == 0:
                        t.add_done_callback(interrupt)
                    t.add_done_callback(lambda _t, i=i: ran.append(i))
                await asyncio.sleep(30)

            main = loop.create_task(start())
            with pytest.raises(KeyboardInterrupt):
                loop.run_until_complete(main)
            main.cancel()
            loop.run_until_complete(asyncio.gather(*ts))
            loop.run_until_complete(asyncio.sleep(0))
            assert sorted(ran) == list(range(16))
            assert [t.result() for t in ts] == [4096] * 16
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def test_gather_of_transfers_cancelled_from_outside_and_with_return_exceptions(make_file):
    # gather reads a child's _cancel_message and _make_cancelled_error(). The
    # cancels come before the loop runs again, so no child can finish first
    # (page-cache reads on the worker engine would finish within milliseconds).
    path, _ = make_file(32 * MiB)
    bufs = [np.zeros(8 * MiB, np.uint8) for _ in range(4)]
    with nvme.open(path, block_size="64K", parallelism=1) as f:
        ts = [f.pread(b, i * 8 * MiB) for i, b in enumerate(bufs)]
        g = asyncio.gather(*ts)
        g.cancel("stop")
        with pytest.raises(asyncio.CancelledError):
            await g
        assert all(t.cancelled() for t in ts)
        for b in bufs:
            assert await _landed_nothing_after(b)
        ts = [f.pread(b, i * 8 * MiB) for i, b in enumerate(bufs)]
        for t in ts:
            t.cancel("mine")
        got = await asyncio.gather(*ts, return_exceptions=True)
        assert all(isinstance(e, asyncio.CancelledError) and e.args == ("mine",) for e in got), got
