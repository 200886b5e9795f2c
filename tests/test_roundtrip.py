"""Round trips against os.pread/os.pwrite as the reference: sizes from 1 byte
to 64 MiB + odd, aligned and unaligned offsets, aligned and deliberately
misaligned buffers, every buffer type users pass. The core round trips run
on both engines (the ``engine`` fixture: kernel AIO and the worker pool)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

import aionvme as nvme

SIZES = [1, 511, 512, 513, 4095, 4096, 4097, 65536 + 7, (1 << 20) - 1, (1 << 20) + 1, 3 * (1 << 20) + 12345]
OFFSETS = [0, 1, 511, 512, 4096, 4097, 1 << 20, 5 * (1 << 20) + 3]


def misaligned(n: int, shift: int) -> np.ndarray:
    """A writable uint8 view whose address is `shift` bytes past a page boundary."""
    base = nvme.empty(n + 4096 * 2)
    return base[shift : shift + n]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
async def test_pread_matches_os_pread(make_file, size, offset, engine):
    path, data = make_file(offset + size + 1000)
    for shift in (0, 1, 512, 4095):
        buf = misaligned(size, shift)
        n = await nvme.pread(buf, path, offset)
        assert n == size
        fd = os.open(path, os.O_RDONLY)
        try:
            ref = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        assert buf.tobytes() == ref


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", [0, 1, 511, 4096, 4097, 1 << 20])
async def test_pwrite_matches_os_pwrite(tmp_dir, size, offset, engine):
    # Same writes through aionvme and through os.pwrite onto identical files.
    rng = np.random.default_rng(size ^ offset)
    base = rng.integers(0, 256, size=offset + size + 3000, dtype=np.uint8).tobytes()
    ours, ref = tmp_dir / "ours.bin", tmp_dir / "ref.bin"
    ours.write_bytes(base)
    ref.write_bytes(base)
    for shift in (0, 3, 512):
        payload = misaligned(size, shift)
        payload[:] = rng.integers(0, 256, size=size, dtype=np.uint8)
        n = await nvme.pwrite(payload, str(ours), offset + shift)
        assert n == size
        fd = os.open(ref, os.O_WRONLY)
        try:
            os.pwrite(fd, payload.tobytes(), offset + shift)
        finally:
            os.close(fd)
    assert ours.read_bytes() == ref.read_bytes()


async def test_large_odd_roundtrip_64mib(tmp_dir, engine):
    size = (64 << 20) + 12345
    src = np.random.default_rng(7).integers(0, 256, size=size, dtype=np.uint8)
    path = str(tmp_dir / "big.bin")
    assert await nvme.pwrite(src, path) == size
    assert os.path.getsize(path) == size  # no O_DIRECT padding left behind
    dst = nvme.empty(size)
    assert await nvme.pread(dst, path) == size
    assert np.array_equal(src, dst)
    # and through a misaligned buffer at a misaligned offset
    dst2 = misaligned(size - 1001, 7)
    await nvme.pread(dst2, path, 1001)
    assert np.array_equal(src[1001:], dst2)


async def test_writes_extend_files_exactly(tmp_dir, engine):
    path = str(tmp_dir / "grow.bin")
    chunks = [np.full(n, i + 1, np.uint8) for i, n in enumerate([100, 4096, 1, 70000, 513])]
    off = 0
    for c in chunks:
        await nvme.pwrite(c, path, off)
        off += len(c)
        assert os.path.getsize(path) == off
    assert np.array_equal(np.fromfile(path, np.uint8), np.concatenate(chunks))


async def test_write_past_eof_leaves_a_zero_hole(tmp_dir, engine):
    path = str(tmp_dir / "hole.bin")
    await nvme.pwrite(b"abc", path, 0)
    await nvme.pwrite(b"xyz", path, 10_000)
    raw = open(path, "rb").read()
    assert len(raw) == 10_003
    assert raw[:3] == b"abc" and raw[10_000:] == b"xyz"
    assert raw[3:10_000] == bytes(10_000 - 3)


async def test_positional_write_does_not_truncate(make_file, engine):
    path, data = make_file(1 << 20)
    await nvme.pwrite(b"hello", path, 100)
    raw = np.fromfile(path, np.uint8)
    assert len(raw) == 1 << 20
    expect = data.copy()
    expect[100:105] = np.frombuffer(b"hello", np.uint8)
    assert np.array_equal(raw, expect)


@pytest.mark.parametrize(
    "kind", ["numpy", "numpy2d", "torch", "torch_f16", "bytearray", "memoryview", "mmap"]
)
async def test_buffer_types(make_file, kind):
    size = 3 * 4096 + 100
    path, data = make_file(size + 50)
    if kind == "numpy":
        buf = np.zeros(size, np.uint8)
    elif kind == "numpy2d":
        buf = np.zeros((size // 4, 4), np.uint8)
    elif kind == "torch":
        buf = torch.zeros(size, dtype=torch.uint8)
    elif kind == "torch_f16":
        buf = torch.zeros(size // 2, dtype=torch.float16)
    elif kind == "bytearray":
        buf = bytearray(size)
    elif kind == "memoryview":
        buf = memoryview(bytearray(size + 10))[5 : 5 + size]
    else:
        buf = mmap.mmap(-1, size)
    nbytes = buf.numel() * buf.element_size() if isinstance(buf, torch.Tensor) else memoryview(buf).nbytes
    assert await nvme.pread(buf, path, 50) == nbytes
    got = buf.view(torch.uint8).numpy().tobytes() if isinstance(buf, torch.Tensor) else bytes(memoryview(buf))
    assert got == data[50 : 50 + nbytes].tobytes()
    # and write it back elsewhere from the same object
    out = path + ".out"
    assert await nvme.pwrite(buf, out, 3) == nbytes
    assert open(out, "rb").read()[3:] == got


async def test_torch_tensor_view_with_storage_offset(make_file):
    path, data = make_file(10_000)
    base = torch.zeros(20_000, dtype=torch.uint8)
    view = base[123 : 123 + 5000]
    await nvme.pread(view, path, 17)
    assert view.numpy().tobytes() == data[17:5017].tobytes()
    assert int(base[:123].sum()) == 0 and int(base[5123:].sum()) == 0


async def test_bytes_source_for_write(tmp_dir):
    path = str(tmp_dir / "b.bin")
    await nvme.pwrite(b"immutable bytes are fine to write", path)
    assert open(path, "rb").read() == b"immutable bytes are fine to write"


async def test_zero_length_transfers(make_file):
    path, _ = make_file(100)
    assert await nvme.pread(bytearray(0), path, 100) == 0
    assert await nvme.pwrite(b"", path, 5) == 0
    assert os.path.getsize(path) == 100


async def test_empty_gives_aligned_buffers():
    a = nvme.empty(12345)
    assert a.nbytes == 12345 and nvme.is_aligned(a, 4096)
    b = nvme.empty((3, 5), dtype="float32")
    assert b.shape == (3, 5) and b.dtype == np.float32 and nvme.is_aligned(b)
    t = nvme.empty((7, 9), dtype=torch.bfloat16, like="torch")
    assert t.dtype == torch.bfloat16 and t.shape == (7, 9) and t.data_ptr() % 4096 == 0
    assert not np.any(a)


async def test_file_object_many_reads_and_writes(tmp_dir, engine):
    path = str(tmp_dir / "f.bin")
    bufs = [np.full(4096 + i, i % 251, np.uint8) for i in range(64)]
    offsets = np.cumsum([0] + [len(b) for b in bufs[:-1]]).tolist()
    async with nvme.open(path, "w+") as f:
        import asyncio

        await asyncio.gather(*(f.pwrite(b, o) for b, o in zip(bufs, offsets)))
        outs = [np.zeros_like(b) for b in bufs]
        await asyncio.gather(*(f.pread(b, o) for b, o in zip(outs, offsets)))
        assert f.direct
    for a, b in zip(bufs, outs):
        assert np.array_equal(a, b)


async def test_pread_many_and_pwrite_many(make_file, engine):
    path, data = make_file(1 << 20)
    items = [(np.zeros(1000 + i, np.uint8), i * 3001) for i in range(100)]
    async with nvme.open(path, "r+") as f:
        n = await f.pread_many(items)
        assert n == sum(len(b) for b, _ in items)
        for b, o in items:
            assert np.array_equal(b, data[o : o + len(b)])
        news = [(np.full(10, i, np.uint8), 500_000 + i * 4099) for i in range(50)]
        assert await f.pwrite_many(news) == 500
    raw = np.fromfile(path, np.uint8)
    for b, o in news:
        assert np.array_equal(raw[o : o + 10], b)


def test_sync_api_without_a_loop(make_file, engine):
    path, data = make_file(3 << 20)
    with nvme.open(path, "r+") as f:
        buf = np.zeros(len(data) - 5, np.uint8)
        assert f.sync_pread(buf, 5) == len(buf)
        assert np.array_equal(buf, data[5:])
        f.sync_pwrite(b"xyz", 1)
        f.sync_fsync()
    assert open(path, "rb").read(4)[1:] == b"xyz"
