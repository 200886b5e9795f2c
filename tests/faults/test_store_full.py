"""A persistent TieredStore on a full filesystem (a 32 MiB ext4 on a loop
device, filled to the last block, root's reserve included): close() cannot
write its index snapshot, warns instead of raising, and loses nothing: the
journal holds every key and the next open (on the still-full disk) replays it."""

from __future__ import annotations

import contextlib
import errno
import os

import numpy as np
import pytest

from aionvme.store import TieredStore


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, 20_000 + 4096 * i, np.uint8)


def fill_to_the_last_block(directory) -> None:
    """Take every free block, the root-reserved ones too (this runs as root)."""
    n = 0
    for step in (1 << 20, 4096, 1024):
        while True:
            try:
                with open(directory / f"ballast.{n}", "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, step)
                n += 1
            except OSError as e:
                assert e.errno == errno.ENOSPC
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / f"ballast.{n}")  # a file left at 0 bytes
                break


async def test_close_on_a_full_disk_warns_and_every_key_reopens(ext4):
    root = ext4.mnt / "cache"
    store = TieredStore(root, host="64K", persist=True)
    for i in range(12):
        await store.put(f"k{i}", value(i))
    await store.delete("k3")
    fill_to_the_last_block(ext4.mnt)
    with pytest.raises(OSError) as ei, open(ext4.mnt / "probe", "wb") as f:  # the disk is really full
        f.write(b"x" * 8192)
        f.flush()
        os.fsync(f.fileno())
    assert ei.value.errno == errno.ENOSPC
    with pytest.warns(RuntimeWarning, match="nothing is lost"):
        await store.close()
    for _ in range(2):  # reopened on the full disk, closed (warning again), reopened
        with pytest.warns(RuntimeWarning, match="the journal holds every key"):
            async with TieredStore(root, host="64K", persist=True) as s:
                assert sorted(s.keys()) == sorted(f"k{i}" for i in range(12) if i != 3)
                for i in range(12):
                    if i != 3:
                        assert np.array_equal(await s.get(f"k{i}"), value(i))
