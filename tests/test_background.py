"""One background event loop per process serves every blocking twin.

The formats' blocking calls, ``sync_save_in_background``, the DeepSpeed
handle, ``SyncTieredStore``, the DCP reader and writer, the data loader's
plain ``for`` and the offload optimizer all run their coroutines on the same
daemon thread (``aionvme._runtime.background``); a forked child gets a fresh
one on first use.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import aionvme as nvme
from aionvme._runtime import background as bgmod

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import aionvme.dcp  # noqa: E402
from aionvme.compat import deepspeed as ds  # noqa: E402
from aionvme.data import Loader, sync_write_dataset  # noqa: E402
from aionvme.offload import Optimizer  # noqa: E402


def loop_threads() -> list[str]:
    """Names of the threads that are running an event loop right now."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        f = frames.get(t.ident) if t.ident is not None else None
        while f is not None:
            if f.f_code.co_name == "run_forever":
                out.append(t.name)
                break
            f = f.f_back
    return sorted(out)


def use_every_blocking_twin(d: Path) -> None:
    """Each user of the background loop, once; raises if a result is wrong."""
    d.mkdir()
    w = torch.arange(4096, dtype=torch.float32)
    nvme.sync_save({"w": w, "step": 3}, d / "ck.safetensors")
    got = nvme.sync_load(d / "ck.safetensors")
    assert torch.equal(got["w"], w) and got["step"] == 3
    nvme.sync_save_in_background({"w": w + 1}, d / "bg.safetensors").result()
    assert torch.equal(nvme.sync_load(d / "bg.safetensors")["w"], w + 1)

    h = ds.aio_handle()
    try:
        assert h.sync_pwrite(w, str(d / "raw")) == 1
        back = torch.empty_like(w)
        assert h.async_pread(back, str(d / "raw")) == 0
        assert h.wait() == 1
        assert torch.equal(back, w)
    finally:
        h.handle.close()

    with nvme.SyncTieredStore(d / "store", host="64K") as s:
        s.put("a", w)
        assert torch.equal(s.get("a"), w)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns and runs single-rank
        dcp.save({"w": w}, storage_writer=aionvme.dcp.Writer(d / "dcp"))
        sd = {"w": torch.zeros_like(w)}
        dcp.load(sd, storage_reader=aionvme.dcp.Reader(d / "dcp"))
    assert torch.equal(sd["w"], w)

    sync_write_dataset(d / "ds", ({"x": np.full(64, i, np.int32)} for i in range(32)))
    with Loader(d / "ds", batch_size=8, shuffle=False) as loader:
        seen = [int(v) for b in loader for v in b["x"][:, 0]]
    assert seen == list(range(32))

    model = torch.nn.Linear(16, 16)
    with Optimizer(torch.optim.SGD, model.parameters(), d / "opt", lr=0.1, budget="64K") as opt:
        model(torch.ones(2, 16)).sum().backward()
        opt.step()


def test_one_background_loop_thread_serves_every_blocking_twin(tmp_path):
    use_every_blocking_twin(tmp_path / "a")
    assert loop_threads() == [bgmod.THREAD_NAME]
    assert [t.name for t in threading.enumerate()].count(bgmod.THREAD_NAME) == 1
    bg = bgmod.background()
    use_every_blocking_twin(tmp_path / "b")
    assert bgmod.background() is bg  # kept, not made again
    assert loop_threads() == [bgmod.THREAD_NAME]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_gets_its_own_background_loop(tmp_path):
    nvme.sync_save({"w": torch.ones(8)}, tmp_path / "parent.safetensors")  # the parent's loop runs
    parent_bg = bgmod.background()
    parent_store = nvme.SyncTieredStore(tmp_path / "store", host="64K")
    parent_store.put("a", torch.ones(4))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            signal.alarm(60)  # a hang ends the child, and the parent sees it
            assert loop_threads() == []  # fork copied no thread
            with pytest.raises(nvme.StoreClosedError, match="parent process"):
                parent_store.put("b", torch.ones(2))  # the parent's store stays the parent's
            use_every_blocking_twin(tmp_path / "child")
            bg = bgmod.background()
            assert bg is not parent_bg and bg.pid == os.getpid()
            assert loop_threads() == [bgmod.THREAD_NAME]
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 90
    status = None
    while time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(st)
            break
        time.sleep(0.05)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert status == 0, f"the child failed (exit status {status})"
    # the parent's loop and store are untouched
    assert bgmod.background() is parent_bg
    assert torch.equal(parent_store.get("a"), torch.ones(4))
    parent_store.close()
    assert torch.equal(nvme.sync_load(tmp_path / "parent.safetensors")["w"], torch.ones(8))
    assert torch.equal(nvme.sync_load(tmp_path / "child" / "ck.safetensors")["w"], torch.arange(4096.0))


def test_a_blocking_call_on_the_loop_thread_is_refused_not_a_deadlock():
    bg = bgmod.background()

    async def inner() -> int:
        return 1

    async def outer() -> str:
        try:
            bg.run(inner())
        except RuntimeError as e:
            return str(e)
        return "no error"

    assert "background loop thread" in bg.run(outer())


def test_ctrl_c_cancels_the_coroutine_and_waits_for_it():
    bg = bgmod.background()
    ended = threading.Event()
    started = threading.Event()

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            time.sleep(0.2)  # cleanup that takes a while: run() must wait for it
            ended.set()

    main = threading.get_ident()

    def interrupt() -> None:
        started.wait(10)
        signal.pthread_kill(main, signal.SIGINT)

    sender = threading.Thread(target=interrupt)
    sender.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        bg.run(slow())
    sender.join()
    assert ended.is_set()  # the coroutine had ended when the exception propagated
    assert time.monotonic() - t0 < 10


def test_a_slow_loader_step_does_not_hold_other_blocking_calls(tmp_path):
    # The loader's plain ``for`` shares the loop, but the step runs in the
    # consumer's thread: while it sits inside its loop body, others' calls go on.
    sync_write_dataset(tmp_path / "ds", ({"x": np.full(1024, i, np.int32)} for i in range(64)))
    inside, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def consume() -> None:
        with Loader(tmp_path / "ds", batch_size=4, shuffle=False, prefetch="64K") as loader:
            for i, b in enumerate(loader):
                seen.extend(int(v) for v in b["x"][:, 0])
                if i == 0:
                    inside.set()
                    release.wait(60)  # a slow training step

    t = threading.Thread(target=consume)
    t.start()
    try:
        assert inside.wait(60)
        t0 = time.monotonic()
        nvme.sync_save({"w": torch.arange(1 << 16)}, tmp_path / "x.safetensors")
        assert torch.equal(nvme.sync_load(tmp_path / "x.safetensors")["w"], torch.arange(1 << 16))
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        t.join(60)
    assert elapsed < 30  # not held until the step ends (60 s)
    assert seen == list(range(64))


def test_exit_finishes_background_saves_but_not_an_abandoned_loader(tmp_path):
    # A plain ``for`` left half-way (its generator still referenced at exit)
    # has read-ahead waiting for batch memory forever: exit must cancel that,
    # and still finish a background save, instead of hanging.
    import subprocess

    script = f"""
import numpy as np, aionvme as nvme
from aionvme.data import Loader, sync_write_dataset
sync_write_dataset({str(tmp_path / "ds")!r}, ({{"x": np.full(1024, i, np.int32)}} for i in range(64)))
loader = Loader({str(tmp_path / "ds")!r}, batch_size=4, shuffle=False, prefetch="64K")
it = iter(loader)
first = next(it)
nvme.sync_save_in_background({{"w": np.arange(1 << 20)}}, {str(tmp_path / "bg.safetensors")!r})
print("leaving", int(first["x"][0, 0]), flush=True)
"""
    src = str(Path(nvme.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "leaving 0" in r.stdout
    assert np.array_equal(nvme.sync_load(tmp_path / "bg.safetensors")["w"], np.arange(1 << 20))
