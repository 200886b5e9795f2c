"""A serving engine's threads on the store (issue 35): submit_put_many /
submit_get_many from foreign threads (concurrent.futures, an eventfd to
poll), close with jobs in flight, pins racing cache-mode eviction, and the
churn of a bounded cache written ten times over while another thread reads."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import select
import threading
import time

import numpy as np
import pytest

from _kvblocks import KiB, MiB, block, disk_bytes
from aionvme.store import (
    OutBufferError,
    StoreClosedError,
    StoreKeyError,
    SyncTieredStore,
    TieredStore,
)


def wait_count(fd: int, want: int, timeout: float = 60.0) -> int:
    """Poll the eventfd until it has counted ``want`` completions in all."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    got = 0
    while got < want:
        assert p.poll(timeout * 1000), f"only {got} of {want} completions signalled"
        got += os.eventfd_read(fd)
    return got


def test_jobs_from_several_threads_complete_futures_and_count_on_the_eventfd(tmp_path):
    with SyncTieredStore(tmp_path, host="256K", nvme="4M", on_full="evict") as s:
        fd = s.completion_fd()
        assert fd == s.completion_fd()
        futs: list = []
        lock = threading.Lock()

        def engine_thread(t: int) -> None:
            for i in range(8):
                keys = [(t << 8) + 2 * i, (t << 8) + 2 * i + 1]
                f = s.submit_put_many({k: block(k, 16 * KiB) for k in keys})
                with lock:
                    futs.append(("put", keys, f))

        threads = [threading.Thread(target=engine_thread, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert wait_count(fd, len(futs)) == len(futs)
        for _, _, f in futs:
            assert f.done() and f.result() is None
        keys = [(t << 8) + i for t in range(4) for i in range(16)]
        outs = [np.empty(16 * KiB, np.uint8) for _ in keys]
        f = s.submit_get_many(keys, out=outs, missing="skip")
        wait_count(fd, 1)
        assert f.result() == [True] * len(keys)
        for k, o in zip(keys, outs):
            assert np.array_equal(o, block(k, 16 * KiB))
        vals = s.submit_get_many([keys[3], "nope"], missing="skip").result()
        assert np.array_equal(vals[0], block(keys[3], 16 * KiB)) and vals[1] is None


def test_errors_arrive_on_the_future_and_still_count(tmp_path):
    with SyncTieredStore(tmp_path, host="256K") as s:
        fd = s.completion_fd()
        s.put("a", block("a"))
        f1 = s.submit_get_many(["a", "b"])
        f2 = s.submit_get_many(["a"], out=[np.empty(10, np.uint8)])
        f3 = s.submit_put_many({"c": "not an array"})
        wait_count(fd, 3)
        assert isinstance(f1.exception(), StoreKeyError)
        assert isinstance(f2.exception(), OutBufferError)
        assert isinstance(f3.exception(), TypeError)
        assert "c" not in s


def test_close_with_jobs_in_flight_finishes_or_refuses_them(tmp_path):
    s = SyncTieredStore(tmp_path, host="128K", nvme="2M", on_full="evict")
    fd = s.completion_fd()
    futs = [s.submit_put_many({i: block(i, 32 * KiB)}) for i in range(64)]
    s.close()
    for f in futs:
        assert f.done()
        exc = f.exception()
        assert exc is None or isinstance(exc, StoreClosedError), exc
    # the eventfd went with the store (conftest's leak check fails a test that leaves a file open)
    assert fd >= 0 and s.aio._jobs._fd == -1
    with pytest.raises(StoreClosedError):
        s.submit_put_many({"x": block("x")})
    with pytest.raises(StoreClosedError):
        s.completion_fd()


def test_a_tieredstore_runs_jobs_on_the_loop_it_is_bound_to(tmp_path):
    s = TieredStore(tmp_path, host="256K")
    with pytest.raises(StoreClosedError, match="no"):  # no loop yet: use it first, or SyncTieredStore
        s.submit_put_many({"a": block("a")})
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    done = asyncio.Event()

    async def owner() -> None:
        await s.put("first", block("first"))  # binds the store to this loop
        ready.set()
        await done.wait()
        await s.close()

    th = threading.Thread(target=loop.run_until_complete, args=(owner(),))
    th.start()
    try:
        ready.wait(30)
        fd = s.completion_fd()
        s.submit_put_many({"b": block("b")}).result(30)
        got = s.submit_get_many(["first", "b"]).result(30)
        assert np.array_equal(got[0], block("first")) and np.array_equal(got[1], block("b"))
        assert wait_count(fd, 2) == 2
    finally:
        loop.call_soon_threadsafe(done.set)
        th.join(30)
        loop.close()
    assert s.closed


def test_pins_from_another_thread_race_eviction_without_losing_a_pinned_value(tmp_path):
    """An engine thread pins keys while the loop fills the cache past its
    capacity: a key whose pin returned True is readable, with its bytes,
    until it is unpinned, and is never listed as evicted meanwhile."""
    n = 8 * KiB
    with SyncTieredStore(tmp_path, host=0, nvme="256K", on_full="evict") as s:
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                k = 0
                while not stop.is_set():
                    s.put_many({k + j: block(k + j, n) for j in range(4)})
                    k += 4
            except BaseException as e:  # handed to the test's thread
                errors.append(e)

        th = threading.Thread(target=writer)
        th.start()
        rng = random.Random(0)
        checked = 0
        try:
            give_up = time.monotonic() + 120  # (a bound, not a timed assertion)
            while checked < 200 and not errors and time.monotonic() < give_up:
                present = s.aio.keys()
                if len(present) < 3:
                    time.sleep(0.001)
                    continue
                keys = rng.sample(present, min(3, len(present)))
                ok = s.pin(keys)
                pinned = [k for k, o in zip(keys, ok) if o]
                evicted_before = set(s.drain_evicted())
                for k in pinned:
                    assert np.array_equal(s.get(k), block(k, n))
                    checked += 1
                s.unpin(pinned)
                assert not set(pinned) & (set(s.drain_evicted()) - evicted_before)
        finally:
            stop.set()
            th.join(60)
        assert not errors, errors
        assert checked >= 200
        assert s.stats()["nvme"]["evictions"] > 0


@pytest.mark.parametrize("persist", [False, True])
def test_churn_ten_times_the_capacity_while_another_thread_reads(tmp_path, persist):
    """Random keys of 16-256 KiB written to a 4 MiB cache until 40 MiB went
    through it, while another thread reads random keys through
    submit_get_many: the slab files never take more than the capacity, and
    every read returns the key's bytes or a miss."""
    cap = 4 * MiB
    rng = random.Random(1)
    sizes = {k: rng.randrange(16, 257) * KiB for k in range(400)}
    with SyncTieredStore(tmp_path, host="512K", nvme=cap, on_full="evict", persist=persist) as s:
        stop = threading.Event()
        reads = {"hit": 0, "miss": 0}
        errors: list[BaseException] = []

        def reader() -> None:
            r = random.Random(2)
            try:
                while not stop.is_set():
                    keys = r.sample(range(400), 8)
                    outs = [np.empty(sizes[k], np.uint8) for k in keys]
                    got = s.submit_get_many(keys, out=outs, missing="skip").result(60)
                    for k, o, hit in zip(keys, outs, got):
                        if hit:
                            assert np.array_equal(o, block(k, sizes[k])), k
                        reads["hit" if hit else "miss"] += 1
            except BaseException as e:  # handed to the test's thread
                errors.append(e)

        th = threading.Thread(target=reader)
        th.start()
        written = 0
        try:
            while written < 10 * cap:
                keys = rng.sample(range(400), rng.randrange(1, 5))
                s.put_many({k: block(k, sizes[k]) for k in keys})
                written += sum(sizes[k] for k in keys)
                assert disk_bytes(s) <= cap
        finally:
            stop.set()
            th.join(60)
        assert not errors, errors
        assert reads["hit"] > 0 and reads["miss"] > 0
        assert len(s.drain_evicted()) > 0
        # (write-behind may still drop a key meanwhile: a miss, never other bytes)
        keys = list(s.aio)
        for k, v in zip(keys, s.get_many(keys, missing="skip")):
            assert v is None or np.array_equal(v, block(k, sizes[k]))


def test_a_forked_child_cannot_submit_to_its_parents_store(tmp_path):
    with SyncTieredStore(tmp_path, host="256K") as s:
        s.put("a", block("a"))
        pid = os.fork()
        if pid == 0:  # the child: its parent's loop thread is not here
            code = 1
            try:
                s.submit_get_many(["a"])
            except StoreClosedError:
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert np.array_equal(s.submit_get_many(["a"]).result(30)[0], block("a"))


@pytest.mark.gpu
def test_loads_into_gpu_memory_from_an_engine_thread(tmp_path):
    """The engines' loads land in their GPU KV cache: out= CUDA tensors,
    from the host tier and from NVMe, a miss left untouched."""
    torch = pytest.importorskip("torch", reason="loads into GPU memory need torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (loads into GPU memory; bench/gpu_check.sh runs the gpu tests)")
    n = 256 * KiB
    with SyncTieredStore(tmp_path, host="512K", nvme="4M", on_full="evict") as s:
        for k in range(8):  # the last ones in host memory, the first only on NVMe
            s.submit_put_many({k: torch.from_numpy(block(k, n))}).result(60)
        outs = [torch.full((n,), 7, dtype=torch.uint8, device="cuda") for _ in range(3)]
        assert s.submit_get_many([0, 99, 7], out=outs, missing="skip").result(60) == [True, False, True]
        assert torch.equal(outs[0].cpu(), torch.from_numpy(block(0, n)))
        assert bool((outs[1] == 7).all())
        assert torch.equal(outs[2].cpu(), torch.from_numpy(block(7, n)))


def test_many_threads_at_once_each_future_its_own_result_and_the_eventfd_never_ahead(tmp_path):
    """8 threads submit gets of host hits, NVMe-only values and absent keys at
    once: each future holds its own keys' bytes, and every count on the
    eventfd is for a future already done (a poller checks at each read)."""
    jobs = 8 * 25
    with SyncTieredStore(tmp_path, host="512K", nvme="16M", on_full="evict") as s:
        s.put_many({("h", i): block(("h", i), 4 * KiB) for i in range(16)})  # host tier
        s.put_many({("n", i): block(("n", i), 64 * KiB) for i in range(32)}, to="nvme")
        assert s.where(("n", 0)) == ["nvme"] and "host" in s.where(("h", 0))
        fd = s.completion_fd()
        futs: list = []
        lock = threading.Lock()
        ahead: list[int] = []  # per eventfd read: counts signalled less futures done (never > 0)
        total = [0]

        def poller() -> None:
            p = select.poll()
            p.register(fd, select.POLLIN)
            deadline = time.monotonic() + 60
            while total[0] < jobs and time.monotonic() < deadline:
                if p.poll(100):
                    total[0] += os.eventfd_read(fd)
                    with lock:
                        done = sum(f.done() for _, _, f in futs)
                    ahead.append(total[0] - done)

        def engine_thread(t: int) -> None:
            for i in range(25):
                keys = [("h", (t + i) % 16), ("n", (3 * t + i) % 32), ("x", i)][: 1 + i % 3]
                outs = [np.zeros(64 * KiB if k[0] == "n" else 4 * KiB, np.uint8) for k in keys]
                with lock:
                    futs.append((keys, outs, s.submit_get_many(keys, out=outs, missing="skip")))

        pt = threading.Thread(target=poller)
        pt.start()
        threads = [threading.Thread(target=engine_thread, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        pt.join(90)
        assert total[0] == len(futs) == jobs
        assert ahead and max(ahead) <= 0, ahead
        for keys, outs, f in futs:
            assert f.result() == [k[0] != "x" for k in keys]
            for k, o in zip(keys, outs):
                want = np.zeros_like(o) if k[0] == "x" else block(k, o.size)
                assert np.array_equal(o, want), k


def _own_loop(tmp_path, **kw):
    """A TieredStore bound to a loop running in a thread of its own, and a
    way to hold that loop busy: ``(store, loop, thread, hold, release, stop)``."""
    s = TieredStore(tmp_path, **kw)
    loop = asyncio.new_event_loop()
    bound = threading.Event()
    gate = threading.Event()

    async def bind() -> None:
        await s.put("bind", block("bind", 4 * KiB))
        bound.set()

    th = threading.Thread(target=loop.run_forever)
    th.start()
    asyncio.run_coroutine_threadsafe(bind(), loop).result(30)

    def hold() -> None:
        gate.clear()
        loop.call_soon_threadsafe(gate.wait, 30)  # the loop's thread waits here

    def stop() -> None:
        gate.set()
        asyncio.run_coroutine_threadsafe(s.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        th.join(30)
        loop.close()

    return s, loop, hold, gate.set, stop


def test_jobs_submitted_while_the_loop_is_busy_share_one_wakeup_and_complete_in_order(tmp_path):
    """40 gets submitted from 4 threads while the store's loop is busy wake it
    once (one callback starts them all, not one hop per call); host hits
    complete in the order they were submitted."""
    s, loop, hold, release, stop = _own_loop(tmp_path, host="1M")
    try:
        asyncio.run_coroutine_threadsafe(s.put_many({i: block(i, 4 * KiB) for i in range(40)}), loop).result(
            30
        )
        wakeups = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            wakeups.append(cb)
            return real(cb, *args, **kw)

        order: list[int] = []
        futs = []
        lock = threading.Lock()
        hold()
        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:

            def engine_thread(t: int) -> None:
                for i in range(t, 40, 4):
                    with lock:  # submission order is the order of this list
                        f = s.submit_get_many([i])
                        f.add_done_callback(lambda _f, i=i: order.append(i))
                        futs.append((i, f))

            threads = [threading.Thread(target=engine_thread, args=(t,)) for t in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            loop.call_soon_threadsafe = real  # type: ignore[method-assign]
            release()
        for i, f in futs:
            assert np.array_equal(f.result(30)[0], block(i, 4 * KiB))
        assert len(wakeups) == 1, wakeups
        assert order == [i for i, _ in futs]
    finally:
        stop()


def test_a_job_cancelled_before_it_starts_never_runs_and_still_counts(tmp_path):
    s, loop, hold, release, stop = _own_loop(tmp_path, host="1M")
    try:
        fd = s.completion_fd()
        hold()
        f = s.submit_put_many({"x": block("x")})
        g = s.submit_put_many({"y": block("y")})
        assert f.cancel()
        release()
        assert g.result(30) is None
        assert wait_count(fd, 2) == 2  # each job once, the cancelled one too
        assert "x" not in s and "y" in s
    finally:
        stop()


def test_a_host_hit_through_submit_checks_every_buffer_before_filling_any(tmp_path):
    """The host-hit path (copied in the callback that starts the job) keeps
    get_many's contract: a wrong out= buffer is an OutBufferError and no
    buffer is filled; a closed store refuses."""
    with SyncTieredStore(tmp_path, host="1M", nvme="4M", on_full="evict") as s:
        s.put_many({k: block(k, 4 * KiB) for k in "ab"})
        good, bad = np.zeros(4 * KiB, np.uint8), np.zeros(2 * KiB, np.uint8)
        f = s.submit_get_many(["a", "b"], out=[good, bad], missing="skip")
        assert isinstance(f.exception(30), OutBufferError)
        assert not good.any()
        with pytest.raises(StoreKeyError):
            s.submit_get_many(["a", "nope"]).result(30)
        assert s.submit_get_many(["a", "nope"], missing="skip").result(30)[1] is None
        with pytest.raises(TypeError, match="outs"):  # a typo is refused, hit or not
            s.submit_get_many(["a"], outs=[good])
    with pytest.raises(StoreClosedError):
        s.submit_get_many(["a"])


def test_a_job_raising_keyboardinterrupt_leaves_the_jobs_after_it_queued():
    """Ctrl-C inside one job's start reaches the loop, that job's future holds
    it, and the jobs submitted with it still run at the next drain (none is
    left pending, which would hang close())."""
    from aionvme.store._kv import Jobs

    def interrupted() -> None:
        raise KeyboardInterrupt

    loop = asyncio.new_event_loop()
    try:
        jobs = Jobs()
        f1 = jobs.submit(loop, interrupted)
        f2 = jobs.submit(loop, lambda: "second")
        with pytest.raises(KeyboardInterrupt):
            jobs._drain(loop)
        assert isinstance(f1.exception(0), KeyboardInterrupt) and not f2.done()
        loop.run_until_complete(asyncio.sleep(0))  # the drain it rescheduled
        assert f2.result(0) == "second"
        assert not jobs.futures
    finally:
        loop.close()


def test_cancelling_a_running_job_cancels_its_task_and_still_counts(tmp_path):
    """A put waiting for room in a host tier full of held values: cancelling
    its future cancels the put on the loop (the key stays absent), and the
    eventfd still counts the job once."""
    s, loop, hold, release, stop = _own_loop(tmp_path, host="256K")
    try:
        fd = s.completion_fd()
        call = functools.partial(asyncio.run_coroutine_threadsafe, loop=loop)
        call(s.put_many({i: block(i, 64 * KiB) for i in range(3)})).result(30)  # with "bind": full
        holds = [s.hold(i) for i in range(3)]
        for h in holds:
            call(h.__aenter__()).result(30)
        f = s.submit_put_many({"x": block("x", 64 * KiB)}, timeout=60)
        for _ in range(3):  # the drain, then the task's first steps: it waits for room
            call(asyncio.sleep(0)).result(30)
        assert not s._jobs.queue and not f.done()
        assert f.cancel()
        assert wait_count(fd, 1) == 1
        for h in holds:
            call(h.__aexit__(None, None, None)).result(30)
        assert "x" not in s
    finally:
        stop()
