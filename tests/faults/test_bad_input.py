"""Bad input, beyond tests/test_errors.py: writes from bad buffers, bad items
in batches, fds that are open the wrong way, closed files and fds, pipes and
FIFOs, sizes and offsets past what the filesystem or the process may write,
bad per-call settings. Each gives a clear typed error and writes nothing."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

import aionvme as nvme

from .faultkit import run_python


@pytest.fixture
def victim(make_file):
    """A file whose bytes must not change, and a check that they did not."""
    path, data = make_file(64 << 10, seed=9)

    def unchanged() -> bool:
        return np.array_equal(np.fromfile(path, np.uint8), data)

    return path, unchanged


async def test_non_contiguous_write_sources(victim):
    path, unchanged = victim
    with pytest.raises(nvme.NonContiguousBufferError):
        await nvme.pwrite(np.ones((64, 64), np.uint8)[:, ::2], path)
    with pytest.raises(nvme.NonContiguousBufferError):
        await nvme.pwrite(torch.ones(64, 64, dtype=torch.uint8).t(), path)
    with pytest.raises(nvme.NonContiguousBufferError):
        await nvme.pwrite(memoryview(bytearray(100))[::3], path)
    assert unchanged()


async def test_tensor_on_an_unreachable_device(victim):
    path, unchanged = victim
    meta = torch.empty(100, dtype=torch.uint8, device="meta")
    with pytest.raises(nvme.DeviceError):
        await nvme.pwrite(meta, path)
    with pytest.raises(nvme.DeviceError):
        await nvme.pread(meta, path)
    assert unchanged()


async def test_read_only_views(victim):
    path, _ = victim
    ro = memoryview(bytearray(100)).toreadonly()
    with pytest.raises(nvme.ReadOnlyBufferError):
        await nvme.pread(ro, path)
    assert not any(ro)


async def test_one_bad_item_fails_the_whole_batch_before_anything_is_written(victim):
    path, unchanged = victim
    good = np.full(1000, 7, np.uint8)
    bad_items = [
        [(good, 0), (object(), 4096)],  # not a buffer
        [(good, 0), (good, -1)],  # negative offset
        [(good, 0), (good, 1.5)],  # float offset
        [(good, 0), (good[::2], 100)],  # not contiguous
        [(good, 0), (good,)],  # not a pair
        [(good, 0), (good, 0, 0)],  # not a pair
        [(good, 0), 5],  # not a pair at all
        [(good, 0), (good, 1 << 64)],  # does not fit in an off_t
    ]
    for items in bad_items:
        with pytest.raises((TypeError, ValueError)):
            await nvme.pwrite_many(items, path)
    with pytest.raises(TypeError):
        await nvme.pwrite_many(42, path)  # not iterable
    with pytest.raises(nvme.ReadOnlyBufferError):
        await nvme.pread_many([(np.zeros(10, np.uint8), 0), (b"abc", 10)], path)
    assert unchanged()


async def test_fds_opened_the_wrong_way(victim):
    path, unchanged = victim
    ro = os.open(path, os.O_RDONLY)
    wo = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(nvme.UnsupportedOperation) as ei:
            await nvme.pwrite(b"x" * 100, ro)
        assert isinstance(ei.value, OSError)
        with pytest.raises(nvme.UnsupportedOperation):
            await nvme.pwrite_many([(b"abc", 0)], ro)
        with pytest.raises(nvme.UnsupportedOperation):
            await nvme.pread(np.zeros(10, np.uint8), wo)
        with pytest.raises(nvme.UnsupportedOperation):
            await nvme.pread_many([(np.zeros(10, np.uint8), 0)], wo)
    finally:
        os.close(ro)
        os.close(wo)
    with nvme.open(path, "r") as f, pytest.raises(nvme.UnsupportedOperation):
        f.sync_pwrite(b"abc", 0)
    assert unchanged()
    with nvme.open(str(path) + ".new", "w") as f, pytest.raises(nvme.UnsupportedOperation):
        await f.pread(np.zeros(10, np.uint8), 0)  # 'w' is write-only


async def test_unaligned_writes_through_a_write_only_o_direct_fd(make_file):
    # A partial block is read-modify-written; a write-only O_DIRECT fd cannot
    # read it, so the handle writes through a read-write twin of the same file
    # (reads through the caller's fd stay refused).
    path, data = make_file(3 * 4096)
    expect = data.copy()
    src = np.random.default_rng(9).integers(0, 256, 5000, dtype=np.uint8)
    expect[7 : 7 + src.nbytes] = src
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        assert await nvme.pwrite(src, fd, offset=7) == src.nbytes
        with pytest.raises(nvme.UnsupportedOperation):
            await nvme.pread(np.zeros(10, np.uint8), fd)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert np.array_equal(np.frombuffer(f.read(), np.uint8), expect)


async def test_closed_and_bad_fds(victim):
    path, unchanged = victim
    # a closed fd (a number nothing else can reuse meanwhile: above any we hold)
    fd = os.open(path, os.O_RDWR)
    high = os.dup2(fd, 900)
    os.close(fd)
    os.close(high)
    with pytest.raises(OSError) as ei:
        await nvme.pwrite(b"abc", high)
    assert ei.value.errno == errno.EBADF and str(high) in str(ei.value.filename)
    with pytest.raises(OSError) as ei:
        await nvme.pread(np.zeros(3, np.uint8), 1 << 20)
    assert ei.value.errno == errno.EBADF
    for bad in (True, None, 1.0, ["a"]):
        with pytest.raises(TypeError):
            await nvme.pread(np.zeros(3, np.uint8), bad)
    assert unchanged()


async def test_every_call_on_a_closed_file(victim):
    path, unchanged = victim
    f = nvme.open(path, "r+")
    f.close()
    calls = [
        lambda: f.pwrite(b"abc", 0),
        lambda: f.pread_many([(np.zeros(1, np.uint8), 0)]),
        lambda: f.pwrite_many([(b"a", 0)]),
        lambda: f.fsync(),
        lambda: f.fdatasync(),
        lambda: f.sync_pwrite(b"abc", 0),
        lambda: f.sync_fsync(),
        f.fileno,
        f.size,
        lambda: f.truncate(0),
    ]
    for call in calls:
        with pytest.raises(nvme.ClosedFileError):
            res = call()
            if hasattr(res, "__await__"):
                await res
    f.close()  # closing twice is fine
    assert unchanged()


async def test_pipes_and_fifos(tmp_dir):
    fifo = str(tmp_dir / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(OSError) as ei:
        await nvme.pwrite(b"abc", fifo)  # must not block waiting for a reader
    assert ei.value.errno == errno.ESPIPE and ei.value.filename == fifo
    with pytest.raises(OSError) as ei:
        nvme.open(fifo, "r")
    assert ei.value.errno == errno.ESPIPE
    r, w = os.pipe()
    try:
        os.write(w, b"data")
        with pytest.raises(OSError) as ei:
            await nvme.pread(np.zeros(4, np.uint8), r)
        assert ei.value.errno == errno.ESPIPE
        with pytest.raises(OSError) as ei:
            await nvme.pwrite(b"abc", w)
        assert ei.value.errno == errno.ESPIPE
        assert os.read(r, 10) == b"data"  # nothing was consumed
    finally:
        os.close(r)
        os.close(w)


async def test_directories_every_way(tmp_dir):
    with pytest.raises(IsADirectoryError):
        nvme.open(tmp_dir, "r")
    with pytest.raises(IsADirectoryError):
        await nvme.pwrite_many([(b"abc", 0)], str(tmp_dir))
    fd = os.open(tmp_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(IsADirectoryError):
            await nvme.pread(np.zeros(3, np.uint8), fd)
    finally:
        os.close(fd)


async def test_offsets_past_the_filesystems_limit(victim):
    # ext4 files end at 16 TiB: a write there is refused (EFBIG), at once,
    # and nothing is written, the size unchanged.
    path, unchanged = victim
    for off in (1 << 50, 1 << 62):
        with pytest.raises(OSError) as ei:
            await nvme.pwrite(np.ones(4096, np.uint8), path, off)
        assert ei.value.errno in (errno.EFBIG, errno.EINVAL), ei.value
        assert ei.value.filename == path
    assert unchanged()
    # reading there is a short read of nothing, not an error
    with pytest.raises(nvme.ShortReadError) as ei:
        await nvme.pread(np.zeros(10, np.uint8), path, 1 << 50)
    assert ei.value.received == 0


def test_file_size_limit_of_the_process(tmp_path):
    # RLIMIT_FSIZE (ulimit -f): writes past it fail with EFBIG (SIGXFSZ ignored).
    code = """
import asyncio, errno, resource, signal, sys
import numpy as np, aionvme as nvme
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
path = sys.argv[1]
async def main():
    for direct in (True, False):
        with nvme.open(path, "w", direct=direct) as f:
            await f.pwrite(np.ones(1 << 19, np.uint8), 0)
            try:
                await f.pwrite(np.ones(1 << 20, np.uint8), 1 << 19)
            except OSError as e:
                assert e.errno == errno.EFBIG and e.filename == path, e
            else:
                raise SystemExit("a write past RLIMIT_FSIZE succeeded")
            assert f.size() <= 1 << 20
    print("ok")
asyncio.run(main())
"""
    r = run_python(code, str(tmp_path / "limited.bin"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


async def test_bad_per_call_settings(victim):
    path, unchanged = victim
    buf = np.zeros(100, np.uint8)
    for kw in (
        dict(block_size="lots"),
        dict(block_size=-4096),
        dict(block_size=0),
        dict(parallelism=-1),
        dict(parallelism=1.5),
        dict(parallelism=True),
    ):
        with pytest.raises((ValueError, TypeError)):
            await nvme.pread(buf, path, **kw)
        with pytest.raises((ValueError, TypeError)):
            await nvme.pwrite(buf, path, **kw)
        with pytest.raises((ValueError, TypeError)):
            nvme.open(path, "r", **kw)
    for kw in (dict(engine="fast"), dict(queue_depth=0), dict(block_size="1K"), dict(nonsense=1)):
        with pytest.raises((ValueError, TypeError)):
            nvme.defaults.set(**kw)
    assert unchanged()


async def test_empty_writes_past_the_end_change_nothing(victim):
    # pwrite(2) of 0 bytes never changes the file: not even its size.
    path, unchanged = victim
    empty = np.zeros(0, np.uint8)
    assert await nvme.pwrite(empty, path, 1 << 30) == 0
    assert await nvme.pwrite_many([(b"", 1 << 30), (empty, 10 << 20)], path) == 0
    with nvme.open(path, "r+", direct=False) as f:
        assert await f.pwrite(b"", 5 << 20) == 0
    assert unchanged()
