"""TieredStore: the core API on real slab files (ext4 under tmp_path)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os

import numpy as np
import pytest
import torch

import aionvme as nvme
from aionvme.exceptions import AionvmeError, BufferTypeError, DeviceError
from aionvme.store import (
    StoreClosedError,
    StoreFullError,
    StoreKeyError,
    StoreTimeoutError,
    SyncTieredStore,
    TieredStore,
)

KiB = 1 << 10
MiB = 1 << 20


def rand(n: int, seed: int = 0, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


def slab_files(d) -> list[str]:
    return sorted(p for p in os.listdir(d) if p.endswith(".slab"))


async def test_put_get_roundtrip_numpy_and_torch_every_dtype(tmp_path):
    values = {
        "f32": rand(1000),
        "f16_2d": rand(777, 1, "float16").reshape(7, 111),
        "i64_3d": np.arange(2 * 3 * 5, dtype=np.int64).reshape(2, 3, 5),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 4), np.float32),
        "noncontig": np.arange(100, dtype=np.int32)[::3],
        "t_bf16": torch.randn(33, 65).to(torch.bfloat16),
        "t_f32": torch.randn(5, 4, 3),
        "t_u8": torch.randint(0, 255, (4097,), dtype=torch.uint8),
        "t_empty": torch.empty(0, dtype=torch.float16),
        "t_fp8": torch.randn(100).to(torch.float8_e4m3fn),
        "t_transposed": torch.randn(20, 30).t(),
    }
    async with TieredStore(tmp_path, host="64K") as s:  # small: most values go through NVMe
        for k, v in values.items():
            await s.put(k, v)
        assert len(s) == len(values) and all(k in s for k in values)
        for _ in range(2):  # cold, then (some) promoted
            for k, v in values.items():
                got = await s.get(k)
                assert type(got) is type(v), k
                assert got.dtype == v.dtype and tuple(got.shape) == tuple(v.shape), k
                if isinstance(v, np.ndarray):
                    assert np.array_equal(got, v), k
                else:
                    assert torch.equal(got.view(torch.uint8), v.contiguous().view(torch.uint8)), k


async def test_put_copies_get_owns(tmp_path):
    a = rand(5000)
    async with TieredStore(tmp_path, host="1M") as s:
        await s.put("a", a)
        a[:] = 0  # the store kept its own copy
        got = await s.get("a")
        assert np.array_equal(got, rand(5000))
        got[:] = 7  # and the result is the caller's own
        assert np.array_equal(await s.get("a"), rand(5000))


async def test_eviction_to_nvme_lru_and_promotion(tmp_path):
    n = 64 * KiB // 4  # 64 KiB values, host holds 4
    async with TieredStore(tmp_path, host=4 * 64 * KiB) as s:
        for i in range(6):
            await s.put(i, rand(n, i))
        st = s.stats()
        assert st["host"]["entries"] == 4 and st["host"]["used"] <= st["host"]["capacity"]
        assert s.where(0) == ["nvme"] and s.where(1) == ["nvme"]  # least recently used went first
        assert s.where(5) == ["host"]
        assert np.array_equal(await s.get(0), rand(n, 0))  # a miss: read from NVMe, promoted
        assert "host" in s.where(0)
        st = s.stats()
        assert st["host"]["misses"] == 1 and st["nvme"]["hits"] == 1 and st["host"]["evictions"] >= 3
        await s.get(3)  # touch 3: now 2 is the oldest resident
        await s.put(9, rand(n, 9))
        assert s.where(2) == ["nvme"] and "host" in s.where(3)
        for i in [*range(6), 9]:
            assert np.array_equal(await s.get(i), rand(n, i)), i


async def test_missing_key_is_a_keyerror_and_an_aionvme_error(tmp_path):
    async with TieredStore(tmp_path, host="1M") as s:
        for call in (s.get("nope"), s.delete("nope"), s.evict("nope"), s.prefetch(["nope"])):
            with pytest.raises(KeyError) as ei:
                await call
            assert isinstance(ei.value, StoreKeyError) and isinstance(ei.value, AionvmeError)
        assert "nope" not in s
        with pytest.raises(BufferTypeError):
            await s.put("x", [1, 2, 3])
        assert s.stats()["nvme"]["misses"] == 4


async def test_delete_and_overwrite_free_space(tmp_path):
    async with TieredStore(tmp_path, host="256K") as s:
        for rnd in range(3):
            for i in range(8):
                await s.put(i, rand(16 * KiB, i + rnd))
        st = s.stats()
        assert st["host"]["used"] <= 256 * KiB
        nvme_used = st["nvme"]["used"]
        assert nvme_used <= 8 * 64 * KiB  # overwritten versions' extents were reused
        for i in range(8):
            assert np.array_equal(await s.get(i), rand(16 * KiB, i + 2))
            await s.delete(i)
        assert len(s) == 0
        st = s.stats()
        assert st["host"]["used"] == 0 and st["nvme"]["used"] == 0
        assert st["nvme"]["free_extents"] == 1  # coalesced back into one


async def test_hold_pins_and_backpressure_times_out(tmp_path):
    n = 64 * KiB
    async with TieredStore(tmp_path, host=2 * n) as s:
        await s.put("a", np.full(n, 1, np.uint8))
        await s.put("b", np.full(n, 2, np.uint8))
        async with s.hold("a") as ha, s.hold("b") as hb:
            assert ha[0] == 1 and hb[-1] == 2
            # the tier is full of held values: a put waits, then gives up
            with pytest.raises(StoreTimeoutError) as ei:
                await s.put("c", np.full(n, 3, np.uint8), timeout=0.05)
            assert isinstance(ei.value, TimeoutError)
            assert "c" not in s and "host" in s.where("a")  # (write-behind may have cleaned it too)
            # without a timeout it waits until a hold ends
            task = asyncio.ensure_future(s.put("c", np.full(n, 3, np.uint8)))
            await asyncio.sleep(0.02)
            assert not task.done()
        await asyncio.wait_for(task, 5)
        assert s.stats()["host"]["wait_s"] > 0.04
        for k, v in (("a", 1), ("b", 2), ("c", 3)):
            assert (await s.get(k) == v).all()


async def test_hold_loads_a_cold_value_and_evict_waits_for_the_holder(tmp_path):
    async with TieredStore(tmp_path, host="1M") as s:
        v = rand(10000)
        await s.put("k", v)
        await s.evict("k")
        assert s.where("k") == ["nvme"]
        async with s.hold("k") as h:
            assert s.where("k") == ["host", "nvme"] and np.array_equal(h, v)
            ev = asyncio.ensure_future(s.evict("k"))
            await asyncio.sleep(0.01)
            assert not ev.done() and "host" in s.where("k")
        await asyncio.wait_for(ev, 5)
        assert s.where("k") == ["nvme"]


async def test_prefetch_starts_now_and_get_waits_for_it(tmp_path):
    async with TieredStore(tmp_path, host="4M") as s:
        await s.put_many({f"k{i}": rand(64 * KiB, i) for i in range(4)})
        for i in range(4):
            await s.evict(f"k{i}")
        await s.prefetch(["k0", "k1"])
        assert s._index["k0"].loading is not None  # in flight, not finished
        got = await s.get("k0")
        assert np.array_equal(got, rand(64 * KiB, 0))
        await asyncio.sleep(0.05)
        assert "host" in s.where("k1")
        assert s.stats()["host"]["hits"] >= 1


async def test_a_put_that_waits_for_a_loading_value_goes_on_when_the_load_ends(tmp_path):
    """The only value a put could evict is being prefetched: the put waits, and
    must wake when the load ends (found by the property test: the tier's wake-up
    came while the entry still counted as loading, and nothing woke it again)."""
    async with TieredStore(tmp_path, host=64 * KiB, nvme="1M") as s:
        await s.put("a", rand(10_000, 1))
        await s.evict("a")
        await s.prefetch(["a"])  # a's load has its room; reading it is in flight
        assert s._index["a"].loading is not None
        await asyncio.wait_for(s.put("d", rand(10_000, 2)), 10)  # room only by evicting a
        assert np.array_equal(await s.get("d"), rand(10_000, 2))
        assert np.array_equal(await s.get("a"), rand(10_000, 1))


async def test_two_holds_whose_values_do_not_fit_together_take_turns(tmp_path):
    """Each hold loads its value, and the other's load evicted it before the
    holder resumed to take it: the two loads evicted each other forever
    (found by the property test). A value a waiter is about to take is not
    evictable until it has taken it."""
    async with TieredStore(tmp_path, host=64 * KiB) as s:
        vals = {
            k: np.random.default_rng(i).integers(0, 256, 40_000, dtype=np.uint8) for i, k in enumerate("bc")
        }
        await s.put_many(vals)
        await s.evict("b")
        await s.evict("c")

        async def hold(k):
            async with s.hold(k) as t:
                await asyncio.sleep(0)
                return np.array_equal(t, vals[k])

        async def get(k):
            return np.array_equal(await s.get(k), vals[k])

        got = await asyncio.wait_for(asyncio.gather(hold("c"), hold("b"), get("c"), get("b")), 10)
        assert got == [True] * 4


async def test_a_write_behind_is_in_the_engine_when_the_put_that_started_it_returns(tmp_path):
    """A put that needs no room and copies without suspending starts the
    write-behind of colder values: their writes must reach the engine before
    the put returns, not at the loop's next iteration (a caller that puts
    again at once would leave the device idle until it next suspends)."""
    mib = 1 << 20
    vals = [np.random.default_rng(i).integers(0, 256, mib, dtype=np.uint8) for i in range(6)]
    async with TieredStore(tmp_path, host=3 * mib + 64 * KiB, nvme="64M") as s:
        await s.put(0, vals[0])
        await s.put(1, vals[1])
        slab = s._nvme.slabs[0].file._h
        assert slab.active == 0
        await s.put(2, vals[2])  # three quarters full: the write-behind starts
        assert slab.active > 0
        for i in range(3, 6):  # each needs room: the values written behind are dropped
            await s.put(i, vals[i])
        for i in range(6):
            assert np.array_equal(await s.get(i), vals[i])
        assert s.stats()["host"]["evictions"] >= 2


async def test_a_write_behind_cancelled_before_it_ran_leaves_nothing_unawaited(tmp_path, recwarn):
    """The write a put started for the write-behind is awaited by a task; a
    task cancelled before its first step (a loop shutting down) never awaits
    it: its coroutine must not be left for the garbage collector to warn
    about, nor its values pinned in the host tier."""
    mib = 1 << 20
    vals = [np.random.default_rng(i).integers(0, 256, mib, dtype=np.uint8) for i in range(3)]
    vals.append(np.random.default_rng(3).integers(0, 256, 5 * mib // 2, dtype=np.uint8))
    s = TieredStore(tmp_path, host=3 * mib + 64 * KiB, nvme="64M")
    for i in range(3):
        await s.put(i, vals[i])
    cleaners = list(s._cleaner.batches)
    assert cleaners
    for t in cleaners:
        t.cancel()  # before it ran: the put returned without suspending
    await asyncio.wait(cleaners)
    await asyncio.sleep(0.2)  # the writes themselves go on to their end
    del cleaners, t  # the tasks hold their coroutines, and those what they were given
    gc.collect()
    # the values it was to write are not pinned: a put that needs their room
    # evicts them (written anew)
    await asyncio.wait_for(s.put(3, vals[3]), 10)
    for i in range(4):
        assert np.array_equal(await s.get(i), vals[i])
    await s.close()
    assert [str(w.message) for w in recwarn if "never awaited" in str(w.message)] == []


async def test_put_many_get_many(tmp_path):
    vals = {f"w{i}": torch.randn(1000 + i) for i in range(10)}
    async with TieredStore(tmp_path, host="16K", admit="second-touch") as s:
        await s.put_many(vals)
        got = await s.get_many(list(vals))
        for (_k, v), g in zip(vals.items(), got):
            assert torch.equal(v, g)
        # second-touch admission: the first miss did not promote, the second does
        assert s.where("w0") == ["nvme"]
        await s.get("w0")
        assert "host" in s.where("w0")


async def test_policies_lfu_and_s3fifo(tmp_path):
    n = 32 * KiB
    for policy in ("lfu", "s3fifo"):
        d = tmp_path / policy
        async with TieredStore(d, host=3 * n, policy=policy) as s:
            await s.put("hot", np.full(n, 1, np.uint8))
            for _ in range(3):
                await s.get("hot")
            for i in range(6):  # a scan of one-hit keys
                await s.put(f"scan{i}", np.full(n, i, np.uint8))
            assert "host" in s.where("hot"), policy
            for i in range(6):
                assert (await s.get(f"scan{i}") == i).all()


def test_s3fifo_victims_are_found_lazily_in_s3fifo_order():
    # A put that evicts takes one or two victims: the policy must not walk (and
    # reinsert) every resident key for them. 10,000 keys, one touched in the
    # small queue and one in main.
    from aionvme.store import S3FIFOPolicy

    p = S3FIFOPolicy(small_ratio=0.5)
    for k in range(10_000):
        p.insert(k, 1)
    p.touch(0)
    list(p.victims())  # a full pass: 0 (touched in small) went to main, the rest are victims
    for k in range(1, 5_001):
        p.remove(k)  # evicted: ghosts now
    p.touch(9_000)
    assert next(p.victims()) == 5_001  # the head of the small queue, untouched
    assert 9_000 in p._small  # a touched key past the first slice: not looked at yet
    order = list(p.victims())  # consumed whole: the S3-FIFO order
    assert 9_000 in p._main and order.index(9_000) > order.index(0) >= 0
    assert (
        order[:3] == [5_001, 5_002, 5_003]
        and len(order) == 5_000
        and set(order) == set(range(5_001, 10_000)) | {0}
    )


async def test_user_policy_object(tmp_path):
    class NewestFirst:  # evicts the most recently inserted key
        def __init__(self):
            self.keys = []

        def insert(self, key, nbytes):
            self.keys.append(key)

        def touch(self, key):
            pass

        def remove(self, key):
            self.keys.remove(key)

        def victims(self):
            return iter(reversed(list(self.keys)))

    n = 16 * KiB
    async with TieredStore(tmp_path, host=2 * n, policy=NewestFirst) as s:
        for i in range(3):
            await s.put(i, np.full(n, i, np.uint8))
        # (write-behind may also have written 0 while 1 was put: it stays in memory, clean)
        assert "host" in s.where(0) and s.where(1) == ["nvme"] and s.where(2) == ["host"]


async def test_striping_over_two_directories(tmp_path):
    d1, d2 = tmp_path / "a", tmp_path / "b"
    v = rand(3 * MiB // 4 + 13)  # ~3 MiB, stripe threshold 1 MiB
    async with TieredStore([d1, d2], host=0, stripe="1M") as s:
        await s.put("v", v)
        await s.put("small", rand(100))
        ext = s._index["v"].disk
        assert sorted({x[0] for x in ext}) == [0, 1]  # one piece per directory
        assert np.array_equal(await s.get("v"), v)
        assert np.array_equal(await s.get("small"), rand(100))
        assert len(slab_files(d1)) == 1 and len(slab_files(d2)) == 1
    assert slab_files(d1) == [] and slab_files(d2) == []  # scratch: removed on close


async def test_full_nvme_tier_is_a_typed_enospc_and_the_store_stays_usable(tmp_path):
    async with TieredStore(tmp_path, host=0, nvme="1M") as s:
        await s.put("a", np.ones(600 * KiB, np.uint8))
        with pytest.raises(StoreFullError) as ei:
            await s.put("b", np.ones(600 * KiB, np.uint8))
        assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOSPC
        assert "b" not in s and (await s.get("a")).sum() == 600 * KiB
        await s.delete("a")
        await s.put("b", np.full(600 * KiB, 2, np.uint8))
        assert (await s.get("b") == 2).all()


async def test_eviction_into_a_full_nvme_tier_fails_the_put_only(tmp_path):
    n = 256 * KiB
    async with TieredStore(tmp_path, host=2 * n, nvme=n) as s:
        await s.put("a", np.full(n, 1, np.uint8))
        await s.put("b", np.full(n, 2, np.uint8))
        await s.put("c", np.full(n, 3, np.uint8))  # a goes to NVMe, which is now full
        with pytest.raises(StoreFullError):
            await s.put("d", np.full(n, 4, np.uint8))  # would push b out: no room anywhere
        assert "d" not in s
        for k, v in (("a", 1), ("b", 2), ("c", 3)):
            assert (await s.get(k) == v).all()


async def test_get_into_out_and_device_errors(tmp_path):
    async with TieredStore(tmp_path, host="1M") as s:
        v = rand(1000)
        await s.put("v", v)
        out = np.empty(1000, np.float32)
        assert await s.get("v", out=out) is out and np.array_equal(out, v)
        await s.evict("v")
        out2 = np.empty(1000, np.float32)
        await s.get("v", out=out2)
        assert np.array_equal(out2, v)
        with pytest.raises(ValueError):
            await s.get("v", out=np.empty(10, np.float32))
        with pytest.raises(DeviceError):
            await s.get("v", device="cuda")


async def test_concurrent_gets_of_one_cold_key_read_once(tmp_path):
    async with TieredStore(tmp_path, host="4M") as s:
        v = rand(256 * KiB)
        await s.put("v", v)
        await s.evict("v")
        got = await asyncio.gather(*(s.get("v") for _ in range(8)))
        assert all(np.array_equal(g, v) for g in got)
        assert s.stats()["nvme"]["hits"] == 1  # one load, the other gets waited for it


async def test_delete_while_a_read_is_in_flight_keeps_the_extent(tmp_path):
    async with TieredStore(tmp_path, host=0) as s:
        v = rand(2 * MiB // 4, 1)
        await s.put("v", v)
        reads = [asyncio.ensure_future(s.get("v")) for _ in range(4)]
        await asyncio.sleep(0)  # the reads are submitted
        await s.delete("v")
        await s.put("w", rand(2 * MiB // 4, 2))  # must not land on v's extent while it is read
        for r in reads:
            assert np.array_equal(await r, v)
        assert np.array_equal(await s.get("w"), rand(2 * MiB // 4, 2))


async def test_close_removes_scratch_files_and_refuses_calls(tmp_path):
    s = TieredStore(tmp_path, host="1M")
    await s.put("a", rand(10))
    await s.evict("a")
    assert len(slab_files(tmp_path)) == 1
    await s.close()
    assert slab_files(tmp_path) == [] and s.closed
    with pytest.raises(StoreClosedError):
        await s.get("a")
    await s.close()  # idempotent


async def test_persist_reopen_gives_back_every_key(tmp_path):
    vals = {f"k{i}": rand(1000 * (i + 1), i) for i in range(5)}
    async with TieredStore(tmp_path, host="8K", persist=True) as s:
        await s.put_many(vals)
        await s.put("k0", rand(10, 99))  # overwritten
        await s.delete("k4")
        await s.put("t", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    async with TieredStore(tmp_path, host="8K", persist=True) as s:
        assert sorted(s.keys()) == ["k0", "k1", "k2", "k3", "t"]
        assert np.array_equal(await s.get("k0"), rand(10, 99))
        for i in (1, 2, 3):
            assert np.array_equal(await s.get(f"k{i}"), vals[f"k{i}"])
        t = await s.get("t")
        assert t.dtype == torch.bfloat16 and torch.equal(
            t, torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
        )
        with pytest.raises(TypeError):
            await s.put(1.5, rand(3))  # str, bytes and int keys: tests/test_store_cache.py


def test_sync_store_without_a_loop(tmp_path):
    with SyncTieredStore(tmp_path, host="64K") as s:
        v = torch.randn(100, 100)
        s.put("v", v)
        s.put_many({"a": rand(10), "b": rand(20)})
        assert torch.equal(s.get("v"), v) and "v" in s and len(s) == 3
        with s.hold("a") as h:
            assert np.array_equal(h, rand(10))
        s.evict("v")
        s.prefetch(["v"])
        assert [g.shape for g in s.get_many(["a", "b"])] == [(10,), (20,)]
        s.delete("a")
        with pytest.raises(KeyError):
            s.get("a")
        assert s.stats()["host"]["capacity"] == 64 * KiB
    with pytest.raises(StoreClosedError):
        s.get("v")


def test_constructor_errors(tmp_path):
    with pytest.raises(ValueError):
        TieredStore(tmp_path, policy="nope")
    with pytest.raises(ValueError):
        TieredStore(tmp_path, host="lots")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError):
            TieredStore(tmp_path, gpu="1G")


def test_exported_from_the_package():
    assert nvme.TieredStore is TieredStore and nvme.SyncTieredStore is SyncTieredStore
    assert issubclass(nvme.StoreKeyError, KeyError) and issubclass(nvme.StoreFullError, OSError)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)")
async def test_gpu_tier_roundtrip(tmp_path):
    async with TieredStore(tmp_path, host="1M", gpu="1M") as s:
        v = torch.randn(64 * KiB, device="cuda")  # 256 KiB
        await s.put("g", v)
        assert s.where("g") == ["gpu"]
        for i in range(5):
            await s.put(f"g{i}", torch.full((64 * KiB,), float(i), device="cuda"))
        assert "gpu" not in s.where("g")
        got = await s.get("g", device="cuda")
        assert got.is_cuda and torch.equal(got, v)
        assert torch.equal(await s.get("g1"), torch.full((64 * KiB,), 1.0))
        await s.evict("g", to="nvme")
        assert s.where("g") == ["nvme"]
        async with s.hold("g", device="cuda") as h:
            assert h.is_cuda and torch.equal(h, v)


async def test_compaction_joins_free_space_when_fragmented(tmp_path):
    n = 64 * KiB
    for persist in (False, True):
        d = tmp_path / f"p{persist}"
        async with TieredStore(d, host=0, nvme=8 * n, persist=persist) as s:
            for i in range(8):
                await s.put(f"k{i}", np.full(n, i, np.uint8))
            for i in range(0, 8, 2):
                await s.delete(f"k{i}")  # four holes of 64 KiB
            st = s.stats()["nvme"]
            assert st["free_extents"] == 4 and st["fragmentation"] > 0.7
            # 128 KiB fits in no hole: the allocation compacts, then succeeds
            await s.put("big", np.full(2 * n, 9, np.uint8))
            st = s.stats()["nvme"]
            assert st["compactions"] >= 1 and st["used"] == 6 * n
            for i in range(1, 8, 2):
                assert (await s.get(f"k{i}") == i).all()
            assert (await s.get("big") == 9).all()
        if persist:  # the moves were journaled: a reopen finds every value where it went
            async with TieredStore(d, host=0, nvme=8 * n, persist=True) as s:
                for i in range(1, 8, 2):
                    assert (await s.get(f"k{i}") == i).all()
                assert (await s.get("big") == 9).all()


async def test_compact_skips_values_being_read(tmp_path):
    n = 256 * KiB
    async with TieredStore(tmp_path, host=0, nvme=4 * n) as s:
        for i in range(4):
            await s.put(i, np.full(n, i, np.uint8))
        await s.delete(0)
        reads = [asyncio.ensure_future(s.get(i)) for i in (1, 2, 3)]
        await asyncio.sleep(0)
        moved = await s.compact()  # all three are being read: nothing moves under the reads
        assert moved == 0
        for i, r in zip((1, 2, 3), reads):
            assert (await r == i).all()
        assert await s.compact() == 3 * n
        assert s.stats()["nvme"]["free_extents"] == 1
        for i in (1, 2, 3):
            assert (await s.get(i) == i).all()


def test_journal_torn_tail_is_cut_and_the_rest_replayed(tmp_path):
    with SyncTieredStore(tmp_path, host=0, persist=True) as s:
        s.put("a", rand(1000, 1))
    # a crash after two more records: the second one torn halfway
    s = SyncTieredStore(tmp_path, host=0, persist=True)
    s.put("b", rand(1000, 2))
    s.put("c", rand(1000, 3))
    journal = tmp_path / "aionvme-store.journal"
    size = journal.stat().st_size
    s.aio._journal.close()  # no clean close: the snapshot is not rewritten
    s.aio._nvme.close(remove=False)
    s.aio._closed = True
    s.close()
    os.truncate(journal, size - 10)
    with SyncTieredStore(tmp_path, host=0, persist=True) as s:
        assert sorted(s.keys()) == ["a", "b"]
        assert np.array_equal(s.get("b"), rand(1000, 2))
        s.put("d", rand(10, 4))  # appends after the cut
    with SyncTieredStore(tmp_path, host=0, persist=True) as s:
        assert sorted(s.keys()) == ["a", "b", "d"]


def test_extent_allocator_coalesces_and_finds_best_fit():
    from aionvme.store import ExtentAllocator

    a = ExtentAllocator(10 * 4096)
    offs = [a.alloc(4096) for _ in range(10)]
    assert offs == [i * 4096 for i in range(10)] and a.alloc(1) is None
    for i in (1, 2, 5, 7, 8):
        a.free(offs[i], 4096)
    assert a.extents() == [(4096, 8192), (5 * 4096, 4096), (7 * 4096, 8192)]
    assert a.alloc(4096) == 5 * 4096  # best fit: the one-page hole
    assert a.alloc(8000) == 4096  # lowest of the equal fits
    with pytest.raises(ValueError):
        a.free(offs[0] + 1, 4096)
    a.free(offs[0], 4096)
    with pytest.raises(ValueError):
        a.free(offs[0], 4096)  # a double free is refused, not absorbed
    assert a.used + a.free_bytes == a.capacity


async def test_cancelled_put_leaves_the_key_as_it_was_and_nothing_leaks(tmp_path):
    n = 64 * KiB
    async with TieredStore(tmp_path, host=2 * n) as s:
        await s.put("k", np.full(n, 1, np.uint8))
        await s.put("other", np.full(n, 2, np.uint8))
        async with s.hold("k"), s.hold("other"):
            t = asyncio.ensure_future(s.put("k", np.full(n, 3, np.uint8)))  # waits for room
            await asyncio.sleep(0.01)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
        assert (await s.get("k") == 1).all()
        # a cancelled cold read: the extent stays whole, the key stays readable
        await s.evict("k")
        g = asyncio.ensure_future(s.get("k"))
        await asyncio.sleep(0)
        g.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await g
        assert (await s.get("k") == 1).all()
        await s.delete("k")
        await s.delete("other")
        await asyncio.sleep(0.01)
        st = s.stats()
        assert st["host"]["used"] == 0 and st["nvme"]["used"] == 0 and not s._klocks


def test_a_store_belongs_to_one_loop(tmp_path):
    s = TieredStore(tmp_path, host="1M")
    asyncio.run(s.put("a", rand(10)))
    with pytest.raises(StoreClosedError):
        asyncio.run(s.get("a"))  # another loop: refused, not corrupted
    s.close_sync()
    assert slab_files(tmp_path) == []


def test_journal_folds_into_a_snapshot_while_puts_go_on(tmp_path):
    with SyncTieredStore(tmp_path, host="16K", persist=True) as s:
        s.aio._journal.snapshot_records = 5  # fold every few records
        for i in range(30):
            s.put(f"k{i}", rand(100 + i, i))
        s.delete("k3")
        assert s.aio._journal.generation > 2 and s.aio._journal.records <= 6
    with SyncTieredStore(tmp_path, host="16K", persist=True) as s:
        assert len(s) == 29 and "k3" not in s
        for i in (0, 17, 29):
            assert np.array_equal(s.get(f"k{i}"), rand(100 + i, i))


def test_an_unclosed_scratch_store_warns_and_removes_its_slab(tmp_path):
    import gc

    s = TieredStore(tmp_path, host="1M")
    asyncio.run(s.put("a", rand(2000)))
    asyncio.run(asyncio.sleep(0))
    assert len(slab_files(tmp_path)) == 1
    with pytest.warns(ResourceWarning, match="unclosed"):
        del s
        gc.collect()
    assert slab_files(tmp_path) == []
