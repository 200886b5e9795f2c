"""Whole-file atomic writes: old content intact until commit, none of the
temporary file left behind on failure, permissions kept."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import aionvme as nvme


async def test_commit_replaces_the_file(tmp_dir):
    path = tmp_dir / "ckpt.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    data = np.random.default_rng(0).integers(0, 256, 3_000_001, dtype=np.uint8)
    async with nvme.atomic_write(path) as f:
        await f.pwrite(data[:1_000_000], 0)
        await f.pwrite(data[1_000_000:], 1_000_000)
        assert path.read_bytes() == b"old"  # not visible before the commit
    assert path.read_bytes() == data.tobytes()
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o640)
    assert [p.name for p in tmp_dir.iterdir()] == ["ckpt.bin"]


async def test_failure_keeps_the_old_file(tmp_dir):
    path = tmp_dir / "ckpt.bin"
    path.write_bytes(b"old content")
    with pytest.raises(RuntimeError):
        async with nvme.atomic_write(path) as f:
            await f.pwrite(b"half of the new", 0)
            raise RuntimeError("training crashed")
    assert path.read_bytes() == b"old content"
    assert [p.name for p in tmp_dir.iterdir()] == ["ckpt.bin"]


async def test_cancellation_keeps_the_old_file(tmp_dir):
    path = tmp_dir / "ckpt.bin"
    path.write_bytes(b"old")
    big = nvme.empty(64 << 20)

    async def save():
        async with nvme.atomic_write(path) as f:
            await f.pwrite(big, 0)
            await asyncio.sleep(10)

    t = asyncio.ensure_future(save())
    await asyncio.sleep(0.05)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_dir.iterdir()] == ["ckpt.bin"]


def test_sync_form(tmp_dir):
    path = tmp_dir / "new.bin"
    with nvme.atomic_write(path) as f:
        f.sync_pwrite(b"hello world", 0)
    assert path.read_bytes() == b"hello world"


async def test_cancel_during_commit_sees_the_commit_through(tmp_dir, monkeypatch):
    # Cancel while the directory fsync runs: the rename has happened, so the
    # fsync must finish before CancelledError reaches the caller.
    import threading

    from aionvme import atomic

    path = tmp_dir / "ckpt.bin"
    path.write_bytes(b"old")
    started, release = threading.Event(), threading.Event()
    synced = []
    real = atomic.fsync_dir

    def slow_fsync_dir(d):
        started.set()
        release.wait(10)
        real(d)
        synced.append(d)

    monkeypatch.setattr(atomic, "fsync_dir", slow_fsync_dir)

    async def save():
        async with nvme.atomic_write(path) as f:
            await f.pwrite(b"new content", 0)

    t = asyncio.ensure_future(save())
    while not started.is_set():
        await asyncio.sleep(0.005)
    t.cancel()
    await asyncio.sleep(0.05)
    assert not t.done()  # still waiting for the fsync
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert synced and path.read_bytes() == b"new content"


async def test_an_unusable_target_leaves_no_temporary_file(tmp_dir):
    # the target's permissions cannot be read (a symlink loop: ELOOP): the
    # error comes out and the temporary file made first is gone
    target = tmp_dir / "loop"
    os.symlink("loop", target)
    with pytest.raises(OSError):
        async with nvme.atomic_write(target) as f:
            await f.pwrite(b"x", 0)
    assert sorted(p.name for p in tmp_dir.iterdir()) == ["loop"]
