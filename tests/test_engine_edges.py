"""Edges of the engine's error reporting (issue 12 §5, §6): reads at the top of
the 64-bit offset range, a ShortReadError that states the real file size, and
an fd closed behind a File's back."""

from __future__ import annotations

import errno
import os
import signal
import threading

import numpy as np
import pytest

import aionvme as nvme
from aionvme.exceptions import ShortReadError

TOP = 1 << 63


@pytest.fixture
def small(make_file):
    path, data = make_file(4000)
    return path, data


# (offset, nbytes): every one reads a block that ends at or past 2**63 (the
# kernel refuses such a transfer with EINVAL); the last byte asked for is
# below 2**63, so the call itself is valid: the file just ends before.
TOP_READS = [(TOP - 200, 100), (TOP - 4096, 4095), (TOP - 512 - 100, 200), (TOP - 4096 - 1, 2)]


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(("offset", "nbytes"), TOP_READS)
def test_reads_ending_at_2_63_are_short_reads(small, direct, offset, nbytes):
    path, _ = small
    buf = np.zeros(nbytes, np.uint8)
    with nvme.open(path, direct=direct) as f, pytest.raises(ShortReadError) as ei:
        f.sync_pread(buf, offset)
    assert ei.value.received == 0
    assert ei.value.offset == offset
    assert ei.value.file_size == 4000


@pytest.mark.parametrize(("offset", "nbytes"), TOP_READS)
async def test_async_reads_ending_at_2_63_are_short_reads(small, offset, nbytes):
    path, _ = small
    buf = np.zeros(nbytes, np.uint8)
    with pytest.raises(ShortReadError) as ei:
        await nvme.pread(buf, path, offset)
    assert ei.value.received == 0


def test_a_read_straddling_2_63_is_still_refused(small):
    path, _ = small
    with nvme.open(path) as f, pytest.raises(nvme.exceptions.InvalidOffsetError):
        f.sync_pread(np.zeros(100, np.uint8), TOP - 50)


@pytest.mark.parametrize("offset", [4000, 10_000, 1 << 40])
def test_short_read_states_the_real_file_size(small, offset):
    path, _ = small
    with nvme.open(path) as f, pytest.raises(ShortReadError) as ei:
        f.sync_pread(np.zeros(100, np.uint8), offset)
    msg = str(ei.value)
    assert "4000 bytes long" in msg, msg
    assert f"ends at {offset}" not in msg
    assert ei.value.file_size == 4000


def test_short_read_in_the_middle_keeps_what_arrived(small):
    path, data = small
    buf = np.zeros(8000, np.uint8)
    with nvme.open(path) as f, pytest.raises(ShortReadError) as ei:
        f.sync_pread(buf, 1000)
    assert ei.value.received == 3000
    assert "4000 bytes long" in str(ei.value)
    assert np.array_equal(buf[:3000], data[1000:])


def test_short_read_error_pickles_with_its_size():
    import pickle

    e = ShortReadError("f", 10, 100, 0, file_size=5)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.file_size, str(e2)) == (5, str(e))
    assert "ends at or before 10" in str(ShortReadError("f", 10, 100, 0))


@pytest.mark.parametrize("direct", [True, False])
def test_fd_closed_behind_the_files_back(small, direct):
    path, _ = small
    f = nvme.open(path, direct=direct)
    os.close(f.fileno())
    with pytest.raises(OSError) as ei:
        f.sync_pread(np.zeros(100, np.uint8), 0)
    assert ei.value.errno == errno.EBADF
    assert "closed" in str(ei.value)
    assert ei.value.filename == path
    with pytest.raises(OSError):
        f.close()  # the fd is gone: close(2) says so too


@pytest.mark.parametrize("direct", [True, False])
async def test_fd_number_reused_by_an_eventfd(small, direct):
    # The number of the closed fd now names an eventfd (another engine's,
    # say): the kernel answers ESPIPE ("Illegal seek") to pread and EINVAL to
    # io_submit, which hide the real cause.
    path, _ = small
    f = nvme.open(path, direct=direct)
    fd = f.fileno()
    r = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        os.dup2(r, fd)  # closes the file's fd, then reuses its number
        with pytest.raises(OSError) as ei:
            await f.pread(np.zeros(100, np.uint8), 0)
        assert ei.value.errno == errno.EBADF, ei.value
        assert "closed" in str(ei.value) and "not a file" in str(ei.value)
    finally:
        f.close()  # closes the eventfd's duplicate
        os.close(r)


def test_an_abandoned_handle_never_closes_a_reused_fd_number(small, tmp_path):
    # A FileHandle nobody closed closes its fd when it is freed: if that fd
    # was closed behind its back and the number now names someone else's
    # file, closing it would pull the file out from under its owner.
    import gc

    import aionvme._engine as _engine

    path, _ = small
    fd = os.open(path, os.O_RDONLY)
    h = _engine.FileHandle(fd, path, _engine.WORKER_POOL, False, True, False, 1, 1, _engine.Inode(4000))
    os.close(fd)
    other = os.open(tmp_path / "other.bin", os.O_RDWR | os.O_CREAT)
    try:
        assert other == fd  # the lowest free number: the one the handle still holds
        del h
        gc.collect()
        os.fstat(other)  # still open
        assert os.pwrite(other, b"still mine", 0) == 10
    finally:
        os.close(other)
    # and an abandoned handle whose fd is still its own closes it
    fd = os.open(path, os.O_RDONLY)
    h = _engine.FileHandle(fd, path, _engine.WORKER_POOL, False, True, False, 1, 1, _engine.Inode(4000))
    del h
    gc.collect()
    with pytest.raises(OSError) as ei:
        os.fstat(fd)
    assert ei.value.errno == errno.EBADF


def test_misaligned_einval_on_a_real_file_keeps_its_errno(small):
    # EINVAL from a file that is still open is not blamed on a lost fd.
    import aionvme._engine as _engine

    path, _ = small
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        ino = _engine.Inode(4000)
        # A handle that claims byte alignment on an O_DIRECT fd: the kernel refuses.
        h = _engine.FileHandle(fd, path, _engine.KERNEL_AIO, True, True, False, 1, 1, ino)
        eng = _engine.Engine(8, 1)
        try:
            req = eng.run(eng.read(h, bytearray(100), 3))
            exc = req.exception()
            assert isinstance(exc, OSError) and exc.errno == errno.EINVAL, exc
        finally:
            eng.close()
            h.detach()
    finally:
        os.close(fd)


async def test_engine_fixture_selects_the_engine(engine, make_file):
    # The fixture the round-trip tests use really switches engines.
    path, data = make_file(10_000)
    buf = np.zeros(9_000, np.uint8)
    await nvme.pread(buf, path, 7)
    assert np.array_equal(buf, data[7:9007])
    s = nvme.Handle().stats()
    assert s["use_aio"] == (engine in ("aio", "uring"))  # the kernel-async path: AIO or the ring
    assert s["uring_direct"] == (engine == "uring")


def _sigint_blocked() -> dict[int, bool]:
    """Per thread id of this process: whether it blocks SIGINT."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            status = open(f"/proc/self/task/{tid}/status").read()
        except OSError:
            continue  # the thread ended meanwhile
        blk = next(line for line in status.splitlines() if line.startswith("SigBlk:"))
        out[int(tid)] = bool(int(blk.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return out


def test_engine_threads_leave_signals_to_python_threads(make_file):
    # A process-directed SIGINT must land on a Python thread (which runs the
    # handler), not on a worker or the submitter. A fresh Python thread gets
    # its own engine for blocking calls, whose threads are all new.
    path, _ = make_file(1 << 20)
    before = set(_sigint_blocked())
    seen: dict[int, bool] = {}

    def work() -> None:
        with nvme.open(path, "r+", direct=False) as f:  # buffered: served by worker threads
            f.sync_pwrite(np.ones(1 << 20, np.uint8), 0)
            f.sync_pread(np.zeros(1 << 20, np.uint8), 0)
        with nvme.open(path, "r+") as f:  # O_DIRECT writes go through the submitter thread
            f.sync_pwrite(nvme.empty(1 << 20), 0)
        me = threading.get_native_id()
        seen.update({t: b for t, b in _sigint_blocked().items() if t not in before and t != me})

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen, "no engine thread was started"
    assert all(seen.values()), f"engine threads that accept SIGINT: {seen}"
    assert not _sigint_blocked()[threading.get_native_id()]
