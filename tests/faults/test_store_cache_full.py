"""A cache-mode TieredStore (on_full='evict') on a real, small ext4 (a 32
MiB loop device): a capacity the disk cannot hold is refused at open with
ENOSPC, and a persistent cache whose journal can no longer grow (the disk
filled to the last block) refuses puts with ENOSPC, never drops a key it
could not journal, and every key it still lists reads back, now and after
reopening."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from aionvme.store import StoreFullError, TieredStore

from .test_store_full import fill_to_the_last_block

KiB = 1 << 10
MiB = 1 << 20


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, 64 * KiB, np.uint8)


def disk_bytes(s: TieredStore) -> int:
    return sum(os.stat(slab.path).st_blocks * 512 for slab in s._nvme.slabs)


async def test_a_capacity_larger_than_the_disk_is_refused_at_open(ext4):
    root = ext4.mnt / "cache"
    with pytest.raises(StoreFullError) as ei:
        TieredStore(root, host=0, nvme="64M", on_full="evict")
    assert ei.value.errno == errno.ENOSPC
    assert not [p for p in os.listdir(root) if p.endswith(".slab")]  # nothing left behind


async def test_a_full_disk_under_a_persistent_cache_loses_no_key(ext4):
    root = ext4.mnt / "cache"
    cap = 1 * MiB
    s = TieredStore(root, host=0, nvme=cap, on_full="evict", persist=True)
    for i in range(16):
        await s.put(i, value(i))
    fill_to_the_last_block(ext4.mnt)  # the slab was preallocated: only the journal needs blocks now
    refused = 0
    for i in range(16, 400):
        try:
            await s.put(i, value(i))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            refused += 1
            if refused >= 3:
                break
        assert disk_bytes(s) <= cap
    assert refused, "the journal never ran out of room"
    listed = sorted(s.keys())
    evicted = set(s.drain_evicted())
    assert not evicted & set(listed)
    for k in listed:
        assert np.array_equal(await s.get(k), value(k))
    await s.close()  # (its journal is broken: no snapshot, the next open replays it)
    for p in ext4.mnt.glob("ballast.*"):
        p.unlink()
    async with TieredStore(root, host=0, nvme=cap, on_full="evict", persist=True) as s:
        # every key listed before is back (a put refused midway may add its key:
        # its value was durable before the journal refused its record)
        assert set(listed) <= set(s.keys())
        for k in list(s):
            assert np.array_equal(await s.get(k), value(k))
        await s.put("after", value(7))
        assert disk_bytes(s) <= cap
