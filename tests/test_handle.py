"""nvme.Handle: every knob changes what the engine does, observably; the
sync API works without a loop and beside a running one; configs (aionvme's
own, DeepSpeed's "aio" section) make handles and defaults."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import aionvme as nvme
from aionvme import Handle, defaults
from aionvme._engine import MODE_NO_OVERLAP, MODE_SINGLE_SUBMIT
from conftest import IS_ROOT

MiB = 1 << 20


def delta(h: Handle, fn, *args):
    """Run fn(*args) and return the change of h's engine counters."""
    before = h.stats()
    result = fn(*args)
    after = h.stats()
    return result, {k: after[k] - before[k] for k in ("submit_calls", "submitted", "thread_jobs", "requests")}


# -- knobs -------------------------------------------------------------------------------


@pytest.mark.parametrize("block, chunks", [("256K", 16), ("1M", 4), (4 * MiB, 1)])
def test_block_size_sets_the_chunk_count(make_file, block, chunks):
    path, data = make_file(4 * MiB)
    buf = nvme.empty(4 * MiB)
    with Handle(block_size=block, queue_depth=32) as h:
        n, d = delta(h, h.sync_pread, buf, path)
    assert n == 4 * MiB and np.array_equal(buf, data)
    assert d["submitted"] == chunks


async def test_block_size_applies_to_async_calls_too(make_file):
    path, data = make_file(4 * MiB)
    buf = nvme.empty(4 * MiB)
    async with Handle(block_size="512K", queue_depth=32) as h:
        before = h.stats()["submitted"]
        assert await h.pread(buf, path) == 4 * MiB
        assert h.stats()["submitted"] - before == 8
    assert np.array_equal(buf, data)


def test_single_submit_issues_one_io_submit_per_chunk(make_file):
    path, data = make_file(8 * MiB)
    buf = nvme.empty(8 * MiB)
    with Handle(queue_depth=32, single_submit=True) as h:
        assert h.mode & MODE_SINGLE_SUBMIT
        _, d = delta(h, h.sync_pread, buf, path)
        assert (d["submit_calls"], d["submitted"]) == (8, 8)
    assert np.array_equal(buf, data)
    with nvme.defaults.set(submit_ramp=0), Handle(queue_depth=32, single_submit=False) as h:
        _, d = delta(h, h.sync_pread, buf, path)
        assert (d["submit_calls"], d["submitted"]) == (1, 8)
    with nvme.defaults.set(submit_ramp=2), Handle(queue_depth=32, single_submit=False) as h:  # 2, 4, 2
        _, d = delta(h, h.sync_pread, buf, path)
        assert (d["submit_calls"], d["submitted"]) == (3, 8)
    with Handle(queue_depth=32, single_submit=False) as h:  # the default ramp starts at 4: 4, 4
        _, d = delta(h, h.sync_pread, buf, path)
        assert (d["submit_calls"], d["submitted"]) == (2, 8)


@pytest.mark.parametrize("ipp, windows", [(1, 8), (2, 4), (4, 2), (0, 1)])
def test_intra_op_parallelism_is_the_window_of_one_request(make_file, ipp, windows):
    # With batch-and-wait and no submit ramp each io_submit carries one whole
    # window, so the call count shows how many chunks were in flight together.
    path, data = make_file(8 * MiB)
    buf = nvme.empty(8 * MiB)
    with (
        nvme.defaults.set(submit_ramp=0),
        Handle(queue_depth=32, intra_op_parallelism=ipp, overlap_events=False) as h,
    ):
        assert h.mode & MODE_NO_OVERLAP
        _, d = delta(h, h.sync_pread, buf, path)
    assert (d["submit_calls"], d["submitted"]) == (windows, 8)
    assert np.array_equal(buf, data)


def test_queue_depth_caps_the_chunks_in_flight(make_file):
    path, data = make_file(8 * MiB)
    buf = nvme.empty(8 * MiB)
    with nvme.defaults.set(submit_ramp=0), Handle(queue_depth=2, overlap_events=False) as h:  # window = 2
        assert h.stats()["queue_depth"] == 2
        _, d = delta(h, h.sync_pread, buf, path)
    assert (d["submit_calls"], d["submitted"]) == (4, 8)
    assert np.array_equal(buf, data)


def test_blocking_calls_on_the_shared_engine_adapt_their_window(make_file):
    # The thread's engine keeps in flight only what the device completes in
    # ~0.25 s (Ctrl-C waits for it: tests/faults/test_ctrl_c.py). A busy period
    # starts with 2 MiB and the window doubles as fast completions come in: on
    # the page cache it reaches the defaults' 64 MiB cap within a 64 MiB read.
    # A Handle with its own engine shape keeps DeepNVMe's knobs exact: no
    # adaptive window on its engines (the counts above rely on that).
    path, data = make_file(64 * MiB)
    buf = nvme.empty(64 * MiB)
    with Handle(direct=False) as h:
        assert h.sync_pread(buf, path) == 64 * MiB
        s = h.stats()
    assert np.array_equal(buf, data)
    assert s["adaptive"] is True and s["engines"] == 1
    assert 16 * MiB <= s["window_bytes"] <= s["max_inflight_bytes"], s
    with Handle(queue_depth=32, direct=False) as h:
        buf[:] = 0
        assert h.sync_pread(buf, path) == 64 * MiB
        assert h.stats()["adaptive"] is False
    assert np.array_equal(buf, data)


@contextlib.contextmanager
def _slow_file(tmp_path: Path, data: np.ndarray, read_iops: int) -> Iterator[str]:
    """A file holding data on ext4 on a loop device whose reads this process may
    issue at read_iops (cgroup v1 blkio): chunks complete one by one, far apart."""
    if not IS_ROOT or not all(shutil.which(t) for t in ("losetup", "mkfs.ext4", "mount")):
        pytest.skip("needs root, losetup, mkfs.ext4 and mount")
    blkio = Path("/sys/fs/cgroup/blkio")
    if not (blkio / "blkio.throttle.read_iops_device").exists():
        pytest.skip("no cgroup v1 blkio throttling here")
    img, mnt = tmp_path / "slow.img", tmp_path / "slow"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(32 * MiB)
    r = subprocess.run(["losetup", "--find", "--show", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"losetup failed: {r.stderr.strip()}")
    dev = r.stdout.strip()
    cg = blkio / f"aionvme-handle-test-{os.getpid()}"
    try:
        subprocess.run(["mkfs.ext4", "-q", dev], check=True, capture_output=True)
        subprocess.run(["mount", dev, str(mnt)], check=True, capture_output=True)
        path = str(mnt / "data.bin")
        data.tofile(path)
        os.sync()
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mine = next(w for _, c, w in (x.split(":", 2) for x in lines) if "blkio" in c.split(","))
        home = blkio / mine.lstrip("/")
        cg.mkdir(exist_ok=True)
        st = os.stat(dev)
        majmin = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        (cg / "blkio.throttle.read_iops_device").write_text(f"{majmin} {read_iops}\n")
        (cg / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield path
        finally:
            (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
    finally:
        for _ in range(50):
            try:
                if cg.exists():
                    cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
        subprocess.run(["losetup", "-d", dev], check=False)


def test_overlap_events_slides_the_window_on_a_slow_device(tmp_path):
    # On a device that completes chunks one at a time, the sliding window
    # submits a replacement after each completion; batch-and-wait submits
    # whole windows only. (On a fast virtio disk a whole window completes
    # inside io_submit, so the two cannot be told apart there.)
    # The throttle lets one or two chunks through per 100 ms slice.
    data = np.random.default_rng(5).integers(0, 256, 8 * 64 * 1024, dtype=np.uint8)
    buf = nvme.empty(data.nbytes)
    calls = {}
    with _slow_file(tmp_path, data, read_iops=10) as path:
        for overlap in (False, True):
            knobs = {"block_size": "64K", "queue_depth": 32, "intra_op_parallelism": 4}
            with nvme.defaults.set(submit_ramp=0), Handle(**knobs, overlap_events=overlap) as h:
                buf[:] = 0
                _, d = delta(h, h.sync_pread, buf, path)
                assert np.array_equal(buf, data)
                calls[overlap] = d["submit_calls"]
    assert calls[False] == 2, calls  # 8 chunks: two windows of 4
    assert calls[True] >= 3, calls  # refills before the first window has drained


def test_backend_thread_serves_everything_from_workers(make_file):
    path, data = make_file(2 * MiB + 5)
    buf = np.zeros(2 * MiB + 5, np.uint8)
    with Handle(backend="thread") as h:
        assert h.stats()["use_aio"] is False
        _, d = delta(h, h.sync_pread, buf, path)
    assert d["submitted"] == 0 and d["thread_jobs"] >= 2
    assert np.array_equal(buf, data)
    with Handle(backend="aio", queue_depth=16) as h:
        assert h.stats()["use_aio"] is True
        _, d = delta(h, h.sync_pread, buf, path)
        assert d["submitted"] >= 2


def test_backend_is_validated():
    with pytest.raises(ValueError, match="engine must be one of"):
        Handle(backend="io_uring")


def test_direct_knob_opens_paths_with_or_without_o_direct(make_file):
    path, data = make_file(1 * MiB)
    buf = nvme.empty(1 * MiB)
    with Handle(direct=False, queue_depth=16) as h:
        with h.open(path) as f:
            assert f.info.direct is False and "buffered" in f.info.reason
        _, d = delta(h, h.sync_pread, buf, path)
        if h.stats().get("use_uring"):
            assert d["submitted"] >= 1 and d["thread_jobs"] == 0  # buffered: through the ring
        else:
            assert d["submitted"] == 0 and d["thread_jobs"] >= 1  # buffered: worker threads
    assert np.array_equal(buf, data)
    with Handle(direct=True, queue_depth=16) as h:
        with h.open(path) as f:
            assert f.info.direct is True
        _, d = delta(h, h.sync_pread, buf, path)
        assert d["submitted"] == 1 and d["thread_jobs"] == 0


def test_knobs_come_from_defaults_when_not_given():
    with defaults.set(
        block_size="2M", queue_depth=64, max_inflight=8, single_submit=True, overlap_events=False
    ):
        h = Handle()
    assert (h.block_size, h.queue_depth, h.intra_op_parallelism, h.single_submit, h.overlap_events) == (
        2 * MiB,
        64,
        8,
        True,
        False,
    )
    assert h.mode == MODE_SINGLE_SUBMIT | MODE_NO_OVERLAP
    assert Handle().block_size == defaults.get("block_size")  # restored after the block


def test_environment_variables_shape_handles(tmp_path):
    code = "import aionvme as n; h = n.Handle(); print(h.single_submit, h.overlap_events, h.block_size)"
    env = dict(os.environ, AIONVME_SINGLE_SUBMIT="1", AIONVME_OVERLAP_EVENTS="0", AIONVME_BLOCK_SIZE="4M")
    env["PYTHONPATH"] = str(Path(nvme.__file__).parent.parent)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False", str(4 * MiB)], out.stderr


# -- engines: shared or owned ------------------------------------------------------------


async def test_a_default_handle_shares_the_loops_engine(make_file):
    path, _ = make_file(MiB)
    h = Handle()
    before = nvme.stats()["requests"]
    await h.pread(nvme.empty(MiB), path)
    assert nvme.stats()["requests"] == before + 1
    h.close()  # nothing of its own to close: the loop's engine stays
    await nvme.pread(nvme.empty(MiB), path)


async def test_a_handle_with_its_own_queue_depth_owns_engines(make_file):
    path, _ = make_file(MiB)
    before = nvme.stats()["requests"]
    h = Handle(queue_depth=7)
    await h.pread(nvme.empty(MiB), path)
    assert nvme.stats()["requests"] == before  # the loop's engine did nothing
    assert h.stats()["queue_depth"] == 7 and h.stats()["requests"] == 1
    h.close()
    with pytest.raises(nvme.EngineClosedError):
        await h.pread(nvme.empty(MiB), path)


def test_sync_calls_from_many_threads_get_engines_from_a_pool(make_file):
    path, data = make_file(8 * MiB)
    bufs = [nvme.empty(MiB) for _ in range(8)]
    with Handle(queue_depth=8) as h:
        errors = []

        def work(i: int) -> None:
            try:
                for _ in range(5):
                    h.sync_pread(bufs[i], path, i * MiB)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert 1 <= h.stats()["engines"] <= 8
    for i, b in enumerate(bufs):
        assert np.array_equal(b, data[i * MiB : (i + 1) * MiB])


def test_closing_closes_the_owned_engines(make_file):
    path, _ = make_file(MiB)
    h = Handle(queue_depth=5)
    h.sync_pread(nvme.empty(MiB), path)
    engines = list(h._engines._engines)  # the blocking engines it owns
    h.close()
    assert engines and all(e.is_closed for e in engines)
    with pytest.raises(nvme.EngineClosedError):
        h.sync_pread(nvme.empty(MiB), path)


def test_unclosed_handle_with_engines_warns(make_file):
    path, _ = make_file(MiB)
    h = Handle(queue_depth=6)
    h.sync_pread(nvme.empty(MiB), path)
    with pytest.warns(ResourceWarning, match="unclosed"):
        del h
        gc.collect()


# -- the API ---------------------------------------------------------------------------------


def test_sync_api_needs_no_loop_and_takes_paths_files_and_fds(make_file, tmp_path):
    path, data = make_file(3 * MiB + 17)
    h = Handle()
    out = np.zeros(3 * MiB + 17, np.uint8)
    assert h.sync_pread(out, path) == out.nbytes
    assert np.array_equal(out, data)
    with nvme.open(path) as f:
        out[:] = 0
        assert h.sync_pread(out[:MiB], f, 5) == MiB
        assert np.array_equal(out[:MiB], data[5 : MiB + 5])
    fd = os.open(path, os.O_RDONLY)
    try:
        assert h.sync_pread(out[:4096], fd, 4096) == 4096
        assert np.array_equal(out[:4096], data[4096:8192])
    finally:
        os.close(fd)
    target = str(tmp_path / "w.bin")
    assert h.sync_pwrite(data, target, 4097) == data.nbytes
    assert os.path.getsize(target) == data.nbytes + 4097
    back = np.fromfile(target, np.uint8)
    assert np.array_equal(back[4097:], data) and not back[:4097].any()
    h.sync_fsync(target)


def test_sync_many_variants(make_file, tmp_path):
    path, data = make_file(MiB)
    h = Handle()
    parts = [np.zeros(1000, np.uint8), np.zeros(70000, np.uint8)]
    assert h.sync_pread_many([(parts[0], 3), (parts[1], 9000)], path) == 71000
    assert np.array_equal(parts[0], data[3:1003]) and np.array_equal(parts[1], data[9000:79000])
    target = str(tmp_path / "many.bin")
    assert h.sync_pwrite_many([(parts[1], 0), (parts[0], 70000)], target) == 71000
    assert np.array_equal(np.fromfile(target, np.uint8), np.concatenate([parts[1], parts[0]]))


async def test_async_api_and_many_variants(make_file, tmp_path):
    path, data = make_file(2 * MiB)
    async with Handle(block_size="256K", queue_depth=16, intra_op_parallelism=4) as h:
        a, b = nvme.empty(MiB), np.zeros(12345, np.uint8)
        assert await asyncio.gather(h.pread(a, path, MiB), h.pread(b, path, 7)) == [MiB, 12345]
        assert np.array_equal(a, data[MiB:]) and np.array_equal(b, data[7:12352])
        target = str(tmp_path / "a.bin")
        assert await h.pwrite_many([(a, 0), (b, MiB)], target) == MiB + 12345
        await h.fsync(target, datasync=True)
        c = np.zeros(MiB + 12345, np.uint8)
        assert await h.pread_many([(c, 0)], target) == c.nbytes
        assert np.array_equal(c, np.concatenate([a, b]))


async def test_sync_call_from_a_thread_while_the_loop_runs(make_file):
    path, data = make_file(16 * MiB)
    async with Handle(queue_depth=16) as h:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.0005)

        t = asyncio.ensure_future(ticker())
        a, b = nvme.empty(16 * MiB), nvme.empty(8 * MiB)
        # the same handle: a blocking call on a thread and async calls on the loop at once
        n1, n2 = await asyncio.gather(asyncio.to_thread(h.sync_pread, a, path), h.pread(b, path, 8 * MiB))
        t.cancel()
        assert (n1, n2) == (16 * MiB, 8 * MiB)
        assert ticks > 0
    assert np.array_equal(a, data) and np.array_equal(b, data[8 * MiB :])


def test_sync_wait_releases_the_gil(make_file):
    path, _ = make_file(32 * MiB)
    buf = nvme.empty(32 * MiB)
    buf[::4096] = 1  # fault the pages in first
    count = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=spin)
    with Handle(block_size="64K", queue_depth=4, single_submit=True) as h:
        t.start()
        time.sleep(0.01)
        before = count
        h.sync_pread(buf, path)
        during = count - before
        stop.set()
    t.join()
    assert during > 0


def test_errors_are_typed(make_file, tmp_path):
    path, _ = make_file(1000)
    h = Handle()
    with pytest.raises(nvme.ShortReadError) as e:
        h.sync_pread(np.zeros(2000, np.uint8), path)
    assert e.value.received == 1000
    with pytest.raises(FileNotFoundError):
        h.sync_pread(np.zeros(10, np.uint8), str(tmp_path / "missing"))
    with pytest.raises(nvme.ReadOnlyBufferError):
        h.sync_pread(b"immutable", path)


# -- configs -----------------------------------------------------------------------------------

DS_AIO = {
    "block_size": 262144,
    "queue_depth": 8,
    "intra_op_parallelism": 4,
    "single_submit": True,
    "overlap_events": False,
    "use_gds": False,
}


def test_a_deepspeed_aio_section_makes_a_handle_as_is(tmp_path):
    # DeepNVMe runs intra_op_parallelism parts of queue_depth chunks each
    h = Handle.from_config(DS_AIO)
    assert (h.block_size, h.queue_depth, h.intra_op_parallelism) == (262144, 32, 32)
    assert (h.single_submit, h.overlap_events) == (True, False)
    # a whole DeepSpeed config, from a file
    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3}, "aio": DS_AIO}))
    h2 = Handle.from_config(p)
    assert h2.config() == h.config()
    # absent keys take DeepSpeed's defaults (queue_depth 8, one part, overlap on)
    h3 = Handle.from_config({"aio": {"block_size": 1048576}})
    assert (h3.queue_depth, h3.intra_op_parallelism, h3.overlap_events, h3.single_submit) == (
        8,
        8,
        True,
        False,
    )


def test_deepspeed_aliases_and_mistakes():
    assert Handle.from_config({"thread_count": 2, "queue_depth": 4}).queue_depth == 8  # DeepSpeed < 0.15
    with pytest.warns(UserWarning, match="ignored by DeepSpeed"):
        h = Handle.from_config({"aio": {"num_threads": 8, "queue_depth": 32, "single_submit": "false"}})
    assert h.queue_depth == 256 and h.single_submit is False  # ds_nvme_tune's string booleans, parsed
    with pytest.raises(ValueError, match="unknown keys"):
        Handle.from_config({"aio": {"queue_dept": 8}})
    with pytest.warns(UserWarning, match="GPUDirect"):
        Handle.from_config({"use_gds": True})


def test_aionvme_config_round_trip_and_overrides():
    h = Handle(block_size="512K", queue_depth=48, intra_op_parallelism=6, single_submit=True, direct=False)
    again = Handle.from_config({"aionvme": h.config()})
    assert again.config() == h.config()
    assert Handle.from_config({"aionvme": h.config()}, queue_depth=12).queue_depth == 12
    with pytest.raises(ValueError, match="unknown aionvme settings"):
        Handle.from_config({"aionvme": {"blocksize": 4096}})


def test_deepspeed_section_of_a_handle_has_exactly_deepspeeds_keys():
    h = Handle(block_size="4M", queue_depth=128, intra_op_parallelism=16, overlap_events=False)
    ds = h.deepspeed_config()
    assert set(ds) == set(defaults.DEEPSPEED_AIO_DEFAULTS)
    assert ds == {
        "block_size": 4 * MiB,
        "queue_depth": 16,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": False,
        "use_gds": False,
    }
    # DeepSpeed's reading of it gives the same chunks in flight per request
    back = Handle.from_config(ds)
    assert (back.block_size, back.intra_op_parallelism, back.overlap_events) == (4 * MiB, 16, False)


def test_defaults_load_config_applies_and_restores(tmp_path):
    p = tmp_path / "tuned.json"
    p.write_text(json.dumps({"aionvme": {"block_size": "2M", "queue_depth": 32, "intra_op_parallelism": 4}}))
    old = defaults.get()
    with defaults.load_config(p):
        assert (defaults.get("block_size"), defaults.get("queue_depth"), defaults.get("max_inflight")) == (
            2 * MiB,
            32,
            4,
        )
        assert Handle().block_size == 2 * MiB
    assert defaults.get() == old
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON config"):
        defaults.read_config(bad)
