#!/usr/bin/env python3
"""LMCache's L2 tier on NVMe: aionvme's adapter against LMCache's own local-disk adapters and fio.

Every side is an LMCache L2 adapter made the way LMCache makes one (its
``--l2-adapter`` JSON, through ``create_l2_adapter``) and driven the way its
store and prefetch controllers drive one: tasks of B chunks (KV chunks of S
bytes, ``ObjectKey`` keys, ``TensorMemoryObj`` buffers carved from one
page-aligned L1 pool, as LMCache's allocator carves its own), up to 8 tasks
in flight (the prefetch controller's default; ``--inflight``, each depth a
row: 1 is one task at a time), completion by eventfd.

Sides:

  aionvme      aionvme.integrations.lmcache.AionvmeL2Adapter (type "plugin",
               by module path): a bounded SyncTieredStore, O_DIRECT, checksums on
  fs           LMCache's "fs" adapter (aiofiles, one file per chunk, buffered)
  fs-odirect   the same with use_odirect=true
  fs-native    LMCache's "fs_native" adapter (its C++ connector, 4 workers,
               use_odirect=true)
  fio          sequential read, bs 1M, iodepth 32, libaio, O_DIRECT (the
               device's ceiling), of a file of the same total size, in every
               round of every point

Workloads (GB/s, 1 GB = 1e9 bytes; CPU in seconds per GB moved: user + system
time of the whole process, every thread of the adapter included):

  store   submit_store_task of every chunk, then os.sync(): until the bytes
          are on the device (a buffered side is otherwise only in page cache)
  load    with the page cache dropped first: lookup-and-lock of every chunk,
          submit_load_task into the (zeroed) L1 buffers, unlock, as a prefetch
          does; every chunk must load and land where it belongs (checked)
  churn   (--churn, aionvme only: LMCache's file adapters have no bound of
          their own) store 10x a --churn-cap budget in new keys while another
          thread looks up, loads and checks random keys written so far: every
          load returns its bytes or a miss; peak disk use: the store's files'
          size (its space), and their allocated blocks (ext4 counts the
          extent-tree block it adds once writes split the preallocated
          extents: 4 KiB over the size, file-system metadata, not data)

Each point runs every side and fio --repeat times, in rounds whose order
rotates; the figures are medians.

--shared runs instead the procedure aionvme.bench.kv times every KV tier with
(time_stores / time_loads: one blocking call at a time, page-aligned numpy
buffers, cold loads, verified), each side wrapped as its load(keys, outs) / store(keys, values).

    python3 bench/suites/bench_kv_lmcache.py --quick
    python3 bench/suites/bench_kv_lmcache.py --churn --sizes 2M --churn-cap 256M
    python3 bench/suites/bench_kv_lmcache.py --dir /nvme --sizes 512K,2M,8M,32M \\
        --batches 1,8,32,128 --total 512M --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
import select
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import aionvme as nvme
from aionvme.bench import drop_caches, local_scratch_dir, peers
from aionvme.defaults import parse_size

GB = 1e9
INFLIGHT = 8  # tasks in flight, as LMCache's prefetch_max_in_flight default
SIDES = ("aionvme", "fs", "fs-odirect", "fs-native")


def spec(side: str, d: str, nvme: int) -> dict[str, Any]:
    """The --l2-adapter JSON of a side; ``nvme``: aionvme's disk budget."""
    if side == "aionvme":
        return {
            "type": "plugin",
            "module_path": "aionvme.integrations.lmcache",
            "class_name": "AionvmeL2Adapter",
            "adapter_params": {"path": d, "nvme": nvme},
        }
    if side == "fs":
        return {"type": "fs", "base_path": d}
    if side == "fs-odirect":
        return {"type": "fs", "base_path": d, "use_odirect": True}
    if side == "fs-native":
        return {"type": "fs_native", "base_path": d, "use_odirect": True}
    raise SystemExit(f"unknown side {side!r} (known: {', '.join(SIDES)})")


def make_adapter(side: str, d: str, nvme: int) -> Any:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )

    args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(
        ["--l2-adapter", json.dumps(spec(side, d, nvme))]
    )
    return create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])


class Pool:
    """The L1 buffer: ``n`` chunks of ``size`` bytes in one page-aligned
    region, each a TensorMemoryObj (bfloat16 layout) over its slice. Every
    4 KiB page starts with its own index, so a load is checked cheaply."""

    def __init__(self, n: int, size: int) -> None:
        import torch
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        self.n, self.size = n, size
        self.raw = nvme.empty(n * size, like="torch")
        self.marks = self.raw.view(torch.int64)[::512]
        self.want = torch.arange(len(self.marks), dtype=torch.int64) + 1
        self.keys = [
            ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name="bench/kv", kv_rank=0) for i in range(n)
        ]
        self.objs = []
        for i in range(n):
            meta = MemoryObjMetadata(
                shape=torch.Size([size // 2]),
                dtype=torch.bfloat16,
                address=i * size,
                phy_size=size,
                ref_count=1,
                fmt=MemoryFormat.KV_2LTD,
            )
            self.objs.append(
                TensorMemoryObj(self.raw[i * size : (i + 1) * size], meta, parent_allocator=None)
            )

    def fill(self) -> None:
        self.raw.fill_(0x5A)
        self.marks.copy_(self.want)

    def clear(self) -> None:
        self.raw.zero_()

    def intact(self) -> bool:
        import torch

        return bool(torch.equal(self.marks, self.want))


def _wait(fd: int) -> None:
    select.select([fd], [], [], 60.0)
    with contextlib.suppress(BlockingIOError):  # counts coalesce: one read may cover several
        os.eventfd_read(fd)


def run_tasks(
    batches: list[list[int]],
    submit: Callable[[list[int]], int],
    fd: int,
    done: Callable[[set[int]], dict[int, Any]],
    depth: int = INFLIGHT,
) -> dict[int, Any]:
    """Up to ``depth`` tasks in flight until every batch has completed; returns task id -> result."""
    todo = collections.deque(batches)
    live: set[int] = set()
    out: dict[int, Any] = {}
    while todo or live:
        while todo and len(live) < depth:
            live.add(submit(todo.popleft()))
        if live:
            _wait(fd)
            got = done(live)
            live -= set(got)
            out.update(got)
    return out


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(side: str, base: str, pool: Pool, batch: int, depth: int = INFLIGHT) -> dict[str, Any]:
    d = tempfile.mkdtemp(prefix=f"{side}-", dir=base)
    a = make_adapter(side, d, pool.n * pool.size + (64 << 20))
    keys, objs = pool.keys, pool.objs
    batches = [list(range(i, min(pool.n, i + batch))) for i in range(0, pool.n, batch)]
    nbytes = pool.n * pool.size
    try:
        pool.fill()
        os.sync()
        c0, t0 = cpu(), time.perf_counter()
        res = run_tasks(
            batches,
            lambda b: a.submit_store_task([keys[i] for i in b], [objs[i] for i in b]),
            a.get_store_event_fd(),
            lambda live: a.pop_completed_store_tasks(),
        )
        os.sync()
        store_s, store_cpu = time.perf_counter() - t0, cpu() - c0
        if not all(r.is_successful() for r in res.values()):
            raise SystemExit(f"{side}: a store task failed")

        pool.clear()
        cold = drop_caches()
        c0, t0 = cpu(), time.perf_counter()

        def lookups(live: set[int]) -> dict[int, Any]:
            got = {t: a.query_lookup_and_lock_result(t) for t in live}
            return {t: r for t, r in got.items() if r is not None}

        looked = run_tasks(
            batches,
            lambda b: a.submit_lookup_and_lock_task([keys[i] for i in b], {}),
            a.get_lookup_and_lock_event_fd(),
            lookups,
            depth,
        )
        found = [len(bm.get_indices_list()) for bm in looked.values()]

        def loads(live: set[int]) -> dict[int, Any]:
            got = {t: a.query_load_result(t) for t in live}
            return {t: r for t, r in got.items() if r is not None}

        loaded = run_tasks(
            batches,
            lambda b: a.submit_load_task([keys[i] for i in b], [objs[i] for i in b]),
            a.get_load_event_fd(),
            loads,
            depth,
        )
        for b in batches:
            a.submit_unlock([keys[i] for i in b])
        load_s, load_cpu = time.perf_counter() - t0, cpu() - c0
        hits = sum(len(bm.get_indices_list()) for bm in loaded.values())
        if sum(found) != pool.n or hits != pool.n or not pool.intact():
            raise SystemExit(f"{side}: {sum(found)} found, {hits} loaded of {pool.n}, or wrong bytes")
    finally:
        a.close()
        shutil.rmtree(d, ignore_errors=True)
    return {
        "cold": cold is None,
        "store_GBps": nbytes / store_s / GB,
        "store_cpu_s_per_GB": store_cpu / (nbytes / GB),
        "load_GBps": nbytes / load_s / GB,
        "load_cpu_s_per_GB": load_cpu / (nbytes / GB),
    }


def fio_read(base: str, total: int) -> dict[str, Any] | None:
    if peers.fio_unavailable() is not None:
        return None
    path = os.path.join(base, "fio.bin")
    r = peers.fio(path, "read", "1M", 32, "libaio", total)
    os.unlink(path)
    return {"GBps": r.nbytes / r.wall_s / GB, "cpu_s_per_GB": (r.cpu_s or 0.0) / (r.nbytes / GB)}


def churn(base: str, size: int, cap: int, factor: int, batch: int) -> dict[str, Any]:
    """aionvme only (LMCache's file adapters have no bound of their own): store
    ``factor`` times a ``cap``-byte budget in new keys, in tasks of ``batch``
    chunks, while another thread looks up, loads and checks random keys
    written so far. Every load must return its key's bytes or be a miss;
    disk use (the files' allocated blocks) is read after every store task."""
    import random
    import threading

    import torch

    d = tempfile.mkdtemp(prefix="churn-", dir=base)
    a = make_adapter("aionvme", d, cap)
    src, dst = Pool(batch, size), Pool(batch, size)
    n = factor * cap // size
    written = [0]
    stop = threading.Event()
    stats = {"loads": 0, "hits": 0, "wrong": 0, "locked_not_loaded": 0}
    errors: list[BaseException] = []

    def stamp(pool: Pool, i: int, key_id: int) -> None:  # every page of chunk i starts with key_id
        pool.marks[i * size // 4096 : (i + 1) * size // 4096].fill_(key_id)

    def reader() -> None:
        rng = random.Random(0)
        fds = (a.get_lookup_and_lock_event_fd(), a.get_load_event_fd())
        try:
            while not stop.is_set():
                ids = [rng.randrange(max(1, written[0])) for _ in range(batch)]
                keys = [key_of(i) for i in ids]
                tid = a.submit_lookup_and_lock_task(keys, {})
                while (bm := a.query_lookup_and_lock_result(tid)) is None:
                    _wait(fds[0])
                hits = list(bm.get_indices_list())
                dst.clear()
                lid = a.submit_load_task([keys[i] for i in hits], [dst.objs[j] for j in range(len(hits))])
                while (got := a.query_load_result(lid)) is None:
                    _wait(fds[1])
                a.submit_unlock([keys[i] for i in hits])
                loaded = got.get_indices_list()
                stats["loads"] += batch
                stats["hits"] += len(loaded)
                stats["locked_not_loaded"] += len(hits) - len(loaded)  # a lock must keep it loadable
                for j in loaded:
                    page = dst.marks[j * size // 4096 : (j + 1) * size // 4096]
                    if not bool(torch.all(page == ids[hits[j]])):
                        stats["wrong"] += 1
        except BaseException as e:
            errors.append(e)

    from lmcache.v1.distributed.api import ObjectKey

    def key_of(i: int) -> Any:
        return ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name="bench/churn", kv_rank=0)

    t = threading.Thread(target=reader)
    t.start()
    peak, peak_alloc, failed = 0, 0, 0
    t0 = time.perf_counter()
    try:
        for first in range(0, n, batch):
            ids = list(range(first, min(n, first + batch)))
            for j, i in enumerate(ids):
                stamp(src, j, i)
            res = run_tasks(
                [ids],
                lambda b: a.submit_store_task([key_of(i) for i in b], src.objs[: len(b)]),
                a.get_store_event_fd(),
                lambda live: a.pop_completed_store_tasks(),
            )
            failed += sum(not r.is_successful() for r in res.values())
            written[0] = ids[-1] + 1
            sts = [os.stat(os.path.join(d, f)) for f in os.listdir(d)]
            peak = max(peak, sum(st.st_size for st in sts))
            peak_alloc = max(peak_alloc, sum(st.st_blocks * 512 for st in sts))
    finally:
        stop.set()
        t.join()
        wall = time.perf_counter() - t0
        a.close()
        shutil.rmtree(d, ignore_errors=True)
    if errors:
        raise errors[0]
    return {
        "size": size,
        "cap": cap,
        "written_GB": n * size / GB,
        "store_GBps": n * size / wall / GB,
        "failed_store_tasks": failed,
        "peak_disk_bytes": peak,
        "peak_allocated_bytes": peak_alloc,
        **stats,
    }


def kv_fns(a: Any) -> tuple[Callable[[list[int], list[Any]], None], Callable[[list[int], list[Any]], None]]:
    """An L2 adapter as the blocking ``load(keys, outs)`` / ``store(keys,
    values)`` of :mod:`aionvme.bench.kv`, whose procedure times every KV tier
    alike (one call at a time): int keys become ObjectKeys, uint8 arrays
    become MemoryObjs over their memory; a load is lookup-and-lock, load,
    unlock, as a prefetch does."""
    import torch
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    def objs(arrays: list[Any]) -> list[Any]:
        out = []
        for x in arrays:
            meta = MemoryObjMetadata(
                shape=torch.Size([x.nbytes]),
                dtype=torch.uint8,
                address=0,
                phy_size=x.nbytes,
                ref_count=1,
                fmt=MemoryFormat.KV_2LTD,
            )
            out.append(TensorMemoryObj(torch.from_numpy(x), meta, parent_allocator=None))
        return out

    def okeys(keys: list[int]) -> list[Any]:
        return [ObjectKey(chunk_hash=k.to_bytes(16, "big"), model_name="bench/kv", kv_rank=0) for k in keys]

    def once(submit: Callable[[], int], fd: int, collect: Callable[[int], Any]) -> Any:
        tid = submit()
        while (got := collect(tid)) is None:
            _wait(fd)
        return got

    done: dict[int, Any] = {}

    def store(keys: list[int], values: list[Any]) -> None:
        def popped(tid: int) -> Any:
            done.update(a.pop_completed_store_tasks())
            return done.pop(tid, None)

        r = once(lambda: a.submit_store_task(okeys(keys), objs(values)), a.get_store_event_fd(), popped)
        if not r.is_successful():
            raise OSError(f"store task of {len(keys)} chunks failed")

    def load(keys: list[int], outs: list[Any]) -> None:
        ks = okeys(keys)
        found = once(
            lambda: a.submit_lookup_and_lock_task(ks, {}),
            a.get_lookup_and_lock_event_fd(),
            a.query_lookup_and_lock_result,
        )
        try:
            if len(found.get_indices_list()) != len(ks):
                raise KeyError(f"{len(ks) - len(found.get_indices_list())} of {len(ks)} chunks not found")
            got = once(lambda: a.submit_load_task(ks, objs(outs)), a.get_load_event_fd(), a.query_load_result)
            if len(got.get_indices_list()) != len(ks):
                raise OSError(f"{len(ks) - len(got.get_indices_list())} of {len(ks)} chunks not loaded")
        finally:
            a.submit_unlock([ks[i] for i in found.get_indices_list()])

    return load, store


def shared_procedure(
    base: str, sides: list[str], sizes: list[int], batches: list[int], total: int
) -> dict[str, Any]:
    """Each side through :func:`aionvme.bench.kv.time_stores` and
    :func:`~aionvme.bench.kv.time_loads` (its buffers are page-aligned
    numpy arrays, as LMCache's L1 pool is; a side that fails a point is
    reported as such)."""
    from aionvme.bench.kv import fio_seqread, time_loads, time_stores

    fio_path = os.path.join(base, "fio.bin")
    out: dict[str, Any] = {"fio_GBps_before": fio_seqread(fio_path, total)}
    for side in sides:
        d = tempfile.mkdtemp(prefix=f"{side}-", dir=base)
        a = make_adapter(side, d, 2 * (total + max(sizes)) + (64 << 20))
        try:
            load, store = kv_fns(a)
            out[side] = {"stores": time_stores(store, sizes, batches, total=total)}
            out[side]["loads"] = time_loads(load, store, sizes, batches, total=total)
        except (OSError, KeyError) as e:
            out[side] = {"error": repr(e)}
        finally:
            a.close()
            shutil.rmtree(d, ignore_errors=True)
        for kind in ("loads", "stores"):
            for r in out[side].get(kind, []):
                print(
                    f"{side:>10} {kind[:-1]:>5} {r['size'] / 2**20:5.1f} MiB x {r['batch']:>3}:"
                    f" {r['GBps']:5.2f} GB/s {r['cpu_s_per_GB']:5.2f} CPU s/GB, {r['call_ms']:.2f} ms/call"
                    + ("" if r.get("verified", 1.0) else "  WRONG BYTES"),
                    flush=True,
                )
        if "error" in out[side]:
            print(f"{side:>10}: {out[side]['error']}", flush=True)
    out["fio_GBps_after"] = fio_seqread(fio_path, total)
    print(
        f"fio seq read bs 1M QD 32, before and after: {out['fio_GBps_before']} {out['fio_GBps_after']} GB/s"
    )
    return out


def median(runs: list[dict[str, Any]], key: str) -> float:
    vals = sorted(float(r[key]) for r in runs)
    return vals[(len(vals) - 1) // 2]


def point(
    base: str, pool: Pool, batch: int, sides: list[str], repeat: int, depth: int = INFLIGHT
) -> dict[str, Any]:
    """Each side ``repeat`` times, and fio as many, in rounds whose order
    rotates (a shared disk drifts: who runs first must not always gain);
    the median of each figure."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    fios: list[dict[str, Any]] = []
    order: list[str] = ["fio", *sides]
    for r in range(repeat):
        for side in order[r % len(order) :] + order[: r % len(order)]:
            if side == "fio":
                f = fio_read(base, pool.n * pool.size)
                if f is not None:
                    fios.append(f)
            else:
                runs[side].append(measure(side, base, pool, batch, depth))
    out: dict[str, Any] = {
        "size": pool.size,
        "batch": batch,
        "inflight": depth,
        "fio_GBps": median(fios, "GBps") if fios else None,
    }
    if fios:
        out["fio_cpu_s_per_GB"] = median(fios, "cpu_s_per_GB")
    for side, rs in runs.items():
        out[side] = {
            k: median(rs, k) for k in ("load_GBps", "load_cpu_s_per_GB", "store_GBps", "store_cpu_s_per_GB")
        }
        out[side]["runs"] = rs
    return out


def report(p: dict[str, Any], sides: list[str]) -> None:
    head = f"{p['size'] / 2**20:5.1f} MiB x {p['batch']:>3}, {p.get('inflight', INFLIGHT)} in flight"
    fio_gbps = p["fio_GBps"]
    if fio_gbps:
        print(f"{head}  {'fio':>10}: read  {fio_gbps:5.2f} GB/s {p['fio_cpu_s_per_GB']:5.2f} CPU s/GB")
    for side in sides:
        r = p[side]
        print(
            f"{head}  {side:>10}: load  {r['load_GBps']:5.2f} GB/s {r['load_cpu_s_per_GB']:5.2f} CPU s/GB"
            f"  store {r['store_GBps']:5.2f} GB/s {r['store_cpu_s_per_GB']:5.2f} CPU s/GB"
            + (f"  load {r['load_GBps'] / fio_gbps:.2f}x fio" if fio_gbps else "")
        )
    if "aionvme" in sides:
        me = p["aionvme"]
        for side in sides:
            if side != "aionvme":
                o = p[side]
                print(
                    f"{head}  aionvme/{side}: load {me['load_GBps'] / o['load_GBps']:.2f}x"
                    f" store {me['store_GBps'] / o['store_GBps']:.2f}x;"
                    f" CPU/GB load {me['load_cpu_s_per_GB'] / o['load_cpu_s_per_GB']:.2f}x"
                    f" store {me['store_cpu_s_per_GB'] / o['store_cpu_s_per_GB']:.2f}x"
                )
    print(flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory on the drive to measure (default: a temp dir on a local disk)")
    p.add_argument("--sizes", default="512K,2M,8M,32M", help="chunk sizes")
    p.add_argument("--batches", default="1,8,32,128", help="chunks per task")
    p.add_argument("--total", default="512M", help="bytes stored and loaded per point (the L1 pool's size)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"adapters to run (of {', '.join(SIDES)})")
    p.add_argument(
        "--inflight",
        default=f"1,{INFLIGHT}",
        help=f"tasks in flight, each a row (default 1,{INFLIGHT}: one at a time, and as LMCache's prefetch)",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds per point (medians)")
    p.add_argument("--quick", action="store_true", help="two small points, once: proves it runs")
    p.add_argument("--churn", action="store_true", help="only the churn workload (see above)")
    p.add_argument(
        "--shared",
        action="store_true",
        help="only the procedure every KV tier is timed with (aionvme.bench.kv: one call at a time)",
    )
    p.add_argument("--churn-cap", default="256M", help="the churn's disk budget (it writes 10x this)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.batches, a.total, a.repeat = "512K,8M", "1,32", "64M", 1
    try:
        import lmcache.v1.distributed.l2_adapters  # noqa: F401
    except ImportError as e:
        print(f"bench_kv_lmcache: needs lmcache ({e})", file=sys.stderr)
        return 2
    sizes = [parse_size(x) for x in a.sizes.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    depths = [int(x) for x in a.inflight.split(",")]
    sides = [s for s in a.sides.split(",") if s]
    for s in sides:
        spec(s, "", 0)  # an unknown side stops here, before any I/O
    total = parse_size(a.total)
    base = tempfile.mkdtemp(prefix="aionvme-bench-kv-lmcache-", dir=local_scratch_dir(a.dir))
    if a.shared:
        try:
            res = shared_procedure(base, sides, sizes, batches, total)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        _dump(a.json, res)
        return 0
    if a.churn:
        cap = parse_size("32M" if a.quick else a.churn_cap)
        try:
            c = churn(base, sizes[0], cap, 10, 8)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(
            f"churn: {c['written_GB']:.2f} GB in {c['size'] / 2**20:.1f} MiB chunks"
            f" (10x a {cap / 2**20:.0f} MiB budget) at {c['store_GBps']:.2f} GB/s,"
            f" {c['failed_store_tasks']} store tasks failed; meanwhile"
            f" {c['loads']} loads, {c['hits']} hits, {c['wrong']} wrong bytes,"
            f" {c['locked_not_loaded']} locked but not loaded; peak disk use"
            f" {c['peak_disk_bytes'] / 2**20:.1f} MiB (allocated blocks {c['peak_allocated_bytes']} bytes,"
            f" budget {cap})"
        )
        _dump(a.json, c)
        return 1 if c["wrong"] or c["locked_not_loaded"] or c["peak_disk_bytes"] > cap else 0
    res: dict[str, Any] = {"total": total, "repeat": a.repeat, "cold": drop_caches() is None, "points": []}
    print(
        f"{total / 2**20:.0f} MiB per point, {a.repeat} rounds; page cache dropped before loads: "
        f"{res['cold']}\n"
    )
    try:
        for size in sizes:
            pool = Pool(max(1, total // size), size)
            for batch in batches:
                for depth in depths:
                    if batch <= pool.n and (depth == 1 or batch < pool.n):  # one task: nothing to overlap
                        res["points"].append(point(base, pool, batch, sides, a.repeat, depth))
                        report(res["points"][-1], sides)
            del pool
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _dump(a.json, res)
    return 0


def _dump(path: str | None, res: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
