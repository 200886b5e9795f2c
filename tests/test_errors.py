"""Bad input and failed transfers give clear, typed errors and change nothing."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import aionvme as nvme
from conftest import IS_ROOT


async def test_short_read_at_eof_says_how_much_arrived(make_file):
    path, data = make_file(10_000)
    buf = np.zeros(5000, np.uint8)
    with pytest.raises(nvme.ShortReadError) as ei:
        await nvme.pread(buf, path, 7000)
    e = ei.value
    assert isinstance(e, EOFError) and isinstance(e, nvme.AionvmeError)
    assert (e.expected, e.received, e.offset, e.filename) == (5000, 3000, 7000, path)
    assert "3000 of 5000" in str(e)


@pytest.mark.parametrize(
    "size,offset,nbytes",
    [(10_000, 10_000, 10), (10_000, 20_000, 4096), (3 << 20, (3 << 20) - 1, 2 << 20), (0, 0, 1)],
)
async def test_short_reads_at_and_past_eof(make_file, size, offset, nbytes):
    path, _ = make_file(size)
    with pytest.raises(nvme.ShortReadError) as ei:
        await nvme.pread(np.zeros(nbytes, np.uint8), path, offset)
    assert ei.value.received == max(0, min(nbytes, size - offset))


async def test_short_read_in_a_batch_names_the_item(make_file):
    path, _ = make_file(10_000)
    items = [(np.zeros(100, np.uint8), 0), (np.zeros(100, np.uint8), 9950), (np.zeros(10, np.uint8), 50)]
    with pytest.raises(nvme.ShortReadError) as ei:
        await nvme.pread_many(items, path)
    assert ei.value.segment == 1 and ei.value.received == 50


async def test_nonexistent_path(tmp_dir):
    missing = str(tmp_dir / "nope.bin")
    with pytest.raises(FileNotFoundError) as ei:
        await nvme.pread(np.zeros(10, np.uint8), missing)
    assert ei.value.filename == missing and ei.value.errno == errno.ENOENT


async def test_directory(tmp_dir):
    with pytest.raises(IsADirectoryError):
        await nvme.pread(np.zeros(10, np.uint8), str(tmp_dir))
    with pytest.raises(IsADirectoryError):
        await nvme.pwrite(np.zeros(10, np.uint8), str(tmp_dir))


async def test_fifo_is_refused_without_blocking(tmp_dir):
    fifo = str(tmp_dir / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(OSError) as ei:
        await nvme.pread(np.zeros(10, np.uint8), fifo)
    assert ei.value.errno == errno.ESPIPE and ei.value.filename == fifo


def test_permission_denied(make_file):
    # Root passes permission checks through CAP_DAC_OVERRIDE: run the check in
    # a child without it (setpriv), so the mode bits apply as they would to
    # any user.
    path, _ = make_file(4096)
    os.chmod(path, 0o000)
    code = f"""
        import asyncio, numpy as np, aionvme as nvme
        async def main():
            try:
                await nvme.pread(np.zeros(10, np.uint8), {path!r})
            except PermissionError as e:
                assert e.filename == {path!r}, e
                print("read-denied")
            try:
                await nvme.pwrite(b"x", {path!r})
            except PermissionError:
                print("write-denied")
        asyncio.run(main())
    """
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    if IS_ROOT:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv(1): cannot drop CAP_DAC_OVERRIDE to test permissions")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["read-denied", "write-denied"]


async def test_read_only_destination(make_file):
    path, _ = make_file(100)
    ro = np.zeros(10, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(nvme.ReadOnlyBufferError):
        await nvme.pread(ro, path)
    with pytest.raises(nvme.ReadOnlyBufferError):
        await nvme.pread(b"0123456789", path)
    assert not ro.any()


async def test_non_contiguous_buffers(make_file):
    path, _ = make_file(1000)
    strided = np.zeros((10, 10), np.uint8)[:, ::2]
    with pytest.raises(nvme.NonContiguousBufferError):
        await nvme.pread(strided, path)
    t = torch.zeros(10, 10, dtype=torch.uint8).t()
    with pytest.raises(nvme.NonContiguousBufferError):
        await nvme.pread(t, path)
    assert not strided.any() and int(t.sum()) == 0


async def test_wrong_buffer_type(make_file):
    path, _ = make_file(100)
    for bad in (None, 123, "text", [1, 2, 3], object()):
        with pytest.raises(nvme.BufferTypeError):
            await nvme.pread(bad, path)
        with pytest.raises(TypeError):
            await nvme.pwrite(bad, path)


async def test_bad_offsets(make_file):
    path, data = make_file(1000)
    with pytest.raises(nvme.InvalidOffsetError):
        await nvme.pread(np.zeros(10, np.uint8), path, -1)
    with pytest.raises(ValueError):
        await nvme.pwrite(b"x", path, -4096)
    with pytest.raises(nvme.InvalidOffsetError):
        await nvme.pwrite(b"x", path, 1 << 64)
    with pytest.raises(nvme.InvalidOffsetError):
        await nvme.pwrite(b"xy", path, (1 << 63) - 1)
    with pytest.raises(TypeError):
        await nvme.pread(np.zeros(10, np.uint8), path, 1.5)
    assert np.array_equal(np.fromfile(path, np.uint8), data)


async def test_write_to_file_opened_read_only(make_file):
    path, data = make_file(1000)
    with nvme.open(path, "r") as f:
        with pytest.raises(nvme.UnsupportedOperation) as ei:
            await f.pwrite(b"abc", 0)
        assert isinstance(ei.value, OSError) and isinstance(ei.value, ValueError)
    assert np.array_equal(np.fromfile(path, np.uint8), data)


async def test_closed_file(make_file):
    path, _ = make_file(1000)
    f = nvme.open(path, "r")
    f.close()
    with pytest.raises(nvme.ClosedFileError):
        await f.pread(np.zeros(10, np.uint8), 0)
    with pytest.raises(ValueError):
        f.sync_pread(np.zeros(10, np.uint8), 0)


def test_bad_modes(make_file):
    path, _ = make_file(10)
    with pytest.raises(ValueError):
        nvme.open(path, "a")
    with pytest.raises(ValueError):
        nvme.open(path, "rw")
    with pytest.raises(FileExistsError):
        nvme.open(path, "x")


async def test_eio_style_errors_carry_offset(make_file):
    # A misaligned O_DIRECT transfer: the kernel fails the *event* with EINVAL.
    # We never issue one, so provoke a real per-chunk error instead: reading
    # through an fd that is only open for writing gives EBADF at io_submit.
    path, _ = make_file(8192)
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        from aionvme._engine import KERNEL_AIO, FileHandle, Inode
        from aionvme._runtime.reactor import get_reactor

        h = FileHandle(fd, path, KERNEL_AIO, True, True, True, 512, 512, Inode(8192))
        try:
            r = get_reactor()
            with pytest.raises(OSError) as ei:
                await r.submit(r.engine.read(h, nvme.empty(8192), 0))
            assert ei.value.errno == errno.EBADF
            assert ei.value.filename == path and ei.value.offset == 0
            assert "offset 0" in str(ei.value)
        finally:
            # The fd is closed below, not by the handle: forget it, or the
            # handle closes the number again when it is collected (it stays in
            # a reference cycle through the traceback in ``ei`` until some
            # later test's garbage collection), whatever that number is by
            # then. That closed a later test's uvloop signal pipe and engine
            # eventfd, and the whole suite stalled in tests/test_formats_faults.py.
            h.detach()
    finally:
        os.close(fd)


def test_errors_are_picklable():
    import pickle

    e = nvme.ShortReadError("/x", 10, 100, 5)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.filename, e2.offset, e2.expected, e2.received) == ("/x", 10, 100, 5)
