"""Checksummed NVMe reads: every value hashed after its read, the event loop
let run between slices of the hashing, a flipped byte anywhere still caught."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aionvme.store import CorruptValueError, TieredStore, _checksum
from test_store_trust import _flip

MiB = 1 << 20


class _Recorder:
    """xxhash, with the number of loop ticks seen at each hashing call."""

    def __init__(self, real: Any, ticks: list[int], seen: list[int]) -> None:
        self._real, self._ticks, self._seen = real, ticks, seen

    def xxh3_64_intdigest(self, data: Any) -> int:
        self._seen.append(self._ticks[0])
        return int(self._real.xxh3_64_intdigest(data))

    def xxh3_64(self) -> Any:
        h = self._real.xxh3_64()
        rec = self

        class _H:
            def update(self, data: Any) -> None:
                rec._seen.append(rec._ticks[0])
                h.update(data)

            def intdigest(self) -> int:
                return int(h.intdigest())

        return _H()


async def test_a_batch_of_checked_values_lets_the_loop_run_between_slices(tmp_path, monkeypatch):
    n, count = 1_000_000, 24  # 24 MB of values each under a slice: hashed a few at a time
    vals = {f"k{i}": np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8) for i in range(count)}
    async with TieredStore(tmp_path, host=0) as s:
        await s.put_many(vals)
        ticks, seen = [0], []
        real = _checksum.xxhash_module()
        monkeypatch.setattr(_checksum, "xxhash_module", lambda: _Recorder(real, ticks, seen))

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0)
                ticks[0] += 1

        t = asyncio.create_task(ticker())
        try:
            got = await s.get_many(list(vals))
        finally:
            t.cancel()
        assert all(np.array_equal(g, vals[k]) for g, k in zip(got, vals))
        assert len(seen) >= count
        # at most a slice (4 MiB, ~0.1 ms of hashing) between two loop ticks
        per_slice = 4 * MiB // n
        runs = [seen.count(v) for v in sorted(set(seen))]
        assert max(runs) <= per_slice, runs


@pytest.mark.parametrize("at", [5, 9 * MiB + 3, 20 * MiB - 1])
async def test_a_flipped_byte_in_any_slice_of_a_large_value_is_caught(tmp_path, at):
    v = np.random.default_rng(7).integers(0, 256, 20 * MiB, dtype=np.uint8)
    async with TieredStore(tmp_path, host=0) as s:
        await s.put_many({"good": v, "bad": v[::-1].copy()})
        assert np.array_equal(await s.get("good"), v)
        _flip(s, "bad", at)
        with pytest.raises(CorruptValueError, match="'bad'"):
            await s.get("bad")
        with pytest.raises(CorruptValueError, match="'bad'"):
            await s.get_many(["good", "bad"])
        assert np.array_equal(await s.get("good", out=np.empty_like(v)), v)
