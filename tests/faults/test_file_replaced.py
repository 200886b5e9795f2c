"""Files that change size behind aionvme's back.

Shrinking: rewritten by another program, truncated with File.truncate, or a
new file that got a deleted file's inode number. The per-file size hint lets
a write that stays inside the file skip its preparation; a stale (too large)
hint let two extending writes race, and the read-modify-write of one trimmed
the file below the other's bytes (zeros where data was written: found by
tests/test_property.py).

Growing: O_DIRECT reads at a moving end of file, where a short count is
followed by more data."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import aionvme as nvme

W1, W2 = 200704, 207556  # two extending writes; RMW tail of the first, middle of the second
N = 3389


async def _two_extending_writes(f, rng) -> tuple[np.ndarray, np.ndarray]:
    a = rng.integers(1, 256, N, dtype=np.uint8)
    b = rng.integers(1, 256, N, dtype=np.uint8)
    assert await asyncio.gather(f.pwrite(a, W1), f.pwrite(b, W2)) == [N, N]
    return a, b


def _check(path: str, head: bytes, a: np.ndarray, b: np.ndarray) -> None:
    disk = np.fromfile(path, np.uint8)
    assert disk.nbytes == W2 + N
    assert disk[: len(head)].tobytes() == head
    assert np.array_equal(disk[W1 : W1 + N], a), "the first write's bytes are gone"
    assert np.array_equal(disk[W2 : W2 + N], b), "the second write's bytes are gone"
    assert not disk[W1 + N : W2].any() and not disk[len(head) : W1].any()


@pytest.fixture(params=["thread", "auto"])
def engine(request):
    with nvme.defaults.set(engine=request.param):
        yield request.param


async def test_file_rewritten_by_another_program(tmp_dir, engine):
    path = str(tmp_dir / "r.bin")
    rng = np.random.default_rng(1)
    for _ in range(12):
        old = nvme.open(path, "w+")
        await old.pwrite(nvme.empty(1 << 20), 0)  # the hint says 1 MiB
        old.close()  # closed, but the object (and its hint) lives on
        head = os.urandom(1535)
        with open(path, "wb") as raw:  # another program rewrites the file
            raw.write(head)
        with nvme.open(path, "r+") as f:
            a, b = await _two_extending_writes(f, rng)
        _check(path, head, a, b)
        del old


async def test_file_truncated_through_aionvme(tmp_dir, engine):
    path = str(tmp_dir / "t.bin")
    rng = np.random.default_rng(2)
    for _ in range(12):
        with nvme.open(path, "w+") as f:
            await f.pwrite(nvme.empty(1 << 20), 0)
            head = os.urandom(1535)
            f.truncate(0)
            await f.pwrite(np.frombuffer(head, np.uint8), 0)
            a, b = await _two_extending_writes(f, rng)
        _check(path, head, a, b)


async def test_new_file_with_a_reused_inode_number(tmp_dir, engine):
    rng = np.random.default_rng(3)
    reused = 0
    for i in range(24):
        first = str(tmp_dir / f"gone{i}.bin")
        old = nvme.open(first, "w+")
        await old.pwrite(nvme.empty(1 << 20), 0)
        ino = os.fstat(old.fileno()).st_ino
        old.close()
        os.unlink(first)
        path = str(tmp_dir / f"new{i}.bin")
        head = os.urandom(1535)
        with open(path, "wb") as raw:
            raw.write(head)
        if os.stat(path).st_ino != ino:
            del old
            continue
        reused += 1
        with nvme.open(path, "r+") as f:
            a, b = await _two_extending_writes(f, rng)
        _check(path, head, a, b)
        del old
    if reused == 0:
        pytest.skip("the filesystem never reused an inode number here")


async def test_reads_racing_a_growing_end_of_file(tmp_dir):
    # O_DIRECT reads on the workers whose range straddles the end of a file
    # that another writer keeps extending: a short count may be followed by
    # more data. Never EINVAL from an unaligned retry; every byte that
    # arrives is the file's.
    import threading

    path = str(tmp_dir / "grow.bin")
    content = np.random.default_rng(4).integers(0, 256, 4 << 20, dtype=np.uint8)
    start = 100_003
    content[:start].tofile(path)
    stop = threading.Event()

    def grow() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            end = start
            while not stop.is_set() and end < content.nbytes - 1000:
                step = 97 + end % 1000
                os.pwrite(fd, content[end : end + step].tobytes(), end)
                end += step
        finally:
            os.close(fd)

    t = threading.Thread(target=grow)
    with nvme.defaults.set(engine="thread"), nvme.open(path, "r", direct=True) as f:
        t.start()
        try:
            for i in range(300):
                size = os.stat(path).st_size
                off = max(0, size - 300 - (i * 37) % 700)
                bufs = [np.zeros(1000, np.uint8) for _ in range(4)]
                res = await asyncio.gather(
                    *(f.pread(b, off + k * 211) for k, b in enumerate(bufs)), return_exceptions=True
                )
                for k, (b, r) in enumerate(zip(bufs, res)):
                    o = off + k * 211
                    if isinstance(r, nvme.ShortReadError):
                        n = r.received
                    else:
                        assert r == 1000, r
                        n = 1000
                    assert np.array_equal(b[:n], content[o : o + n])
        finally:
            stop.set()
            t.join()
