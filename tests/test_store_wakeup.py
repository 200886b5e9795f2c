"""A put that waits for room must wake when the value being filled ahead of it
becomes evictable (found by offload.Optimizer hanging on its second chunk)."""

from __future__ import annotations

import asyncio

import numpy as np

from aionvme.store import TieredStore


async def test_put_waiting_for_room_wakes_when_the_previous_put_lands(tmp_path):
    n = (8 << 20) + 64  # two do not fit the tier; each is copied on a thread (>= copy_threshold)
    async with TieredStore(tmp_path, host=16 << 20) as store:
        vals = [np.full(n, i, np.uint8) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(store.put(f"k{i}", v) for i, v in enumerate(vals))), 60)
        for i, v in enumerate(vals):
            assert np.array_equal(await store.get(f"k{i}"), v)
        assert store.stats()["host"]["used"] <= 16 << 20
