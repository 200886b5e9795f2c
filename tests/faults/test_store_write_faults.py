"""TieredStore when the NVMe tier's writes fail (ENOSPC, EIO) under an
eviction: the put that needed the room raises a typed error, and once the
fault is gone and room is freed, puts go in again. Before the store's mover
owned its counts, a failed eviction write kept the reference it had taken on
every value it tried to write out: those values stayed pinned in the host
tier for good (even deleted), and the next put waited forever ("all of it held
or in flight")."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from aionvme.store import StoreError, StoreTimeoutError, TieredStore

from .faultkit import fiemap

KiB = 1 << 10
MiB = 1 << 20
N = 256 * KiB  # four values fill the host tier


def _val(i: int) -> np.ndarray:
    return np.full(N, i % 251, np.uint8)


def _typed(err: BaseException) -> bool:
    """A write failure as the store reports it: its own error, or the OSError of the transfer."""
    return isinstance(err, StoreError) or (
        isinstance(err, OSError) and err.errno in (errno.EIO, errno.ENOSPC)
    )


async def _fill_until_it_fails(store: TieredStore, count: int = 16) -> dict[str, np.ndarray]:
    """Put values until evictions fail; the keys whose put returned, with their values."""
    done: dict[str, np.ndarray] = {}
    failed: list[BaseException] = []
    for i in range(count):
        try:
            await store.put(f"k{i}", _val(i))
        except Exception as e:
            assert _typed(e), repr(e)
            # the put that caused the eviction raises its error; a timeout means it hung
            assert not isinstance(e, StoreTimeoutError), repr(e)
            failed.append(e)
        else:
            done[f"k{i}"] = _val(i)
    assert failed, "no eviction failed: the test needs a failing write"
    return done


def _no_counts_left(store: TieredStore) -> None:
    for e in store._index.values():
        idle = getattr(e, "idle", None)
        if idle is not None:
            assert idle(), f"{e.key}: {e.copies}"
        else:  # the entry before the mover
            assert e.refs == 0 and e.disk_refs == 0 and e.claims == 0 and not e.moving, e.key


async def _recovers(store: TieredStore, done: dict[str, np.ndarray]) -> None:
    """Every returned put reads back; no reference or claim is left; deleting
    makes room, and the next puts go in (the store's timeout turns a hang into
    StoreTimeoutError)."""
    for k, v in done.items():
        assert np.array_equal(await store.get(k), v), k
    _no_counts_left(store)
    for k in list(store.keys()):
        await store.delete(k)
    assert store.stats()["host"]["used"] == 0
    for i in range(6):  # more than the host tier holds: evictions again, now to a working disk
        await store.put(f"again{i}", _val(i))
    for i in range(6):
        assert np.array_equal(await store.get(f"again{i}"), _val(i))


async def test_a_full_nvme_tier_fails_the_put_and_deleting_makes_room(tmp_path):
    # the tier's own capacity: one value fits, the second eviction finds no room
    async with TieredStore(tmp_path, host=4 * N, nvme=N, timeout=10) as store:
        done = await _fill_until_it_fails(store)
        for k in list(store.keys()):
            await store.delete(k)
        assert store.stats()["host"]["used"] == 0
        for i in range(4):
            await store.put(f"again{i}", _val(i))
        assert store.stats()["host"]["entries"] == 4
        assert set(done) >= {"k0"}


@pytest.mark.usefixtures("kernel_engine")
async def test_enospc_on_an_eviction_write_raises_at_the_put_then_puts_go_on(loopfs):
    fs = loopfs("ext4", 16 * MiB)
    filler = fs.mnt / "filler"
    with open(filler, "wb") as f:  # leave about 1 MiB free
        st = os.statvfs(fs.mnt)
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 3 * N)
    async with TieredStore(fs.mnt / "cache", host=4 * N, timeout=10) as store:
        done = await _fill_until_it_fails(store)
        filler.unlink()  # the fault stops
        await _recovers(store, done)


@pytest.mark.usefixtures("kernel_engine")
async def test_eio_on_an_eviction_write_raises_at_the_put_then_puts_go_on(loopfs):
    fs = loopfs("ext4", 64 * MiB)
    async with TieredStore(fs.mnt / "cache", host=4 * N, nvme=8 * MiB, timeout=10) as store:
        slab = store._nvme.slabs[0]
        (_, phys, _), *_ = fiemap(slab.file.fileno(), 8 * MiB)
        fs.set_size_limit(phys - phys % 4096)  # every write into the slab fails with EIO
        try:
            done = await _fill_until_it_fails(store)
        finally:
            fs.set_size_limit(0)  # the fault stops
        await _recovers(store, done)
