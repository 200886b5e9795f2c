"""Checkpoints: nested state dicts round-trip through nvme.save/nvme.load,
stay readable by safetensors, keep ties, save atomically, and
save_in_background snapshots before its await returns, without stalling the
loop; the blocking twins work without a loop."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import aionvme as nvme
from aionvme.formats import _checkpoint

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
st_numpy = pytest.importorskip("safetensors.numpy")


def training_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50))
    model[2].weight = model[0].weight  # tied input/output embeddings
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randint(0, 50, (4, 7))).sum().backward()
        opt.step()
    return model, opt


async def writing_started(directory):
    while not any(p.name.endswith(".tmp") for p in directory.iterdir()):
        await asyncio.sleep(0)


def assert_same_tree(a, b, path="root"):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


async def test_model_and_optimizer_round_trip(tmp_dir):
    model, opt = training_state()
    ckpt = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 1234,
        "rng": torch.get_rng_state(),
        "config": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "run-7", "warmup": None, "loss": float("nan")},
        "history": [1.5, 1.25, {"eval": np.arange(4, dtype=np.float32)}],
        7: "int key",
        True: "bool key",
    }
    path = tmp_dir / "ckpt.safetensors"
    await nvme.save(ckpt, path)
    back = await nvme.load(path)
    assert_same_tree(ckpt, back)
    assert isinstance(back["optimizer"]["state"], dict) and 0 in back["optimizer"]["state"]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    # usable as it comes back
    model2, opt2 = training_state()
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optimizer"])


async def test_ties_are_stored_once_and_come_back_tied(tmp_dir):
    model, _ = training_state()
    sd = model.state_dict()
    path = tmp_dir / "tied.safetensors"
    await nvme.save({"model": sd}, path)
    flat = st.load_file(path)
    assert "model.0.weight" in flat and "model.2.weight" not in flat  # stored once
    back = await nvme.load(path)
    assert back["model"]["0.weight"] is back["model"]["2.weight"]
    # views that only overlap are separate tensors
    base = torch.arange(10.0)
    await nvme.save({"a": base[:6], "b": base[4:]}, path)
    got = await nvme.load(path)
    assert torch.equal(got["a"], base[:6]) and torch.equal(got["b"], base[4:])
    got["a"][5] = -1
    assert got["b"][1] == 5


async def test_conjugate_and_negative_views_are_not_ties(tmp_dir):
    # x.conj() and x.conj().imag share memory and layout with x and x.imag,
    # but not values: each must be stored as what it reads as
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    ckpt = {"z": z, "zc": z.conj(), "im": z.imag, "im_neg": z.conj().imag}
    path = tmp_dir / "conj.safetensors"
    await nvme.save(ckpt, path)
    back = await nvme.load(path)
    for k, v in ckpt.items():
        assert torch.equal(back[k], v.resolve_conj().resolve_neg()), k


async def test_readable_by_safetensors_with_dotted_names(tmp_dir):
    ckpt = {"model": {"layer.0.w": torch.ones(2)}, "a.b": torch.zeros(1), "a": {"b": torch.full((1,), 2.0)}}
    path = tmp_dir / "c.safetensors"
    await nvme.save(ckpt, path, metadata={"epoch": "3"})
    flat = st.load_file(path)
    assert set(flat) == {"model.layer.0.w", "a.b", "a.b~2"}
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert meta["epoch"] == "3"
    assert json.loads(meta[_checkpoint.STRUCTURE_KEY])["version"] == 1
    back = await nvme.load(path)
    assert_same_tree(ckpt, back)


async def test_plain_safetensors_files_load_as_flat_dicts(tmp_dir):
    path = tmp_dir / "plain.safetensors"
    st.save_file({"x": torch.ones(3), "y": torch.arange(2)}, path)
    back = await nvme.load(path)
    assert set(back) == {"x", "y"} and torch.equal(back["x"], torch.ones(3))


async def test_a_bare_tensor_and_empty_containers(tmp_dir):
    path = tmp_dir / "t.safetensors"
    await nvme.save(torch.arange(5), path)
    assert torch.equal(await nvme.load(path), torch.arange(5))
    await nvme.save({"a": {}, "b": [], "c": (), "e": torch.empty(0, 3)}, path)
    back = await nvme.load(path)
    assert back["a"] == {} and back["b"] == [] and back["c"] == () and back["e"].shape == (0, 3)


async def test_unsupported_values_fail_before_touching_the_file(tmp_dir):
    path = tmp_dir / "c.safetensors"
    path.write_bytes(b"previous")
    with pytest.raises(TypeError, match=r"'opt\.sched'"):
        await nvme.save({"opt": {"sched": object()}}, path)
    with pytest.raises(TypeError, match=r"numpy scalar: save x\.item\(\)"):
        await nvme.save({"best": np.int64(3)}, path)
    with pytest.raises(TypeError, match="keys must be"):
        await nvme.save({("a", 1): torch.ones(1)}, path)
    loop: dict = {"x": torch.ones(1)}
    loop["self"] = loop
    with pytest.raises(ValueError, match="circular"):
        await nvme.save(loop, path)
    with pytest.raises(ValueError, match="reserved"):
        await nvme.save({"x": torch.ones(1)}, path, metadata={_checkpoint.STRUCTURE_KEY: "x"})
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_dir.iterdir()] == ["c.safetensors"]


async def test_corrupt_structure_is_a_clear_error(tmp_dir):
    path = tmp_dir / "c.safetensors"
    for structure, message in [
        ("{not json", "not valid JSON"),
        ('{"version": 99, "root": 1}', "version 99"),
        ('{"version": 1, "root": {"t": "ghost"}}', "missing tensor 'ghost'"),
        ('{"version": 1, "root": {"zz": []}}', "unknown node"),
    ]:
        st.save_file({"x": torch.ones(1)}, path, metadata={_checkpoint.STRUCTURE_KEY: structure})
        with pytest.raises(nvme.SafetensorsError, match=message):
            await nvme.load(path)


async def test_load_device_checks(tmp_dir):
    path = tmp_dir / "c.safetensors"
    await nvme.save({"w": torch.ones(2)}, path)
    if not torch.cuda.is_available():
        with pytest.raises(nvme.DeviceError):
            await nvme.load(path, device="cuda")
    else:
        assert (await nvme.load(path, device="cuda"))["w"].is_cuda


# -- save_in_background ----------------------------------------------------------------


async def test_background_save_snapshots_before_returning(tmp_dir):
    path = tmp_dir / "bg.safetensors"
    w = torch.randn(8 << 20)  # 32 MiB: the write is still in flight when we mutate
    b = torch.arange(10)
    arr = np.arange(6, dtype=np.float64)
    expected = {"w": w.clone(), "b": b.clone(), "arr": arr.copy(), "step": 5}
    state = {"w": w, "b": b, "arr": arr, "step": 5}
    pending = await nvme.save_in_background(state, path)
    assert isinstance(pending, nvme.BackgroundSave) and pending.path == str(path)
    w.mul_(-1)  # training continues
    b.zero_()
    arr[:] = -1
    state["step"] = 6
    state["new"] = torch.ones(1)
    await pending
    assert pending.done() and pending.exception() is None
    back = await nvme.load(path)
    assert_same_tree(expected, back)
    assert st.load_file(path).keys() == {"w", "b", "arr"}


async def test_background_save_of_views_and_strided_tensors(tmp_dir):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "row": base[2], "base": base, "bf": base.to(torch.bfloat16)}
    expected = {k: v.clone() for k, v in state.items()}
    pending = await nvme.save_in_background(state, tmp_dir / "v.safetensors")
    base.fill_(0)
    await pending
    back = await nvme.load(tmp_dir / "v.safetensors")
    assert_same_tree(expected, back)
    # the same bytes save() writes
    await nvme.save(expected, tmp_dir / "same.safetensors")
    assert (tmp_dir / "v.safetensors").read_bytes() == (tmp_dir / "same.safetensors").read_bytes()


async def test_cancelled_background_save_keeps_the_old_checkpoint(tmp_dir):
    path = tmp_dir / "bg.safetensors"
    await nvme.save({"w": torch.zeros(3)}, path)
    old = path.read_bytes()
    pending = await nvme.save_in_background({"w": torch.randn(24 << 20)}, path)  # 96 MiB
    await writing_started(tmp_dir)  # the temporary file exists: the write is under way
    assert pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert pending.done() and not pending.cancel()
    assert path.read_bytes() == old
    assert [p.name for p in tmp_dir.iterdir()] == ["bg.safetensors"]


async def test_cancelling_the_snapshot_writes_nothing_and_keeps_the_buffer(tmp_dir, monkeypatch):
    import threading

    nvme.formats.release_snapshot_buffers()
    started, release = threading.Event(), threading.Event()
    real = _checkpoint.snapshot

    def held_snapshot(*args):
        started.set()
        release.wait()  # the copy is under way when the cancel comes
        return real(*args)

    monkeypatch.setattr(_checkpoint, "snapshot", held_snapshot)
    task = asyncio.ensure_future(nvme.save_in_background({"w": torch.randn(16 << 20)}, tmp_dir / "x.st"))
    while not started.is_set():
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # the copy reads the caller's tensors: it is seen to its end first
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert list(tmp_dir.iterdir()) == []
    assert _checkpoint._spare[False].nbytes >= 64 << 20  # its buffer is kept for the next save
    nvme.formats.release_snapshot_buffers()


async def test_background_save_errors_arrive_through_the_await(tmp_dir):
    pending = await nvme.save_in_background({"w": torch.ones(1)}, tmp_dir / "no-such-dir" / "x.safetensors")
    with pytest.raises(FileNotFoundError):
        await pending
    assert isinstance(pending.exception(), FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        pending.result()  # done: result() does not block the loop


async def _max_loop_lag(start):
    """(what awaiting start() gives, the longest the loop went without running a 1 ms timer, in s)."""
    lags = []
    running = True

    async def monitor():
        while running:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    m = asyncio.ensure_future(monitor())
    await asyncio.sleep(0.02)
    try:
        result = await start()
    finally:
        running = False
        await m
    return result, max(lags)


async def test_the_snapshot_does_not_stall_the_event_loop(tmp_dir):
    # 256 MiB into a fresh snapshot buffer: the old code blocked the loop for
    # the whole copy (1.2 s measured here; 0.24-2.1 s for 512 MiB in the
    # issue). Now the copy runs on a thread. The machine is shared: an idle
    # loop sees 10-15 ms lags here at times, so the best of 3 attempts counts.
    state = {f"layer{i}": torch.full((16 << 20,), float(i)) for i in range(4)}
    path = tmp_dir / "big.safetensors"
    lags = []
    for _ in range(3):
        nvme.formats.release_snapshot_buffers()
        pending, lag = await _max_loop_lag(lambda: nvme.save_in_background(state, path, durable=False))
        await pending
        lags.append(lag)
        if lag < 0.05:
            break
    assert min(lags) < 0.05, (
        f"the event loop stalled for {[round(x * 1e3) for x in lags]} ms in the snapshots"
    )
    pending = await nvme.save_in_background(state, path, durable=False)
    for t in state.values():
        t.zero_()  # the snapshot is complete: training may overwrite the tensors
    await pending
    with st.safe_open(path, "pt") as f:
        for i in range(4):
            assert torch.equal(f.get_slice(f"layer{i}")[-1000:], torch.full((1000,), float(i)))
    nvme.formats.release_snapshot_buffers()


def test_background_save_from_plain_code(tmp_dir):
    # no event loop anywhere: the snapshot blocks this thread, the write runs on aionvme's loop thread
    path = tmp_dir / "plain.safetensors"
    w = torch.randn(8 << 20)
    expected = {"w": w.clone(), "step": 7}
    pending = nvme.sync_save_in_background({"w": w, "step": 7}, path)
    w.mul_(-1)  # the snapshot is taken
    assert pending.result(timeout=120) is None
    assert pending.done() and pending.wait(0)
    assert_same_tree(expected, nvme.sync_load(path))
    failing = nvme.sync_save_in_background({"w": w}, tmp_dir / "missing" / "x.safetensors")
    assert failing.wait(120)
    assert isinstance(failing.exception(), FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        failing.result()


async def test_a_plain_code_background_save_can_be_awaited_from_a_loop(tmp_dir):
    state = {"w": torch.arange(100)}
    pending = await asyncio.to_thread(nvme.sync_save_in_background, state, tmp_dir / "x.safetensors")
    await pending  # written by the background loop, awaited on this one
    assert_same_tree(state, await nvme.load(tmp_dir / "x.safetensors"))


async def test_the_blocking_forms_refuse_a_running_loop(tmp_dir):
    with pytest.raises(RuntimeError, match="save_in_background"):
        nvme.sync_save_in_background({"w": torch.ones(1)}, tmp_dir / "x.safetensors")
    pending = await nvme.save_in_background({"w": torch.ones(1)}, tmp_dir / "y.safetensors")
    if not pending.done():
        with pytest.raises(RuntimeError, match="await it"):
            pending.result()  # would wait on the loop that has to do the write
    await pending
    assert sorted(p.name for p in tmp_dir.iterdir()) == ["y.safetensors"]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)
async def test_background_save_from_cuda(tmp_dir):
    w = torch.randn(1 << 20, device="cuda")
    expected = w.cpu()
    pending = await nvme.save_in_background({"w": w, "n": torch.arange(3)}, tmp_dir / "g.safetensors")
    w.zero_()
    await pending
    back = await nvme.load(tmp_dir / "g.safetensors", device="cuda")
    assert back["w"].is_cuda and torch.equal(back["w"].cpu(), expected)


async def test_background_saves_reuse_the_snapshot_buffer(tmp_dir):
    nvme.formats.release_snapshot_buffers()
    first = {"w": torch.randn(1 << 20), "n": 1}
    await (await nvme.save_in_background(first, tmp_dir / "a.safetensors"))
    spare = _checkpoint._spare[False]
    assert spare.nbytes >= 4 << 20
    # a smaller second checkpoint goes into the same memory: exact bytes, nothing stale
    second = {"w": torch.arange(1000, dtype=torch.int16), "n": 2}
    pending = await nvme.save_in_background(second, tmp_dir / "b.safetensors")
    assert pending.done() or _checkpoint._spare.get(False) is None  # in use by the write
    await pending
    assert _checkpoint._spare[False] is spare
    await nvme.save(second, tmp_dir / "same.safetensors")
    assert (tmp_dir / "b.safetensors").read_bytes() == (tmp_dir / "same.safetensors").read_bytes()
    assert_same_tree(first, await nvme.load(tmp_dir / "a.safetensors"))
    # a bigger one needs a new buffer, which is kept instead
    await (await nvme.save_in_background({"w": torch.randn(2 << 20)}, tmp_dir / "c.safetensors"))
    assert _checkpoint._spare[False] is not spare and _checkpoint._spare[False].nbytes >= 8 << 20
    nvme.formats.release_snapshot_buffers()
    assert _checkpoint._spare == {}


async def test_a_failed_snapshot_writes_nothing(tmp_dir):
    with pytest.raises(TypeError, match="'bad'"):
        await nvme.save_in_background({"w": torch.ones(3), "bad": {1, 2}}, tmp_dir / "x.safetensors")
    assert list(tmp_dir.iterdir()) == []


def _python(code: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_a_plain_code_background_save_finishes_at_interpreter_exit(tmp_dir):
    path = tmp_dir / "exit.safetensors"
    r = _python(
        f"""
import numpy as np, aionvme as nvme
pending = nvme.sync_save_in_background({{"w": np.arange(16 << 20, dtype=np.int32)}}, {str(path)!r})
print("done before exit:", pending.done())
"""
    )
    assert r.returncode == 0, r.stderr
    assert np.array_equal(st_numpy.load_file(path)["w"], np.arange(16 << 20, dtype=np.int32))
    assert [p.name for p in tmp_dir.iterdir()] == ["exit.safetensors"]


def test_ctrl_c_during_a_blocking_save_cancels_it_and_keeps_the_old_file(tmp_dir):
    path = tmp_dir / "c.safetensors"
    r = _python(
        f"""
import asyncio, os, signal, sys, threading, time
import numpy as np, aionvme as nvme
from aionvme._runtime import background as _background
path = {str(path)!r}
nvme.sync_save({{"w": np.zeros(4)}}, path)
old = open(path, "rb").read()
big = {{f"t{{i}}": np.full(8 << 20, i, dtype=np.float64) for i in range(8)}}  # 512 MiB
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
t0 = time.perf_counter()
try:
    nvme.sync_save(big, path)
except KeyboardInterrupt:
    print("interrupted after", round(time.perf_counter() - t0, 2))
else:
    print("finished first")
    sys.exit(0)
bg = _background.background()
running = bg.call(lambda: [t for t in asyncio.all_tasks(bg.loop) if not t.done()])
assert running == [], running  # the save was cancelled and has ended
assert open(path, "rb").read() == old
print(sorted(os.listdir(os.path.dirname(path))))
"""
    )
    assert r.returncode == 0, r.stderr
    if "finished first" in r.stdout:
        pytest.skip("the save finished before the signal (a fast disk): nothing to interrupt")
    assert "interrupted after" in r.stdout
    assert r.stdout.splitlines()[-1] == "['c.safetensors']"  # no temporary file left


def test_ctrl_c_landing_after_a_background_save_began_abandons_it_and_keeps_its_buffer(tmp_dir, monkeypatch):
    # sync_save_in_background hands the write to the background loop and waits
    # for the hand-off; an interrupt that lands once the write has begun must
    # not give the snapshot buffer back for reuse while the write reads it.
    from aionvme._runtime import background as bgmod
    from aionvme.formats import _checkpoint

    path = tmp_dir / "i.safetensors"
    nvme.sync_save({"w": np.zeros(4)}, path)
    old = path.read_bytes()
    _checkpoint.release_snapshot_buffers()
    real = bgmod.BackgroundLoop.call

    def call_then_interrupt(self, fn):
        real(self, fn)  # the write has begun
        raise KeyboardInterrupt

    monkeypatch.setattr(bgmod.BackgroundLoop, "call", call_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        nvme.sync_save_in_background({"w": np.arange(8 << 20, dtype=np.float64)}, path)  # 64 MiB
    monkeypatch.undo()
    bg = bgmod.background()

    def look() -> tuple[list[asyncio.Task], bool]:  # on the loop thread: tasks and buffers seen at once
        writes = [t for t in asyncio.all_tasks(bg.loop) if "sync_save_in_background" in t.get_name()]
        return writes, bool(_checkpoint._spare) and not all(t.done() for t in writes)

    writes, spare_while_writing = bg.call(look)
    for t in writes:
        bg.run(asyncio.wait([t]))
    assert not spare_while_writing  # the buffer came back only when the write had ended
    assert _checkpoint._spare  # and then it did
    # abandoned: the previous file stays (or, if the write won the race, the whole new one)
    got = path.read_bytes()
    assert got == old or np.array_equal(nvme.sync_load(path)["w"], np.arange(8 << 20, dtype=np.float64))
    assert sorted(p.name for p in tmp_dir.iterdir()) == ["i.safetensors"]
