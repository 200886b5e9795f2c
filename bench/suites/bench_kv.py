#!/usr/bin/env python3
"""The store as a serving engine's KV-cache tier (issue 35), next to fio.

Workloads (GB/s, 1 GB = 1e9 bytes), all in one run, on one directory:

  fio      sequential read, bs 1M, QD 32, libaio, O_DIRECT: the device's
           practical ceiling, measured before and after the grid in the same
           run (the ratios use their mean)
  load     blocks of each size (0.5-32 MiB: one KV block or chunk each),
           ``--total`` bytes of them stored, the page cache dropped, then
           loaded in batches of 1..128 through SyncTieredStore.submit_get_many
           (out= preallocated buffers) from this thread, as the adapters do;
           ratio to fio. Twice: one call at a time (each waited for before
           the next), and as the engines drive their tiers, ``--inflight``
           calls in flight (8: LMCache's prefetch_max_in_flight; vLLM
           submits one load per request each scheduler step, then polls)
  store    the same grid through submit_put_many into a cache-mode store
           (on_full='evict': once full, each store drops the coldest blocks)
  churn    10x the capacity written in random keys while another thread reads:
           the most the slab files took on disk (st_blocks) against the
           capacity, and wrong reads (must be 0)
  per call the fixed cost of a call, µs: a 512 KiB hit in the host tier
           through submit and through the blocking get; a 512 KiB load from
           NVMe through submit and by get_many on the store's loop (no hop)

The adapters time themselves with the same procedure:
``aionvme.bench.kv.time_loads(load, store, sizes, batches, total=...)``.

    python3 bench/suites/bench_kv.py --quick                       # proves it runs
    python3 bench/suites/bench_kv.py --dir /nvme --total 1G --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

from aionvme.bench import kv, local_scratch_dir
from aionvme.bench.render import markdown_table
from aionvme.defaults import parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory on the drive to measure (default: a local scratch directory)")
    p.add_argument("--sizes", default="512K,2M,8M,32M", help="object sizes (default 512K,2M,8M,32M)")
    p.add_argument("--batches", default="1,8,32,128", help="blocks per call (default 1,8,32,128)")
    p.add_argument("--total", default="256M", help="bytes of blocks per point (default 256M)")
    p.add_argument("--churn", default="256M", help="the churn cache's capacity (default 256M)")
    p.add_argument("--inflight", type=int, default=8, help="calls in flight, engine-like rows (default 8)")
    p.add_argument("--fio-size", default="1G", help="fio's file (default 1G)")
    p.add_argument("--quick", action="store_true", help="small sizes: proves it runs")
    p.add_argument("--json", help="write every figure here")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.batches, a.total, a.churn, a.fio_size = "512K,8M", "1,32", "64M", "32M", "256M"
    sizes = [parse_size(x) for x in a.sizes.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    parent = a.dir or local_scratch_dir()
    with tempfile.TemporaryDirectory(prefix="bench-kv-", dir=parent) as d:
        got = kv.run_kv(
            d,
            sizes,
            batches,
            parse_size(a.total),
            parse_size(a.churn),
            parse_size(a.fio_size),
            inflight=a.inflight,
        )
    fio = got["fio_GBps"]
    print(f"machine: {platform.node()} ({os.cpu_count()} CPUs), directory {parent}")
    if fio:
        b, a2 = got["fio_before_after_GBps"]
        print(f"fio seq read bs 1M QD 32: {fio:.2f} GB/s (mean of {b:.2f} before, {a2:.2f} after)")
    else:
        print("fio: not installed (no ratio)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    rows = []
    stores = {(r["size"], r["batch"]): r for r in got["stores"]}
    queued = {(r["size"], r["batch"]): r for r in got["loads_inflight"]}
    for r in got["loads"]:
        s = stores.get((r["size"], r["batch"]), {})
        q = queued.get((r["size"], r["batch"]), {})
        rows.append(
            [
                kv._label(int(r["size"])),
                str(int(r["batch"])),
                f"{r['GBps']:.2f}",
                f"{r['GBps'] / fio:.2f}x" if fio else "n/a",
                f"{r['cpu_s_per_GB']:.2f}",
                f"{q.get('GBps', 0.0):.2f} ({int(q.get('inflight', 0))})",
                f"{q.get('GBps', 0.0) / fio:.2f}x" if fio else "n/a",
                f"{q.get('cpu_s_per_GB', 0.0):.2f}",
                f"{s.get('GBps', 0.0):.2f}",
                f"{s.get('cpu_s_per_GB', 0.0):.2f}",
                "yes" if r["verified"] == 1.0 and q.get("verified") == 1.0 else "NO",
            ]
        )
    head = [
        "block",
        "batch",
        "load GB/s, 1 call",
        "vs fio",
        "CPU s/GB",
        "load GB/s (in flight)",
        "vs fio",
        "CPU s/GB",
        "store GB/s",
        "store CPU s/GB",
        "ok",
    ]
    print(markdown_table(head, rows, right=2))
    ch = got["churn"]
    print(
        f"churn: {ch['written'] / 2**20:.0f} MiB written to a {ch['capacity'] / 2**20:.0f} MiB cache at "
        f"{ch['write_GBps']:.2f} GB/s; most on disk {ch['max_disk_bytes'] / 2**20:.1f} MiB; reads: "
        f"{int(ch['hits'])} hits, {int(ch['misses'])} misses, {int(ch['wrong'])} wrong; "
        f"{int(ch['evictions'])} evictions, {int(ch['refused'])} puts refused"
    )
    h = got["hit"]
    print(
        f"per call: host-tier hit of 512 KiB {h['host_hit_submit_us']:.1f} µs via submit, "
        f"{h['host_hit_get_us']:.1f} µs via get; NVMe load of 512 KiB {h['nvme_load_submit_us']:.1f} µs "
        f"via submit, {h['nvme_load_loop_us']:.1f} µs on the store's loop"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(got, f, indent=1)
    ok = (
        ch["wrong"] == 0
        and ch["max_disk_bytes"] <= ch["capacity"]
        and all(r["verified"] for r in got["loads"] + got["loads_inflight"])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
