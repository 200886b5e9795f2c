"""aionvme's calls are first-class asyncio citizens (issue 12 section 1).

Every async entry point returns an object that ``await``, ``create_task``,
``ensure_future``, ``TaskGroup.create_task``, ``gather``, ``wait_for``,
``asyncio.timeout``, ``shield`` and anyio accept; every error arrives at the
await, never from the call; the buffer promise holds under structured
concurrency. Every test here runs on asyncio and uvloop (conftest).
"""

from __future__ import annotations

import asyncio
import collections.abc
import errno
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import aionvme as nvme
from aionvme import Handle

if sys.version_info < (3, 11):  # pragma: no cover - TaskGroup and asyncio.timeout are 3.11+
    pytest.skip("needs Python 3.11 (TaskGroup, asyncio.timeout)", allow_module_level=True)

MiB = 1 << 20
SENTINEL = 0xA5


def _entry_points(path: str, tmp: str) -> dict[str, Callable[[], Awaitable[Any]]]:
    """name -> a call starting one small transfer through that entry point."""
    out = np.zeros(4096, np.uint8)
    src = np.ones(4096, np.uint8)
    wpath = os.path.join(tmp, "w.bin")
    f = nvme.open(path, "r")
    fw = nvme.open(wpath, "w+")
    h = Handle(queue_depth=16)
    shared = Handle()
    _entry_points.keep = (f, fw, h, shared)  # type: ignore[attr-defined]
    return {
        "pread": lambda: nvme.pread(out, path),
        "pwrite": lambda: nvme.pwrite(src, wpath),
        "pread_many": lambda: nvme.pread_many([(out, 0)], path),
        "pwrite_many": lambda: nvme.pwrite_many([(src, 0)], wpath),
        "fsync": lambda: nvme.fsync(wpath),
        "File.pread": lambda: f.pread(out),
        "File.pread_many": lambda: f.pread_many([(out, 0)]),
        "File.pwrite": lambda: fw.pwrite(src),
        "File.pwrite_many": lambda: fw.pwrite_many([(src, 4096)]),
        "File.fsync": lambda: fw.fsync(),
        "File.fdatasync": lambda: fw.fdatasync(),
        "Handle.pread": lambda: h.pread(out, path),
        "Handle.pwrite": lambda: h.pwrite(src, wpath),
        "Handle.pread_many": lambda: h.pread_many([(out, 0)], path),
        "Handle.pwrite_many": lambda: h.pwrite_many([(src, 0)], wpath),
        "Handle.fsync": lambda: h.fsync(wpath),
        "shared Handle.pread": lambda: shared.pread(out, f),
        "load_safetensors": lambda: nvme.load_safetensors(os.path.join(tmp, "t.safetensors"), like="numpy"),
        "save_safetensors": lambda: nvme.save_safetensors(
            {"a": np.arange(10, dtype=np.float32)}, os.path.join(tmp, "t2.safetensors")
        ),
    }


def _close_entry_points() -> None:
    for obj in getattr(_entry_points, "keep", ()):
        obj.close()
    _entry_points.keep = ()  # type: ignore[attr-defined]


@pytest.fixture
async def entry_points(make_file, tmp_path):
    path, _ = make_file(64 * 1024)
    await nvme.save_safetensors({"x": np.arange(100, dtype=np.int64)}, str(tmp_path / "t.safetensors"))
    try:
        yield _entry_points(path, str(tmp_path))
    finally:
        _close_entry_points()


async def test_every_entry_point_is_coroutine_compatible(entry_points):
    for name, call in entry_points.items():
        aw = call()
        assert asyncio.iscoroutine(aw), name
        assert isinstance(aw, collections.abc.Coroutine), name
        await aw
        await asyncio.create_task(call())
        await asyncio.ensure_future(call())
        async with asyncio.TaskGroup() as tg:
            t = tg.create_task(call())
        t.result()
        await asyncio.gather(call(), call())
        await asyncio.wait_for(call(), timeout=30)
        async with asyncio.timeout(30):
            await call()
        await asyncio.shield(call())


async def test_anyio_task_groups_run_them(entry_points):
    anyio = pytest.importorskip("anyio")
    done = []

    async def run(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        await call()
        done.append(name)

    async with anyio.create_task_group() as tg:
        for name, call in entry_points.items():
            tg.start_soon(run, name, call)
    assert sorted(done) == sorted(entry_points)
    # anyio's start_soon also takes the call itself (it awaits what it returns)
    path = str(_entry_points.keep[0].path)  # type: ignore[attr-defined]
    out = np.zeros(4096, np.uint8)
    async with anyio.create_task_group() as tg:
        tg.start_soon(nvme.pread, out, path)
        tg.start_soon(nvme.pread_many, [(out, 0)], path)


async def test_gather_takes_the_futures_without_a_task_each(make_file):
    path, data = make_file(64 * 4096)
    bufs = [np.zeros(4096, np.uint8) for _ in range(64)]
    futs = [nvme.pread(b, path, i * 4096) for i, b in enumerate(bufs)]
    # future-like (asyncio.isfuture: gather's fast path, no Task per call)
    assert all(asyncio.isfuture(f) for f in futs)
    tasks_before = len(asyncio.all_tasks())
    gathered = asyncio.gather(*futs)
    assert len(asyncio.all_tasks()) == tasks_before
    assert await gathered == [4096] * 64
    assert all(np.array_equal(b, data[i * 4096 : (i + 1) * 4096]) for i, b in enumerate(bufs))


# -- errors arrive at the await ---------------------------------------------------------------


async def test_file_system_and_argument_errors_arrive_at_the_await(make_file, tmp_path):
    path, _ = make_file(1000)
    missing = str(tmp_path / "missing.bin")
    buf = np.zeros(4096, np.uint8)
    closed = nvme.open(path)
    closed.close()
    ro = nvme.open(path, "r")
    h = Handle()
    try:
        cases: list[tuple[Callable[[], Awaitable[Any]], type[BaseException]]] = [
            (lambda: nvme.pread(buf, missing), FileNotFoundError),
            (lambda: nvme.pread(buf, str(tmp_path)), IsADirectoryError),
            (lambda: nvme.pwrite(buf, str(tmp_path)), IsADirectoryError),
            (lambda: nvme.pread_many([(buf, 0)], missing), FileNotFoundError),
            (lambda: nvme.fsync(missing), FileNotFoundError),
            (lambda: nvme.pread(buf, path), nvme.ShortReadError),
            (lambda: closed.pread(buf), nvme.ClosedFileError),
            (lambda: closed.pwrite(buf), nvme.ClosedFileError),
            (lambda: closed.fsync(), nvme.ClosedFileError),
            (lambda: ro.pwrite(buf), nvme.UnsupportedOperation),
            (lambda: h.pread(buf, missing), FileNotFoundError),
            (lambda: h.pread(buf, closed), nvme.ClosedFileError),
            (lambda: nvme.pread(object(), path), nvme.BufferTypeError),
            (lambda: nvme.pread(b"read-only", path), nvme.ReadOnlyBufferError),
            (lambda: nvme.pread(buf, path, -1), ValueError),
            (lambda: nvme.pread(buf, object()), TypeError),
            (lambda: nvme.pread(buf, path, block_size=1000), nvme.InvalidSettingError),
            (lambda: nvme.pwrite_many([(buf, 0)], path, parallelism=-1), nvme.InvalidSettingError),
        ]
        for call, exc in cases:
            aw = call()  # never raises
            with pytest.raises(exc):
                await aw
            with pytest.raises(exc):
                await asyncio.create_task(call())
        h.close()
        with pytest.raises(nvme.EngineClosedError):
            await h.pread(buf, path)
    finally:
        ro.close()
        h.close()


async def test_unsupported_operation_names_the_file(make_file):
    path, _ = make_file(4096)
    with nvme.open(path, "r") as f:
        with pytest.raises(nvme.UnsupportedOperation) as ei:
            await f.pwrite(np.zeros(10, np.uint8))
        assert ei.value.filename == path and path in str(ei.value)
        with pytest.raises(nvme.UnsupportedOperation) as ei:
            f.sync_pwrite(np.zeros(10, np.uint8))
        assert ei.value.filename == path


# -- the buffer promise under structured concurrency ------------------------------------------


def _big_files(make_file, n: int, size: int) -> list[str]:
    return [make_file(size, seed=i)[0] for i in range(n)]


async def test_gather_with_a_missing_path_raises_at_the_await(make_file, tmp_path):
    # The reproducer: 64 reads, the last path missing. The generator
    # no longer raises while gather's arguments are built, so every transfer
    # is awaitable; the error comes from the await. Waiting for the others
    # (asyncio.gather does not cancel them) is then possible, and after that
    # no buffer is written any more.
    paths = [*_big_files(make_file, 63, MiB), str(tmp_path / "missing.bin")]
    bufs = [np.zeros(MiB, np.uint8) for _ in paths]
    futs = [nvme.pread(b, p, block_size="64K", parallelism=1) for b, p in zip(bufs, paths)]
    with pytest.raises(FileNotFoundError):
        await asyncio.gather(*futs)
    # asyncio.wait refuses coroutines (these are futures and coroutines): gather waits for all
    await asyncio.gather(*futs, return_exceptions=True)
    for b in bufs:
        b.fill(SENTINEL)
    await asyncio.sleep(0.5)
    assert all((b == SENTINEL).all() for b in bufs)

    # the generator form from the issue: nothing raised while building the arguments
    bufs2 = [np.zeros(4096, np.uint8) for _ in paths]
    gen = (nvme.pread(b, p) for b, p in zip(bufs2, paths))
    aws = list(gen)  # would raise FileNotFoundError at the 64th before
    with pytest.raises(FileNotFoundError):
        await asyncio.gather(*aws)
    await asyncio.gather(*aws, return_exceptions=True)


async def test_taskgroup_failure_leaves_no_sibling_writing(make_file, tmp_path):
    # Slow reads (64 KiB chunks, one in flight) in a TaskGroup whose other
    # child fails: when the `async with` ends, no sibling buffer is written
    # afterwards (sentinels filled after the exit survive 0.5 s).
    paths = _big_files(make_file, 8, 8 * MiB)
    bufs = [np.zeros(8 * MiB, np.uint8) for _ in paths]

    async def fail_soon() -> None:
        await asyncio.sleep(0.005)
        raise ValueError("boom")

    with pytest.raises(BaseException) as ei:  # an ExceptionGroup (Python 3.11+)
        async with asyncio.TaskGroup() as tg:
            for b, p in zip(bufs, paths):
                tg.create_task(nvme.pread(b, p, block_size="64K", parallelism=1))
            tg.create_task(nvme.pread(np.zeros(10, np.uint8), str(tmp_path / "missing.bin")))
            tg.create_task(fail_soon())
    assert any(isinstance(e, (FileNotFoundError, ValueError)) for e in ei.value.exceptions)  # type: ignore[attr-defined]
    for b in bufs:
        b.fill(SENTINEL)
    await asyncio.sleep(0.5)
    assert all((b == SENTINEL).all() for b in bufs)


async def test_wait_for_timeout_and_shield_keep_the_promise(make_file):
    path, data = make_file(32 * MiB)
    buf = np.zeros(32 * MiB, np.uint8)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(nvme.pread(buf, path, block_size="64K", parallelism=1), timeout=0.001)
    buf.fill(SENTINEL)
    await asyncio.sleep(0.3)
    assert (buf == SENTINEL).all()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.001):
            await nvme.pread(buf, path, block_size="64K", parallelism=1)
    buf.fill(SENTINEL)
    await asyncio.sleep(0.3)
    assert (buf == SENTINEL).all()
    # shield: the outer wait is cancelled, the transfer itself completes
    inner = nvme.pread(buf, path)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(inner), timeout=0.0001)
    assert await inner == 32 * MiB
    assert np.array_equal(buf, data)


async def test_cancelling_a_task_made_from_a_call_waits_for_the_kernel(make_file):
    path, _ = make_file(32 * MiB)
    buf = np.zeros(32 * MiB, np.uint8)
    task = asyncio.create_task(nvme.pread(buf, path, block_size="64K", parallelism=1))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    buf.fill(SENTINEL)
    await asyncio.sleep(0.3)
    assert (buf == SENTINEL).all()


# -- File.aclose ---------------------------------------------------------------------------------


async def test_file_aclose_waits_for_transfers_in_flight(make_file):
    path, data = make_file(16 * MiB)
    buf = np.zeros(16 * MiB, np.uint8)
    f = nvme.open(path, block_size="64K", parallelism=1)
    fd = f.fileno()
    fut = f.pread(buf)
    await asyncio.sleep(0)
    await f.aclose()
    assert fut.done() and f.closed
    assert await fut == 16 * MiB and np.array_equal(buf, data)
    with pytest.raises(OSError) as ei:
        os.fstat(fd)  # the fd is closed by now
    assert ei.value.errno == errno.EBADF


async def test_async_with_waits_for_transfers_in_flight(make_file):
    path, data = make_file(16 * MiB)
    buf = np.zeros(16 * MiB, np.uint8)
    async with nvme.open(path, block_size="64K", parallelism=1) as f:
        fut = f.pread(buf)
    assert fut.done()
    assert await fut == 16 * MiB


async def test_the_cuda_transfer_object_is_coroutine_compatible_too():
    # Transfers with CUDA tensors run as a Task subclass (no GPU needed to
    # check the object itself): create_task, TaskGroup, gather and
    # cancellation through the wrapping Task all work.
    from aionvme._runtime.transfer import _DeviceTransfer

    async def work() -> int:
        await asyncio.sleep(0.001)
        return 7

    loop = asyncio.get_running_loop()
    assert await asyncio.create_task(_DeviceTransfer(work(), loop=loop)) == 7
    async with asyncio.TaskGroup() as tg:
        t = tg.create_task(_DeviceTransfer(work(), loop=loop))
    assert t.result() == 7
    assert await asyncio.gather(_DeviceTransfer(work(), loop=loop)) == [7]
    inner = _DeviceTransfer(asyncio.sleep(10), loop=loop)
    outer = asyncio.create_task(inner)
    await asyncio.sleep(0.001)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert inner.cancelled()


def test_calls_made_outside_a_loop_start_when_a_loop_runs_them(tmp_path):
    # asyncio.run(nvme.pread(...)): no loop runs when the call is made, so it
    # returns a coroutine that submits once asyncio.run's loop runs it.
    path = str(tmp_path / "f.bin")
    data = np.arange(1 << 16, dtype=np.uint8)
    assert asyncio.run(nvme.pwrite(data, path)) == data.nbytes
    back = np.zeros_like(data)
    assert asyncio.run(nvme.pread(back, path)) == data.nbytes
    assert np.array_equal(back, data)
    with nvme.Handle() as h:
        assert asyncio.run(h.pread(back, path, 0)) == data.nbytes
    with nvme.open(path) as f:
        assert asyncio.run(f.pread(back, 0)) == data.nbytes
    # errors still arrive at the await, not at the call
    missing = nvme.pread(back, str(tmp_path / "missing.bin"))
    with pytest.raises(FileNotFoundError):
        asyncio.run(missing)
    bad = nvme.pread(back, path, block_size=1000)
    with pytest.raises(nvme.InvalidSettingError):
        asyncio.run(bad)
