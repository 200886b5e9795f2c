"""The ``store`` workload: :class:`aionvme.TieredStore` put / get / host-hit figures as one Result."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..defaults import parse_size
from ..store import TieredStore
from .result import Result
from .system import drop_caches
from .timer import Timer

__all__ = ["store_workload"]

GB = 1e9


async def store_workload(ctx: Any) -> Result:
    """The ``store`` workload: a TieredStore in the scratch directory.

    Three phases, ``ctx.size`` bytes each (at most 1 GiB by default is
    plenty), in values of ``-o value=4M``:

    - put: puts into a host tier of ``-o host=16`` values, so once it is
      full every put evicts one value to NVMe (write-behind); the Result's
      ``nbytes``/``wall_s`` are this steady state (``nbytes``: the bytes put
      or, if fewer, the bytes that reached NVMe meanwhile);
    - nvme get: gets of values only in the NVMe tier (``host=0``), page
      cache dropped first where allowed (``-o cold=0``: not dropped);
    - host hit: gets of a value resident in the host tier into a
      preallocated ``out=``, against ``np.copyto`` of the same size,
      alternated in the same run (best of 5 windows of 256 MiB each), and
      the time of one 4 KiB host-hit get (best of 5 windows).

    ``figures``: ``put_GBps``, ``nvme_written_GBps``, ``evictions``, ``nvme_get_GBps``,
    ``host_hit_GBps``, ``memcpy_GBps``, ``host_hit_vs_memcpy``,
    ``get_4k_us``, ``host_hit_ratio`` (hits / gets of the host tier).
    """
    value = ctx.option("value", 4 << 20, parse_size)
    nvals = ctx.option("host", 16, int)
    n = max(4, ctx.size // value)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, value, dtype=np.uint8)
    vals = [np.roll(base, i) for i in range(8)]
    figures: dict[str, float] = {}
    ok = True
    # put: steady state, every put evicts one value
    async with TieredStore(ctx.workdir, host=nvals * value + 4096) as s:
        for i in range(nvals):  # fill the host tier
            await s.put(("fill", i), vals[i % 8])
        st0 = s.stats()
        with Timer() as put_t:
            for i in range(n):
                await s.put(i, vals[i % 8])
        st = s.stats()
        figures["evictions"] = st["host"]["evictions"] - st0["host"]["evictions"]
        written = st["nvme"]["bytes_in"] - st0["nvme"]["bytes_in"]
        for i in (0, n // 2, n - 1):
            ok = ok and bool(np.array_equal(await s.get(i), vals[i % 8]))
    figures["put_GBps"] = round(n * value / put_t.wall / GB, 3)
    figures["nvme_written_GBps"] = round(written / put_t.wall / GB, 3)
    # nvme get: values only on NVMe, cold
    async with TieredStore(ctx.workdir, host=0) as s:
        await s.put_many({i: vals[i % 8] for i in range(min(n, 8))})
        for i in range(8, n):
            await s.put(i, vals[i % 8])
        cold = bool(ctx.option("cold", 1, int)) and drop_caches() is None
        t0 = time.perf_counter()
        for i in range(n):
            got = await s.get(i)
        dt = time.perf_counter() - t0
        ok = ok and bool(np.array_equal(got, vals[(n - 1) % 8]))
    figures["nvme_get_GBps"] = round(n * value / dt / GB, 3)
    # host hit vs memcpy, alternated, best of 3
    async with TieredStore(ctx.workdir, host=2 * value + (1 << 20)) as s:
        await s.put("v", vals[0])
        await s.put("small", vals[1][:4096].copy())
        out = np.empty(value, np.uint8)
        hit = mem = float("inf")
        reps = max(4, (256 << 20) // value)  # windows long enough that one preemption does not decide
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                await s.get("v", out=out)
            hit = min(hit, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(reps):
                np.copyto(out, vals[0])
            mem = min(mem, time.perf_counter() - t0)
        ok = ok and bool(np.array_equal(out, vals[0]))
        small = np.empty(4096, np.uint8)
        k = 2000
        per = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(k):
                await s.get("small", out=small)
            per = min(per, (time.perf_counter() - t0) / k)
        figures["get_4k_us"] = round(per * 1e6, 2)
        hs = s.stats()["host"]
        figures["host_hit_ratio"] = round(hs["hits"] / max(1, hs["hits"] + hs["misses"]), 3)
    figures["host_hit_GBps"] = round(reps * value / hit / GB, 3)
    figures["memcpy_GBps"] = round(reps * value / mem / GB, 3)
    figures["host_hit_vs_memcpy"] = round(mem / hit, 3)
    r = put_t.result(
        "store",
        nbytes=min(n * value, written),  # the slower of the puts and the writes they caused
        ops=n,
        verified=ok,
        params={"value": value, "host_values": nvals, "cold": cold},
        figures=figures,
    )
    f = figures
    r.notes.append(
        f"put (each evicts one to NVMe) {f['put_GBps']:.2f} GB/s, {int(f['evictions'])} evictions; "
        f"NVMe get{' (cold)' if cold else ''} {f['nvme_get_GBps']:.2f} GB/s; host hit "
        f"{f['host_hit_GBps']:.2f} GB/s = {f['host_hit_vs_memcpy']:.2f}x memcpy "
        f"({f['memcpy_GBps']:.2f}); 4 KiB host-hit get {f['get_4k_us']:.1f} us"
    )
    return r
