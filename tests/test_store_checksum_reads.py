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

    def __init__(self, real: Any, ticks: list[int], seen: list[int], sizes: list[int] | None = None) -> None:
        self._real, self._ticks, self._seen = real, ticks, seen
        self._sizes = sizes if sizes is not None else []

    def xxh3_64_intdigest(self, data: Any) -> int:
        self._seen.append(self._ticks[0])
        return int(self._real.xxh3_64_intdigest(data))

    def xxh3_64(self) -> Any:
        h = self._real.xxh3_64()
        rec = self

        class _H:
            def update(self, data: Any) -> None:
                rec._seen.append(rec._ticks[0])
                rec._sizes.append(len(data))
                h.update(data)

            def intdigest(self) -> int:
                return int(h.intdigest())

        return _H()


async def _while_ticking(ticks: list[int], work: Any) -> Any:
    """Await ``work`` while a task counts the loop's turns in ``ticks[0]``."""

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0)
            ticks[0] += 1

    t = asyncio.create_task(ticker())
    try:
        return await work
    finally:
        t.cancel()


async def test_a_batch_of_checked_values_lets_the_loop_run_between_slices(tmp_path, monkeypatch):
    n, count = 1_000_000, 24  # 24 MB of values each under a slice: hashed a few at a time
    vals = {f"k{i}": np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8) for i in range(count)}
    async with TieredStore(tmp_path, host=0) as s:
        await s.put_many(vals)
        ticks, seen = [0], []
        real = _checksum.xxhash_module()
        monkeypatch.setattr(_checksum, "xxhash_module", lambda: _Recorder(real, ticks, seen))
        got = await _while_ticking(ticks, s.get_many(list(vals)))
        assert all(np.array_equal(g, vals[k]) for g, k in zip(got, vals))
        assert len(seen) >= count
        # at most a slice (4 MiB, ~0.1 ms of hashing) between two loop ticks
        per_slice = 4 * MiB // n
        runs = [seen.count(v) for v in sorted(set(seen))]
        assert max(runs) <= per_slice, runs


@pytest.mark.parametrize("at", [5, 9 * MiB + 3, 20 * MiB - 1])
async def test_a_flipped_byte_in_any_slice_of_a_large_value_is_caught(tmp_path, at):
    await _good_and_bad(tmp_path, np.random.default_rng(7).integers(0, 256, 20 * MiB, dtype=np.uint8), at)


async def _good_and_bad(tmp_path: Any, v: np.ndarray, at: int, segmented: list[int] | None = None) -> None:
    """Values "good" and "bad" (v reversed) with a byte of bad flipped at
    ``at``: good reads, bad is a CorruptValueError by get and get_many."""
    async with TieredStore(tmp_path, host=0) as s:
        await s.put_many({"good": v, "bad": v[::-1].copy()})
        assert np.array_equal(await s.get("good"), v)
        if segmented is not None:
            assert segmented == [v.nbytes]  # the segmented path was taken
        _flip(s, "bad", at)
        with pytest.raises(CorruptValueError, match="'bad'"):
            await s.get("bad")
        with pytest.raises(CorruptValueError, match="'bad'"):
            await s.get_many(["good", "bad"])
        assert np.array_equal(await s.get("good", out=np.empty_like(v)), v)


# -- large values: read in segments, hashed as they land (_checksum.read_hashed) ------------


@pytest.fixture
def small_pipe(monkeypatch):
    """The segmented read from 2 MiB values up, in 256 KiB segments, 512 KiB in flight."""
    from aionvme.store import _nvme

    monkeypatch.setattr(_nvme, "PIPE_MIN", 2 * MiB)
    monkeypatch.setattr(_checksum, "PIPE_SEG", 256 << 10)
    monkeypatch.setattr(_checksum, "PIPE_WINDOW", 512 << 10)
    calls: list[int] = []
    real = _checksum.read_hashed

    async def spy(file: Any, mem: Any, offset: int, at: int, n: int) -> int:
        calls.append(n)
        return await real(file, mem, offset, at, n)

    monkeypatch.setattr(_nvme, "read_hashed", spy)
    return calls


SEG = 256 << 10


@pytest.mark.parametrize("at", [0, SEG - 1, SEG, 2 * SEG + 17, 3 * MiB - 1])
async def test_a_segmented_read_catches_a_flipped_byte_in_any_segment(tmp_path, small_pipe, at):
    v = np.random.default_rng(at).integers(0, 256, 3 * MiB, dtype=np.uint8)
    await _good_and_bad(tmp_path, v, at, small_pipe)


async def test_a_segmented_read_of_phase_placed_and_odd_sized_values(tmp_path, small_pipe):
    torch = pytest.importorskip("torch")
    t = torch.arange(3 * MiB // 4 + 7, dtype=torch.int32)  # a torch tensor: 64 bytes into its page
    odd = np.random.default_rng(1).integers(0, 256, 2 * MiB + 4097, dtype=np.uint8)
    async with TieredStore(tmp_path, host=0) as s:
        await s.put_many({"t": t, "odd": odd})
        got = await s.get_many(["t", "odd"])
        assert torch.equal(got[0], t) and np.array_equal(got[1], odd)
        assert sorted(small_pipe) == sorted([t.numel() * 4, odd.nbytes])
        out = torch.empty_like(t)
        await s.get("t", out=out)
        assert torch.equal(out, t)
        _flip(s, "t", t.numel() * 4 - 1)  # the last byte, in the partial last page
        with pytest.raises(CorruptValueError, match="'t'"):
            await s.get("t")


async def test_a_failed_segment_raises_after_every_segment_has_ended(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksum, "PIPE_SEG", 256 << 10)
    monkeypatch.setattr(_checksum, "PIPE_WINDOW", 1 * MiB)
    import aionvme as nvme

    path = tmp_path / "f"
    v = np.random.default_rng(2).integers(0, 256, 3 * MiB, dtype=np.uint8)
    path.write_bytes(v.tobytes())
    issued: list[Any] = []

    class Failing:
        """A real file whose request at one offset fails with EIO."""

        def __init__(self, f: Any) -> None:
            self.f = f

        def pread(self, buf: Any, offset: int) -> Any:
            if offset == 5 * SEG:
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(OSError(5, "Input/output error", str(path)))
                issued.append(fut)
                return fut
            t = self.f.pread(buf, offset)
            issued.append(t)
            return t

    mem = nvme.memory.empty(3 * MiB)
    async with nvme.File(path) as f:
        with pytest.raises(OSError, match="Input/output"):
            await _checksum.read_hashed(Failing(f), mem, 0, 0, 3 * MiB)
        assert len(issued) >= 6 and all(t.done() for t in issued)
        assert await _checksum.read_hashed(f, mem, 0, 0, 3 * MiB) == _checksum.digest(v, v.nbytes)
        assert np.array_equal(mem, v)


async def test_a_48_mib_value_is_read_in_segments_at_the_default_sizes(tmp_path):
    from aionvme.store import _nvme

    assert 48 * MiB >= _nvme.PIPE_MIN
    v = np.random.default_rng(3).integers(0, 256, 48 * MiB, dtype=np.uint8)
    async with TieredStore(tmp_path, host=0) as s:
        await s.put("v", v)
        assert np.array_equal(await s.get("v"), v)
        _flip(s, "v", 48 * MiB - 2)
        with pytest.raises(CorruptValueError, match="'v'"):
            await s.get("v")


async def test_a_segmented_read_lets_the_loop_run_between_hash_slices(tmp_path, small_pipe, monkeypatch):
    monkeypatch.setattr(_checksum, "SLICE", 128 << 10)
    v = np.random.default_rng(4).integers(0, 256, 3 * MiB, dtype=np.uint8)
    async with TieredStore(tmp_path, host=0) as s:
        await s.put("v", v)
        ticks, seen, sizes = [0], [], []
        real = _checksum.xxhash_module()
        monkeypatch.setattr(_checksum, "xxhash_module", lambda: _Recorder(real, ticks, seen, sizes))
        got = await _while_ticking(ticks, s.get("v"))
        per_tick: dict[int, int] = {}
        for tick, n in zip(seen, sizes):
            per_tick[tick] = per_tick.get(tick, 0) + n
        assert np.array_equal(got, v) and small_pipe == [3 * MiB]
        assert sum(per_tick.values()) == 3 * MiB
        assert max(per_tick.values()) <= 128 << 10, per_tick
