"""A plain ``get`` in cache mode: the value it found is pinned for the call,
so an eviction while its read is in flight never turns the hit into a
``StoreKeyError`` (as for ``get_many``)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from _kvblocks import MiB, block, nvme_for
from aionvme.store import TieredStore


async def _get_while_evicted(s: TieredStore, key: int, get: Any) -> Any:
    """Start ``get``, hold its NVMe read until puts have made ``key`` the
    coldest value and dropped everything cold, then let the read finish."""
    nv = s._nvme
    real = nv.read
    entered, go = asyncio.Event(), asyncio.Event()

    async def slow_read(jobs: Any, keys: Any = None) -> None:
        if keys and key in keys:
            entered.set()
            await go.wait()
        await real(jobs, keys)

    nv.read = slow_read
    try:
        task = asyncio.ensure_future(get())
        await asyncio.wait_for(entered.wait(), 10)
        for k in range(100, 120):  # newer than anything: the cold ones go, key among them
            await s.put(k, block(k))
        go.set()
        return await task
    finally:
        nv.read = real


@pytest.mark.parametrize("with_out", [False, True])
async def test_a_get_in_flight_keeps_its_value_through_evictions(tmp_path, with_out):
    async with TieredStore(tmp_path, host=0, nvme=nvme_for(1 * MiB), on_full="evict") as s:
        for k in range(16):
            await s.put(k, block(k))
        out = np.empty_like(block(0)) if with_out else None
        got = await _get_while_evicted(s, 0, lambda: s.get(0, out=out))
        assert np.array_equal(got, block(0))
        assert not with_out or got is out
        dropped = s.drain_evicted()
        assert len(dropped) >= 16 - 1  # the others went; 0 only once its get ended
        assert 0 not in s or 0 not in dropped


async def test_get_many_in_flight_keeps_its_values_too(tmp_path):
    async with TieredStore(tmp_path, host=0, nvme=nvme_for(1 * MiB), on_full="evict") as s:
        for k in range(16):
            await s.put(k, block(k))
        got = await _get_while_evicted(s, 0, lambda: s.get_many([0, 1]))
        assert np.array_equal(got[0], block(0)) and np.array_equal(got[1], block(1))


async def test_a_get_waiting_on_a_prefetch_keeps_its_value_through_evictions(tmp_path):
    # The get waits for a prefetch of its key, which waits for host room that
    # holds keep; meanwhile puts drop the cold values from NVMe, the key among
    # them unless the get pinned it.
    async with TieredStore(tmp_path, host=128 << 10, nvme=nvme_for(1 * MiB), on_full="evict") as s:
        for k in range(16):
            await s.put(k, block(k), to="nvme")
        async with s.hold(1), s.hold(2):  # the host tier: full and held
            await s.prefetch([0])
            task = asyncio.ensure_future(s.get(0))
            for _ in range(5):
                await asyncio.sleep(0)
            for k in range(100, 120):
                await s.put(k, block(k), to="nvme")
        assert np.array_equal(await asyncio.wait_for(task, 10), block(0))
