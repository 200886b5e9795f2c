#!/usr/bin/env python3
"""KV-cache tiers of serving engines: aionvme's vLLM and SGLang adapters next
to the engines' own file backends (run from the installed packages) and fio.

Each point stores then loads KV blocks of S bytes, B per call (vLLM: one
``submit_store``/``submit_load`` job of B chunks, polled to completion;
SGLang: one ``batch_set``/``batch_get`` call of B pages, as its cache
controller makes them), until ``--total`` bytes have gone each way. vLLM's
loads run twice: one job at a time, and ``--inflight`` jobs in flight (its
scheduler submits one load per request each step and polls
``get_finished_jobs``; here every 0.2 ms). SGLang's calls block, one at a time:

  vllm   aionvme   aionvme.integrations.vllm.AionvmeTier (SecondaryTierFactory, module path)
         own       vLLM's FileSystemTierManager ("fs": a file per chunk, 16+16 threads)
  sglang aionvme   aionvme.integrations.sglang.AionvmeHiCache (dynamic backend,
                   interface_v1: batch_set_v1/batch_get_v1 on host-pool indices)
         own       SGLang's HiCacheFile ("file": the controller's generic path,
                   batch_set / batch_get into fresh pages, then into the pool)

The SGLang host pool is MHA page-first (a page is two parts, K and V: aionvme
reads it through an aligned staging page) or, with ``--pool mla``, MLA
page-first (a page is contiguous: read in place). Loads start from a cold
page cache (dropped as root; each side's files evicted). Stores are timed
until the bytes are written: the O_DIRECT sides at completion; HiCacheFile
writes through the page cache, so its stores include an fdatasync of each
of its files.
CPU per GB is the process's user+sys time (getrusage: every thread of the
side) over the bytes moved; fio's is its own. torch runs one intra-op
thread (``--torch-threads``): on a shared 2-core machine its parallel copies
of a page (both SGLang sides copy pages with torch) wait milliseconds for a
second thread. fio: sequential read, bs 1M,
QD 32, libaio, O_DIRECT, in the same run (before and after the points;
the median is the reference). Every block loaded is checked. With
``--repeat N`` each point runs N times, the sides taking turns to go first,
and each figure is the median. Each side runs once, untimed, before the
grid (its first imports and threads).

    python3 bench/suites/bench_kv_engines.py --quick
    python3 bench/suites/bench_kv_engines.py --sizes 512K,2M,8M,32M --batches 1,8,32,128 --total 256M
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any
from unittest.mock import MagicMock

import numpy as np

from aionvme.bench import drop_caches, evict, local_scratch_dir, peers
from aionvme.bench.render import table
from aionvme.defaults import parse_size

GB = 1e9
STAMP = 4096  # every page of a block carries its block's id


def aligned(nbytes: int) -> Any:
    import torch

    raw = torch.zeros(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
    shift = -raw.data_ptr() % mmap.PAGESIZE
    return raw[shift : shift + nbytes]


def stamp(rows: Any, ids: list[int]) -> None:
    """Write each row's id into every 4 KiB page of it (uint8 rows, a multiple of 8 bytes)."""
    for r, i in zip(rows, ids):
        r.view(-1).numpy().view(np.int64)[:: STAMP // 8] = i


def stamped(rows: Any, ids: list[int]) -> bool:
    return all(bool((r.view(-1).numpy().view(np.int64)[:: STAMP // 8] == i).all()) for r, i in zip(rows, ids))


def files_under(d: str) -> list[str]:
    return [os.path.join(a, f) for a, _, fs in os.walk(d) for f in fs]


def cold(d: str) -> None:
    drop_caches()
    paths = [p for p in files_under(d) if os.path.isfile(p)]
    if paths:
        evict(*paths)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process, to the microsecond
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall s, process CPU s) of fn()."""
    c0, t0 = cpu_s(), time.perf_counter()
    fn()
    t1, c1 = time.perf_counter(), cpu_s()
    return t1 - t0, c1 - c0


# -- vLLM --------------------------------------------------------------------------------------


def vllm_spec() -> Any:
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    s = MagicMock()
    s.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    s.blocks_per_chunk = 1
    s.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=False, self_describing_kv_events=False
    )
    return s


def vllm_point(side: str, d: str, size: int, batch: int, rounds: int, inflight: int = 1) -> dict[str, Any]:
    """A store then a load of ``rounds`` jobs of ``batch`` chunks. Loads go as
    vLLM's scheduler makes them: up to ``inflight`` jobs submitted (one per
    request each step), then ``get_finished_jobs`` polled (every 0.2 ms: its
    tier-poll thread) until one ends and the next can go; inflight=1: each
    job waited for (``drain_jobs``) before the next."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    slots = max(1, min(inflight, rounds))
    mem = aligned((1 + slots) * batch * size).view((1 + slots) * batch, size)
    if side == "aionvme":
        cfg = {
            "type": "AionvmeTier",
            "module_path": "aionvme.integrations.vllm",
            "root_dir": d,
            "capacity": rounds * batch * size + (64 << 20),
        }
    else:
        cfg = {"type": "fs", "root_dir": d}
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(mem.numpy()), vllm_spec())
    ctx = ReqContext(req_id="bench")
    jid = iter(range(1 << 30))

    def keys(r: int) -> list[Any]:
        return [make_offload_key(((r << 20) | i).to_bytes(16, "big"), 0) for i in range(batch)]

    def check(results: list[Any], what: str) -> None:
        if not all(x.success for x in results):
            raise SystemExit(f"vllm {side}: a {what} failed")

    def run_stores() -> None:
        for r in range(rounds):
            stamp(mem[:batch], [(r << 20) | i for i in range(batch)])
            tier.submit_store(TransferJob(next(jid), keys(r), np.arange(batch, dtype=np.int64), False, ctx))
            tier.drain_jobs()
            check(list(tier.get_finished_jobs()), "store")

    def run_loads() -> None:
        live: dict[int, tuple[int, int]] = {}  # job id -> (round, slot)
        free = list(range(slots))
        r = 0
        while r < rounds or live:
            while r < rounds and free:
                slot = free.pop()
                chunks = np.arange((1 + slot) * batch, (2 + slot) * batch, dtype=np.int64)
                job = TransferJob(next(jid), keys(r), chunks, True, ctx)
                live[job.job_id] = (r, slot)
                tier.submit_load(job)
                r += 1
            if slots == 1:
                tier.drain_jobs()
            done = list(tier.get_finished_jobs())
            if not done:
                time.sleep(0.0002)
                continue
            check(done, "load")
            for x in done:
                rr, slot = live.pop(x.job_id)
                lo = (1 + slot) * batch
                if not stamped(mem[lo : lo + batch], [(rr << 20) | i for i in range(batch)]):
                    raise SystemExit(f"vllm {side}: wrong bytes loaded")
                free.append(slot)

    try:
        return measure(d, rounds * batch * size, run_stores, run_loads, sync=False)
    finally:
        tier.shutdown()


# -- SGLang ------------------------------------------------------------------------------------


class Pool:
    """A host pool as SGLang's (pool_host/mha.py): MHA page-first, a page in
    two parts (kv_buffer[:, i:i+1]), or MLA page-first, a page contiguous."""

    def __init__(self, pages: int, size: int, kind: str) -> None:
        self.page_size, self.kind = 1, kind
        self.kv_buffer = aligned(pages * size).view(2, pages, size // 2) if kind == "mha" else None
        if kind != "mha":
            self.kv_buffer = aligned(pages * size).view(pages, size)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        p = self.kv_buffer[:, index : index + 1] if self.kind == "mha" else self.kv_buffer[index : index + 1]
        return p.flatten() if flat else p

    def get_dummy_flat_data_page(self) -> Any:
        import torch

        return torch.zeros(self.get_data_page(0).numel(), dtype=self.kv_buffer.dtype)

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        p = self.get_data_page(index, flat=False)
        p.copy_(data_page.reshape(p.shape))


def sglang_point(side: str, d: str, size: int, batch: int, rounds: int, kind: str) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    cap = rounds * batch * size + (64 << 20)
    extra: dict[str, Any] = {"file_storage_path": d, "max_size": cap}
    if side == "aionvme":
        extra.update(
            backend_name="aionvme",
            module_path="aionvme.integrations.sglang",
            class_name="AionvmeHiCache",
            interface_v1=1,
        )
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=kind == "mla",
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/model",
        extra_config=extra,
    )
    pool = Pool(2 * batch, size, kind)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool) if side == "aionvme" else HiCacheFile(cfg)
    b.register_mem_pool_host(pool)
    src, dst = torch.arange(batch), torch.arange(batch, 2 * batch)

    def keys(r: int) -> list[str]:
        return [f"{r:08x}{i:08x}" for i in range(batch)]

    def mark(r: int) -> None:
        for i in range(batch):
            p = pool.get_data_page(i, flat=False)
            for part in p.view(-1, p.shape[-1]):  # MHA: its K and V halves, each contiguous
                part.numpy().view(np.int64)[:: STAMP // 8] = (r << 20) | i

    def check(r: int) -> bool:
        want = [(r << 20) | i for i in range(batch)]
        return stamped([pool.get_data_page(batch + i) for i in range(batch)], want)

    def run(load: bool) -> None:
        for r in range(rounds):
            if side == "aionvme":
                if load:
                    ok = all(b.batch_get_v1(keys(r), dst))
                else:
                    mark(r)
                    ok = all(b.batch_set_v1(keys(r), src))
            elif load:  # the controller's generic path: fresh pages, then into the pool
                got = b.batch_get(keys(r), [pool.get_dummy_flat_data_page() for _ in range(batch)])
                ok = all(g is not None for g in got)
                for i, g in enumerate(got):
                    pool.set_from_flat_data_page(batch + i, g)
            else:
                mark(r)
                ok = bool(b.batch_set(keys(r), [pool.get_data_page(i) for i in range(batch)]))
            if not ok:
                raise SystemExit(f"sglang {side}: a {'load' if load else 'store'} failed")
            if load and not check(r):
                raise SystemExit(f"sglang {side}: wrong bytes loaded")

    try:
        return measure(
            d, rounds * batch * size, lambda: run(False), lambda: run(True), sync=side != "aionvme"
        )
    finally:
        if hasattr(b, "close"):
            b.close()


# -- the points --------------------------------------------------------------------------------


def measure(
    d: str, nbytes: int, store: Callable[[], None], load: Callable[[], None], sync: bool
) -> dict[str, Any]:
    os.sync()

    def stored() -> None:
        store()
        if sync:  # written through the page cache: timed until the bytes are on the device
            for path in files_under(d):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)

    sw, sc = timed(stored)
    cold(d)
    lw, lc = timed(load)
    return {
        "bytes": nbytes,
        "store_GBps": nbytes / sw / GB,
        "store_cpu_s_per_GB": sc / (nbytes / GB),
        "load_GBps": nbytes / lw / GB,
        "load_cpu_s_per_GB": lc / (nbytes / GB),
    }


def fio_read(d: str, size: int) -> dict[str, Any] | None:
    if peers.fio_unavailable() is not None:
        return None
    path = os.path.join(d, "fio.dat")
    r = peers.fio(path, "write", "1M", 32, "libaio", size, end_fsync=1)
    cold(d)
    r = peers.fio(path, "read", "1M", 32, "libaio", size)
    os.unlink(path)
    return {"GBps": r.nbytes / r.wall_s / GB, "cpu_s_per_GB": r.cpu_s / (r.nbytes / GB)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory on the drive (default: a temp dir on a local disk)")
    p.add_argument("--sizes", default="512K,2M,8M,32M", help="KV block sizes")
    p.add_argument("--batches", default="1,8,32,128", help="blocks per call")
    p.add_argument("--total", default="256M", help="bytes stored and loaded per point")
    p.add_argument("--max-batch-bytes", default="256M", help="skip points whose one call moves more")
    p.add_argument("--engines", default="vllm,sglang")
    p.add_argument("--pool", default="mha", choices=("mha", "mla"), help="SGLang host pool layout")
    p.add_argument("--quick", action="store_true", help="a few small points: proves it runs")
    p.add_argument("--repeat", type=int, default=1, help="runs per point (median; sides alternate)")
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--inflight",
        type=int,
        default=8,
        help="vLLM: also load with this many jobs in flight, as its scheduler submits them (default 8)",
    )
    p.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads (0: leave it)")
    a = p.parse_args()
    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)
    if a.quick:
        a.sizes, a.batches, a.total = "512K,8M", "1,32", "64M"
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    batches = [int(b) for b in a.batches.split(",")]
    total, cap = parse_size(a.total), parse_size(a.max_batch_bytes)
    engines = a.engines.split(",")
    root = tempfile.mkdtemp(prefix="aionvme-kv-", dir=a.dir or local_scratch_dir())
    results: list[dict[str, Any]] = []
    try:
        fios = [f for f in [fio_read(root, max(total, 256 << 20))] if f]
        for eng in engines:
            for side in ("own", "aionvme"):  # untimed: first imports, threads, the background loop
                d = os.path.join(root, f"warm-{eng}-{side}")
                os.makedirs(d)
                if eng == "vllm":
                    vllm_point(side, d, 1 << 20, 2, 2)
                else:
                    sglang_point(side, d, 1 << 20, 2, 2, a.pool)
                shutil.rmtree(d, ignore_errors=True)
            # vLLM submits loads without waiting (one per request each step): one
            # at a time and --inflight at once; SGLang's batch_get is blocking
            depths = sorted({1, max(1, a.inflight)}) if eng == "vllm" else [1]
            for size in sizes:
                for batch in batches:
                    if batch * size > cap:
                        continue
                    rounds = max(1, total // (batch * size))
                    for depth in depths:
                        if depth > 1 and rounds == 1:
                            continue  # one job: nothing to overlap
                        runs: dict[str, list[dict[str, Any]]] = {"own": [], "aionvme": []}
                        for rep in range(a.repeat):  # the sides take turns going first
                            for side in ("own", "aionvme")[:: 1 if rep % 2 == 0 else -1]:
                                d = os.path.join(root, f"{eng}-{side}")
                                os.makedirs(d)
                                try:
                                    if eng == "vllm":
                                        r = vllm_point(side, d, size, batch, rounds, depth)
                                    else:
                                        r = sglang_point(side, d, size, batch, rounds, a.pool)
                                finally:
                                    shutil.rmtree(d, ignore_errors=True)
                                runs[side].append(r)
                        for side, rs in runs.items():
                            med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
                            results.append(
                                {
                                    "engine": eng,
                                    "side": side,
                                    "size": size,
                                    "batch": batch,
                                    "inflight": min(depth, rounds),
                                    **med,
                                }
                            )
                            print(json.dumps(results[-1]), flush=True)
        fios += [f for f in [fio_read(root, max(total, 256 << 20))] if f]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = statistics.median(f["GBps"] for f in fios) if fios else None
    rows = []
    for r in results:
        if r["side"] != "aionvme":
            continue
        own = next(
            o
            for o in results
            if o["side"] == "own"
            and (o["engine"], o["size"], o["batch"], o["inflight"])
            == (r["engine"], r["size"], r["batch"], r["inflight"])
        )
        rows.append(
            [
                r["engine"],
                f"{r['size'] / 2**20:g} MiB",
                str(r["batch"]),
                str(r["inflight"]),
                f"{r['load_GBps']:.2f}",
                f"{r['load_GBps'] / ref:.2f}x" if ref else "-",
                f"{r['load_GBps'] / own['load_GBps']:.2f}x",
                f"{r['load_cpu_s_per_GB']:.2f} / {own['load_cpu_s_per_GB']:.2f}",
                f"{r['store_GBps']:.2f}",
                f"{r['store_GBps'] / own['store_GBps']:.2f}x",
                f"{r['store_cpu_s_per_GB']:.2f} / {own['store_cpu_s_per_GB']:.2f}",
            ]
        )
    head = [
        "engine",
        "block",
        "batch",
        "jobs in flight",
        "load GB/s",
        "/fio",
        "/own",
        "load CPU s/GB (own)",
        "store GB/s",
        "/own",
        "store CPU s/GB (own)",
    ]
    print(
        table(
            head, rows, title=f"KV tiers: aionvme vs the engines' own (fio read 1M QD32: {ref or 0:.2f} GB/s)"
        )
    )
    if fios:
        runs = ", ".join(f"{f['GBps']:.2f}" for f in fios)
        print(f"fio read bs 1M QD 32: {runs} GB/s; CPU s/GB {fios[0]['cpu_s_per_GB']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"fio": fios, "points": results, "pool": a.pool}, f, indent=1)


if __name__ == "__main__":
    main()
