"""aionvme.compat.deepspeed.aio_handle behaves as DeepNVMe's documented handle
(return values, wait counts, offsets, locked tensors), minus its silent
failures; install() makes DeepSpeed's own code use it (tested with the real
deepspeed package when it is installed)."""

from __future__ import annotations

import filecmp
import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import aionvme as nvme
from aionvme.compat import deepspeed as ds

torch = pytest.importorskip("torch")

MiB = 1 << 20
SRC = str(Path(nvme.__file__).parent.parent)


@pytest.fixture
def h():
    handle = ds.aio_handle(
        block_size=256 * 1024, queue_depth=4, single_submit=False, overlap_events=True, intra_op_parallelism=2
    )
    yield handle
    assert handle.wait() == 0  # nothing left outstanding by the test
    handle.handle.close()


def _file(path: Path, data: torch.Tensor) -> str:
    data.numpy().tofile(path)
    return str(path)


# -- the handle's knobs --------------------------------------------------------------------------


def test_getters_and_defaults_are_deepnvmes():
    x = ds.aio_handle()  # DeepNVMe's defaults: 1 MiB, 128, batch submit, no overlap, 1 part
    assert (x.get_block_size(), x.get_queue_depth(), x.get_single_submit(), x.get_overlap_events()) == (
        1 << 20,
        128,
        False,
        False,
    )
    assert (x.get_intra_op_parallelism(), x.get_thread_count(), x.get_alignment()) == (1, 1, 512)
    y = ds.aio_handle(65536, 16, True, True, 8)
    assert (y.get_block_size(), y.get_queue_depth(), y.get_single_submit(), y.get_overlap_events()) == (
        65536,
        16,
        True,
        True,
    )
    assert (y.get_intra_op_parallelism(), y.get_alignment()) == (8, 4096)
    # the work is done by a Handle with intra_op_parallelism parts of queue_depth chunks in flight
    assert (y.handle.queue_depth, y.handle.intra_op_parallelism, y.handle.single_submit) == (128, 128, True)
    with pytest.raises(ValueError):
        ds.aio_handle(intra_op_parallelism=0)


# -- return values and wait counts ----------------------------------------------------------------


def test_sync_calls_return_one(h, tmp_path):
    t = torch.arange(300_000, dtype=torch.float32)
    path = str(tmp_path / "t.pt")
    assert h.sync_pwrite(t, path) == 1
    assert os.path.getsize(path) == t.nbytes
    u = torch.zeros_like(t)
    assert h.sync_pread(u, path) == 1
    assert torch.equal(u, t)


def test_async_calls_return_zero_and_wait_counts_them(h, tmp_path):
    ts = [torch.randn(n) for n in (1, 1000, 250_001)]
    paths = [str(tmp_path / f"{i}.swp") for i in range(3)]
    assert [h.async_pwrite(t, p) for t, p in zip(ts, paths)] == [0, 0, 0]
    assert h.wait() == 3
    assert h.wait() == 0
    outs = [torch.empty_like(t) for t in ts]
    assert [h.async_pread(o, p) for o, p in zip(outs, paths)] == [0, 0, 0]
    assert h.wait() == 3
    assert all(torch.equal(o, t) for o, t in zip(outs, ts))


def test_a_sync_call_waits_for_the_outstanding_ones_too(h, tmp_path):
    # DeepNVMe: the synchronous call is pread(async=False), which wait()s for
    # every outstanding operation and returns their count.
    a, b = torch.ones(5000), torch.full((7000,), 2.0)
    h.async_pwrite(a, str(tmp_path / "a"))
    assert h.sync_pwrite(b, str(tmp_path / "b")) == 2
    assert h.wait() == 0


def test_pread_pwrite_take_validate_and_async(h, tmp_path):
    t = torch.randint(0, 100, (123_457,), dtype=torch.int32)
    path = str(tmp_path / "v.pt")
    assert h.pwrite(t, path, True, False) == 1  # validate, synchronous
    assert h.pwrite(t, path, False, True) == 0  # asynchronous
    assert h.wait() == 1
    u = torch.zeros_like(t)
    assert h.pread(u, path, True, **{"async": True}) == 0  # DeepSpeed's keyword
    assert h.wait() == 1 and torch.equal(u, t)
    with pytest.raises(TypeError):
        h.pread(u, path, False, asynch=True)


def test_read_and_write_leave_outstanding_operations_alone(h, tmp_path):
    t = torch.randn(70_000)
    path = str(tmp_path / "rw.pt")
    h.async_pwrite(torch.ones(10), str(tmp_path / "other"))
    assert h.write(t, path, True) == 0  # DeepNVMe's read/write return 0
    u = torch.zeros_like(t)
    assert h.read(u, path, True) == 0
    assert torch.equal(u, t)
    assert h.wait() == 1  # the async write is still counted by wait()


def test_async_calls_do_not_block(h, tmp_path):
    t = torch.ones(64 * MiB // 4)
    path = str(tmp_path / "big.pt")
    t0 = time.perf_counter()
    assert h.async_pwrite(t, path) == 0
    t_call = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert h.wait() == 1
    t_wait = time.perf_counter() - t0
    assert t_call < t_wait, (t_call, t_wait)
    assert os.path.getsize(path) == t.nbytes


# -- offsets, unaligned sizes, tails ------------------------------------------------------------------


def test_file_offsets_and_unaligned_sizes_are_exact(h, tmp_path):
    path = str(tmp_path / "off.bin")
    pieces = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (1, 511, 4097, 1_000_003)]
    offsets = [0, 1, 4096 + 3, 2 * MiB + 1]
    for p, off in zip(pieces, offsets):
        assert h.async_pwrite(p, path, off) == 0
    assert h.wait() == 4
    raw = np.fromfile(path, np.uint8)
    assert raw.size == offsets[-1] + pieces[-1].numel()  # nothing padded, nothing truncated
    for p, off in zip(pieces, offsets):
        assert np.array_equal(raw[off : off + p.numel()], p.numpy())
        back = torch.zeros_like(p)
        assert h.sync_pread(back, path, off) == 1
        assert torch.equal(back, p)


def test_sizes_need_not_divide_by_the_parallelism(tmp_path):
    # DeepNVMe refuses (prints, returns -1) when nbytes % intra_op_parallelism != 0
    x = ds.aio_handle(intra_op_parallelism=3, overlap_events=True)
    t = torch.randint(0, 255, (1_000_001,), dtype=torch.uint8)
    path = str(tmp_path / "odd.bin")
    assert x.sync_pwrite(t, path) == 1
    u = torch.zeros_like(t)
    assert x.sync_pread(u, path) == 1 and torch.equal(u, t)


def test_non_contiguous_tensors_are_staged(h, tmp_path):
    base = torch.arange(2000, dtype=torch.float64).reshape(40, 50)
    view = base.t()  # not contiguous
    path = str(tmp_path / "nc.bin")
    assert h.sync_pwrite(view, path) == 1
    assert np.array_equal(np.fromfile(path, np.float64), view.contiguous().numpy().ravel())
    dest = torch.zeros(50, 40, dtype=torch.float64).t()
    assert not dest.is_contiguous()
    assert h.async_pread(dest, path) == 0
    assert h.wait() == 1
    assert torch.equal(dest, torch.from_numpy(np.fromfile(path, np.float64)).reshape(40, 50))


# -- errors raise, after everything finished ------------------------------------------------------------


def test_wait_raises_a_short_read_after_all_operations_finished(h, tmp_path, capsys):
    data = torch.randint(0, 255, (10_000,), dtype=torch.uint8)
    path = _file(tmp_path / "short.bin", data)
    good, bad = torch.zeros(5000, dtype=torch.uint8), torch.zeros(20_000, dtype=torch.uint8)
    assert h.async_pread(bad, path) == 0
    assert h.async_pread(good, path, 5000) == 0
    with pytest.raises(nvme.ShortReadError) as e:
        h.wait()
    assert (e.value.expected, e.value.received) == (20_000, 10_000)
    assert torch.equal(good, data[5000:])  # the other operation completed
    assert h.wait() == 0
    assert capsys.readouterr() == ("", "")  # nothing printed


def test_wait_reports_every_failure(h, tmp_path):
    path = _file(tmp_path / "tiny.bin", torch.zeros(10, dtype=torch.uint8))
    for _ in range(3):
        h.async_pread(torch.zeros(100, dtype=torch.uint8), path)
    with pytest.raises(nvme.ShortReadError) as e:
        h.wait()
    if hasattr(e.value, "__notes__"):
        assert "2 more of the 3 operations failed" in e.value.__notes__[0]


def test_missing_file_raises_at_the_call(h, tmp_path):
    with pytest.raises(FileNotFoundError):
        h.async_pread(torch.zeros(10), str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        h.sync_pread(torch.zeros(10), str(tmp_path / "nope"))


def test_validate_compares_with_the_file(tmp_path):
    data = torch.randint(0, 255, (9000,), dtype=torch.uint8)
    path = _file(tmp_path / "val.bin", data)
    ds._validate(data, path, 0)  # equal: fine
    changed = data.clone()
    changed[4321] += 1
    with pytest.raises(ds.ValidationError, match="first difference at byte 4321"):
        ds._validate(changed, path, 0)


def test_validate_through_an_fd(h, tmp_path):
    # DeepNVMe's validate compares with the file; with an fd (O_DIRECT,
    # write-only) the file is reopened through /proc, after the transfer
    path = str(tmp_path / "v.bin")
    t = torch.randint(0, 255, (3 * 4096 + 5,), dtype=torch.uint8)
    fd = os.open(path, os.O_DIRECT | os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert h.write(t, fd, True) == 0
        assert h.pwrite(t, fd, True, True, 4096) == 0
        assert h.wait() == 1
    finally:
        os.close(fd)
    raw = np.fromfile(path, np.uint8)
    assert np.array_equal(raw[4096:], t.numpy()) and np.array_equal(raw[:4096], t.numpy()[:4096])


def test_async_pwrite_to_an_open_fd(h, tmp_path):
    # DeepSpeed's FastFileWriter opens the file itself (O_DIRECT | O_WRONLY) and
    # passes the fd with aligned buffers and offsets
    path = str(tmp_path / "fd.bin")
    fd = os.open(path, os.O_DIRECT | os.O_CREAT | os.O_WRONLY, 0o644)
    t = torch.randint(0, 255, (3 * 4096,), dtype=torch.uint8)
    try:
        assert h.async_pwrite(t, fd, 4096) == 0
        assert h.wait() == 1
        # an unaligned tail under O_DIRECT needs a read-modify-write, which a
        # write-only fd cannot do: aionvme writes through a read-write twin
        assert h.async_pwrite(t[:100], fd, 4 * 4096 + 1) == 0
        assert h.wait() == 1
    finally:
        os.close(fd)
    raw = np.fromfile(path, np.uint8)
    assert np.array_equal(raw[4096 : 4 * 4096], t.numpy())
    assert raw.size == 4 * 4096 + 101 and np.array_equal(raw[4 * 4096 + 1 :], t[:100].numpy())
    fd = os.open(path, os.O_DIRECT | os.O_RDWR)  # readable too: any size and offset
    try:
        assert h.async_pwrite(t[:100], fd, 4 * 4096 + 1) == 0
        assert h.wait() == 1
    finally:
        os.close(fd)
    raw = np.fromfile(path, np.uint8)
    assert raw.size == 4 * 4096 + 101 and np.array_equal(raw[4 * 4096 + 1 :], t[:100].numpy())


# -- locked tensors ---------------------------------------------------------------------------------


def test_new_cpu_locked_tensor(h):
    t = h.new_cpu_locked_tensor(100_000, torch.empty(0, dtype=torch.bfloat16))
    assert (t.shape, t.dtype, t.device.type) == ((100_000,), torch.bfloat16, "cpu")
    assert t.data_ptr() % 4096 == 0
    assert h.is_pinned(t) and h.is_pinned(t[500:])  # slices too, as DeepSpeed's swapper expects
    assert not h.is_pinned(torch.zeros(10))
    assert h.free_cpu_locked_tensor(t) is True
    assert h.free_cpu_locked_tensor(t) is False
    assert not h.is_pinned(t)
    t.fill_(1.5)  # still valid memory after free: no dangling tensor
    assert float(t[-1]) == 1.5


def test_locked_tensor_round_trip(h, tmp_path):
    src = h.new_cpu_locked_tensor(3 * MiB // 2 + 1, torch.empty(0, dtype=torch.float16))
    src.copy_(torch.randn(src.numel()).half())
    path = str(tmp_path / "locked.bin")
    assert h.sync_pwrite(src, path) == 1
    dst = h.new_cpu_locked_tensor(src.numel(), src).zero_()
    assert h.sync_pread(dst, path) == 1
    assert torch.equal(src, dst)


def test_locked_tensor_falls_back_when_memlock_is_too_small(h):
    code = textwrap.dedent(
        """
        import resource, warnings, torch
        from aionvme.compat.deepspeed import aio_handle
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))
        # the limit binds only without CAP_IPC_LOCK (dropped by setpriv for root)
        h = aio_handle()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            t = h.new_cpu_locked_tensor(1 << 20, torch.empty(0))
        t.fill_(3)
        print(len(w), bool(h.is_pinned(t)), float(t.sum()))
        """
    )
    setpriv = "/usr/bin/setpriv"
    if os.geteuid() == 0 and os.path.exists(setpriv):  # drop CAP_IPC_LOCK so the limit applies
        cmd = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=120)
    assert r.returncode == 0, r.stderr
    warned, pinned, total = r.stdout.split()
    assert pinned == "True" and float(total) == 3 * (1 << 20)
    if os.geteuid() == 0 and os.path.exists(setpriv):
        assert warned == "1"  # mlock was refused and said so


# -- DeepSpeed's own unit tests, reproduced (its sdist ships no tests) ----------------------------------
#
# tests/unit/v1/nvme/test_aio.py::TestAsyncFileOffset::test_offset_write and
# tests/unit/v1/nvme/test_pinned_manager.py of DeepSpeed 0.19.8, with the handle
# AsyncIOBuilder().load() returns once install() is in effect.

DS_BLOCK_SIZE, DS_QUEUE_DEPTH, DS_IO_PARALLEL = 1024, 2, 2


@pytest.mark.parametrize("file_partitions", [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]])
@pytest.mark.parametrize("use_fd", [False, True])
def test_deepspeed_offset_write(tmp_path, file_partitions, use_fd):
    ref_file = str(tmp_path / "_py_random.pt")
    aio_file = str(tmp_path / "_aio_random.pt")
    unit = DS_BLOCK_SIZE
    file_size = sum(file_partitions) * unit
    h = ds.aio_handle(DS_BLOCK_SIZE, DS_QUEUE_DEPTH, True, True, DS_IO_PARALLEL)
    data_buffer = h.new_cpu_locked_tensor(file_size, torch.empty(0, dtype=torch.uint8))
    data_buffer.copy_(torch.randint(0, 256, (file_size,), dtype=torch.uint8))
    file_offsets = list(itertools.accumulate([0] + [p * unit for p in file_partitions[:-1]]))
    with open(ref_file, "wb") as ref_fd:
        for i, p in enumerate(file_partitions):
            src_buffer = torch.narrow(data_buffer, 0, file_offsets[i], p * unit)
            ref_fd.write(src_buffer.numpy().tobytes())
            ref_fd.flush()
            if use_fd:
                aio_fd = os.open(aio_file, flags=os.O_DIRECT | os.O_CREAT | os.O_WRONLY)
                write_status = h.async_pwrite(buffer=src_buffer, fd=aio_fd, file_offset=file_offsets[i])
            else:
                write_status = h.async_pwrite(
                    buffer=src_buffer, filename=aio_file, file_offset=file_offsets[i]
                )
            assert write_status == 0
            assert h.wait() == 1
            if use_fd:
                assert os.path.isfile(aio_fd)
                os.close(aio_fd)
            filecmp.clear_cache()
            assert filecmp.cmp(ref_file, aio_file, shallow=False)
    h.free_cpu_locked_tensor(data_buffer)
    h.handle.close()


def test_async_pwrite_fd_by_position_and_its_argument_errors(h, tmp_path):
    path = str(tmp_path / "p.bin")
    t = torch.arange(4096, dtype=torch.uint8)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert h.async_pwrite(t, fd, 0) == 0  # the fd overload, positionally
        assert h.wait() == 1
        with pytest.raises(TypeError, match="not both"):
            h.async_pwrite(t, path, fd=fd)
        with pytest.raises(TypeError, match="filename or fd"):
            h.async_pwrite(t)
        with pytest.raises(TypeError, match="int file descriptor"):
            h.async_pwrite(t, fd=path)
    finally:
        os.close(fd)
    assert np.array_equal(np.fromfile(path, np.uint8), t.numpy())


def _ds_handle():
    return ds.aio_handle(DS_BLOCK_SIZE, DS_QUEUE_DEPTH, False, False, 1)


def test_deepspeed_narrow_of_locked_buffer_is_pinned():
    handle = _ds_handle()
    buffer = handle.new_cpu_locked_tensor(4 * DS_BLOCK_SIZE, torch.empty(0, dtype=torch.float))
    try:
        assert handle.is_pinned(buffer)
        assert handle.is_pinned(buffer.narrow(0, DS_BLOCK_SIZE, DS_BLOCK_SIZE))
    finally:
        handle.free_cpu_locked_tensor(buffer)


def test_deepspeed_buffer_is_shared_across_handles():
    # ZeRO-3 hands the parameter swapper's buffers to the optimizer swapper,
    # which asserts all(aio_handle.is_pinned(...)) with its own handle
    handle_a, handle_b = _ds_handle(), _ds_handle()
    buffer = handle_a.new_cpu_locked_tensor(4 * DS_BLOCK_SIZE, torch.empty(0, dtype=torch.float))
    try:
        assert handle_b.is_pinned(buffer) and handle_b.is_pinned(buffer[5:9])
    finally:
        assert handle_b.free_cpu_locked_tensor(buffer)  # any handle may free it
    assert not handle_a.is_pinned(buffer)


def test_deepspeed_unmanaged_buffer_is_not_pinned():
    assert not _ds_handle().is_pinned(torch.empty(4 * DS_BLOCK_SIZE, dtype=torch.float))


def test_deepnvme_keyword_names_of_new_cpu_locked_tensor():
    t = _ds_handle().new_cpu_locked_tensor(num_elem=8, example_tenosr=torch.empty(0, dtype=torch.int16))
    assert (t.shape, t.dtype) == ((8,), torch.int16)


def _deepspeed_pin_memory_buildable() -> str | None:
    """Why DeepSpeed's pin_memory op cannot be loaded here, or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    import shutil

    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        return "DeepSpeed's pin_memory op is not built and there is no ninja/C++ compiler to JIT-build it"
    return None


@pytest.mark.slow  # the first run JIT-builds DeepSpeed's pin_memory op: ~3 minutes on 2 cores
@pytest.mark.skipif(
    _deepspeed_pin_memory_buildable() is not None, reason=str(_deepspeed_pin_memory_buildable())
)
def test_deepspeed_pin_manager_and_ours_recognise_each_other(tmp_path):
    # test_pin_handle_buffer_recognized_by_aio_handle and
    # test_aio_handle_buffer_recognized_by_pin_handle, plus the lifetime of
    # memory borrowed from DeepSpeed's manager. TORCH_EXTENSIONS_DIR (if set)
    # says where the JIT build is cached.
    out = _run(
        """
        import gc, torch
        import aionvme.compat.deepspeed as compat
        compat.install()
        from deepspeed.ops.op_builder import AsyncIOBuilder, PinMemoryBuilder
        pin_handle = PinMemoryBuilder().load().pin_handle()
        def new():
            return AsyncIOBuilder().load().aio_handle(1024, 2, False, False, 1)
        aio_handle = new()
        buffer = pin_handle.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.float))
        assert pin_handle.is_pinned(buffer)
        assert aio_handle.is_pinned(buffer)
        assert aio_handle.is_pinned(buffer.narrow(0, 1024, 1024))
        pin_handle.free_cpu_locked_tensor(buffer)
        ours = aio_handle.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.float))
        assert aio_handle.is_pinned(ours) and new().is_pinned(ours)
        assert pin_handle.is_pinned(ours), "a locked tensor of ours is not pinned for DeepSpeed"
        ours.fill_(2.0)
        base = ours.data_ptr()
        assert aio_handle.free_cpu_locked_tensor(ours)
        view = ours[10:20]
        del ours
        gc.collect()
        assert pin_handle.is_pinned(view) and float(view.sum()) == 20.0  # no dangling view
        del view
        gc.collect()
        # the last reference gone: the memory went back to DeepSpeed's manager
        assert not pin_handle.free_cpu_locked_tensor_by_ptr(base)
        print("ok")
        """,
        tmp_path,
        timeout=900,
    )
    assert out.split()[-1] == "ok"


# -- DeepNVMe's module functions ------------------------------------------------------------------------


def test_module_functions(tmp_path):
    t = torch.randn(4099)
    path = str(tmp_path / "m.bin")
    assert ds.aio_write(t, path, 1 << 20, 8, False, True, True) == 0
    u = torch.zeros_like(t)
    assert ds.aio_read(u, path, 1 << 20, 8, False, True, True) == 0
    assert torch.equal(u, t)
    v = torch.zeros_like(t)
    assert ds.deepspeed_memcpy(v, t) == 0 and torch.equal(v, t)


# -- the real DeepSpeed ---------------------------------------------------------------------------------

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (.ci/run installs it with --no-deps)",
)


def _run(code: str, tmp_path: Path, timeout: int = 240) -> str:
    """Run code in a fresh interpreter (DeepSpeed and torch.distributed keep global state)."""
    env = dict(os.environ, PYTHONPATH=SRC, TMP=str(tmp_path))
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@needs_deepspeed
def test_install_makes_asynciobuilder_load_return_aionvme(tmp_path):
    out = _run(
        """
        import aionvme.compat.deepspeed as compat
        from deepspeed.ops.op_builder import AsyncIOBuilder
        original = AsyncIOBuilder.load
        compat.install()
        assert compat.installed()
        assert AsyncIOBuilder().is_compatible()
        op = AsyncIOBuilder().load()
        assert op is compat, op
        h = op.aio_handle(block_size=1 << 20, queue_depth=8, single_submit=False, overlap_events=True,
                          intra_op_parallelism=2)
        import deepspeed.nvme.validate_async_io  # DeepSpeed's own check: asserts compatible and loadable
        compat.uninstall()
        assert AsyncIOBuilder.load is original and not compat.installed()
        print("ok", type(h).__module__)
        """,
        tmp_path,
    )
    assert out.split()[-2:] == ["ok", "aionvme.compat.deepspeed"]


@needs_deepspeed
def test_deepspeed_swap_buffer_pool_and_ds_io_engine_on_aionvme(tmp_path):
    # DeepSpeed's SwapBufferPool (optimizer swapping) and its ds_io benchmark engine,
    # unmodified, doing their I/O through aionvme
    out = _run(
        """
        import os, argparse, torch
        import aionvme.compat.deepspeed as compat
        compat.install()
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.runtime.swap_tensor.utils import SwapBufferPool
        tmp = os.environ["TMP"]
        h = AsyncIOBuilder().load().aio_handle(262144, 8, False, True, 2)
        bufs = [h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.float16)) for _ in range(2)]
        pool = SwapBufferPool(bufs, h)  # asserts the buffers are pinned
        srcs = [torch.randn(n).half() for n in (1000, 300000, 5, 700001)]
        for i, t in enumerate(srcs):
            swap, compute = pool.insert_tensor(t, f"{tmp}/p{i}.swp", (t.numel() + 1023) // 1024 * 1024)
            assert swap is not None
        pool.swap_out(h)  # async_pwrite x4, asserts wait() == 4
        for b in bufs:
            b.zero_()
        pool.swap_in(h)  # async_pread x4, asserts wait() == 4
        assert all(torch.equal(c, s) for c, s in zip(pool.get_compute_tensors(), srcs))

        import numpy as np
        from deepspeed.nvme.ds_aio_handle import AIOHandle_Engine
        from deepspeed.nvme.ds_aio_constants import BUFFER, FILE
        args = argparse.Namespace(
            mapping_list=[(0, tmp)], different_file_each_iteration=False, read=False,
            io_size=3 * 1024 * 1024 + 1024, total_loops=1, use_gds=False, io_parallel=2, block_size=1 << 20,
            queue_depth=8, single_submit=False, sequential_requests=False, gpu=False,
            use_accelerator_pin_memory=False, validate=True, slow_bounce_buffer=False,
        )
        w = AIOHandle_Engine(args, 0, False)  # buffer from new_cpu_locked_tensor
        w.write(args, 0, 0)  # pwrite(validate=True, async=True) + wait()
        written = np.fromfile(w.ctxt[FILE][0], np.uint8)
        assert np.array_equal(written, w.ctxt[BUFFER].numpy())
        args.read = True
        r = AIOHandle_Engine(args, 0, True)  # creates its file with dd
        r.read(args, 0, 0)
        assert np.array_equal(r.ctxt[BUFFER].numpy(), np.fromfile(r.ctxt[FILE][0], np.uint8))
        w.fini()
        r.fini()
        print("ok")
        """,
        tmp_path,
    )
    assert out.split()[-1] == "ok"


@needs_deepspeed
def test_zero3_parameter_swapper_on_aionvme(tmp_path):
    # ZeRO-Infinity/ZeRO-Inference's parameter swapper, configured by a DeepSpeed
    # config with an "aio" section, swapping fp16 partitions out to NVMe and back.
    out = _run(
        """
        import os, socket, types, torch
        import aionvme.compat.deepspeed as compat
        compat.install()
        import deepspeed, deepspeed.ops
        # one process: keep DeepSpeed from JIT-building its shared-memory allreduce op
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (
            AsyncPartitionedParameterSwapper, PartitionedParamStatus)
        tmp = os.environ["TMP"]
        cfg = {"train_batch_size": 1,
               "zero_optimization": {"stage": 3, "offload_param": {
                   "device": "nvme", "nvme_path": tmp, "buffer_count": 4, "buffer_size": 1 << 20}},
               "aio": {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 2,
                       "single_submit": False, "overlap_events": True}}
        sw = AsyncPartitionedParameterSwapper(DeepSpeedConfig(cfg), torch.float16)
        assert isinstance(sw.aio_read_handle, compat.aio_handle)
        assert sw.aio_read_handle.handle.queue_depth == 8  # 2 parts x 4 chunks
        params = []
        for i, n in enumerate((1 << 20, 700001, 3)):
            p = types.SimpleNamespace(ds_id=i, ds_tensor=torch.empty(0, dtype=torch.float16))
            p.ds_tensor.ds_numel = n
            buf = sw.get_buffer(p, n)
            buf.copy_(torch.randn(n).half())
            p.ds_tensor.data = buf.data
            p.ds_tensor.status = PartitionedParamStatus.AVAILABLE
            p.ref = buf.clone()
            params.append(p)
        sw.swap_out_and_release(params)  # async writes; asserts wait() == 3
        sizes = [os.path.getsize(sw.get_path(p)) for p in params]
        sw.swap_in(params, async_op=False)  # async reads; asserts wait() == 3
        assert all(torch.equal(p.ds_tensor.data, p.ref) for p in params)
        print("ok", *sizes)
        """,
        tmp_path,
    )
    words = out.split()
    i = words.index("ok")
    # fp16 partitions padded by DeepSpeed to its alignment (1024 * parallelism bytes)
    assert [int(x) for x in words[i + 1 : i + 4]] == [2 * (1 << 20), 1400832, 2048]


def test_install_without_deepspeed_says_so(tmp_path):
    out = _run(
        """
        import sys
        sys.modules["deepspeed"] = None  # as if not installed
        import aionvme.compat.deepspeed as compat
        try:
            compat.install()
        except ImportError as e:
            print("ImportError:", e)
        """,
        tmp_path,
    )
    assert "deepspeed is not importable" in out


def _reports_cuda(t: torch.Tensor) -> torch.Tensor:
    """t (host memory) as a tensor that says it lives on a CUDA device: what
    DeepSpeed hands the handle for GPU memory, as far as a machine without a
    GPU can show it."""

    class _Cuda(torch.Tensor):
        @property
        def is_cuda(self) -> bool:
            return True

        @property
        def device(self) -> torch.device:
            return torch.device("cuda", 0)

    return t.as_subclass(_Cuda)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CUDA is available: test_gpu.py moves real CUDA tensors"
)
def test_cuda_tensors_take_aionvmes_gpu_path(h, tmp_path):
    # Not a host staging copy of the handle's own: the tensor reaches aionvme's
    # GPU path, which here (no CUDA) says so, for async, blocking and the
    # non-contiguous (staged on its own device) alike.
    path = _file(tmp_path / "g.bin", torch.arange(4096, dtype=torch.uint8))
    gpu_tensor = _reports_cuda(torch.zeros(4096, dtype=torch.uint8))
    assert h.async_pread(gpu_tensor, path) == 0
    with pytest.raises(nvme.DeviceError, match="CUDA tensor transfer"):
        h.wait()
    with pytest.raises(nvme.DeviceError, match="CUDA tensor transfer"):
        h.read(gpu_tensor, path, False)
    with pytest.raises(nvme.DeviceError, match="CUDA tensor transfer"):
        h.sync_pwrite(gpu_tensor, path)
    assert torch.equal(torch.from_numpy(np.fromfile(path, np.uint8)), torch.arange(4096, dtype=torch.uint8))
