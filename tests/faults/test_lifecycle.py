"""The runtime through its lifecycle with transfers in flight: a loop closed
under them, loops in many threads at once, fork() in the middle of transfers,
and processes that exit with transfers running."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest
import uvloop

import aionvme as nvme
from aionvme._engine import open_handles
from aionvme._runtime import reactor as _reactor

from .faultkit import run_python

MiB = 1 << 20


@pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_loop_closed_with_reads_writes_and_queued_requests(make_file, tmp_dir, new_loop):
    rpath, rdata = make_file(32 * MiB)
    wpath = str(tmp_dir / "w.bin")
    fds = open_handles()
    loop = new_loop()
    rbufs = [nvme.empty(4 * MiB) for _ in range(8)]
    for b in rbufs:
        b[:] = 0xEE
    wbufs = [np.full(MiB + 1, i + 1, np.uint8) for i in range(8)]

    async def start():
        reads = [nvme.pread(b, rpath, i * 4 * MiB, block_size="64K") for i, b in enumerate(rbufs)]
        writes = [nvme.pwrite(b, wpath, i * 2 * MiB + 1) for i, b in enumerate(wbufs)]
        f = nvme.open(rpath)
        more = [f.pread(np.zeros(1000, np.uint8), 10 * i) for i in range(200)]  # not yet submitted
        f.close()
        await asyncio.sleep(0.002)
        return reads + writes + more

    futs = loop.run_until_complete(start())
    eng = loop._aionvme_reactor.engine
    t0 = time.monotonic()
    loop.close()
    assert time.monotonic() - t0 < 30
    assert eng.is_closed and eng.stats()["inflight"] == 0
    snaps = [b.copy() for b in rbufs]
    # every future ended: done with a result, or with an error, or cancelled
    for fut in futs:
        assert fut.done()
        if not fut.cancelled() and fut.exception() is None:
            assert fut.result() > 0
    for i, b in enumerate(rbufs):
        landed = b == rdata[i * 4 * MiB : (i + 1) * 4 * MiB]
        assert (landed | (b == 0xEE)).all()
    time.sleep(0.3)
    assert all(np.array_equal(a, b) for a, b in zip(snaps, rbufs))
    assert open_handles() == fds
    # the thread can run a new loop at once
    out = nvme.empty(MiB)
    asyncio.run(_read(out, rpath, 3 * MiB))
    assert np.array_equal(out, rdata[3 * MiB : 4 * MiB])


async def _read(buf, path, off):
    return await nvme.pread(buf, path, off)


def test_many_loops_in_many_threads_reading_and_writing(tmp_dir, make_file):
    rpath, rdata = make_file(16 * MiB)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(k: int) -> None:
        wpath = str(tmp_dir / f"w{k}.bin")
        rng = np.random.default_rng(k)
        leftovers = []

        async def main():
            barrier.wait(30)
            src = rng.integers(0, 256, 3 * MiB + k, dtype=np.uint8)
            bufs = [np.zeros(100_000, np.uint8) for _ in range(40)]
            offs = rng.integers(0, 16 * MiB - 100_000, 40)
            await asyncio.gather(
                nvme.pwrite(src, wpath, k),
                *(nvme.pread(b, rpath, int(o)) for b, o in zip(bufs, offs)),
            )
            for b, o in zip(bufs, offs):
                assert np.array_equal(b, rdata[o : o + 100_000])
            back = np.zeros_like(src)
            await nvme.pread(back, wpath, k)
            assert np.array_equal(back, src)
            if k == 7:  # one thread closes its loop with a transfer still going
                leftovers.append(nvme.pread(nvme.empty(16 * MiB), rpath, block_size="64K"))
                await asyncio.sleep(0.001)
            return _reactor.get_reactor()

        try:
            if k % 3 == 2:  # and some use the blocking API from their thread
                barrier.wait(30)
                with nvme.open(wpath, "w+") as f:
                    src = rng.integers(0, 256, MiB + 3, dtype=np.uint8)
                    f.sync_pwrite(src, 5)
                    back = np.zeros_like(src)
                    f.sync_pread(back, 5)
                    assert np.array_equal(back, src)
                return
            r = uvloop.run(main()) if k % 2 else asyncio.run(main())
            assert r.closed
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


async def test_fork_with_transfers_in_flight(make_file, tmp_dir):
    path, data = make_file(64 * MiB)
    bufs = [nvme.empty(8 * MiB) for _ in range(8)]
    futs = [nvme.pread(b, path, i * 8 * MiB, block_size="64K", parallelism=4) for i, b in enumerate(bufs)]
    await asyncio.sleep(0.001)
    assert nvme.stats()["inflight"] > 0, "nothing in flight at fork time"
    out_path = str(tmp_dir / "child.bin")
    pid = os.fork()
    if pid == 0:  # child: the parent's context and workers are not ours
        code = 1
        try:
            child_ok: list[bool] = []

            def in_thread() -> None:
                async def main():
                    b = nvme.empty(4 * MiB)
                    await nvme.pread(b, path, 4 * MiB)
                    await nvme.pwrite(b, out_path)
                    return np.array_equal(b, data[4 * MiB : 8 * MiB])

                child_ok.append(asyncio.run(main()))
                with nvme.open(path) as f:  # and the blocking API
                    b = np.zeros(10_000, np.uint8)
                    f.sync_pread(b, 123)
                    child_ok.append(np.array_equal(b, data[123:10_123]))

            t = threading.Thread(target=in_thread)
            t.start()
            t.join(60)
            code = 0 if child_ok == [True, True] else 2
        finally:
            os._exit(code)
    # parent: its transfers finish, untouched by the child
    got = await asyncio.gather(*futs)
    assert got == [8 * MiB] * 8
    for i, b in enumerate(bufs):
        assert np.array_equal(b, data[i * 8 * MiB : (i + 1) * 8 * MiB])
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert np.array_equal(np.fromfile(out_path, np.uint8), data[4 * MiB : 8 * MiB])
    # the parent's runtime carries on
    more = nvme.empty(MiB)
    await nvme.pread(more, path, 9 * MiB)
    assert np.array_equal(more, data[9 * MiB : 10 * MiB])


EXIT_SCRIPTS = {
    # asyncio.run returns while transfers run: its tasks are cancelled, the
    # loop closes, the reactor drains
    "return-from-main": """
async def main():
    for b in bufs:
        asyncio.ensure_future(nvme.pread(b, path, block_size="64K"))
    asyncio.ensure_future(nvme.pwrite(bufs[0], path + ".w", block_size="64K"))
    await asyncio.sleep(0.002)
run(main())
""",
    # sys.exit from inside a coroutine while transfers run
    "sys-exit": """
async def main():
    futs = [nvme.pread(b, path, block_size="64K") for b in bufs]
    await asyncio.sleep(0.002)
    sys.exit(3)
run(main())
""",
    # a loop that is never closed: the interpreter exits, atexit drains
    "loop-never-closed": """
loop = new_loop()
async def start():
    return [nvme.pread(b, path, block_size="64K") for b in bufs]
futs = loop.run_until_complete(start())
loop.run_until_complete(asyncio.sleep(0.002))
""",
    # an exception escapes with transfers running
    "uncaught-exception": """
async def main():
    futs = [nvme.pread(b, path, block_size="64K") for b in bufs]
    await asyncio.sleep(0.002)
    raise RuntimeError("boom")
run(main())
""",
    # the blocking API in a daemon thread, still reading when the process exits
    "daemon-thread-blocking": """
import threading
def blocking():
    with nvme.open(path) as f:
        while True:
            f.sync_pread(bufs[0], 0)
threading.Thread(target=blocking, daemon=True).start()
time.sleep(0.05)
""",
    # an event loop in a daemon thread, with transfers running at exit
    "daemon-thread-loop": """
import threading
async def forever():
    while True:
        await asyncio.gather(*(nvme.pread(b, path, block_size="64K") for b in bufs))
threading.Thread(target=lambda: run(forever()), daemon=True).start()
time.sleep(0.05)
""",
}
EXPECTED_RC = {"sys-exit": 3, "uncaught-exception": 1}


EXIT_CASES = [
    (case, kind)
    for case in sorted(EXIT_SCRIPTS)
    for kind in ("asyncio", "uvloop")
    if not (case == "daemon-thread-blocking" and kind == "uvloop")  # no event loop there
]


@pytest.mark.parametrize(("case", "loop_kind"), EXIT_CASES)
def test_process_exit_with_transfers_in_flight(make_file, case, loop_kind):
    path, _ = make_file(32 * MiB)
    prelude = f"""
import asyncio, sys, time, uvloop
import aionvme as nvme
path = {path!r}
bufs = [nvme.empty(32 << 20) for _ in range(4)]
run = {"uvloop.run" if loop_kind == "uvloop" else "asyncio.run"}
new_loop = {"uvloop.new_event_loop" if loop_kind == "uvloop" else "asyncio.new_event_loop"}
"""
    t0 = time.monotonic()
    r = run_python(prelude + EXIT_SCRIPTS[case], timeout=60)
    assert time.monotonic() - t0 < 60
    assert r.returncode == EXPECTED_RC.get(case, 0), r.stderr
    assert "Fatal Python error" not in r.stderr and "Segmentation" not in r.stderr, r.stderr
    if case != "uncaught-exception":
        assert "Traceback" not in r.stderr, r.stderr
