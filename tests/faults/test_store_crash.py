"""TieredStore(persist=True) through a filesystem shutdown that drops
everything not yet durable (like pulling the plug), on ext4 and xfs: after
unmount and mount, every key whose put (or delete) had returned is there with
its bytes (or gone), and a put in flight at the crash is either all there or
absent, never half-written."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from aionvme.store import TieredStore

from .faultkit import SHUTDOWN_NOLOGFLUSH

KiB = 1 << 10


def value(key: str, gen: int) -> np.ndarray:
    size = 4 * KiB * (1 + hash((key, gen)) % 40) + gen  # 4 KiB .. 160 KiB, unaligned tails
    return np.random.default_rng([gen, len(key), sum(map(ord, key))]).integers(0, 256, size, np.uint8)


async def test_returned_puts_survive_a_crash_and_torn_puts_vanish(shutdown_fs):
    fs = shutdown_fs
    root = fs.mnt / "cache"
    durable: dict[str, int | None] = {}  # key -> generation whose put returned (None: deleted)
    attempted: dict[str, set[int]] = {}
    store = TieredStore(root, host="256K", persist=True)
    # phase 1: settled state, with overwrites and deletes
    for i in range(12):
        k = f"k{i}"
        await store.put(k, value(k, 0))
        durable[k] = 0
        attempted.setdefault(k, set()).add(0)
    for i in range(0, 12, 3):
        await store.put(f"k{i}", value(f"k{i}", 1))
        durable[f"k{i}"] = 1
        attempted[f"k{i}"].add(1)
    await store.delete("k1")
    durable["k1"] = None
    deleted_after = {"k1": max(attempted["k1"])}  # generations older than the delete

    # phase 2: many puts at once; the plug is pulled when the fifth returns
    returned = 0
    plugged = asyncio.Event()

    async def put(k: str, gen: int) -> None:
        nonlocal returned
        attempted.setdefault(k, set()).add(gen)
        await store.put(k, value(k, gen))
        if not plugged.is_set():
            durable[k] = gen
            returned += 1
            if returned == 5:
                fs.shutdown(SHUTDOWN_NOLOGFLUSH)
                plugged.set()

    jobs = [put(f"k{i % 16}", 2 + i // 16) for i in range(40)]
    await asyncio.gather(*jobs, return_exceptions=True)
    assert plugged.is_set()
    with contextlib.suppress(OSError):
        await store.close()  # the index snapshot cannot be written any more: EIO

    fs.remount()
    async with TieredStore(root, host="256K", persist=True) as s:
        for k, gen in durable.items():
            if gen is None:
                # a later put of the key (phase 2) may have reached the journal
                # before the plug without returning; a value from before the
                # delete must never come back
                if k in s:
                    got = await s.get(k)
                    later = [
                        g for g in attempted[k] if g > deleted_after[k] and np.array_equal(got, value(k, g))
                    ]
                    assert later, f"{k} was deleted before the crash and came back with an older value"
                continue
            assert k in s, f"{k}: its put returned before the crash, it must survive"
            got = await s.get(k)
            # a later put of the key may have reached the journal before the plug
            ok = [g for g in attempted[k] if g >= gen and np.array_equal(got, value(k, g))]
            assert ok, f"{k}: torn or lost value ({got.nbytes} bytes)"
        for k in s:
            got = await s.get(k)
            assert any(np.array_equal(got, value(k, g)) for g in attempted[k]), f"{k}: torn value"
        # the store is fully usable after the crash
        await s.put("after", value("after", 0))
        assert np.array_equal(await s.get("after"), value("after", 0))
