"""pread_rows / pwrite_rows: batches of equal-sized transfers between the
rows of one buffer and offsets of a file, on real files, through each engine
(kernel AIO, io_uring, worker threads) and both loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aionvme as nvme


def _offsets(n: int, size: int, row: int, seed: int, align: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, (size - row) // align, n) * align).astype(np.int64)


async def test_rows_hold_the_bytes_at_their_offsets(make_file, engine):
    path, data = make_file(4 << 20)
    offs = _offsets(300, len(data), 4096, seed=1)
    buf = nvme.empty((300, 4096))
    async with nvme.open(path) as f:
        assert f.direct
        assert await f.pread_rows(buf, offs) == buf.nbytes
    for i, o in enumerate(offs):
        assert np.array_equal(buf[i], data[o : o + 4096]), i


@pytest.mark.parametrize("direct", [True, False])
async def test_unaligned_rows_offsets_and_memory(make_file, engine, direct):
    # rows of 1000 bytes at odd offsets, in memory that starts 3 bytes into a page:
    # O_DIRECT goes through bounce blocks, buffered reads take them as they are
    path, data = make_file(1 << 20, seed=2)
    offs = [7, 999_000, 12_345, 0, 4095, 500_001]
    raw = nvme.empty(3 + 6 * 1000)
    buf = raw[3:].reshape(6, 1000)
    async with nvme.open(path, direct=direct) as f:
        assert await f.pread_rows(buf, offs) == 6000
    for i, o in enumerate(offs):
        assert np.array_equal(buf[i], data[o : o + 1000]), i


async def test_offsets_of_any_integer_kind(make_file, engine):
    path, data = make_file(1 << 20, seed=3)
    want = [4096, 0, 65536, 8192]
    strided = np.array([4096, -1, 0, -1, 65536, -1, 8192, -1], np.int64)[::2]  # not contiguous
    for offs in (
        want,
        np.array(want, np.int32),
        np.array(want, np.uint64),
        torch.tensor(want),
        tuple(want),
        strided,
    ):
        buf = np.zeros((4, 512), np.uint8)
        assert await nvme.pread_rows(buf, offs, path) == buf.nbytes
        for i, o in enumerate(want):
            assert np.array_equal(buf[i], data[o : o + 512]), (type(offs), i)


async def test_a_tensor_and_a_flat_buffer_split_into_rows(make_file, engine):
    path, data = make_file(1 << 20, seed=4)
    offs = np.array([8192, 0, 4096], np.int64)
    t = torch.zeros((3, 1024), dtype=torch.float32)  # no buffer protocol: held by the request
    async with nvme.open(path) as f:
        assert await f.pread_rows(t, offs) == t.numel() * 4
        flat = bytearray(3 * 100)  # any buffer of n equal records
        assert await f.pread_rows(flat, offs) == 300
    got = t.view(torch.uint8).numpy()
    for i, o in enumerate(offs):
        assert np.array_equal(got[i], data[o : o + 4096])
        assert bytes(flat[i * 100 : (i + 1) * 100]) == data[o : o + 100].tobytes()


def test_blocking_twin_and_handle(make_file, engine):
    path, data = make_file(2 << 20, seed=5)
    offs = _offsets(64, len(data), 4096, seed=6)
    buf = nvme.empty((64, 4096))
    with nvme.open(path) as f:
        assert f.sync_pread_rows(buf, offs) == buf.nbytes
    for i, o in enumerate(offs):
        assert np.array_equal(buf[i], data[o : o + 4096])
    buf[:] = 0
    with nvme.Handle(queue_depth=16) as h:
        assert h.sync_pread_rows(buf, offs, path) == buf.nbytes
    for i, o in enumerate(offs):
        assert np.array_equal(buf[i], data[o : o + 4096])


async def test_handle_shares_its_depth_among_row_batches(make_file, engine):
    import asyncio

    path, data = make_file(4 << 20, seed=7)
    offs = [_offsets(128, len(data), 4096, seed=s) for s in range(4)]
    bufs = [nvme.empty((128, 4096)) for _ in range(4)]
    async with nvme.Handle(queue_depth=32) as h, nvme.open(path) as f:
        ns = await asyncio.gather(*(h.pread_rows(b, o, f) for b, o in zip(bufs, offs)))
    assert ns == [128 * 4096] * 4
    for b, o in zip(bufs, offs):
        for i, off in enumerate(o):
            assert np.array_equal(b[i], data[off : off + 4096])


async def test_a_row_past_the_end_names_its_row(make_file, engine):
    path, data = make_file(100_000, seed=8)
    buf = np.zeros((3, 4096), np.uint8)
    with pytest.raises(nvme.ShortReadError) as ei:
        await nvme.pread_rows(buf, [0, len(data) - 100, 4096], path)
    e = ei.value
    assert e.segment == 1 and e.received == 100 and e.expected == 4096
    assert e.filename == path


async def test_bad_shapes_and_offsets_arrive_at_the_await(make_file, engine):
    path, _ = make_file(1 << 20, seed=9)
    async with nvme.open(path) as f:
        t = f.pread_rows(np.zeros(1000, np.uint8), [0, 4096, 8192])  # 1000 bytes in 3 rows
        with pytest.raises(ValueError, match="does not split into 3 rows"):
            await t
        with pytest.raises(nvme.InvalidOffsetError, match=r"row 1"):
            await f.pread_rows(np.zeros((2, 10), np.uint8), np.array([0, -4096], np.int64))
        with pytest.raises(nvme.InvalidOffsetError):
            await f.pread_rows(np.zeros((2, 10), np.uint8), [0, -1])
        with pytest.raises(TypeError):
            await f.pread_rows(np.zeros((2, 10), np.uint8), ["0", "1"])
        with pytest.raises(ValueError, match="no offsets"):
            await f.pread_rows(np.zeros(10, np.uint8), [])
        assert await f.pread_rows(np.zeros(0, np.uint8), []) == 0
        with pytest.raises(nvme.ReadOnlyBufferError):
            await f.pread_rows(b"x" * 20, [0, 10])
        with pytest.raises(nvme.NonContiguousBufferError):
            await f.pread_rows(np.zeros((2, 8192), np.uint8)[:, ::2], [0, 4096])
        with pytest.raises(nvme.NonContiguousBufferError):
            await f.pread_rows(torch.zeros((8, 2)).t(), [0, 4096])
    with pytest.raises(nvme.ClosedFileError):
        await f.pread_rows(np.zeros((2, 10), np.uint8), [0, 10])


async def test_the_buffer_and_offsets_are_let_go(make_file, engine):
    # the offsets are read when the call is made; the buffer is held until the
    # request has finished, then let go (numpy refuses to resize an array
    # something else still references)
    path, _ = make_file(1 << 20, seed=10)
    buf = np.zeros((8, 4096), np.uint8)
    offs = np.arange(8, dtype=np.int64) * 4096
    async with nvme.open(path) as f:
        t = f.pread_rows(buf, offs)
        offs.resize(4)
        with pytest.raises(ValueError, match="referenced"):
            buf.resize((4, 4096))
        await t
        del t
    buf.resize((4, 4096))


@pytest.mark.parametrize("direct", [True, False])
async def test_rows_written_land_at_their_offsets(make_file, engine, direct):
    # aligned rows, and rows of 1000 bytes at odd offsets (O_DIRECT: read-modify-write
    # of the blocks they share); the bytes between them are kept
    path, data = make_file(1 << 20, seed=11)
    expect = data.copy()
    rows = np.random.default_rng(12).integers(0, 256, (4, 4096), dtype=np.uint8)
    aligned = np.array([8192, 0, 65536, 4096 * 200], np.int64)
    odd = [7, 500_001, 12_345, 999_000]
    small = np.random.default_rng(13).integers(0, 256, (4, 1000), dtype=np.uint8)
    async with nvme.open(path, "r+", direct=direct) as f:
        assert await f.pwrite_rows(rows, aligned) == rows.nbytes
        assert await f.pwrite_rows(small, odd) == small.nbytes
    for i, o in enumerate(aligned):
        expect[o : o + 4096] = rows[i]
    for i, o in enumerate(odd):
        expect[o : o + 1000] = small[i]
    assert np.array_equal(np.fromfile(path, np.uint8), expect)


async def test_rows_written_past_the_end_grow_the_file(tmp_dir, engine):
    path = str(tmp_dir / "grow.bin")
    rows = np.arange(3 * 4096, dtype=np.uint8).reshape(3, 4096)
    assert await nvme.pwrite_rows(rows, [4096 * 10, 0, 4096 * 4], path) == rows.nbytes
    raw = np.fromfile(path, np.uint8)
    assert len(raw) == 4096 * 11
    assert np.array_equal(raw[40960:], rows[0]) and np.array_equal(raw[:4096], rows[1])
    assert np.array_equal(raw[4096 * 4 : 4096 * 5], rows[2]) and not raw[4096:16384].any()


def test_rows_written_blocking_and_by_a_handle(make_file, engine):
    path, data = make_file(1 << 20, seed=14)
    rows = bytes(range(256)) * 32  # read-only memory is fine to write from: 2 rows of 4 KiB
    with nvme.open(path, "r+") as f:
        assert f.sync_pwrite_rows(rows, [4096, 0]) == 8192
    with nvme.Handle(queue_depth=8) as h:
        assert h.sync_pwrite_rows(np.full((2, 512), 9, np.uint8), [65536, 70000], path) == 1024
    raw = np.fromfile(path, np.uint8)
    assert raw[4096:8192].tobytes() == rows[:4096] and raw[:4096].tobytes() == rows[4096:]
    assert (raw[65536 : 65536 + 512] == 9).all() and (raw[70000:70512] == 9).all()
    assert np.array_equal(raw[8192:65536], data[8192:65536])


async def test_bad_rows_to_write_arrive_at_the_await(make_file, engine):
    path, data = make_file(1 << 16, seed=15)
    async with nvme.open(path, "r+") as f:
        with pytest.raises(ValueError, match="does not split into 3 rows"):
            await f.pwrite_rows(np.zeros(1000, np.uint8), [0, 4096, 8192])
        with pytest.raises(nvme.InvalidOffsetError, match="row 0"):
            await f.pwrite_rows(np.zeros((1, 10), np.uint8), np.array([-1], np.int64))
    async with nvme.open(path, "r") as f:
        with pytest.raises(nvme.UnsupportedOperation):
            await f.pwrite_rows(np.zeros((1, 10), np.uint8), [0])
    assert np.array_equal(np.fromfile(path, np.uint8), data)
