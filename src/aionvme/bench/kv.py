"""The ``kv`` workload: the store as a serving engine's KV-cache tier, driven
the way the engines drive it (from a thread of their own, through
``SyncTieredStore.submit_get_many`` / ``submit_put_many``), next to fio's
sequential read at bs 1M QD 32 in the same run.

:func:`time_loads` and :func:`time_stores` time any blocking ``load(keys,
outs)`` / ``store(keys, values)`` pair over a grid of object sizes and batch
sizes, cold: the adapters (vLLM, SGLang, LMCache) time themselves with them,
so every figure comes from one procedure.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..defaults import parse_size
from ..store import StoreFullError, SyncTieredStore
from . import peers
from .pattern import make_file
from .result import Result
from .system import drop_caches

__all__ = ["block", "churn", "host_hit_us", "kv_workload", "time_loads", "time_stores"]

GB = 1e9
MiB = 1 << 20
SIZES = (512 << 10, 2 * MiB, 8 * MiB, 32 * MiB)
BATCHES = (1, 8, 32, 128)

# load(keys, outs) / store(keys, values): blocking; keys are ints (block hashes)
Load = Callable[[list[int], list[np.ndarray]], Any]
Store = Callable[[list[int], list[np.ndarray]], Any]
# start(keys, outs): begins a load, returns wait() (blocks until it is done)
Start = Callable[[list[int], list[np.ndarray]], Callable[[], Any]]


def block(key: int, nbytes: int, base: np.ndarray | None = None) -> np.ndarray:
    """A KV block's bytes: ``base`` (random, shared) with the key in its first
    8 bytes, so a block read back under another key is caught."""
    b = np.empty(nbytes, np.uint8) if base is None else base[:nbytes].copy()
    if base is None:
        b[:] = np.random.default_rng(key & 0xFFFFFFFF).integers(0, 256, nbytes, dtype=np.uint8)
    b[:8] = np.frombuffer(int(key & (2**64 - 1)).to_bytes(8, "little"), np.uint8)
    return b


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _points(sizes: Sequence[int], batches: Sequence[int], total: int) -> list[tuple[int, int, int]]:
    """(size, batch, blocks) of each point: ``total`` bytes of blocks (at
    least one). A batch larger than that many blocks is cut to them (32 MiB
    blocks in batches of 128 would be 4 GiB a call); the points that become
    the same are run once."""
    out: list[tuple[int, int, int]] = []
    for s in sizes:
        n = max(1, total // s)
        for b in batches:
            p = (s, min(b, n), n)
            if p not in out:
                out.append(p)
    return out


def _grid(
    sizes: Sequence[int], batches: Sequence[int], total: int, first_key: int
) -> Iterator[tuple[int, int, int, list[int]]]:
    """(size, batch, blocks, their keys) of each point; keys from ``first_key`` up, new ones per point."""
    key = first_key
    for size, batch, n in _points(sizes, batches, total):
        yield size, batch, n, list(range(key, key + n))
        key += n


def time_stores(
    store: Store,
    sizes: Sequence[int] = SIZES,
    batches: Sequence[int] = BATCHES,
    *,
    total: int = 256 * MiB,
    first_key: int = 1 << 40,
) -> list[dict[str, float]]:
    """Time ``store(keys, values)`` (blocking: returns once stored) for each
    object size and batch size: ``total`` bytes per point, in calls of
    ``batch`` blocks. Rows: ``size``, ``batch``, ``blocks``, ``GBps``,
    ``cpu_s_per_GB`` (this process's CPU time, every thread), ``call_ms``
    (median per call). Keys are ints from ``first_key`` up, one per block."""
    rows: list[dict[str, float]] = []
    base = np.random.default_rng(1).integers(0, 256, max(sizes), dtype=np.uint8)
    for size, batch, n, keys in _grid(sizes, batches, total, first_key):
        # a few blocks, reused: the bytes do not matter here
        vals = [block(k, size, base) for k in keys[: min(n, 2 * batch)]]
        calls: list[float] = []
        c0, t0 = _cpu(), time.perf_counter()
        for i in range(0, n, batch):
            t = time.perf_counter()
            ks = keys[i : i + batch]
            store(ks, [vals[j % len(vals)] for j in range(i, i + len(ks))])
            calls.append(time.perf_counter() - t)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        rows.append(_row(size, batch, n, wall, cpu, calls))
    return rows


def time_loads(
    load: Load,
    store: Store,
    sizes: Sequence[int] = SIZES,
    batches: Sequence[int] = BATCHES,
    *,
    total: int = 256 * MiB,
    cold: Callable[[], Any] | None = drop_caches,
    verify: bool = True,
    first_key: int = 0,
    start: Start | None = None,
    inflight: int = 1,
) -> list[dict[str, float]]:
    """Time ``load(keys, outs)`` (blocking: returns once every ``outs[i]``,
    a preallocated uint8 array, holds block ``keys[i]``) for each object
    size and batch size: ``total`` bytes of blocks per point, first stored
    with ``store(keys, values)``, then ``cold()`` (drop the page cache),
    then loaded in calls of ``batch`` blocks, into page-aligned buffers (as
    the engines' are: vLLM's primary tier, LMCache's L1 pool, SGLang's host
    pool). Rows as :func:`time_stores`,
    plus ``verified`` (1.0: every block read back was the one stored) and
    ``inflight``.

    With ``start`` and ``inflight`` > 1, loads overlap as an engine's do:
    ``start(keys, outs)`` begins one and returns ``wait()``, which blocks
    until it is done (or raises); up to ``inflight`` run at once (fewer
    where the point has fewer calls), each into buffers of its own, waited
    for in the order they started; ``call_ms`` is then start to end of each."""
    rows: list[dict[str, float]] = []
    base = np.random.default_rng(2).integers(0, 256, max(sizes), dtype=np.uint8)
    depth = max(1, inflight) if start is not None else 1
    for size, batch, n, keys in _grid(sizes, batches, total, first_key):
        for i in range(0, n, batch):
            ks = keys[i : i + batch]
            store(ks, [block(k, size, base) for k in ks])
        if cold is not None:
            cold()
        slots = min(depth, -(-n // batch))
        outs = [_page_aligned(size) for _ in range(slots * min(n, batch))]
        for o in outs:
            o.fill(0)  # touched: the first load does not pay the page faults
        ok = True
        calls: list[float] = []
        live: collections.deque[tuple[Callable[[], Any], list[int], list[np.ndarray], float]] = (
            collections.deque()
        )

        c0, t0 = _cpu(), time.perf_counter()
        for j, i in enumerate(range(0, n, batch)):
            ks = keys[i : i + batch]
            slot = (j % slots) * min(n, batch)
            mine = outs[slot : slot + len(ks)]
            if start is None:
                t = time.perf_counter()
                load(ks, mine)
                calls.append(time.perf_counter() - t)
                if verify:
                    ok = ok and all(_holds(o, k, base) for o, k in zip(mine, ks))
                continue
            if len(live) == slots:
                ok = (
                    _oldest_done(live, calls, verify, base) and ok
                )  # its buffers are the ones this call reuses
            live.append((start(ks, mine), ks, mine, time.perf_counter()))
        while live:
            ok = _oldest_done(live, calls, verify, base) and ok
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        # (verification is inside the timed loop: a few µs per block, against ms of I/O)
        row = _row(size, batch, n, wall, cpu, calls)
        row["verified"] = float(ok)
        row["inflight"] = float(slots)
        rows.append(row)
    return rows


def _page_aligned(n: int) -> np.ndarray:
    """A uint8 array of n bytes starting on a page (np.empty's start 16 bytes
    into one: O_DIRECT reads into it bounce through the engine's buffers)."""
    raw = np.empty(n + 4096, np.uint8)
    off = -raw.ctypes.data % 4096
    return raw[off : off + n]


def _oldest_done(
    live: collections.deque[tuple[Callable[[], Any], list[int], list[np.ndarray], float]],
    calls: list[float],
    verify: bool,
    base: np.ndarray,
) -> bool:
    """Wait for the oldest load in flight; whether its buffers hold its blocks."""
    wait, ks, outs, t = live.popleft()
    wait()
    calls.append(time.perf_counter() - t)
    return not verify or all(_holds(o, k, base) for o, k in zip(outs, ks))


def _holds(out: np.ndarray, key: int, base: np.ndarray) -> bool:
    """``out`` is block ``key``: its stamp, and its bytes sampled at 64 places."""
    n = len(out)
    if bytes(out[:8]) != int(key & (2**64 - 1)).to_bytes(8, "little"):
        return False
    idx = np.linspace(8, n - 1, 64, dtype=np.int64) if n > 8 else np.arange(0)
    return bool(np.array_equal(out[idx], base[idx]))


def _row(size: int, batch: int, n: int, wall: float, cpu: float, calls: list[float]) -> dict[str, float]:
    nbytes = size * n
    return {
        "size": size,
        "batch": batch,
        "blocks": n,
        "GBps": round(nbytes / wall / GB, 3),
        "cpu_s_per_GB": round(cpu / (nbytes / GB), 3),
        "call_ms": round(float(np.median(calls)) * 1e3, 3),
    }


def store_fns(s: SyncTieredStore) -> tuple[Load, Store]:
    """The store's own load and store, through the adapters' path (jobs
    submitted from this thread, waited on)."""

    def load(keys: list[int], outs: list[np.ndarray]) -> None:
        got = s.submit_get_many(keys, out=outs, missing="skip").result()
        if not all(got):
            raise KeyError(f"{got.count(False)} of {len(keys)} blocks missing")

    def store(keys: list[int], values: list[np.ndarray]) -> None:
        s.submit_put_many(dict(zip(keys, values))).result()

    return load, store


def store_start(s: SyncTieredStore) -> Start:
    """The store's load as an engine keeps several in flight: submitted, its
    future waited on later."""

    def start(keys: list[int], outs: list[np.ndarray]) -> Callable[[], None]:
        fut = s.submit_get_many(keys, out=outs, missing="skip")

        def wait() -> None:
            got = fut.result()
            if not all(got):
                raise KeyError(f"{got.count(False)} of {len(keys)} blocks missing")

        return wait

    return start


def churn(
    directory: str,
    capacity: int,
    sizes: Sequence[int] = SIZES,
    *,
    factor: int = 10,
    keys: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """Write ``factor`` times ``capacity`` in random keys (random sizes of
    ``sizes``) to a cache-mode store of that capacity while another thread
    reads random keys (``get_many(missing='skip')``, through submit): the
    most the slab files took on disk (``max_disk_bytes``, st_blocks, sampled
    after every put), reads that returned their bytes (``hits``), misses,
    ``wrong`` reads (must be 0), puts ``refused`` (StoreFullError: the
    values they would drop were all being read), evictions, the write rate."""
    rng = random.Random(seed)
    nkeys = keys or max(64, 4 * capacity // max(1, int(np.mean(sizes))))
    # keys per put and per read: what one call holds stays a small part of
    # the cache (a read pins its blocks; a put's batch cannot evict itself)
    per = max(1, min(4, capacity // (8 * max(sizes))))
    size_of = {k: rng.choice(list(sizes)) for k in range(nkeys)}
    base = np.random.default_rng(3).integers(0, 256, max(sizes), dtype=np.uint8)
    out = {"hits": 0.0, "misses": 0.0, "wrong": 0.0, "refused": 0.0}
    errors: list[BaseException] = []
    stop = threading.Event()
    with SyncTieredStore(directory, host=0, nvme=capacity, on_full="evict") as s:
        slabs = [sl.path for sl in s.aio._nvme.slabs]

        def disk() -> int:
            return sum(os.stat(p).st_blocks * 512 for p in slabs)

        def reader() -> None:
            r = random.Random(seed + 1)
            try:
                while not stop.is_set():
                    ks = r.sample(range(nkeys), per)
                    outs = [np.empty(size_of[k], np.uint8) for k in ks]
                    got = s.submit_get_many(ks, out=outs, missing="skip").result()
                    for k, o, hit in zip(ks, outs, got):
                        if not hit:
                            out["misses"] += 1
                        elif _holds(o, k, base):
                            out["hits"] += 1
                        else:
                            out["wrong"] += 1
            except BaseException as e:  # handed to the caller
                errors.append(e)

        th = threading.Thread(target=reader, name="kv-churn-reader")
        th.start()
        written = 0
        most = disk()
        t0 = time.perf_counter()
        try:
            while written < factor * capacity:
                ks = rng.sample(range(nkeys), per)
                try:
                    s.submit_put_many({k: block(k, size_of[k], base) for k in ks}).result()
                except StoreFullError:  # all of it read (pinned) right now: an engine skips the store
                    out["refused"] += 1
                written += sum(size_of[k] for k in ks)
                most = max(most, disk())
        finally:
            stop.set()
            th.join()
        wall = time.perf_counter() - t0
        evicted = s.aio.stats()["nvme"]["evictions"]
    if errors:
        raise errors[0]
    return {
        "capacity": capacity,
        "written": written,
        "max_disk_bytes": most,
        "evictions": evicted,
        "write_GBps": round(written / wall / GB, 3),
        **out,
    }


def host_hit_us(directory: str, size: int = 512 << 10, calls: int = 2000) -> dict[str, float]:
    """The fixed cost of a call, µs, best of 5 windows:

    - ``host_hit_submit_us`` / ``host_hit_get_us``: a host-tier hit of one
      ``size``-byte block into an ``out=`` buffer, through
      ``submit_get_many(...).result()`` (the adapters' path, a hop to the
      store's loop and back) and through the blocking ``get``;
    - ``nvme_load_submit_us`` / ``nvme_load_loop_us``: a load of one such
      block from NVMe (64 blocks in turn), through ``submit_get_many`` from
      this thread, and by ``get_many`` on the store's loop itself (no hop):
      their difference is what the hop costs a load."""
    with SyncTieredStore(directory, host=4 * size + MiB, nvme=8 * size, on_full="evict") as s:
        s.put(1, block(1, size))
        out = [_page_aligned(size)]
        best_submit = best_get = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                s.submit_get_many([1], out=out).result()
            best_submit = min(best_submit, (time.perf_counter() - t0) / calls)
            t0 = time.perf_counter()
            for _ in range(calls):
                s.get(1, out=out[0])
            best_get = min(best_get, (time.perf_counter() - t0) / calls)
        hits = s.aio.stats()["host"]["hits"]
    n, loads = 64, max(64, calls // 8)
    with SyncTieredStore(directory + "-nvme", host=0, nvme=2 * n * size, on_full="evict") as s:
        base = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
        s.put_many({k: block(k, size, base) for k in range(n)})
        best_nvme = best_loop = float("inf")

        async def on_loop() -> float:
            t0 = time.perf_counter()
            for i in range(loads):
                await s.aio.get_many([i % n], out=out, missing="skip")
            return (time.perf_counter() - t0) / loads

        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(loads):
                s.submit_get_many([i % n], out=out, missing="skip").result()
            best_nvme = min(best_nvme, (time.perf_counter() - t0) / loads)
            best_loop = min(best_loop, asyncio.run_coroutine_threadsafe(on_loop(), s.loop).result())
    return {
        "host_hit_submit_us": round(best_submit * 1e6, 2),
        "host_hit_get_us": round(best_get * 1e6, 2),
        "host_hits": float(hits),
        "nvme_load_submit_us": round(best_nvme * 1e6, 2),
        "nvme_load_loop_us": round(best_loop * 1e6, 2),
    }


def fio_seqread(path: str, size: int) -> float | None:
    """fio sequential read, bs 1M, QD 32, libaio, O_DIRECT: GB/s, or None without fio."""
    if peers.fio_unavailable() is not None:
        return None
    make_file(path, size, overwrite=True)
    try:
        drop_caches()
        r = peers.fio(path, "read", "1M", 32, "libaio", size)
    finally:
        os.unlink(path)
    return r.nbytes / r.wall_s / GB


def _label(n: int) -> str:
    return f"{n >> 20}M" if n >= MiB else f"{n >> 10}K"


def run_kv(
    workdir: str,
    sizes: Sequence[int],
    batches: Sequence[int],
    total: int,
    churn_capacity: int,
    fio_size: int,
    hit_calls: int = 2000,
    inflight: int = 8,
) -> dict[str, Any]:
    """Every part of the workload, blocking (see :func:`kv_workload`). fio
    runs before and after the loads (``fio_GBps`` is their mean, both are
    kept): on a shared machine the device's rate drifts during a run."""
    fio_path = os.path.join(workdir, "fio.bin")
    before = fio_seqread(fio_path, fio_size)
    cap = 2 * (total + max(sizes)) + 64 * MiB  # a point's blocks fit; the next point's evict them
    with SyncTieredStore(os.path.join(workdir, "kv"), host=0, nvme=cap, on_full="evict") as s:
        load, store = store_fns(s)
        stores = time_stores(store, sizes, batches, total=total)
        loads = time_loads(load, store, sizes, batches, total=total)
        queued = time_loads(load, store, sizes, batches, total=total, start=store_start(s), inflight=inflight)
    after = fio_seqread(fio_path, fio_size)
    fio_gbps = None if before is None or after is None else (before + after) / 2
    ch = churn(os.path.join(workdir, "churn"), churn_capacity, sizes)
    hit = host_hit_us(os.path.join(workdir, "hit"), calls=hit_calls)
    return {
        "fio_GBps": fio_gbps,
        "fio_before_after_GBps": [before, after],
        "loads": loads,
        "loads_inflight": queued,
        "stores": stores,
        "churn": ch,
        "hit": hit,
    }


async def kv_workload(ctx: Any) -> Result:
    """The ``kv`` workload (``aionvme bench -w kv``): the store as an
    engine's KV tier, in the scratch directory.

    - load: ``-o total=`` bytes (default ``ctx.size``, at most 256 MiB) of
      blocks of each size in ``-o sizes=512K,2M,8M,32M`` stored, the page
      cache dropped, then loaded in batches of each of ``-o
      batches=1,8,32,128`` through ``SyncTieredStore.submit_get_many(out=)``
      from a thread; against fio sequential read bs 1M QD 32 of the same
      directory in the same run;
    - store: the same grid through ``submit_put_many``;
    - churn: 10x ``-o churn=64M`` written in random keys to a cache of that
      capacity while another thread reads: the most the slab took on disk;
    - the same loads with ``-o inflight=8`` calls in flight (as the
      engines keep them): ``load_<size>_b<batch>_q<n>_GBps``;
    - per call: µs of a 512 KiB host-tier hit, and of a 512 KiB NVMe load
      through submit and on the store's loop.

    ``figures``: ``fio_GBps``, ``load_<size>_b<batch>_GBps`` (and
    ``..._vs_fio``), ``store_<size>_b<batch>_GBps``, ``load_best_vs_fio``,
    ``churn_max_disk_bytes``, ``churn_capacity``, ``churn_wrong``,
    ``host_hit_submit_us``, ``host_hit_get_us``, ``nvme_load_submit_us``,
    ``nvme_load_loop_us``.
    """
    sizes = [parse_size(x) for x in ctx.option("sizes", "512K,2M,8M,32M").split(",")]
    batches = [int(x) for x in ctx.option("batches", "1,8,32,128").split(",")]
    total = ctx.option("total", min(ctx.size, 256 * MiB), parse_size)
    churn_cap = ctx.option("churn", 64 * MiB, parse_size)
    hit_calls = ctx.option("hit_calls", 2000, int)
    inflight = ctx.option("inflight", 8, int)
    t0 = time.perf_counter()
    fio_size = min(ctx.size, 1 << 30)
    got = await asyncio.to_thread(
        run_kv, ctx.workdir, sizes, batches, total, churn_cap, fio_size, hit_calls, inflight
    )
    wall = time.perf_counter() - t0
    figures: dict[str, float] = {}
    fio_gbps = got["fio_GBps"]
    if fio_gbps:
        figures["fio_GBps"] = round(fio_gbps, 3)
    ok = True
    best = 0.0
    for r in got["loads"]:
        name = f"load_{_label(int(r['size']))}_b{int(r['batch'])}"
        figures[f"{name}_GBps"] = r["GBps"]
        best = max(best, r["GBps"])
        ok = ok and r["verified"] == 1.0
        if fio_gbps:
            figures[f"{name}_vs_fio"] = round(r["GBps"] / fio_gbps, 3)
    for r in got["loads_inflight"]:
        name = f"load_{_label(int(r['size']))}_b{int(r['batch'])}_q{int(r['inflight'])}"
        figures[f"{name}_GBps"] = r["GBps"]
        ok = ok and r["verified"] == 1.0
        if fio_gbps:
            figures[f"{name}_vs_fio"] = round(r["GBps"] / fio_gbps, 3)
    for r in got["stores"]:
        figures[f"store_{_label(int(r['size']))}_b{int(r['batch'])}_GBps"] = r["GBps"]
    if fio_gbps:
        figures["load_best_vs_fio"] = round(best / fio_gbps, 3)
    ch = got["churn"]
    figures.update(
        churn_capacity=ch["capacity"],
        churn_max_disk_bytes=ch["max_disk_bytes"],
        churn_wrong=ch["wrong"],
        churn_hits=ch["hits"],
        churn_misses=ch["misses"],
    )
    ok = ok and ch["wrong"] == 0 and ch["max_disk_bytes"] <= ch["capacity"]
    figures.update({k: v for k, v in got["hit"].items() if k.endswith("_us")})
    # the table's row: the best load point (every point is in the figures)
    top = max(got["loads"], key=lambda r: r["GBps"])
    nbytes = int(top["size"] * top["blocks"])
    r = Result(
        "kv",
        nbytes=nbytes,
        ops=int(top["blocks"]),
        wall_s=nbytes / GB / top["GBps"],
        cpu_s=top["cpu_s_per_GB"] * nbytes / GB,
        verified=ok,
        params={
            "sizes": sizes,
            "batches": batches,
            "total": total,
            "churn": churn_cap,
            "best": f"{_label(int(top['size']))} x {int(top['batch'])}",
            "run_s": round(wall, 1),
        },
        figures=figures,
    )
    vs = f" = {figures['load_best_vs_fio']:.2f}x fio seq read bs 1M QD 32" if fio_gbps else " (no fio here)"
    r.notes.append(
        f"best load {best:.2f} GB/s{vs}; churn: max {ch['max_disk_bytes'] / MiB:.0f} MiB on disk for a "
        f"{ch['capacity'] / MiB:.0f} MiB cache, {int(ch['wrong'])} wrong reads; host hit "
        f"{figures['host_hit_submit_us']:.0f} us per call via submit, "
        f"{figures['host_hit_get_us']:.0f} us via get; NVMe load of 512 KiB "
        f"{figures['nvme_load_submit_us']:.0f} us via submit, "
        f"{figures['nvme_load_loop_us']:.0f} us on the loop"
    )
    small = min(got["loads"], key=lambda r: (r["size"], r["batch"]))
    queued = [q for q in got["loads_inflight"] if (q["size"], q["batch"]) == (small["size"], small["batch"])]
    if fio_gbps and queued:
        r.notes.append(
            f"{_label(int(small['size']))} x {int(small['batch'])}: {small['GBps'] / fio_gbps:.2f}x fio one "
            f"call at a time, {queued[0]['GBps'] / fio_gbps:.2f}x with {int(queued[0]['inflight'])} in flight"
        )
    return r
