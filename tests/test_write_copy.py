"""O_DIRECT writes through the engine's own buffers (``write_copy``): the
bytes land exactly, on real files under tmp_path, whatever the buffer's
alignment and the call; 'auto' copies memory whose pages are scattered in
physical memory (read from /proc/self/pagemap, which shows frame numbers to
root only) and leaves contiguous memory zero-copy; 'never' never copies."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os

import numpy as np
import pytest
import torch

import aionvme as nvme
from aionvme._engine import MODE_COPY
from aionvme._runtime import scatter
from aionvme.exceptions import InvalidSettingError

MiB = 1 << 20
PAGE = 4096
LIMITS = (254, 4 * MiB)  # virtio-blk's max_segments and max_sectors_kb here


def _frames_visible() -> bool:
    a = nvme.empty(2 * PAGE)
    a[:] = 1
    return scatter.request_bytes(a.ctypes.data, a.nbytes, LIMITS) is not None


def _frames(a: np.ndarray) -> np.ndarray:
    """The physical frame numbers of a's pages, read here (not by the code under test)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(a.ctypes.data // PAGE * 8)
        e = np.frombuffer(f.read(a.nbytes // PAGE * 8), dtype=np.uint64)
    return e & np.uint64((1 << 55) - 1)


def scattered_buffer(nbytes: int) -> tuple[np.ndarray, mmap.mmap]:
    """nbytes of anonymous memory no two neighbouring pages of which are
    neighbours in physical memory: twice as many pages are faulted, sorted by
    frame number, and every other one is moved (mremap) into place, so the
    frames of neighbouring pages differ by 2 or more, whatever order the
    kernel handed them out in."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    n = nbytes // PAGE
    src_map = mmap.mmap(-1, 2 * nbytes)
    src = np.frombuffer(src_map, dtype=np.uint8)
    libc.madvise(ctypes.c_void_p(src.ctypes.data), ctypes.c_size_t(2 * nbytes), 15)  # MADV_NOHUGEPAGE
    src[::PAGE] = 1
    order = np.argsort(_frames(src), kind="stable")[::2][:n]
    dst_map = mmap.mmap(-1, nbytes)
    dst = np.frombuffer(dst_map, dtype=np.uint8)
    base, dst_base = src.ctypes.data, dst.ctypes.data
    for i, j in enumerate(order.tolist()):
        got = libc.mremap(base + j * PAGE, PAGE, PAGE, 3, dst_base + i * PAGE)  # MAYMOVE | FIXED
        if got != dst_base + i * PAGE:
            raise OSError(ctypes.get_errno(), "mremap")
    del src
    src_map.close()
    pfn = _frames(dst)
    if np.count_nonzero(pfn[1:] == pfn[:-1] + np.uint64(1)):
        raise AssertionError("the construction left neighbouring frames")
    dst[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    return dst, dst_map


def test_requests_of_counts_segments_and_caps_requests():
    run = np.arange(1000, 1000 + 4096, dtype=np.uint64)
    assert scatter.requests_of(run, LIMITS) == 4 * MiB  # contiguous: max_sectors_kb
    apart = np.arange(0, 2 * 4096, 2, dtype=np.uint64)  # no two pages adjacent
    assert scatter.requests_of(apart, LIMITS) == 254 * PAGE  # max_segments pages
    eights = (np.arange(512, dtype=np.uint64)[:, None] * 100 + np.arange(8, dtype=np.uint64)).ravel()
    assert scatter.requests_of(eights, LIMITS) == 4 * MiB  # 254 runs of 8 pages cover 4 MiB
    assert scatter.requests_of(eights, (64, 4 * MiB)) == 64 * 8 * PAGE
    descending = np.arange(4096, 0, -1, dtype=np.uint64)
    assert scatter.requests_of(descending, LIMITS) == 254 * PAGE


def test_device_limits_come_from_the_request_queue(tmp_path):
    got = scatter.device_limits(os.stat(tmp_path).st_dev)
    st = os.stat(tmp_path).st_dev
    q = f"/sys/dev/block/{os.major(st)}:{os.minor(st)}"
    if not os.path.exists(q):
        assert got is None
        return
    segs, nbytes = got
    queue = q + "/queue" if os.path.exists(q + "/queue") else q + "/../queue"
    assert segs == int(open(queue + "/max_segments").read())
    assert nbytes == int(open(queue + "/max_sectors_kb").read()) * 1024
    if os.path.isdir("/dev/shm"):
        assert scatter.device_limits(os.stat("/dev/shm").st_dev) is None  # tmpfs: no queue


def test_an_unknown_choice_is_refused():
    with pytest.raises(InvalidSettingError, match="write_copy"):
        nvme.defaults.set(write_copy="sometimes")


@pytest.mark.parametrize("phase", [0, 64, 512])
async def test_copied_writes_land_every_byte(tmp_path, phase):
    n = 5 * MiB + 1234
    raw = nvme.empty(n + 2 * PAGE)
    src = raw[phase : phase + n]
    src[:] = np.random.default_rng(phase).integers(0, 256, n, dtype=np.uint8)
    t = torch.from_numpy(src.copy())
    path = tmp_path / "f.bin"
    with nvme.defaults.set(write_copy="always"):
        before = nvme.stats()["bounce_buffers"]
        with nvme.File(path, "w", block_size="4M") as f:
            await f.pwrite(src, 4096)
            await f.pwrite_many([(t, 4096 + n), (src[: 3 * MiB], 4096 + 2 * n)])
            await asyncio.to_thread(f.sync_pwrite_many, [(src, 8192 + 2 * n + 3 * MiB)])  # blocking: a thread
            await f.fsync()
        assert nvme.stats()["bounce_buffers"] > before, "nothing went through the engine's buffers"
    data = np.fromfile(path, dtype=np.uint8)
    assert not data[:4096].any()
    assert np.array_equal(data[4096 : 4096 + n], src)
    assert np.array_equal(data[4096 + n : 4096 + 2 * n], src)
    assert np.array_equal(data[4096 + 2 * n : 4096 + 2 * n + 3 * MiB], src[: 3 * MiB])
    tail = 8192 + 2 * n + 3 * MiB
    assert np.array_equal(data[tail : tail + n], src) and len(data) == tail + n


async def test_auto_copies_scattered_memory_and_nothing_else(tmp_path):
    if not _frames_visible():
        pytest.skip("physical frame numbers are hidden from this process (needs CAP_SYS_ADMIN)")
    a, m = scattered_buffer(8 * MiB)
    try:
        got = scatter.request_bytes(a.ctypes.data, a.nbytes, LIMITS)
        assert got is not None and got < 2 * MiB, got
        path = tmp_path / "f.bin"
        with nvme.File(path, "w") as f:
            st_dev_limits = scatter.device_limits(os.fstat(f._h.fd).st_dev)
            if st_dev_limits is None or st_dev_limits[0] * PAGE >= st_dev_limits[1]:
                pytest.skip(f"{tmp_path}'s device builds full requests from scattered pages")
            if not f.direct:
                pytest.skip("no O_DIRECT here")
            p = f._params()
            assert scatter.params_for(f._h.fd, True, [(a, 0)], p)[2] & MODE_COPY
            with nvme.defaults.set(write_copy="never"):
                assert scatter.params_for(f._h.fd, True, [(a, 0)], p) == p
            # small items are never checked, nor are buffered files
            assert scatter.params_for(f._h.fd, True, [(a[: 1 * MiB], 0)], p) == p
            assert scatter.params_for(f._h.fd, False, [(a, 0)], p) == p
            before = nvme.stats()["bounce_buffers"]
            await f.pwrite(a, 0)
            assert nvme.stats()["bounce_buffers"] > before
            await f.fsync()
        assert np.array_equal(np.fromfile(path, dtype=np.uint8), a)
    finally:
        del a  # the mapping goes with the last view of it


def test_small_writes_are_never_checked_and_always_copies_them(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        p = (1 << 20, 0, 0)
        small = [nvme.empty(64 * 1024), torch.zeros(1024), b"x" * 4096, bytearray(100), memoryview(b"ab")]
        for buf in small:
            assert scatter.params_for_one(fd, buf, p) == p
        assert scatter.params_for(fd, True, [(b, 0) for b in small], p) == p
        with nvme.defaults.set(write_copy="always"):
            for buf in small:
                assert scatter.params_for_one(fd, buf, p)[2] & MODE_COPY
        with nvme.defaults.set(write_copy="never"):
            assert scatter.params_for_one(fd, nvme.empty(8 * MiB), p) == p
    finally:
        os.close(fd)
