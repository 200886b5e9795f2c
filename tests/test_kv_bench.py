"""The kv benchmark (issue 35): ``aionvme bench -w kv`` is registered and
runs, and :func:`aionvme.bench.kv.time_loads` (which the adapters time
themselves with) checks what the load it times returns."""

from __future__ import annotations

import aionvme.bench as B
from aionvme.bench import kv
from aionvme.store import SyncTieredStore

KiB = 1 << 10
MiB = 1 << 20


def test_time_loads_times_the_store_and_catches_a_wrong_block(tmp_path):
    with SyncTieredStore(tmp_path, host=0, nvme="8M", on_full="evict") as s:
        load, store = kv.store_fns(s)
        rows = kv.time_loads(load, store, [64 * KiB, 256 * KiB], [1, 4], total=MiB, cold=None)
        assert [(r["size"], r["batch"], r["blocks"]) for r in rows] == [
            (64 * KiB, 1, 16),
            (64 * KiB, 4, 16),
            (256 * KiB, 1, 4),
            (256 * KiB, 4, 4),
        ]
        assert all(r["verified"] == 1.0 and r["GBps"] > 0 for r in rows)

        def wrong(keys, outs):  # the blocks of a batch in the wrong order
            load(keys[::-1], outs)

        rows = kv.time_loads(wrong, store, [64 * KiB], [2], total=256 * KiB, cold=None, first_key=1000)
        assert rows[0]["verified"] == 0.0
        assert kv.time_stores(store, [64 * KiB], [1, 8], total=512 * KiB)[1]["blocks"] == 8


def test_churn_stays_within_the_capacity(tmp_path):
    ch = kv.churn(str(tmp_path), 2 * MiB, [32 * KiB, 128 * KiB], factor=10)
    assert ch["written"] >= 20 * MiB
    assert 0 < ch["max_disk_bytes"] <= 2 * MiB
    assert ch["wrong"] == 0 and ch["evictions"] > 0


def test_the_kv_workload_runs_by_name(tmp_path):
    assert "kv" in B.names()
    ctx = B.Context(
        str(tmp_path),
        size=8 * MiB,
        options={"sizes": "64K,256K", "batches": "1,8", "total": "1M", "churn": "2M", "hit_calls": "50"},
    )
    r = B.run_loop(B.run("kv", ctx), "asyncio")
    assert r.workload == "kv" and r.verified, r.notes
    assert r.figures["churn_max_disk_bytes"] <= r.figures["churn_capacity"]
    assert "load_64K_b8_GBps" in r.figures and r.figures["host_hit_submit_us"] > 0


def test_time_loads_with_loads_in_flight_gives_each_its_own_buffers(tmp_path):
    """Engine-like loads (start now, wait later, 4 in flight): every block
    checked in its own buffers; a start that fills the wrong ones is caught."""
    with SyncTieredStore(tmp_path, host=0, nvme="8M", on_full="evict") as s:
        load, store = kv.store_fns(s)
        start = kv.store_start(s)
        rows = kv.time_loads(
            load, store, [64 * KiB], [1, 4, 16], total=MiB, cold=None, start=start, inflight=4
        )
        assert [(r["batch"], r["inflight"]) for r in rows] == [(1, 4), (4, 4), (16, 1)]
        assert all(r["verified"] == 1.0 for r in rows)

        def swapped(keys, outs):  # the blocks of a call into each other's buffers
            return start(keys[::-1], outs)

        rows = kv.time_loads(
            load, store, [64 * KiB], [2], total=MiB, cold=None, start=swapped, inflight=4, first_key=2000
        )
        assert rows[0]["verified"] == 0.0
