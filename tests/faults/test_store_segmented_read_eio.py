"""A checked read of a large value in segments (``_checksum.read_hashed``)
when the device fails part-way, on kernel AIO and io_uring: the loop
device's size limit is cut inside the value, so its first segments land and
the later ones fail with EIO. The get raises that OSError (not a checksum
error, and not before every segment in flight has ended), nothing stays
referenced, and once the device is whole again the same get returns the
value's bytes."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from aionvme.store import TieredStore, _checksum, _nvme

from .faultkit import fiemap

MiB = 1 << 20


@pytest.mark.usefixtures("kernel_engine")
async def test_a_segmented_read_that_fails_part_way_raises_eio_and_leaks_nothing(ext4, monkeypatch):
    monkeypatch.setattr(_nvme, "PIPE_MIN", 2 * MiB)
    monkeypatch.setattr(_checksum, "PIPE_SEG", 512 << 10)
    monkeypatch.setattr(_checksum, "PIPE_WINDOW", 1 * MiB)
    segments: list[int] = []
    real = _checksum.read_hashed

    async def spy(file, mem, offset, at, n):  # type: ignore[no-untyped-def]
        segments.append(n)
        return await real(file, mem, offset, at, n)

    monkeypatch.setattr(_nvme, "read_hashed", spy)
    v = np.random.default_rng(5).integers(0, 256, 6 * MiB, dtype=np.uint8)
    async with TieredStore(ext4.mnt / "store", host=0, nvme=8 * MiB) as s:
        await s.put("v", v)
        assert np.array_equal(await s.get("v"), v) and segments == [6 * MiB]
        e = s._index["v"]
        ((slab, off, _, _),) = e.disk
        f = s._nvme.slabs[slab].file
        ext = fiemap(f.fileno(), s._nvme.slabs[slab].size)
        at = off + 3 * MiB  # the value's fourth MiB on the device: past the first window
        lo, phys, _ = next(x for x in ext if x[0] <= at < x[0] + x[2])
        ext4.set_size_limit(phys + at - lo)
        try:
            with pytest.raises(OSError) as got:
                await s.get("v")
            assert got.value.errno == errno.EIO, got.value
            assert e.idle() and len(segments) == 2
        finally:
            ext4.set_size_limit(0)
        assert np.array_equal(await s.get("v"), v)
        assert e.idle()
