"""The store as a serving engine's KV-cache tier (issue 35): keys of str,
bytes and int (persisted with their type), per-key hits (get_many
missing='skip', count_prefix, contains), pins across calls, cache mode
(on_full='evict': a bounded disk, the coldest values dropped), all on real
slab files. Calls from other threads: tests/test_store_threads.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _fuzz import fuzz_settings
from _kvblocks import KiB, MiB, block, disk_bytes, nvme_for
from aionvme.store import (
    OutBufferError,
    StoreClosedError,
    StoreFullError,
    StoreKeyError,
    StoreKeyTypeError,
    StorePinError,
    SyncTieredStore,
    TieredStore,
)


def crash(s: SyncTieredStore) -> None:
    """Leave the directory as a crash would: no snapshot, the journal as it is."""
    s.aio._journal.close()
    s.aio._nvme.close(remove=False)
    s.aio._closed = True
    s.close()


# -- keys: str, bytes, int, persisted with their type -----------------------------------


KEYS = ["1", 1, b"1", -7, 1 << 200, -(1 << 100), b"\x00\xff", "", b"", 0, "i:5", "b:31"]


@pytest.mark.parametrize("reopen", ["snapshot", "journal"])
def test_str_bytes_int_keys_persist_with_their_type(tmp_path, reopen):
    s = SyncTieredStore(tmp_path, host="64K", persist=True)
    for k in KEYS:
        s.put(k, block(k, 4 * KiB))
    s.delete(b"\x00\xff")
    s.put(-7, block("again", 4 * KiB))
    if reopen == "journal":
        crash(s)  # the journal's records only
    else:
        s.close()  # a snapshot (format 3: typed keys)
    with SyncTieredStore(tmp_path, host="64K", persist=True) as s:
        keys = s.keys()
        assert sorted(map(repr, keys)) == sorted(repr(k) for k in KEYS if k != b"\x00\xff")
        assert len({(type(k), k) for k in keys}) == len(KEYS) - 1  # "1", 1 and b"1" stay three keys
        for k in keys:
            want = block("again", 4 * KiB) if k == -7 else block(k, 4 * KiB)
            assert type(k) in (str, bytes, int)
            assert np.array_equal(s.get(k), want), k
        assert s.contains(1) and s.contains("1") and s.contains(b"1") and not s.contains(b"\x00\xff")


def test_typed_keys_survive_the_journal_folding_into_snapshots(tmp_path):
    s = SyncTieredStore(tmp_path, host=0, nvme=nvme_for(MiB), on_full="evict", persist=True)
    s.aio._journal.snapshot_records = 5  # fold every few records (from the files, on the commit thread)
    for k in range(24):  # 16 fit: the first 8 are dropped, journaled as deletes
        s.put(k if k % 2 else k.to_bytes(2, "big"), block(k, 64 * KiB))
    assert len(s.drain_evicted()) == 8
    crash(s)
    assert b'"typed"' in (tmp_path / "aionvme-store.index").read_bytes()  # folded at least once
    with SyncTieredStore(tmp_path, host=0, nvme=nvme_for(MiB), on_full="evict", persist=True) as s:
        want = {k if k % 2 else k.to_bytes(2, "big"): k for k in range(8, 24)}
        assert sorted(map(repr, s.keys())) == sorted(map(repr, want))
        for key, k in want.items():
            assert np.array_equal(s.get(key), block(k, 64 * KiB))


def test_a_store_of_str_keys_keeps_format_2(tmp_path):
    with SyncTieredStore(tmp_path, host="64K", persist=True) as s:
        s.put("a", block("a", 4 * KiB))
    assert b'"aionvme-store/2"' in (tmp_path / "aionvme-store.index").read_bytes()
    with SyncTieredStore(tmp_path, host="64K", persist=True) as s:
        s.put(5, block(5, 4 * KiB))
    assert b'"aionvme-store/3"' in (tmp_path / "aionvme-store.index").read_bytes()


@pytest.mark.parametrize("key", [True, 1.5, ("a",), 1 << 5000])
async def test_a_persistent_store_refuses_other_keys(tmp_path, key):
    async with TieredStore(tmp_path, host=0, persist=True) as s:
        with pytest.raises(StoreKeyTypeError):
            await s.put(key, block("x"))
        assert s.keys() == []


# -- per-key hits ------------------------------------------------------------------------


async def test_get_many_skip_fills_what_is_there_and_leaves_the_rest(tmp_path):
    async with TieredStore(tmp_path, host=128 * KiB) as s:
        for k in (1, 3, 4):
            await s.put(k, block(k))
        await s.evict(3)  # one from NVMe, the others from host memory
        outs = [np.full(64 * KiB, 7, np.uint8) for _ in range(5)]
        got = await s.get_many([0, 1, 2, 3, 4], out=outs, missing="skip")
        assert got == [False, True, False, True, True]
        for i in (0, 2):
            assert (outs[i] == 7).all()  # untouched
        for i in (1, 3, 4):
            assert np.array_equal(outs[i], block(i))
        vals = await s.get_many([9, 4, 3], missing="skip")
        assert vals[0] is None and np.array_equal(vals[1], block(4)) and np.array_equal(vals[2], block(3))
        with pytest.raises(StoreKeyError):
            await s.get_many([1, 2])
        with pytest.raises(ValueError, match="missing"):
            await s.get_many([1], missing="ignore")
        assert await s.get_many([], missing="skip") == []
        # a wrong buffer anywhere: a typed error before any buffer is filled
        outs = [np.full(64 * KiB, 7, np.uint8), np.full(10, 7, np.uint8)]
        with pytest.raises(OutBufferError):
            await s.get_many([1, 4], out=outs, missing="skip")
        assert (outs[0] == 7).all()


async def test_a_batch_of_host_hits_mixed_with_nvme_reads_and_misses(tmp_path):
    async with TieredStore(tmp_path, host=MiB, nvme=nvme_for(4 * MiB), on_full="evict") as s:
        for k in range(8):
            await s.put(k, block(k), to="nvme" if k % 2 else None)  # odd keys only on NVMe
        before = s.stats()["host"]["hits"]
        keys = [7, 0, 100, 2, 5, 4, 6, 3, 1, 101]
        outs = [np.zeros(64 * KiB, np.uint8) for _ in keys]
        got = await s.get_many(keys, out=outs, missing="skip")
        assert got == [k < 100 for k in keys]
        for k, o in zip(keys, outs):
            assert np.array_equal(o, block(k)) if k < 100 else not o.any()
        assert s.stats()["host"]["hits"] - before == 4  # the even keys, from host memory
        vals = await s.get_many(keys, missing="skip")  # fresh results: copies the caller owns
        for k, v in zip(keys, vals):
            assert v is None if k >= 100 else np.array_equal(v, block(k))
        assert not np.shares_memory(vals[1], s._host.arena)


def test_count_prefix_and_contains(tmp_path):
    with SyncTieredStore(tmp_path, host="1M") as s:
        for k in (10, 11, 12, 14):
            s.put(k, block(k, 4 * KiB))
        assert s.count_prefix([10, 11, 12, 13, 14]) == 3
        assert s.count_prefix([13, 10]) == 0
        assert s.count_prefix([]) == 0
        assert s.contains(14) and not s.contains(13) and 14 in s
        with pytest.raises(TypeError, match="list of keys"):
            s.count_prefix(10)  # type: ignore[arg-type]


# -- pins ---------------------------------------------------------------------------------


def test_pin_is_refcounted_and_unpin_past_zero_is_a_typed_error(tmp_path):
    with SyncTieredStore(tmp_path, host="1M") as s:
        s.put("a", block("a"))
        assert s.pin(["a", "missing", "a"]) == [True, False, True]
        s.unpin(["a"])
        s.unpin(["a"])
        with pytest.raises(StorePinError) as err:
            s.unpin(["a"])
        assert isinstance(err.value, ValueError)
        s.pin(["a"])
        with pytest.raises(StorePinError):
            s.unpin(["a", "a"])  # all or nothing: the one pin stays
        s.unpin(["a"])
        with pytest.raises(StorePinError):
            s.unpin(["missing"])


async def test_a_deleted_pinned_value_keeps_its_bytes_until_the_last_unpin(tmp_path):
    async with TieredStore(tmp_path, host=0, nvme=MiB, on_full="evict") as s:
        await s.put("a", block("a"))
        used = s._nvme.used
        assert s.pin(["a"]) == [True]
        e = s._index["a"]
        await s.delete("a")
        assert "a" not in s and s.pin(["a"]) == [False]
        with pytest.raises(StoreKeyError):
            await s.get("a")
        assert s._nvme.used == used and e.disk is not None  # still allocated: pinned
        s.unpin(["a"])
        await asyncio.sleep(0)  # the last unpin frees it on the loop
        assert s._nvme.used == 0


async def test_a_put_moves_the_pins_of_its_key_to_the_new_value(tmp_path):
    async with TieredStore(tmp_path, host=0, nvme=nvme_for(512 * KiB), on_full="evict") as s:
        for k in range(8):
            await s.put(k, block(k))
        s.pin([0])
        await s.put(0, block("new 0"))  # replaced while pinned
        for k in range(8, 24):
            await s.put(k, block(k))
        assert 0 in s and 0 not in s.drain_evicted()
        assert np.array_equal(await s.get(0), block("new 0"))
        assert s._nvme.used <= 512 * KiB
        s.unpin([0])
        for k in range(24, 32):
            await s.put(k, block(k))
        assert 0 in s.drain_evicted()


# -- cache mode -----------------------------------------------------------------------------


def test_cache_mode_checks_its_settings(tmp_path):
    with pytest.raises(ValueError, match="nvme="):
        TieredStore(tmp_path, on_full="evict")
    with pytest.raises(ValueError, match="on_full"):
        TieredStore(tmp_path, nvme="1M", on_full="drop")


@pytest.mark.parametrize("persist", [False, True])
async def test_a_full_tier_drops_its_coldest_values_and_never_grows(tmp_path, persist):
    cap = nvme_for(1 * MiB)
    async with TieredStore(tmp_path, host=0, nvme=cap, on_full="evict", persist=persist) as s:
        for k in range(16):  # 16 blocks of 64 KiB fill it
            await s.put(k, block(k))
        assert s.drain_evicted() == []
        await s.get(0)  # now the warmest
        for k in range(16, 20):
            await s.put(k, block(k))
            assert disk_bytes(s) <= cap
        assert s.drain_evicted() == [1, 2, 3, 4]
        assert s.drain_evicted() == []
        assert sorted(s.keys()) == [0, *range(5, 20)]
        for k in list(s):
            assert np.array_equal(await s.get(k), block(k))
        assert s.stats()["nvme"]["evictions"] == 4
        with pytest.raises(StoreFullError):
            await s.put("huge", np.zeros(MiB + 4096, np.uint8))
        assert len(s) == 16


async def test_pinned_and_held_values_are_never_dropped(tmp_path):
    async with TieredStore(tmp_path, host=64 * KiB, nvme=nvme_for(512 * KiB), on_full="evict") as s:
        for k in range(8):
            await s.put(k, block(k), to="nvme")
        assert s.pin([0, 1]) == [True, True]
        async with s.hold(2) as held:
            for k in range(8, 40):
                await s.put(k, block(k), to="nvme")
            assert np.array_equal(held, block(2))
            assert {0, 1, 2} <= set(s.keys())
        s.unpin([0, 1])
        evicted = s.drain_evicted()
        assert not {0, 1, 2} & set(evicted)
        for k in range(40, 48):
            await s.put(k, block(k), to="nvme")
        assert {0, 1, 2} & set(s.drain_evicted())  # unpinned and released: droppable again


async def test_when_everything_is_pinned_a_put_raises_full(tmp_path):
    async with TieredStore(tmp_path, host=0, nvme=nvme_for(256 * KiB), on_full="evict") as s:
        for k in range(4):
            await s.put(k, block(k))
        s.pin(range(4))  # type: ignore[arg-type]
        with pytest.raises(StoreFullError, match="pinned"):
            await s.put(9, block(9))
        assert sorted(s.keys()) == [0, 1, 2, 3]
        s.unpin([2])
        await s.put(9, block(9))
        assert s.drain_evicted() == [2]


async def test_dropped_keys_are_journaled_as_deletes(tmp_path):
    d = tmp_path / "s"
    s = SyncTieredStore(d, host=0, nvme=nvme_for(512 * KiB), on_full="evict", persist=True)
    for k in range(12):
        s.put(k, block(k))
    assert s.drain_evicted() == [0, 1, 2, 3]
    crash(s)  # the journal only: its delete records must hold
    s = SyncTieredStore(d, host=0, nvme=nvme_for(512 * KiB), on_full="evict", persist=True)
    try:
        assert sorted(s.keys()) == list(range(4, 12))
        for k in range(4, 12):
            assert np.array_equal(s.get(k), block(k))
        s.put(12, block(12))  # the coldest of a reopened store go first
        assert s.drain_evicted() == [4]
    finally:
        s.close()


async def test_cache_mode_compacts_when_free_space_is_in_pieces(tmp_path):
    async with TieredStore(tmp_path, host=0, nvme=nvme_for(MiB), on_full="evict") as s:
        for k in range(16):
            await s.put(k, block(k))
        for k in range(0, 16, 2):
            await s.delete(k)  # 512 KiB free, in 64 KiB holes
        s.pin([1, 3, 5])
        await s.put("big", block("big", 256 * KiB))  # fits once moved together: nothing dropped
        assert s.drain_evicted() == []
        assert s.stats()["nvme"]["compactions"] >= 1
        assert np.array_equal(await s.get("big"), block("big", 256 * KiB))
        for k in range(1, 16, 2):
            assert np.array_equal(await s.get(k), block(k))
        s.unpin([1, 3, 5])


async def test_write_behind_of_a_scratch_cache_stays_bounded(tmp_path):
    cap = 512 * KiB
    async with TieredStore(tmp_path, host=256 * KiB, nvme=cap, on_full="evict") as s:
        for k in range(64):
            await s.put(k, block(k))
            assert disk_bytes(s) <= cap
        present = [k for k in range(64) if k in s]
        assert len(present) >= 8
        got = await s.get_many(range(64), missing="skip")
        for k, v in enumerate(got):
            assert (v is None) == (k not in present)
            if v is not None:
                assert np.array_equal(v, block(k))
        assert set(s.drain_evicted()) == set(range(64)) - set(present)


# -- a property: pins, puts, deletes and evictions against a model -------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "pin", "unpin", "delete", "get"]),
        st.integers(0, 9),
        st.sampled_from([4 * KiB, 16 * KiB, 60 * KiB]),
    ),
    max_size=40,
)


@fuzz_settings(60)
@given(ops=OPS)
def test_pins_and_evictions_follow_a_model(tmp_path_factory, ops):
    """A cache of 256 KiB under random puts, pins, unpins, deletes and gets:
    a value whose key is pinned (pins taken while it was present, or moved to
    it by a put) is never evicted; pin says whether the key is present; unpin
    past zero is an error; every present key reads back its last value; the
    slab never takes more than the capacity."""
    cap = 256 * KiB
    present: dict[int, tuple[int, int]] = {}  # key -> (version, size) of its value
    life: dict[int, int] = {}  # key -> its current life (a delete or eviction ends one)
    pins: dict[int, list[int]] = {}  # key -> the life each pin was taken in, oldest first
    version = 0
    with SyncTieredStore(tmp_path_factory.mktemp("p"), host=0, nvme=cap, on_full="evict") as s:
        for op, k, n in ops:
            if op == "put":
                version += 1
                try:
                    s.put(k, block((k, version), n))
                except StoreFullError:
                    pass  # everything else is pinned: the key is as it was
                else:
                    if k not in present:
                        life[k] = life.get(k, 0) + 1
                    present[k] = (version, n)
            elif op == "pin":
                assert s.pin([k]) == [k in present]
                if k in present:
                    pins.setdefault(k, []).append(life[k])
            elif op == "unpin":
                if pins.get(k):
                    s.unpin([k])
                    pins[k].pop(0)
                else:
                    with pytest.raises(StorePinError):
                        s.unpin([k])
            elif op == "delete":
                if k in present:
                    s.delete(k)
                    del present[k]
                else:
                    with pytest.raises(StoreKeyError):
                        s.delete(k)
            else:
                got = s.get_many([k], missing="skip")[0]
                assert (got is None) == (k not in present)
                if got is not None:
                    assert np.array_equal(got, block((k, present[k][0]), present[k][1]))
            for gone in s.drain_evicted():
                assert gone in present
                assert life[gone] not in pins.get(gone, []), f"pinned key {gone} was evicted"
                del present[gone]
            assert disk_bytes(s.aio) <= cap
        assert sorted(s.aio.keys()) == sorted(present)
        for k, (v, n) in present.items():
            assert np.array_equal(s.get(k), block((k, v), n))
        for k, held in pins.items():
            s.unpin([k] * len(held))
        assert s.aio._pins.by_key == {}


async def test_a_value_no_slab_can_hold_drops_nothing(tmp_path):
    """Two directories of 512 KiB each: a 768 KiB value (one piece: below
    the stripe size) fits no slab, whatever is dropped."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    async with TieredStore(dirs, host=0, nvme=nvme_for(MiB), on_full="evict", stripe="4M") as s:
        for k in range(8):
            await s.put(k, block(k))
        with pytest.raises(StoreFullError, match="larger"):
            await s.put("big", block("big", 768 * KiB))
        assert s.drain_evicted() == [] and len(s) == 8


async def test_a_large_batch_of_host_hits_lets_the_loop_run_between_slices(tmp_path):
    """64 host hits of 1 MiB (each small enough to copy on the loop's
    thread): the copies are cut into slices with the loop's other callbacks
    between them, not one 64 MiB stall."""
    async with TieredStore(tmp_path, host=80 * MiB, nvme=nvme_for(128 * MiB), on_full="evict") as s:
        for k in range(64):
            await s.put(k, block(k % 4, MiB))
        outs = [np.empty(MiB, np.uint8) for _ in range(64)]
        ticks = 0
        stop = False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0)
        start = ticks
        assert await s.get_many(range(64), out=outs, missing="skip") == [True] * 64
        stop = True
        await t
        assert ticks - start >= 8  # 64 MiB in 4 MiB slices
        assert all(np.array_equal(outs[k], block(k % 4, MiB)) for k in (0, 33, 63))


async def test_touch_keeps_a_value_as_a_get_would_without_reading_it(tmp_path):
    """touch(keys) makes them the warmest for cache mode's drops (and the
    host tier's policy) with no read: absent keys are ignored."""
    cap = nvme_for(1 * MiB)
    async with TieredStore(tmp_path, host=0, nvme=cap, on_full="evict") as s:
        for k in range(16):
            await s.put(k, block(k))
        reads = s.stats()["nvme"]["hits"]
        s.touch([0, 2, "absent"])
        assert s.stats()["nvme"]["hits"] == reads  # nothing read
        for k in range(16, 19):
            await s.put(k, block(k))
        assert s.drain_evicted() == [1, 3, 4]
        assert "absent" not in s
        with pytest.raises(TypeError):
            s.touch(0)


async def test_touch_on_the_host_tier_moves_a_key_to_the_end_of_its_lru(tmp_path):
    async with TieredStore(tmp_path, host=256 * KiB) as s:
        for k in range(4):  # 4 x 64 KiB: full
            await s.put(k, block(k))
        s.touch([0])
        await s.put(4, block(4))  # pushes the coldest out of memory: 1, not 0
        assert "host" in s.where(0) and s.where(1) == ["nvme"]


def test_touch_from_another_thread_applies_before_later_jobs(tmp_path):
    cap = nvme_for(1 * MiB)
    with SyncTieredStore(tmp_path, host=0, nvme=cap, on_full="evict") as s:
        for k in range(16):
            s.put(k, block(k))
        s.touch([0])  # from this thread: queued on the store's loop
        s.submit_put_many({16: block(16)}).result(30)
        assert s.drain_evicted() == [1]
    with pytest.raises(StoreClosedError):
        s.touch([0])


async def test_drained_keys_are_bounded_oldest_forgotten_and_counted(tmp_path):
    cap = nvme_for(1 * MiB)
    async with TieredStore(tmp_path, host=0, nvme=cap, on_full="evict", evicted_max=3) as s:
        for k in range(16 + 5):
            await s.put(k, block(k))
        assert s.drain_evicted() == [2, 3, 4]  # the newest 3 of 5 dropped
        assert s.evicted_lost == 2
        await s.put(21, block(21))
        assert s.drain_evicted() == [5] and s.evicted_lost == 2
    async with TieredStore(tmp_path / "b", host=0, nvme=cap, on_full="evict", evicted_max=None) as s:
        for k in range(16 + 5):
            await s.put(k, block(k))
        assert s.drain_evicted() == [0, 1, 2, 3, 4] and s.evicted_lost == 0
    with pytest.raises(ValueError, match="evicted_max"):
        TieredStore(tmp_path / "c", nvme="1M", on_full="evict", evicted_max=-1)
