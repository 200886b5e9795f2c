"""CUDA tensors to and from files, on a real GPU (marker ``gpu``; skipped
without CUDA). bench/gpu_check.sh runs these. Each transfer test runs with
each way: ``gds`` (cuFile; skipped where the cuFile driver does not open,
run in cuFile's compatibility mode where that is what the machine has) and
``bounce`` (the pinned bounce pipeline); ``gpu.stats()`` confirms which
way each transfer took.
"""

from __future__ import annotations

import asyncio
import gc
import tempfile

import numpy as np
import pytest

import aionvme as nvme
from aionvme import defaults, gpu
from aionvme._runtime import pinned
from aionvme.exceptions import NonContiguousBufferError, ShortReadError

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available())"
    ),
]

MiB = 1 << 20


@pytest.fixture(params=["gds", "bounce"])
def way(request):
    """Force one way for the test; 'gds' needs the cuFile driver to open."""
    if request.param == "gds":
        st = gpu.cufile_status()
        if st["mode"] is None:
            pytest.skip(f"cuFile unavailable: {st['reason']}")
    with defaults.set(gpu_path=request.param):
        yield request.param


def _used(before, way):
    after = gpu.stats()
    key = "gds_requests" if way == "gds" else "bounce_requests"
    other = "bounce_requests" if way == "gds" else "gds_requests"
    return after[key] > before[key] and after[other] == before[other]


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, 40 * MiB + 12345, dtype=np.uint8)
    path = tmp_path / "data.bin"
    data.tofile(path)
    return str(path), data


SPANS = [
    (0, 1),
    (1, 1),
    (4095, 2),
    (4096, 4096),
    (12345, 4 * MiB + 7),
    (3, 9 * MiB + 3),
    (8 * MiB, 16 * MiB),
    (40 * MiB + 12345 - 777, 777),
    (5, 0),
]


async def test_read_any_size_and_offset(way, data_file):
    path, data = data_file
    before = gpu.stats()
    async with nvme.open(path) as f:
        for off, n in SPANS:
            t = torch.full((n,), 0xEE, dtype=torch.uint8, device="cuda")
            assert await f.pread(t, off) == n
            assert np.array_equal(t.cpu().numpy(), data[off : off + n]), (off, n)
    # the path-based call too, and a typed tensor
    t = torch.empty((3, 1000), dtype=torch.float32, device="cuda")
    assert await nvme.pread(t, path, 1001) == 12000
    assert np.array_equal(t.cpu().numpy().view(np.uint8).reshape(-1), data[1001:13001])
    assert _used(before, way)


async def test_write_any_size_and_offset(way, tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "w.bin"
    expect = np.zeros(30 * MiB, np.uint8)
    before = gpu.stats()
    async with nvme.open(path, "w+") as f:
        for off, n in [
            (0, 4096),
            (4097, 5 * MiB + 1),
            (777, 3),
            (12 * MiB + 1, 9 * MiB + 4095),
            (29 * MiB, MiB),
        ]:
            src = rng.integers(0, 256, n, dtype=np.uint8)
            expect[off : off + n] = src
            assert await f.pwrite(torch.from_numpy(src).cuda(), off) == n
    got = np.fromfile(path, dtype=np.uint8)
    assert np.array_equal(got, expect[: len(got)]) and len(got) == 30 * MiB
    assert _used(before, way)


async def test_gather_of_many_and_mixed_batches(way, data_file):
    path, data = data_file
    rng = np.random.default_rng(11)
    spans = [(int(rng.integers(0, 40 * MiB)), int(rng.integers(1, 300_000))) for _ in range(300)]
    spans = [(o, min(n, len(data) - o)) for o, n in spans]
    dst = torch.zeros(sum(n for _, n in spans), dtype=torch.uint8, device="cuda")
    views, pos = [], 0
    for _, n in spans:
        views.append(dst[pos : pos + n])
        pos += n
    async with nvme.open(path) as f:
        await asyncio.gather(*(f.pread(v, o) for v, (o, _) in zip(views, spans)))
        expect = np.concatenate([data[o : o + n] for o, n in spans])
        assert np.array_equal(dst.cpu().numpy(), expect)
        # one batch holding CUDA tensors and host buffers
        host = nvme.empty(70_000)
        cuda = torch.empty(123_457, dtype=torch.uint8, device="cuda")
        n = await f.pread_many([(cuda, 10), (host, 5 * MiB + 1), (cuda[:1000], 7 * MiB)])
        assert n == 123_457 + 70_000 + 1000
        assert np.array_equal(host, data[5 * MiB + 1 : 5 * MiB + 70_001])
        assert np.array_equal(cuda[:1000].cpu().numpy(), data[7 * MiB : 7 * MiB + 1000])


async def test_rows_of_a_cuda_tensor(way, tmp_path):
    path = tmp_path / "rows.bin"
    data = np.random.default_rng(3).integers(0, 256, 8 * MiB, dtype=np.uint8)
    data.tofile(path)
    offs = np.array([MiB, 0, 3 * MiB + 5, 7 * MiB], dtype=np.int64)
    t = torch.zeros((4, 65536), dtype=torch.uint8, device="cuda")
    async with nvme.open(path) as f:
        assert await f.pread_rows(t, offs) == t.numel()
        with pytest.raises(ValueError, match="does not split into 3 rows"):
            await f.pread_rows(torch.zeros(100, dtype=torch.uint8, device="cuda"), [0, 1, 2])
        with pytest.raises(NonContiguousBufferError):
            await f.pread_rows(t.t(), [0, 1])
    got = t.cpu().numpy()
    for i, o in enumerate(offs):
        assert np.array_equal(got[i], data[o : o + 65536]), i
    t.zero_()
    with nvme.open(path) as f:
        assert f.sync_pread_rows(t, offs.tolist()) == t.numel()
    assert np.array_equal(t.cpu().numpy(), got)
    # and back: the rows written from the GPU at other offsets
    out = tmp_path / "rows-out.bin"
    assert await nvme.pwrite_rows(t, offs[::-1].copy(), out) == t.numel()
    raw = np.fromfile(out, np.uint8)
    for i, o in enumerate(offs[::-1]):
        assert np.array_equal(raw[o : o + 65536], got[i]), i


async def test_short_read_names_what_arrived(way, tmp_path):
    path = tmp_path / "s.bin"
    np.arange(MiB + 100, dtype=np.uint8).tofile(path)
    t = torch.zeros(3 * MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(ShortReadError) as ei:
        await nvme.pread(t, path, 50)
    assert (ei.value.offset, ei.value.expected, ei.value.received) == (50, 3 * MiB, MiB + 50)
    assert np.array_equal(t[: MiB + 50].cpu().numpy(), np.arange(MiB + 100, dtype=np.uint8)[50:])
    async with nvme.open(path) as f:
        with pytest.raises(ShortReadError) as ei:
            await f.pread_many([(t[:10], 0), (t[10:20], MiB + 95)])
        assert ei.value.segment == 1 and ei.value.received == 5


async def test_cancel_leaves_the_tensor_alone_afterwards(way, tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "wb") as fh:
        fh.truncate(1 << 30)
    t = torch.full((1 << 30,), 7, dtype=torch.uint8, device="cuda")
    task = asyncio.ensure_future(nvme.pread(t, path))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    torch.cuda.synchronize()
    snap = t.clone()
    await asyncio.sleep(0.3)
    torch.cuda.synchronize()
    assert torch.equal(snap, t)  # nothing landed after the await ended
    p = gpu.stats()["pool"]
    assert p is None or p["free"] == p["slots"]


async def test_ordered_after_the_current_stream(way, tmp_path):
    t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    t.fill_(5)  # queued on the current stream; not waited for
    await nvme.pwrite(t, tmp_path / "o.bin")
    assert (np.fromfile(tmp_path / "o.bin", dtype=np.uint8) == 5).all()
    r = torch.empty_like(t)
    r.fill_(1)
    await nvme.pread(r, tmp_path / "o.bin")
    assert int((r == 5).sum()) == r.numel()  # complete for any stream when the await returns


def test_blocking_calls_and_handles(way, data_file, tmp_path):
    path, data = data_file
    with nvme.open(path) as f:
        t = torch.empty(5 * MiB + 3, dtype=torch.uint8, device="cuda")
        assert f.sync_pread(t, 4097) == 5 * MiB + 3
        assert np.array_equal(t.cpu().numpy(), data[4097 : 4097 + 5 * MiB + 3])
    with nvme.Handle(block_size="512K") as h:
        assert h.sync_pwrite(t, str(tmp_path / "h.bin"), 1) == t.numel()
        back = torch.empty_like(t)
        assert h.sync_pread(back, str(tmp_path / "h.bin"), 1) == t.numel()
        assert torch.equal(back, t)


async def test_handle_async(way, data_file):
    path, data = data_file
    async with nvme.Handle(intra_op_parallelism=4) as h:
        t = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        assert await h.pread(t, path, 99) == 3 * MiB
        assert np.array_equal(t.cpu().numpy(), data[99 : 99 + 3 * MiB])


async def test_non_contiguous_cuda_tensor_is_refused(tmp_path):
    t = torch.zeros((64, 64), device="cuda").t()
    with pytest.raises(NonContiguousBufferError):
        await nvme.pwrite(t, tmp_path / "x.bin")


async def test_auto_falls_back_per_file(data_file):
    # /dev/shm is tmpfs: served buffered (no O_DIRECT), which cuFile cannot take
    path, data = data_file
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as tmp:
        tmp.write(data[: 2 * MiB].tobytes())
        tmp.flush()
        before = gpu.stats()
        t = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        await nvme.pread(t, tmp.name)
        assert np.array_equal(t.cpu().numpy(), data[: 2 * MiB])
        assert gpu.stats()["bounce_requests"] == before["bounce_requests"] + 1


def test_pinned_empty():
    t = nvme.empty((1024, 1024), "float32", like="torch", pinned=True)
    assert t.is_pinned() and t.data_ptr() % 4096 == 0 and t.device.type == "cpu"
    t.copy_(torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024))
    c = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(c.cpu(), t)
    errors = gpu.stats()["pinned_unregister_errors"]
    del t, c
    gc.collect()
    assert gpu.stats()["pinned_unregister_errors"] == errors  # unregistered before the pages went


def test_bounce_pool_is_pinned_and_bounded():
    p = pinned.pool()
    assert p.pinned, p.why_not_pinned
    assert p.nslots >= 2 and p.slot_size == defaults.get("gpu_block_size")


async def test_register_for_streaming(data_file):
    path, data = data_file
    buf = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    ok = nvme.register(buf)
    try:
        async with nvme.open(path) as f:
            for i in range(4):
                await f.pread(buf[i * MiB : (i + 2) * MiB], i * 3 * MiB + 1)
                assert np.array_equal(
                    buf[i * MiB : (i + 2) * MiB].cpu().numpy(), data[i * 3 * MiB + 1 :][: 2 * MiB]
                )
    finally:
        assert nvme.deregister(buf) is ok
    assert ok == (gpu.cufile_status()["mode"] == "gds" and defaults.get("gpu_path") != "bounce")


async def test_safetensors_and_checkpoints_to_cuda(tmp_path):
    from aionvme.formats import load, load_safetensors, save_in_background, save_safetensors

    sd = {"w": torch.randn(1000, 333, device="cuda"), "b": torch.arange(77, device="cuda", dtype=torch.int64)}
    await save_safetensors(sd, tmp_path / "m.safetensors")
    got = await load_safetensors(tmp_path / "m.safetensors", device="cuda")
    assert all(got[k].is_cuda and torch.equal(got[k], sd[k]) for k in sd)
    task = await save_in_background(
        {"model": sd, "step": 3}, tmp_path / "c.ckpt"
    )  # pinned, page-aligned snapshot
    await task
    back = await load(tmp_path / "c.ckpt", device="cuda")
    assert back["step"] == 3 and torch.equal(back["model"]["w"], sd["w"])


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
async def test_second_device(way, data_file):
    path, data = data_file
    t = torch.empty(3 * MiB + 1, dtype=torch.uint8, device="cuda:1")
    await nvme.pread(t, path, 4095)
    assert np.array_equal(t.cpu().numpy(), data[4095 : 4095 + 3 * MiB + 1])


def test_deepspeed_handle_moves_cuda_tensors_on_aionvmes_gpu_path(way, data_file, tmp_path):
    from aionvme.compat import deepspeed as ds

    path, data = data_file
    h = ds.aio_handle(block_size=1 << 20, queue_depth=8)
    try:
        t = torch.empty(3 * MiB + 4097, dtype=torch.uint8, device="cuda")
        before = gpu.stats()
        assert h.sync_pread(t, path, 4096) == 1
        assert np.array_equal(t.cpu().numpy(), data[4096 : 4096 + t.numel()])
        out = str(tmp_path / "out.bin")
        assert h.async_pwrite(t, out) == 0 and h.wait() == 1
        assert np.array_equal(np.fromfile(out, np.uint8), data[4096 : 4096 + t.numel()])
        assert _used(before, way)
    finally:
        h.handle.close()
