#!/usr/bin/env python3
"""aionvme.data.Loader next to fio and the data loaders people use, on the same data.

    python3 bench/suites/bench_loader.py                # 1 GiB of 128 KiB samples, 256 MiB of 4 KiB samples
    python3 bench/suites/bench_loader.py --size 64M --small-size 16M --prefetch 16M --quick   # a smoke run
    python3 bench/suites/bench_loader.py --json loader.json --markdown loader.md

Workloads (one epoch each, shuffled, the page cache dropped before every run when root):
  128k   samples of 128 KiB, batch 64: aionvme async and sync, against fio randread bs=128k QD 64
         on the same shard file (the issue's bound), fio randread at the loader's own queue depth
         (the engine's queue_depth, 128 by default: as many chunks in flight), and fio replaying
         (read_iolog, at that depth) the loader's own offsets of the epoch, in the epoch's
         shuffled order and sorted by offset inside each batch of 64 as the loader reads them
         (what explains a loader above fio at QD 64); peers: torch
         DataLoader (num_workers 0 and 2) over an np.memmap of one file and over one .npy per
         sample, mosaicml-streaming StreamingDataset over local MDS shards, webdataset over tar
         shards, and aionvme over the .npy directory.
  4k     samples of 4 KiB, batch 1024: aionvme against fio randread bs=4k QD 64 (IOPS).
  memory a fresh process runs one epoch over a dataset 4x the prefetch budget and reports its
         RSS growth (bound: budget + 10% + FIXED_OVERHEAD).
Every reader's samples are checked: each sample begins with its index (int64), and an epoch
must deliver every index once. CPU is the process's user+system time (workers included).
fio and the aionvme rows are repeated --repeat times, each tool once per round in turn, and
the table shows medians (the stall: the median of each run's worst; its worst over all runs
is in the JSON). A full garbage collection runs before every timed run (a collection owed by
the set-up, 90-170 ms of loop time with torch loaded, must not land in one reader's epoch).
"loop CPU ms" is the most CPU the event loop's thread spent between two ticks of a 1 ms
probe: the loop's own work, which other processes on the machine do not inflate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import aionvme as nvme
from aionvme.bench import drop_caches
from aionvme.bench.loader import LoopProbe
from aionvme.defaults import parse_size

FIXED_OVERHEAD = 32 << 20  # RSS allowed besides the budget: loop thread, engine, thread pool, index


def cpu_s() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def sample(i: int, nbytes: int) -> np.ndarray:
    x = np.empty(nbytes, dtype=np.uint8)
    x[:] = i % 251
    x[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
    return x


def ids_of(x: Any) -> list[int]:
    a = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    return a.reshape(a.shape[0], -1)[:, :8].copy().view(np.int64).reshape(-1).tolist()


class Check:
    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = np.zeros(n, dtype=np.int32)

    def add(self, x: Any) -> int:
        ids = ids_of(x)
        np.add.at(self.seen, ids, 1)
        return len(ids)

    def ok(self) -> bool:
        return bool((self.seen == 1).all())


# -- fio ---------------------------------------------------------------------------


def fio(path: str, bs: str, iodepth: int, size: int) -> dict[str, float]:
    cmd = [
        "fio",
        "--name=job",
        f"--filename={path}",
        "--rw=randread",
        f"--bs={bs}",
        f"--iodepth={iodepth}",
        "--ioengine=libaio",
        "--direct=1",
        f"--size={size}",
        "--output-format=json",
        "--thread",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]["read"]
    return {"MB_s": job["bw_bytes"] / 1e6, "iops": job["iops"], "ios": job["total_ios"]}


def write_iolog(log: str, path: str, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """A fio iolog (version 2) that reads (offset, length) pairs of ``path`` in this order."""
    with open(log, "w") as f:
        f.write(f"fio version 2 iolog\n{path} add\n{path} open\n")
        f.writelines(f"{path} read {o} {n}\n" for o, n in zip(offsets.tolist(), lengths.tolist()))
        f.write(f"{path} close\n")


def fio_replay(log: str, iodepth: int) -> dict[str, float]:
    """fio replaying an iolog with libaio, O_DIRECT, ``iodepth`` in flight."""
    cmd = ["fio", "--name=replay", f"--read_iolog={log}", "--ioengine=libaio", "--direct=1"]
    cmd += [f"--iodepth={iodepth}", "--output-format=json", "--thread"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]["read"]
    return {"MB_s": job["bw_bytes"] / 1e6, "iops": job["iops"], "ios": job["total_ios"]}


def loader_iologs(root: str, path: str, batch: int) -> tuple[str, str]:
    """Two iologs of the loader's epoch 0 (seed 0, shuffled) over dataset ``path``: the
    epoch's order, and that order sorted by offset inside each batch (as the loader reads)."""
    ds = nvme.data.Dataset(path)
    x = ds.layout.fields["x"]
    if len(ds.layout.files) != 1:
        raise ValueError("the replay needs a dataset of one shard")
    order = nvme.data.epoch_order(len(ds), 0, 0, True)
    in_batches = np.concatenate(
        [b[np.argsort(x.offset[b], kind="stable")] for b in np.split(order, range(batch, len(order), batch))]
    )
    logs = []
    for name, seq in (("shuffled", order), ("sorted", in_batches)):
        logs.append(os.path.join(root, f"iolog-{name}.txt"))
        write_iolog(logs[-1], ds.layout.files[0], x.offset[seq], x.nbytes[seq])
    return logs[0], logs[1]


# -- aionvme -------------------------------------------------------------------------


async def _stall_probe(stop: asyncio.Event, out: list[float]) -> None:
    """The longest time the loop did not run this task when it asked to wake in 1 ms."""
    worst = 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        worst = max(worst, time.perf_counter() - t - 0.001)
    out.append(worst)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the numbers over repetitions (the stall: the median of each run's worst,
    and ``stall_max_ms`` the worst of all); ok only if every run was."""
    out: dict[str, Any] = {"runs": len(runs)}
    for k, v in runs[0].items():
        vals = [r[k] for r in runs if r.get(k) is not None]
        if k == "ok":
            out[k] = all(vals)
        elif k in ("stall_ms", "loop_cpu_ms"):
            out[k] = statistics.median(vals) if vals else None
            out[k.replace("_ms", "_max_ms")] = max(vals) if vals else None
        elif isinstance(v, (int, float)):
            out[k] = statistics.median(vals)
        else:
            out[k] = v
    return out


def run_aionvme(
    path: str, n: int, batch: int, prefetch: str, mode: str, verify: bool = False
) -> dict[str, Any]:
    chk = Check(n)
    drop_caches()
    loader = nvme.data.Loader(path, batch_size=batch, shuffle=True, seed=0, prefetch=prefetch, verify=verify)
    gc.collect()
    c0, t0 = cpu_s(), time.perf_counter()
    stall: list[float] = []
    loop_cpu: list[float] = []
    if mode == "async":

        async def main() -> None:
            stop = asyncio.Event()
            probe = asyncio.ensure_future(_stall_probe(stop, stall))
            work = LoopProbe()
            work.start()
            key = loader.dataset.keys[0]
            async for b in loader:
                chk.add(b[key])
            work.stop()
            loop_cpu.append(work.max_cpu)
            stop.set()
            await probe
            await loader.aclose()

        try:
            import uvloop

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())
    else:
        key = loader.dataset.keys[0]
        for b in loader:
            chk.add(b[key])
        loader.close()
    wall = time.perf_counter() - t0
    cpu = cpu_s() - c0
    st = loader.stats()
    return {
        "wall_s": wall,
        "MB_s": st["bytes"] / wall / 1e6,
        "samples_s": n / wall,
        "cpu_us_per_sample": cpu / n * 1e6,
        "stall_ms": stall[0] * 1e3 if stall else None,
        "loop_cpu_ms": loop_cpu[0] * 1e3 if loop_cpu else None,
        "slabs": st["slabs"],
        "consumer_wait_s": st["consumer_wait_s"],
        "io_wait_s": st["io_wait_s"],
        "ok": chk.ok(),
    }


# -- peers ------------------------------------------------------------------------------


def _torch_loader(ds: Any, batch: int, workers: int) -> Any:
    import torch

    return torch.utils.data.DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(0)
    )


class MemmapDataset:
    def __init__(self, path: str, n: int, nbytes: int) -> None:
        self.path, self.n, self.nbytes = path, n, nbytes
        self.mm: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.mm is None:  # opened in each worker
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(self.n, self.nbytes))
        return torch.from_numpy(np.array(self.mm[i]))


class NpyDataset:
    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.from_numpy(np.load(self.files[i]))


def timed_peer(name: str, n: int, nbytes: int, batches: Any, key: Any = None) -> dict[str, Any]:
    chk = Check(n)
    drop_caches()
    gc.collect()
    c0, t0 = cpu_s(), time.perf_counter()
    for b in batches():
        chk.add(b if key is None else key(b))
    wall = time.perf_counter() - t0
    cpu = cpu_s() - c0
    return {
        "wall_s": wall,
        "MB_s": n * nbytes / wall / 1e6,
        "samples_s": n / wall,
        "cpu_us_per_sample": cpu / n * 1e6,
        "ok": chk.ok(),
    }


def import_streaming() -> Any:
    """mosaicml-streaming imports torchvision in its package __init__: stand-ins for the bench."""
    import importlib.machinery
    import importlib.util
    import types

    if importlib.util.find_spec("torchvision") is None and "torchvision" not in sys.modules:
        names = (
            "torchvision",
            "torchvision.datasets",
            "torchvision.transforms",
            "torchvision.transforms.functional",
        )
        mods = {}
        for name in names:
            m = types.ModuleType(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            m.__path__ = []
            mods[name] = m

        class VisionDataset:
            def __init__(self, *a: Any, **k: Any) -> None:
                pass

        mods["torchvision.datasets"].VisionDataset = VisionDataset  # type: ignore[attr-defined]
        mods["torchvision.datasets"].CIFAR10 = VisionDataset  # type: ignore[attr-defined]
        mods["torchvision.transforms.functional"].to_tensor = lambda x: x  # type: ignore[attr-defined]
        sys.modules.update(mods)
    import streaming

    return streaming


# -- memory (in a fresh process) -------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(path: str, prefetch: str, batch: int) -> None:
    import torch  # noqa: F401 - its memory is not the loader's

    loader = nvme.data.Loader(path, batch_size=batch, shuffle=True, seed=0, prefetch=prefetch)
    base = rss()
    peak = base
    n = 0
    for b in loader:
        n += len(b["x"])
        peak = max(peak, rss())
    loader.close()
    print(
        json.dumps(
            {
                "base": base,
                "peak": peak,
                "growth": peak - base,
                "samples": n,
                "prefetch": loader.prefetch,
                "dataset": loader.dataset.nbytes,
            }
        )
    )


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--size", default="1G", help="bytes of 128 KiB samples")
    ap.add_argument("--small-size", default="256M", help="bytes of 4 KiB samples")
    ap.add_argument("--prefetch", default="256M", help="the loader's prefetch budget")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of fio and aionvme (medians)")
    ap.add_argument("--quick", action="store_true", help="no peers with worker processes")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--_memory", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory:
        memory_child(args._memory[0], args._memory[1], int(args._memory[2]))
        return
    import torch  # noqa: F401 - imported once, before any timing

    big, small = parse_size(args.size), parse_size(args.small_size)
    root = tempfile.mkdtemp(prefix="aionvme-bench-loader-", dir=args.dir)
    rows: list[dict[str, Any]] = []
    try:
        rows = run_all(root, big, small, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(rows, args, big, small)


def run_all(root: str, big: int, small: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    S = 128 << 10
    n = big // S
    d128 = os.path.join(root, "ds128k")
    nvme.data.sync_write_dataset(d128, ({"x": sample(i, S)} for i in range(n)), shard_size=big * 2)
    shard = os.path.join(d128, "shard-00000.bin")
    fsize = os.path.getsize(shard)

    def add(workload: str, tool: str, r: dict[str, Any], ref: float | None, metric: str = "MB_s") -> None:
        r = dict(r, workload=workload, tool=tool)
        if ref:
            r["vs_fio"] = r[metric] / ref
        rows.append(r)
        print(
            f"{workload:6} {tool:42} {r.get('MB_s', 0):9.1f} MB/s {r.get('samples_s', 0):10.0f} samples/s"
            f"  vs fio {r.get('vs_fio', float('nan')):.2f}  ok={r.get('ok')}",
            flush=True,
        )

    # warm-up (engine, loop, thread pool, extent maps): not timed
    run_aionvme(d128, n, 64, args.prefetch, "sync")
    K = 4096
    m = small // K
    d4 = os.path.join(root, "ds4k")
    nvme.data.sync_write_dataset(d4, ({"x": sample(i, K)} for i in range(m)), shard_size=small * 2)
    s4 = os.path.join(d4, "shard-00000.bin")
    log_shuffled, log_sorted = loader_iologs(root, d128, 64)
    qd = nvme.defaults.settings.queue_depth  # chunks the loader's engine keeps in flight
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeat):  # every tool once per repetition, in turn
        drop_caches()
        f = fio(shard, "128k", 64, fsize)
        runs.setdefault("fio128", []).append({"MB_s": f["MB_s"], "samples_s": f["iops"], "ok": True})
        drop_caches()
        f = fio(shard, "128k", qd, fsize)
        runs.setdefault("fio128_qd", []).append({"MB_s": f["MB_s"], "samples_s": f["iops"], "ok": True})
        for key, log in (("fio_shuffled", log_shuffled), ("fio_sorted", log_sorted)):
            drop_caches()
            f = fio_replay(log, qd)
            runs.setdefault(key, []).append({"MB_s": f["MB_s"], "samples_s": f["iops"], "ok": f["ios"] == n})
        runs.setdefault("async128", []).append(run_aionvme(d128, n, 64, args.prefetch, "async"))
        runs.setdefault("sync128", []).append(run_aionvme(d128, n, 64, args.prefetch, "sync"))
        drop_caches()
        f4 = fio(s4, "4k", 64, os.path.getsize(s4))
        runs.setdefault("fio4", []).append({"samples_s": f4["iops"], "MB_s": f4["MB_s"], "ok": True})
        runs.setdefault("async4", []).append(run_aionvme(d4, m, 1024, args.prefetch, "async"))
        runs.setdefault("sync4", []).append(run_aionvme(d4, m, 1024, args.prefetch, "sync"))
    med = {k: median_run(v) for k, v in runs.items()}
    ref = med["fio128"]["MB_s"]
    add("128k", "fio randread bs=128k QD 64", med["fio128"], ref)
    add("128k", f"fio randread bs=128k QD {qd} (the loader's depth)", med["fio128_qd"], ref)
    add("128k", f"fio replay QD {qd}: loader's offsets, shuffled", med["fio_shuffled"], ref)
    add("128k", f"fio replay QD {qd}: loader's offsets, sorted/batch", med["fio_sorted"], ref)
    add("128k", "aionvme Loader async (uvloop)", med["async128"], ref)
    add("128k", "aionvme Loader sync for", med["sync128"], ref)
    ref4 = med["fio4"]["samples_s"]
    add("4k", "fio randread bs=4k QD 64", med["fio4"], ref4, "samples_s")
    add("4k", "aionvme Loader async (batch 1024)", med["async4"], ref4, "samples_s")
    add("4k", "aionvme Loader sync (batch 1024)", med["sync4"], ref4, "samples_s")
    # the price of checking every sample's crc32 (Loader(verify=True)), once
    add(
        "128k",
        "aionvme Loader sync for, verify=True",
        run_aionvme(d128, n, 64, args.prefetch, "sync", verify=True),
        ref,
    )

    # memory: a fresh process, dataset = 4x the budget
    budget = max(big // 4, 1 << 20)
    out = subprocess.run(
        [sys.executable, __file__, "--_memory", d128, str(budget), str(max(1, min(64, budget // (3 * S))))],
        capture_output=True,
        text=True,
        check=True,
    )
    mem = json.loads(out.stdout.strip().splitlines()[-1])
    mem["bound"] = int(budget * 1.1) + FIXED_OVERHEAD
    mem["within"] = mem["growth"] <= mem["bound"]
    rows.append(dict(workload="memory", tool="aionvme Loader (fresh process)", **mem))
    mib = 1 << 20
    print(
        f"memory: RSS growth {mem['growth'] / mib:.1f} MiB over an epoch of {mem['dataset'] / mib:.0f} MiB, "
        f"budget {budget / mib:.0f} MiB, bound {mem['bound'] / mib:.0f} MiB: within={mem['within']}"
    )

    if args.no_peers:
        return rows
    # the same samples in the peers' formats
    flat = os.path.join(root, "flat.bin")
    with open(flat, "wb") as fh:
        for i in range(n):
            fh.write(sample(i, S).tobytes())
    npy = os.path.join(root, "npy")
    os.makedirs(npy)
    files = []
    for i in range(n):
        files.append(os.path.join(npy, f"{i:07d}.npy"))
        np.save(files[-1], sample(i, S))
    for w in (0,) if args.quick else (0, 2):
        add(
            "128k",
            f"torch DataLoader np.memmap workers={w}",
            timed_peer("memmap", n, S, lambda w=w: _torch_loader(MemmapDataset(flat, n, S), 64, w)),
            ref,
        )
        add(
            "128k",
            f"torch DataLoader .npy per sample workers={w}",
            timed_peer("npy", n, S, lambda w=w: _torch_loader(NpyDataset(files), 64, w)),
            ref,
        )
    add(
        "128k",
        "aionvme Loader sync over the .npy directory",
        run_aionvme(npy, n, 64, args.prefetch, "sync"),
        ref,
    )
    with contextlib.suppress(ImportError):
        streaming = import_streaming()
        mds = os.path.join(root, "mds")
        with streaming.MDSWriter(out=mds, columns={"x": f"ndarray:uint8:{S}"}, size_limit=1 << 26) as w:
            for i in range(n):
                w.write({"x": sample(i, S)})
        import torch

        def mds_batches() -> Any:
            sds = streaming.StreamingDataset(local=mds, shuffle=True, shuffle_seed=0, batch_size=64)
            return torch.utils.data.DataLoader(sds, batch_size=64, num_workers=0)

        add(
            "128k",
            "mosaicml-streaming StreamingDataset (local MDS)",
            timed_peer("mds", n, S, mds_batches, key=lambda b: b["x"]),
            ref,
        )
    with contextlib.suppress(ImportError):
        import webdataset as wds

        tar = os.path.join(root, "wds")
        os.makedirs(tar)
        with wds.ShardWriter(os.path.join(tar, "shard-%05d.tar"), maxsize=1 << 26, verbose=0) as sw:
            for i in range(n):
                sw.write({"__key__": f"{i:07d}", "x.npy": sample(i, S)})
        urls = sorted(os.path.join(tar, x) for x in os.listdir(tar))

        def wds_batches() -> Any:
            return (
                wds.WebDataset(urls, shardshuffle=len(urls), seed=0)
                .shuffle(1000)
                .decode()
                .to_tuple("x.npy")
                .batched(64)
            )

        add(
            "128k",
            "webdataset tar shards (shuffle buffer 1000)",
            timed_peer("wds", n, S, wds_batches, key=lambda b: np.stack(b[0])),
            ref,
        )
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace, big: int, small: int) -> None:
    head = (
        f"{time.strftime('%Y-%m-%d')}, {platform.node()}: {os.cpu_count()} CPUs, "
        f"kernel {platform.release()}, "
        f"{big >> 20} MiB of 128 KiB samples, {small >> 20} MiB of 4 KiB samples, prefetch {args.prefetch}"
    )
    head += f"; medians of {args.repeat} runs for fio and the aionvme rows (one run for the rest)"
    cols = "| workload | reader | MB/s | samples/s | vs fio | CPU µs/sample | stall ms | loop CPU ms | ok |"
    lines = [head, "", cols, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["workload"] == "memory":
            continue
        vs = f"{r['vs_fio']:.2f}x" if "vs_fio" in r else ""
        cpu = f"{r['cpu_us_per_sample']:.1f}" if "cpu_us_per_sample" in r else ""
        stall = f"{r['stall_ms']:.2f}" if r.get("stall_ms") is not None else ""
        work = f"{r['loop_cpu_ms']:.2f}" if r.get("loop_cpu_ms") is not None else ""
        mbs, sps = r.get("MB_s", 0), r.get("samples_s", 0)
        lines.append(
            f"| {r['workload']} | {r['tool']} | {mbs:,.0f} | {sps:,.0f} | "
            f"{vs} | {cpu} | {stall} | {work} | {r.get('ok')} |"
        )
    by = {r["tool"]: r for r in rows if r["workload"] == "128k"}
    a, s = by.get("aionvme Loader async (uvloop)"), by.get("aionvme Loader sync for")
    if a and s:
        lines.append(f"\nsync for / async for (128k): {s['samples_s'] / a['samples_s']:.2f}x")
    for r in rows:
        if a and s and r["tool"].startswith("fio") and "QD 64" not in r["tool"]:
            lines.append(
                f"against {r['tool']}: async {a['MB_s'] / r['MB_s']:.2f}x, sync {s['MB_s'] / r['MB_s']:.2f}x"
            )
    peers = [r for r in rows if r["workload"] == "128k" and not r["tool"].startswith(("aionvme", "fio"))]
    if a and peers:
        best = max(peers, key=lambda r: r["samples_s"])
        lines.append(
            f"aionvme async / fastest peer ({best['tool']}): {a['samples_s'] / best['samples_s']:.2f}x"
        )
    for r in rows:
        if r["workload"] == "memory":
            lines.append(
                f"memory: RSS grew {r['growth'] / 2**20:.1f} MiB over one epoch of "
                f"{r['dataset'] / 2**20:.0f} MiB with prefetch {r['prefetch'] / 2**20:.0f} MiB "
                f"(bound: budget + 10% + {FIXED_OVERHEAD >> 20} MiB = {r['bound'] / 2**20:.0f} MiB): "
                f"{'within' if r['within'] else 'OVER'}"
            )
    text = "\n".join(lines)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
