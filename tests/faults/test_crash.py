"""Crash consistency: atomic_write interrupted by a filesystem shutdown that
drops everything not yet in the journal (like pulling the plug), at each step
of the commit; after unmount and mount the target holds the complete old or
the complete new content, never a mix; what was fsynced before survives."""

from __future__ import annotations

import asyncio
import errno
import os

import numpy as np
import pytest

import aionvme as nvme
from aionvme import atomic
from aionvme._runtime import reactor as _reactor

from .faultkit import SHUTDOWN_NOLOGFLUSH, blkio_throttle

MiB = 1 << 20
OLD = np.random.default_rng(1).integers(0, 256, 3 * MiB + 5, dtype=np.uint8)
NEW = np.random.default_rng(2).integers(0, 256, 5 * MiB + 11, dtype=np.uint8)


async def _prepare(fs):
    target = fs.mnt / "ckpt.bin"
    async with nvme.atomic_write(target) as f:
        await f.pwrite(OLD, 0)
    # and an unrelated file written and fsynced before any trouble
    durable = str(fs.mnt / "durable.bin")
    await nvme.pwrite(NEW[:MiB], durable, 3)
    await nvme.fsync(durable)
    return target, durable


def _after_remount(fs, target, durable) -> str:
    fs.remount()
    got = np.fromfile(target, np.uint8)
    back = np.fromfile(durable, np.uint8)
    assert np.array_equal(back[3:], NEW[:MiB]) and not back[:3].any(), "fsynced data lost"
    if np.array_equal(got, OLD):
        return "old"
    if np.array_equal(got, NEW):
        return "new"
    raise AssertionError(f"torn file: {got.nbytes} bytes, neither the old nor the new content")


async def _write_new(target) -> None:
    async with nvme.atomic_write(target) as f:
        await f.pwrite(NEW[: 2 * MiB], 0)
        await f.pwrite(NEW[2 * MiB :], 2 * MiB)


async def test_shutdown_while_the_new_content_is_written(shutdown_fs):
    fs = shutdown_fs
    target, durable = await _prepare(fs)
    eng = _reactor.get_reactor().engine

    async def pull_the_plug():
        while eng.inflight == 0:
            await asyncio.sleep(0.0005)
        fs.shutdown(SHUTDOWN_NOLOGFLUSH)

    with blkio_throttle(fs.dev, write_bps=8 * MiB):
        plug = asyncio.ensure_future(pull_the_plug())
        with pytest.raises(OSError) as ei:
            await _write_new(target)
        await plug
    assert ei.value.errno == errno.EIO
    assert _after_remount(fs, target, durable) == "old"


@pytest.mark.parametrize("step", ["before-rename", "before-dir-fsync", "after-commit"])
async def test_shutdown_at_each_commit_step(shutdown_fs, monkeypatch, step):
    fs = shutdown_fs
    target, durable = await _prepare(fs)
    real_replace, real_fsync_dir = os.replace, atomic.fsync_dir

    def replace(src, dst, **dir_fds):
        if step == "before-rename":
            fs.shutdown(SHUTDOWN_NOLOGFLUSH)
        return real_replace(src, dst, **dir_fds)

    def fsync_dir(directory):
        if step == "before-dir-fsync":
            fs.shutdown(SHUTDOWN_NOLOGFLUSH)
        return real_fsync_dir(directory)

    monkeypatch.setattr(atomic.os, "replace", replace)
    monkeypatch.setattr(atomic, "fsync_dir", fsync_dir)
    if step == "after-commit":
        await _write_new(target)
        fs.shutdown(SHUTDOWN_NOLOGFLUSH)
    else:
        with pytest.raises(OSError) as ei:
            await _write_new(target)
        assert ei.value.errno == errno.EIO
    monkeypatch.undo()
    outcome = _after_remount(fs, target, durable)
    # Before the rename the old file is all there is; once atomic_write has
    # returned, the new one is durable; in between, either (never a mix).
    expected = {"before-rename": {"old"}, "before-dir-fsync": {"old", "new"}, "after-commit": {"new"}}
    print(fs.fstype, step, outcome)
    assert outcome in expected[step], outcome
