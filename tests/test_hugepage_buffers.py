"""Page-aligned buffers of 2 MiB and more start on a 2 MiB boundary, so each
whole 2 MiB of them can be a transparent huge page (an O_DIRECT read into
them is one segment per 2 MiB instead of one per 4 KiB page)."""

from __future__ import annotations

import numpy as np
import pytest

import aionvme as nvme
from aionvme._engine import AlignedBuffer
from aionvme.store import TieredStore

KiB = 1 << 10
MiB = 1 << 20


def _vm_size_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1])
    pytest.skip("no VmSize in /proc/self/status")


@pytest.fixture
def empty_pool():
    """No recycled mapping kept (the pool is process-wide): each buffer is a new mapping."""
    from aionvme.memory import recycle_limit

    limit, _ = recycle_limit()
    recycle_limit(0)
    yield
    recycle_limit(limit)


@pytest.mark.parametrize("recycle", [False, True])
def test_large_buffers_start_on_a_2mib_boundary_and_map_no_slack(recycle, empty_pool):
    small = AlignedBuffer(MiB + 5, recycle=recycle)
    assert small.address % (4 * KiB) == 0
    for n in (2 * MiB, 3 * MiB + 5, 4 * MiB + 4 * KiB, 17 * MiB):
        before = _vm_size_kib()
        b = AlignedBuffer(n, recycle=recycle)
        grew = _vm_size_kib() - before
        assert b.address % (2 * MiB) == 0, (n, hex(b.address))
        # the 2 MiB mapped to find the boundary are unmapped again
        assert grew * KiB == -(-n // (4 * KiB)) * 4 * KiB, (n, grew)
        view = np.frombuffer(memoryview(b), np.uint8)
        view[:: 4 * KiB] = 1  # every page is there and writable
        assert int(view.sum()) == -(-n // (4 * KiB))
        del view, b
    assert nvme.empty(5 * MiB).ctypes.data % (2 * MiB) == 0


async def test_a_fresh_nvme_get_result_starts_its_pages_on_a_2mib_boundary(tmp_path, empty_pool):
    # a value of 4 MiB at phase 16: its result's pages (4 MiB + 4 KiB) are
    # read whole into memory that two huge pages can back
    vals = {}
    for k in range(3):
        v = nvme.empty(4 * MiB + 4 * KiB)[16 : 16 + 4 * MiB]
        v[:] = np.random.default_rng(k).integers(0, 256, 4 * MiB, dtype=np.uint8)
        vals[k] = v
    async with TieredStore(tmp_path, host=0) as s:
        await s.put_many(vals)
        kept = []
        for k, v in vals.items():
            got = await s.get(k)
            assert np.array_equal(got, v)
            assert got.ctypes.data % (2 * MiB) == 16
            kept.append(got)  # kept: the next result is a new mapping, aligned too
