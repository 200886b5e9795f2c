"""TieredStore: the host-hit fast path, parallel large copies and write-behind eviction."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

import aionvme as nvme
from aionvme.store import SyncTieredStore, TieredStore

KiB = 1 << 10
MiB = 1 << 20


async def test_host_hit_is_a_fresh_copy_with_dtype_shape_and_stats(tmp_path):
    values = {
        "f32": np.random.default_rng(1).standard_normal((33, 7)).astype(np.float32),
        "i16": np.arange(5000, dtype=np.int16),
        "scalar": np.array(2.5),
        "t_bf16": torch.randn(17, 9).to(torch.bfloat16),
        "t_i64": torch.arange(1000).reshape(10, 100),
    }
    async with TieredStore(tmp_path, host="1M") as s:
        for k, v in values.items():
            await s.put(k, v)
        before = s.stats()["host"]
        for k, v in values.items():
            got = await s.get(k)
            assert type(got) is type(v) and tuple(got.shape) == tuple(v.shape) and got.dtype == v.dtype
            if isinstance(v, np.ndarray):
                assert np.array_equal(got, v)
                got[...] = 0  # the result is the caller's: the store keeps its bytes
                assert np.array_equal(await s.get(k), v)
            else:
                assert torch.equal(got, v)
                got.zero_()
                assert torch.equal(await s.get(k), v)
        after = s.stats()["host"]
        assert after["hits"] - before["hits"] == 2 * len(values)
        assert after["misses"] == before["misses"]
        assert after["bytes_out"] - before["bytes_out"] == 2 * sum(
            v.nbytes if isinstance(v, np.ndarray) else v.numel() * v.element_size() for v in values.values()
        )
        out = np.empty((33, 7), np.float32)
        assert (await s.get("f32", out=out)) is out and np.array_equal(out, values["f32"])
        tout = torch.empty(17, 9, dtype=torch.bfloat16)
        assert (await s.get("t_bf16", out=tout)) is tout and torch.equal(tout, values["t_bf16"])


async def test_host_hit_touches_the_policy(tmp_path):
    # three 256 KiB values in a 768 KiB tier: reading "a" makes "b" the least recently used
    vals = {k: np.full(256 * KiB, i, np.uint8) for i, k in enumerate("abc")}
    async with TieredStore(tmp_path, host=768 * KiB) as s:
        for k, v in vals.items():
            await s.put(k, v)
        assert np.array_equal(await s.get("a"), vals["a"])
        await s.put("d", np.full(256 * KiB, 9, np.uint8))
        assert s.where("b") == ["nvme"] and "host" in s.where("a")
        for k, v in vals.items():
            assert np.array_equal(await s.get(k), v)


async def test_large_copies_run_in_parallel_slices(tmp_path):
    n = MiB + 12  # not a multiple of the slice: the last slice is short
    v = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    t = torch.randn(300_001)
    async with TieredStore(tmp_path, host="8M") as s:
        s.copy_threshold = 64 * KiB
        s.copy_slice = 64 * KiB
        s.copy_threads = 4
        await s.put("v", v)  # copied in by the threads
        await s.put("t", t)
        assert s._mover.copy_pool is not None
        assert s.where("v") == ["host"] and s.where("t") == ["host"]
        assert np.array_equal(await s.get("v"), v)
        out = np.empty_like(v)
        await s.get("v", out=out)
        assert np.array_equal(out, v)
        assert torch.equal(await s.get("t"), t)
        pool = s._mover.copy_pool
    assert s._mover.copy_pool is None and pool._shutdown


async def test_write_behind_keeps_several_batches_in_flight_and_every_put_evicts(tmp_path):
    n = 256 * KiB
    vals = [np.full(n, i, np.uint8) for i in range(48)]
    async with TieredStore(tmp_path, host=16 * n) as s:
        s.clean_batch = n  # one value per batch: a quarter of the tier is four batches
        most = 0
        for i, v in enumerate(vals):
            await s.put(i, v)
            most = max(most, len(s._cleaner.batches))
            assert s._cleaner.in_flight <= 4 * n
        assert most >= 2  # batches overlap (the device always has the next one queued)
        while s._tasks:
            await asyncio.gather(*list(s._tasks))
        st = s.stats()
        assert st["host"]["evictions"] >= len(vals) - 16
        assert st["host"]["used"] <= st["host"]["capacity"]
        assert s.errors == []
        for i, v in enumerate(vals):  # what was evicted was written first: nothing lost
            assert np.array_equal(await s.get(i), v)
        # the written values went out cold-first, in allocation order: their extents follow each other
        offs = sorted(s._index[i].disk[0][1] for i in range(8))
        assert offs == [offs[0] + j * n for j in range(8)]


async def test_bench_store_workload_reports_put_get_and_hit_figures(tmp_path):
    from aionvme.bench import Context, run

    r = await run(
        "store",
        Context(workdir=str(tmp_path), size=8 * MiB, options={"value": "1M", "host": "4", "cold": "0"}),
    )
    assert r.workload == "store" and r.verified and r.skipped is None
    assert 0 < r.nbytes <= 8 * MiB and r.ops == 8 and r.wall_s > 0
    f = r.figures
    assert f["evictions"] >= 8  # every steady-state put evicted one value
    for k in (
        "put_GBps",
        "nvme_written_GBps",
        "nvme_get_GBps",
        "host_hit_GBps",
        "memcpy_GBps",
        "host_hit_vs_memcpy",
        "get_4k_us",
    ):
        assert f[k] > 0, k
    assert f["host_hit_ratio"] == 1.0
    assert os.listdir(tmp_path) == []  # scratch stores leave nothing behind


async def test_get_many_of_cold_values_reads_in_one_batch_and_promotes_the_last_that_fit(tmp_path):
    n = 256 * KiB
    vals = {i: np.full(n, i, np.uint8) for i in range(10)}
    async with TieredStore(tmp_path, host=3 * n) as s:
        await s.put_many(vals)
        for i in vals:
            await s.evict(i)
        assert all(s.where(i) == ["nvme"] for i in vals)
        reads = s.stats()["nvme"]["bytes_out"]
        got = await s.get_many(list(vals))
        assert all(np.array_equal(g, v) for g, v in zip(got, vals.values()))
        st = s.stats()
        assert st["nvme"]["bytes_out"] - reads == 10 * n  # every value read once, straight into its result
        assert st["host"]["misses"] >= 10
        assert [i for i in vals if "host" in s.where(i)] == [7, 8, 9]  # the last ones that fit
        got[9][:] = 0  # results never alias the store's memory
        assert np.array_equal(await s.get(9), vals[9])
        # a batch that fits is promoted whole; hits are then served from memory
        small = await s.get_many([0, 1])
        assert all(np.array_equal(g, vals[i]) for i, g in enumerate(small))
        assert "host" in s.where(0) and "host" in s.where(1)


async def test_get_many_into_out_buffers_cold_warm_and_errors(tmp_path):
    vals = {i: torch.full((50_000 + i,), float(i)) for i in range(6)}
    async with TieredStore(tmp_path, host="1M") as s:
        await s.put_many(vals)
        for i in range(3):
            await s.evict(i)  # 0-2 only on NVMe, 3-5 in memory
        outs = [torch.empty(50_000 + i) for i in range(6)]
        got = await s.get_many(range(6), out=outs)
        assert all(g is o for g, o in zip(got, outs))
        assert all(torch.equal(outs[i], vals[i]) for i in range(6))
        with pytest.raises(ValueError):
            await s.get_many([0, 1], out=outs[:1])
        with pytest.raises(ValueError):
            await s.get_many([0], out=[torch.empty(3)])


def test_sync_get_many_into_out(tmp_path):
    with SyncTieredStore(tmp_path, host="1M") as s:
        s.put("a", np.arange(1000))
        s.evict("a")
        buf = np.empty(1000, np.int64)
        assert s.get_many(["a"], out=[buf])[0] is buf and np.array_equal(buf, np.arange(1000))


async def test_host_hit_into_out_checks_the_buffer_and_keeps_other_dtypes(tmp_path):
    from aionvme.exceptions import BufferTypeError, NonContiguousBufferError

    v = np.arange(1024, dtype=np.float32).reshape(32, 32)
    async with TieredStore(tmp_path, host="1M") as s:
        await s.put("v", v)
        same_bytes = np.empty(4096, np.uint8)  # another dtype and shape, the same bytes: a raw copy
        assert await s.get("v", out=same_bytes) is same_bytes
        assert same_bytes.tobytes() == v.tobytes()
        out = np.zeros((32, 32), np.float32)
        assert await s.get("v", out=out) is out and np.array_equal(out, v)
        with pytest.raises(NonContiguousBufferError):
            await s.get("v", out=np.zeros((32, 64), np.float32)[:, ::2])
        ro = np.zeros((32, 32), np.float32)
        ro.flags.writeable = False
        with pytest.raises(BufferTypeError):
            await s.get("v", out=ro)
        assert not ro.any()
        with pytest.raises(ValueError):
            await s.get("v", out=np.zeros(1023, np.float32))
        with pytest.raises(BufferTypeError):
            await s.get("v", out=np.empty(512, object))
        assert s.stats()["host"]["hits"] == 2  # the refused calls were not served


async def test_put_to_nvme_writes_straight_and_evicts_nothing(tmp_path):
    n = 256 * KiB
    async with TieredStore(tmp_path, host=2 * n) as s:
        hot = [np.full(n, i, np.uint8) for i in range(2)]
        for i, v in enumerate(hot):
            await s.put(("hot", i), v)
        used = s.stats()["host"]["used"]
        cold = {i: torch.full((n // 4 + 3,), float(i)) for i in range(6)}  # odd sizes: partial last pages
        await s.put_many(cold, to="nvme")
        st = s.stats()
        assert st["host"]["used"] == used and st["host"]["evictions"] == 0
        assert st["nvme"]["bytes_in"] >= sum(t.numel() * 4 for t in cold.values())
        for i in range(2):  # the hot values were not pushed out
            assert s._index[("hot", i)].host is not None
        for i, t in cold.items():
            e = s._index[i]
            assert e.host is None and e.disk is not None
            assert torch.equal(await s.get(i), t)
        await s.put("x", np.arange(10, dtype=np.int64), to="host")
        assert s._index["x"].host is not None
        with pytest.raises(ValueError):
            await s.put("y", np.zeros(4), to="gpu")
        assert "y" not in s


def test_sync_put_to_nvme(tmp_path):
    with SyncTieredStore(tmp_path, host="1M") as s:
        s.put("a", np.arange(100.0), to="nvme")
        s.put_many({"b": np.arange(5)}, to="nvme")
        assert s.aio._index["a"].host is None
        assert np.array_equal(s.get("a"), np.arange(100.0)) and np.array_equal(s.get("b"), np.arange(5))


async def test_write_behind_of_a_two_value_tier_keeps_two_writes_in_flight(tmp_path):
    n = 256 * KiB
    vals = [np.full(n, i, np.uint8) for i in range(24)]
    async with TieredStore(tmp_path, host=2 * n) as s:
        most = 0
        for i, v in enumerate(vals):
            await s.put(i, v)
            most = max(most, len(s._cleaner.batches))
        assert most == 2  # the value being written and the next one: the device is never idle
        while s._tasks:
            await asyncio.gather(*list(s._tasks))
        assert s.errors == []
        for i, v in enumerate(vals):
            assert np.array_equal(await s.get(i), v)


async def test_put_to_nvme_in_a_persistent_store_survives_reopening(tmp_path):
    async with TieredStore(tmp_path, host="1M", persist=True) as s:
        await s.put("a", np.arange(1000.0), to="nvme")
        await s.put_many({"b": torch.arange(7), "c": np.ones(5000, np.int8)}, to="nvme")
        assert s.where("a") == ["nvme"]
    async with TieredStore(tmp_path, host="1M", persist=True) as s:
        assert np.array_equal(await s.get("a"), np.arange(1000.0))
        assert torch.equal(await s.get("b"), torch.arange(7))
        assert np.array_equal(await s.get("c"), np.ones(5000, np.int8))


# -- fresh results in recycled memory ---------------------------------------------------------


@pytest.fixture
def recycling():
    """A pool emptied before and after the test (it is process-wide)."""
    from aionvme.memory import recycle_limit

    limit, _ = recycle_limit()
    recycle_limit(0)
    recycle_limit(limit)
    yield recycle_limit
    recycle_limit(0)
    recycle_limit(limit)


def test_a_recycled_buffer_takes_the_memory_of_one_freed_before_it(recycling):
    from aionvme._engine import AlignedBuffer, counters

    base = counters()["aligned_bytes"]
    a = AlignedBuffer(3 * MiB + 5, recycle=True)
    addr = a.address
    np.frombuffer(memoryview(a), np.uint8)[:] = 7
    del a
    assert recycling()[1] == 3 * MiB + 4096  # kept, page-rounded, and not counted as live
    assert counters()["aligned_bytes"] == base
    other = AlignedBuffer(2 * MiB, recycle=True)
    assert other.address != addr  # another size: a new mapping
    b = AlignedBuffer(3 * MiB + 5, recycle=True)
    assert b.address == addr and recycling()[1] == 0
    assert np.frombuffer(memoryview(b), np.uint8)[:4].tolist() == [7] * 4  # old bytes: not zeroed
    c = AlignedBuffer(3 * MiB + 5)  # not recycled: fresh and zero-filled, and unmapped when freed
    assert not np.frombuffer(memoryview(c), np.uint8).any()
    del b, c, other
    assert recycling()[1] == 5 * MiB + 4096


def test_recycling_keeps_no_more_than_its_limit_and_never_hooked_memory(recycling):
    from aionvme._engine import AlignedBuffer

    recycling(4 * MiB)
    bufs = [AlignedBuffer(MiB, recycle=True) for _ in range(6)]
    del bufs
    assert recycling() == (4 * MiB, 4 * MiB)  # two of the six were unmapped
    hooked = AlignedBuffer(2 * MiB, recycle=True)
    calls = []
    hooked.set_release_hook(calls.append)  # e.g. registered with CUDA: its pages must go
    del hooked
    assert len(calls) == 1 and recycling()[1] == 4 * MiB
    assert recycling(MiB) == (MiB, MiB)  # lowering the limit unmaps what is over it
    assert not AlignedBuffer(8 * MiB, recycle=True, lock=False).locked


async def test_nvme_gets_land_in_recycled_memory_with_their_own_bytes(tmp_path, recycling):
    def at_phase_16(k):  # the same phase for each: the same span, so the same recycled size
        v = nvme.empty(5 * MiB + 4096)[16 : 16 + 5 * MiB]
        v[:] = np.random.default_rng(k).integers(0, 256, 5 * MiB, dtype=np.uint8)
        return v

    vals = {k: at_phase_16(k) for k in range(4)}
    tens = {k: torch.randn(MiB // 4 + k) for k in range(2)}  # 1 MiB and a few bytes: a phase-placed span
    async with TieredStore(tmp_path, host=0) as s:
        await s.put_many({**vals, **{("t", k): v for k, v in tens.items()}})
        first = await s.get(0)
        page = first.ctypes.data // 4096  # each value sits at its own phase in its first page
        assert np.array_equal(first, vals[0])
        del first  # its pages go back for the next result of the size
        for k in (1, 2, 3, 0):
            got = await s.get(k)
            assert np.array_equal(got, vals[k])  # the memory of the one before, with this value's bytes
            assert got.ctypes.data // 4096 == page
            del got
        for k, v in tens.items():
            for _ in range(2):
                got_t = await s.get(("t", k))
                assert torch.equal(got_t, v) and got_t.data_ptr() % 4096 == v.data_ptr() % 4096
                del got_t
        many = await s.get_many(list(vals))  # all alive at once: each its own memory
        assert len({m.ctypes.data for m in many}) == 4
        assert all(np.array_equal(m, vals[k]) for k, m in zip(vals, many))
