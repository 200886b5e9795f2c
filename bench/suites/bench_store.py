#!/usr/bin/env python3
"""TieredStore benchmarks, next to fio, memcpy and DeepSpeed's AsyncTensorSwapper.

Workloads (each figure in GB/s, 1 GB = 1e9 bytes):

  nvme-get    get of S-byte tensors that are only in the NVMe tier (host=0),
              one at a time, page cache dropped first; vs fio sequential read
              with bs=S, O_DIRECT, libaio, iodepth 1 (the same request stream)
  put-evict   put into a host tier of two (and of sixteen) values, so every put
              evicts one to NVMe (steady state); the slower of the put rate and
              the rate bytes reached NVMe meanwhile (write-behind may owe some
              at the end); vs fio sequential write bs=S, iodepth 1
  get-pread   an NVMe-tier get of S bytes into a fresh result (host=0, one at
              a time, page cache dropped first), with value checksums on and
              off, against File.pread of the same extents into one
              preallocated page-aligned buffer; the three sides alternate per
              round over the same keys, each round in a new order; ratios
              get/pread (on, off) and the checksum's cost (1 - on/off) of
              the median times, then [paired] the median of the same ratios
              taken call by call (robust to a drifting disk), and the
              median CPU per call of each side (the process's, all threads)
  host-hit    get of values resident in the host tier: a fresh result per call
              and into a preallocated ``out=``; vs memcpy (np.copyto) into a
              fresh and a preallocated array, alternated in the same run, best
              of 3; per-call time in µs of a 4 KiB get
  sweep       a working set of 0.5x..4x the host tier, read in layer order
              (a cyclic scan, as layer-streamed inference does), with and
              without ``prefetch`` of the next key: hit ratio and GB/s, plotted
  deepspeed   swap-out then swap-in of N tensors: DeepSpeed's AsyncTensorSwapper
              (with the swap_in_tensors helper) on aionvme's drop-in op and on
              DeepSpeed's own JIT-built async_io op (each in a child process;
              the own op where it is built, or with --ds-build), vs
              TieredStore put_many(to="nvme") / get_many(out=) into preallocated
              tensors (swap_in_tensors also fills tensors allocated beforehand);
              each side swaps out 4 times: the first into fresh space, the last
              the steady state (overwriting space written before)

nvme-get and put-evict run --repeat times with fio first in every other run,
and every timed side starts after a sync and --settle seconds of idle.

    python3 bench/suites/bench_store.py --quick                    # small sizes: proves it runs
    python3 bench/suites/bench_store.py --dir /nvme --sizes 1M,4M,16M,64M --total 2G \\
        --plot sweep.png --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import aionvme as nvme
from aionvme.bench import drop_caches, local_scratch_dir, peers
from aionvme.defaults import parse_size

GB = 1e9


def fio(path: str, rw: str, bs: int, size: int) -> float | None:
    """fio's bandwidth in GB/s (O_DIRECT, libaio, iodepth 1), or None without fio."""
    if peers.fio_unavailable() is not None:
        return None
    r = peers.fio(path, rw, str(bs), 1, "libaio", size, **({"end_fsync": 1} if rw == "write" else {}))
    return r.nbytes / r.wall_s / GB


def median_run(runs: list[dict[str, Any]], key: str = "ratio") -> dict[str, Any]:
    """The run with the median ``key`` of several alternated runs, with every run's ``key`` listed."""
    ok = [r for r in runs if r.get(key) is not None]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: float(r[key]))
    return {
        **ok[(len(ok) - 1) // 2],
        f"{key}s": [round(float(r[key]), 3) for r in runs if r.get(key) is not None],
    }


# Seconds of idle before each timed side of a comparison (--settle): the virtual
# disk of bench/README.md goes on writing back (and discarding) what came before
# after the guest's sync returns, so a side that starts at once pays for it.
SETTLE = 0.0


def _quiet() -> None:
    os.sync()
    time.sleep(SETTLE)


def _values(n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size, dtype=np.uint8)
    return [np.roll(base, i) for i in range(n)]


async def nvme_get(d: str, size: int, total: int, drop: bool, fio_first: bool = False) -> dict[str, Any]:
    n = max(2, total // size)
    vals = _values(n, size)
    async with nvme.TieredStore(d, host=0) as s:
        await s.put_many({i: v for i, v in enumerate(vals)})
        slab = s.stats()["nvme"]["slabs"][0]
        if fio_first:  # this disk has burst credit: who runs first after a pause gains, so alternate
            if drop:
                drop_caches()
            _quiet()
            ref = fio(slab, "read", size, n * size)
        if drop:
            drop_caches()
        _quiet()
        t0 = time.perf_counter()
        for i in range(n):
            got = await s.get(i)
        dt = time.perf_counter() - t0
        if not np.array_equal(got, vals[-1]):
            raise SystemExit("nvme-get: wrong bytes")
        store = n * size / dt / GB
        if not fio_first:
            if drop:
                drop_caches()
            _quiet()
            ref = fio(slab, "read", size, n * size)
    return {"size": size, "n": n, "store_GBps": store, "fio_GBps": ref, "ratio": store / ref if ref else None}


async def get_vs_pread(d: str, size: int, total: int, drop: bool, rounds: int = 3) -> dict[str, Any]:
    """NVMe-tier gets (checksum on / off) against File.pread of the same bytes.

    One store holds the values (written with checksums); the 'off' side
    turns its checksum knob off for its reads. The three sides take turns
    call by call (each value read once per side per round, the side order
    rotating), so the drift of a shared disk hits them alike; each figure is
    the median of its per-call times. Reads are O_DIRECT (the page cache is
    dropped once first): every call goes to the device."""
    n = max(2, total // size)
    vals = _values(n, size)
    times: dict[str, list[float]] = {"on": [], "off": [], "pread": []}
    cpu: dict[str, list[float]] = {"on": [], "off": [], "pread": []}
    async with nvme.TieredStore(d, host=0) as s:
        await s.put_many({i: v for i, v in enumerate(vals)})
        ext = [s._index[i].disk for i in range(n)]
        if any(len(x) != 1 for x in ext):
            raise SystemExit("get-pread: a value was split (one directory expected)")
        f = nvme.open(s.stats()["nvme"]["slabs"][0], "r")
        buf = nvme.empty(size + 4096)
        if drop:
            drop_caches()
        _quiet()
        try:
            sides = ["on", "off", "pread"]
            for r in range(rounds):
                for i in range(n):
                    k = (r + i) % 3
                    for side in sides[k:] + sides[:k]:
                        s._nvme.checksum = side == "on"
                        c0 = time.process_time()
                        t0 = time.perf_counter()
                        if side == "pread":
                            (_, off, _, nb) = ext[i][0]
                            p = off % 4096
                            await f.pread(buf[: -(-(p + nb) // 4096) * 4096], off - p)
                        else:
                            got = await s.get(i)
                        times[side].append(time.perf_counter() - t0)
                        cpu[side].append(time.process_time() - c0)
                        if side != "pread":
                            if not np.array_equal(got, vals[i]):
                                raise SystemExit("get-pread: wrong bytes")
                            del got  # freed: the next fresh result may reuse its mapping
        finally:
            f.close()
    med = {k: float(np.median(v)) for k, v in times.items()}
    # the same ratios call by call (the three sides read value i in one
    # round back to back), then their median: a drift of the shared disk
    # between rounds cancels out
    t = {k: np.asarray(v) for k, v in times.items()}
    return {
        "ratio_paired": float(np.median(t["pread"] / t["on"])),
        "ratio_nocheck_paired": float(np.median(t["pread"] / t["off"])),
        "checksum_cost_paired": float(np.median(1 - t["off"] / t["on"])),
        "cpu_us": {k: float(np.median(v)) * 1e6 for k, v in cpu.items()},
        "size": size,
        "calls": n * rounds,
        "get_GBps": size / med["on"] / GB,
        "get_nocheck_GBps": size / med["off"] / GB,
        "pread_GBps": size / med["pread"] / GB,
        "ratio": med["pread"] / med["on"],
        "ratio_nocheck": med["pread"] / med["off"],
        "checksum_cost": 1 - med["off"] / med["on"],
    }


def _fio_write(d: str, size: int, nbytes: int) -> float | None:
    _quiet()
    path = os.path.join(d, "fio-write.bin")
    try:
        return fio(path, "write", size, nbytes)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def put_evict(
    d: str, size: int, total: int, host_values: int = 2, fio_first: bool = False
) -> dict[str, Any]:
    """Puts into a host tier of ``host_values`` values: once it is full, every put evicts one.
    At least twice the tier's values are put, so the write-behind reaches its steady state."""
    n = max(4, total // size, 2 * host_values)
    vals = _values(min(n, 8), size)
    if fio_first:
        ref = _fio_write(d, size, n * size)
    async with nvme.TieredStore(d, host=host_values * size + 4096) as s:
        for i in range(host_values + 2):  # warm-up: the tier fills, the slab grows
            await s.put(("w", i), vals[i % len(vals)])
        _quiet()
        st0 = s.stats()
        t0 = time.perf_counter()
        for i in range(n):
            await s.put(i, vals[i % len(vals)])
        dt = time.perf_counter() - t0
        st = s.stats()
        ev = st["host"]["evictions"] - st0["host"]["evictions"]
        written = st["nvme"]["bytes_in"] - st0["nvme"]["bytes_in"]
        # write-behind may still owe some writes when the last put returns:
        # count the slower of the put rate and the rate bytes reached NVMe
        store = min(n * size, written) / dt / GB
    if not fio_first:
        ref = _fio_write(d, size, n * size)
    return {
        "size": size,
        "n": n,
        "host_values": host_values,
        "evictions": ev,
        "put_GBps": n * size / dt / GB,
        "nvme_written_GBps": written / dt / GB,
        "store_GBps": store,
        "fio_GBps": ref,
        "ratio": store / ref if ref else None,
    }


async def host_hit(d: str, size: int, reps: int, rounds: int = 3) -> dict[str, Any]:
    """Gets of a host-resident value against np.copyto of the same size,
    alternated ``rounds`` times in the same run, best of each."""
    v = _values(1, size)[0]
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, float("inf")), seconds)

    async with nvme.TieredStore(d, host=4 * size + (1 << 20)) as s:
        await s.put("v", v)
        await s.put("small", np.zeros(4096, np.uint8))
        out = np.empty_like(v)
        small_out = np.empty(4096, np.uint8)
        await s.get("v")
        k = 2000
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                await s.get("v")
            keep("fresh", time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(reps):
                dst = np.empty_like(v)
                np.copyto(dst, v)
            keep("memcpy_fresh", time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(reps):
                await s.get("v", out=out)
            keep("into", time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(reps):
                np.copyto(out, v)
            keep("memcpy", time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(k):
                await s.get("small", out=small_out)
            keep("small_out", time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(k):
                await s.get("small")
            keep("small_fresh", time.perf_counter() - t0)
        if not np.array_equal(out, v):
            raise SystemExit("host-hit: wrong bytes")
    gbps = {name: reps * size / t / GB for name, t in best.items() if not name.startswith("small")}
    return {
        "size": size,
        "get_GBps": gbps["fresh"],
        "get_out_GBps": gbps["into"],
        "memcpy_fresh_GBps": gbps["memcpy_fresh"],
        "memcpy_GBps": gbps["memcpy"],
        "ratio_fresh": gbps["fresh"] / gbps["memcpy_fresh"],
        "ratio_out": gbps["into"] / gbps["memcpy"],
        "us_per_call_4K_out": best["small_out"] / k * 1e6,
        "us_per_call_4K_fresh": best["small_fresh"] / k * 1e6,
    }


async def sweep(d: str, host: int, size: int, passes: int) -> list[dict[str, Any]]:
    rows = []
    for f in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0):
        nkeys = max(2, int(f * host / size))
        vals = _values(nkeys, size)
        for pf in (False, True):
            async with nvme.TieredStore(d, host=host) as s:
                for i, v in enumerate(vals):
                    await s.put(i, v)
                base = s.stats()["host"]
                t0 = time.perf_counter()
                for _ in range(passes):
                    for i in range(nkeys):
                        if pf:
                            await s.prefetch([(i + 1) % nkeys])
                        await s.get(i)
                dt = time.perf_counter() - t0
                st = s.stats()["host"]
                hits = st["hits"] - base["hits"]
                gets = hits + st["misses"] - base["misses"]
            rows.append(
                {
                    "working_set_x": f,
                    "prefetch": pf,
                    "keys": nkeys,
                    "hit_ratio": hits / gets if gets else 0.0,
                    "GBps": passes * nkeys * size / dt / GB,
                }
            )
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for pf in (False, True):
        pts = [r for r in rows if r["prefetch"] is pf]
        label = "prefetch next" if pf else "no prefetch"
        a1.plot([r["working_set_x"] for r in pts], [r["hit_ratio"] for r in pts], "o-", label=label)
        a2.plot([r["working_set_x"] for r in pts], [r["GBps"] for r in pts], "o-", label=label)
    a1.set(
        xlabel="working set / host tier",
        ylabel="host hit ratio",
        title="hit ratio (LRU, cyclic scan; a get\nwaiting for its prefetch counts as a hit)",
    )
    a2.set(xlabel="working set / host tier", ylabel="GB/s", title="get throughput")
    for a in (a1, a2):
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def deepspeed_swap(
    d: str, size: int, n: int, build: bool = False, store_first: bool = False, rounds: int = 4
) -> dict[str, Any]:
    """AsyncTensorSwapper (swap out) + swap_in_tensors (swap in) in a child
    process (DeepSpeed needs a process group), once on aionvme's drop-in and
    once on DeepSpeed's own JIT-built ``async_io`` op (where it is built, or
    ``build``: minutes), and the same on the store: after them, or before
    them with ``store_first`` (on this disk whoever writes first after a
    pause is faster: repetitions alternate). Each side starts after a sync,
    so none pays for the write-back of the one before.

    Every side swaps the same tensors out ``rounds`` times, as a training
    loop does each step. The first swap-out writes fresh space on both sides
    (the swapper's files are removed first; the store's slab is new): on
    ext4 that is about half as fast as overwriting blocks written before
    (unwritten extents are converted as each write completes). The last
    swap-out is the steady state: the swapper overwrites its files in place,
    the store writes into space its values of two rounds ago freed. Both
    are reported, with the CPU seconds (all threads) of the steady one; the
    swap-in reads what the last round wrote."""
    code = r"""
import json, os, socket, sys, time, torch
import aionvme.compat.deepspeed as compat
if sys.argv[4] == "dropin":
    compat.install()
import deepspeed, deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper
from deepspeed.runtime.swap_tensor.utils import swap_in_tensors
d, size, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
numel = size // 4
b = AsyncIOBuilder()
if sys.argv[4] == "own" and not b.is_compatible(verbose=False):
    raise SystemExit("DeepSpeed's AsyncIOBuilder is not compatible here (libaio-dev missing?)")
lib = b.load(verbose=False)
op_file = getattr(lib, "__file__", "") or ""
if sys.argv[4] == "own" and ("aionvme" in op_file or not op_file.endswith(".so")):
    raise SystemExit(f"AsyncIOBuilder().load() gave {op_file!r}, not DeepSpeed's built op")
h = lib.aio_handle(1 << 20, 32, False, True, 1)
bufs = [h.new_cpu_locked_tensor(numel * 2, torch.empty(0, dtype=torch.float32)) for _ in range(2)]
sw = AsyncTensorSwapper(h, numel_alignment=1024, timers=None)
ts = [torch.full((numel,), float(i)) for i in range(n)]
paths = [os.path.join(d, f"ds{i}.swp") for i in range(n)]
for p in paths:  # fresh space for the first round, as the store's new slab
    if os.path.exists(p):
        os.unlink(p)
outs, cpus = [], []
for r in range(rounds):
    os.sync(); time.sleep(0.5)
    sw.add_buffers(bufs)
    c0, t0 = time.process_time(), time.perf_counter()
    sw.swap_out_tensors(ts, paths); bufs = sw.release_buffers()
    outs.append(n * size / (time.perf_counter() - t0) / 1e9)
    cpus.append(time.process_time() - c0)
dst = [torch.empty(numel) for _ in range(n)]
t0 = time.perf_counter()
swap_in_tensors(h, dst, paths); assert h.wait() == n
in_s = time.perf_counter() - t0
assert all(torch.equal(a, b) for a, b in zip(dst, ts))
for p in paths:
    os.unlink(p)
print(json.dumps({"first_out_GBps": outs[0], "out_GBps": outs[-1], "in_GBps": n * size / in_s / 1e9,
                  "out_cpu_s": cpus[-1]}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

    def child(op: str) -> dict[str, float] | str:
        os.sync()
        try:
            r = subprocess.run(
                [sys.executable, "-c", code, d, str(size), str(n), op, str(rounds)],
                capture_output=True,
                text=True,
                env=env,
                timeout=1200,  # a first JIT build of the op takes minutes
            )
        except subprocess.TimeoutExpired:
            return "timed out (the JIT build of DeepSpeed's op?)"
        if r.returncode != 0:
            return (r.stderr.strip().splitlines() or ["?"])[-1]
        out: dict[str, float] = json.loads(r.stdout.strip().splitlines()[-1])
        return out

    async def store() -> dict[str, float]:
        import torch

        ts = {i: torch.full((size // 4,), float(i)) for i in range(n)}
        outs, cpus = [], []
        async with nvme.TieredStore(d, host=2 * size + 4096) as s:
            for _ in range(rounds):
                os.sync()
                await asyncio.sleep(0.5)
                c0, t0 = time.process_time(), time.perf_counter()
                await s.put_many(ts, to="nvme")  # a swap-out: straight from the tensors
                outs.append(n * size / (time.perf_counter() - t0) / GB)
                cpus.append(time.process_time() - c0)
            got = [torch.empty(size // 4) for _ in range(n)]  # as DeepSpeed's swap-in is given them
            t0 = time.perf_counter()
            await s.get_many(range(n), out=got)
            in_s = time.perf_counter() - t0
            if not all(torch.equal(got[i], ts[i]) for i in range(n)):
                raise SystemExit("deepspeed workload: wrong bytes")
        return {
            "first_out_GBps": outs[0],
            "out_GBps": outs[-1],
            "in_GBps": n * size / in_s / GB,
            "out_cpu_s": cpus[-1],
        }

    ours: dict[str, float] = {}
    if store_first:
        os.sync()
        ours = asyncio.run(store())
    ds = child("dropin")
    if isinstance(ds, str):
        return {"error": ds}
    why = peers.deepspeed_unavailable(build=build)
    own = child("own") if why is None else why
    if not store_first:
        os.sync()
        ours = asyncio.run(store())
    res: dict[str, Any] = {
        "size": size,
        "n": n,
        "rounds": rounds,
        "deepspeed_dropin": ds,
        "tieredstore": ours,
        "deepspeed_own_op": own,
    }
    for suffix, peer in (("", ds), ("_own", own)):
        if isinstance(peer, str):
            continue
        res["ratio_out" + suffix] = ours["out_GBps"] / peer["out_GBps"]
        res["ratio_first_out" + suffix] = ours["first_out_GBps"] / peer["first_out_GBps"]
        res["ratio_in" + suffix] = ours["in_GBps"] / peer["in_GBps"]
    return res


_SWAP_RATIOS = (
    "ratio_out",
    "ratio_first_out",
    "ratio_in",
    "ratio_out_own",
    "ratio_first_out_own",
    "ratio_in_own",
)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _row(r: dict[str, Any]) -> None:
    mib = r["size"] >> 20
    print(f"  {mib:>5} MiB  {_fmt(r['store_GBps']):>9}  {_fmt(r['fio_GBps']):>8}  {_fmt(r['ratio'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory on the drive to measure (default: a temp dir on a local disk)")
    p.add_argument(
        "--sizes", default="1M,4M,16M,64M", help="tensor sizes for nvme-get / put-evict / host-hit"
    )
    p.add_argument("--total", default="1G", help="bytes moved per point")
    p.add_argument("--host", default="256M", help="host tier of the sweep")
    p.add_argument("--sweep-size", default="4M", help="tensor size in the sweep")
    p.add_argument("--passes", type=int, default=3, help="passes over the working set in the sweep")
    p.add_argument("--quick", action="store_true", help="small sizes: proves it runs, in seconds")
    p.add_argument(
        "--repeat", type=int, default=3, help="alternated runs of nvme-get, put-evict and deepspeed (medians)"
    )
    p.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds of idle (after a sync) before each timed side of nvme-get and put-evict (default 1)",
    )
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument(
        "--only",
        choices=["get-pread"],
        help="run just this workload (get-pread: see above; --repeat rounds)",
    )
    p.add_argument(
        "--ds-build",
        action="store_true",
        help="JIT-build DeepSpeed's async_io op if it is not built (minutes)",
    )
    p.add_argument("--plot", help="PNG of the sweep (needs matplotlib)")
    p.add_argument("--json", help="write all results here")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.total, a.host, a.sweep_size, a.passes, a.repeat = "1M,4M", "32M", "8M", "1M", 2, 1
    global SETTLE
    SETTLE = 0.0 if a.quick else a.settle
    sizes = [parse_size(x) for x in a.sizes.split(",")]
    total = parse_size(a.total)
    base = tempfile.mkdtemp(prefix="aionvme-bench-store-", dir=local_scratch_dir(a.dir))
    drop = os.geteuid() == 0
    res: dict[str, Any] = {}
    try:
        rep = range(a.repeat)
        res["get_pread"] = [asyncio.run(get_vs_pread(base, s, total, drop, max(3, a.repeat))) for s in sizes]
        print(
            "get-pread  (cold, one at a time):  size  get GB/s (checksum on / off)  pread GB/s  ratios  cost"
            "  [paired: ratios  cost]  CPU µs/call on / off / pread"
        )
        for r in res["get_pread"]:
            c = r["cpu_us"]
            print(
                f"  {r['size'] >> 20:>5} MiB  {r['get_GBps']:.2f} / {r['get_nocheck_GBps']:.2f}"
                f"  {r['pread_GBps']:.2f}  {r['ratio']:.2f} / {r['ratio_nocheck']:.2f}"
                f"  {100 * r['checksum_cost']:.1f}%"
                f"  [{r['ratio_paired']:.2f} / {r['ratio_nocheck_paired']:.2f}"
                f"  {100 * r['checksum_cost_paired']:.1f}%]"
                f"  {c['on']:.0f} / {c['off']:.0f} / {c['pread']:.0f}"
            )
        if a.only == "get-pread":
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(res, f, indent=1)
            return 0
        res["nvme_get"] = [
            median_run([asyncio.run(nvme_get(base, s, total, drop, fio_first=bool(i % 2))) for i in rep])
            for s in sizes
        ]
        print(f"nvme-get   (tier NVMe only, cold; median of {a.repeat}):  size  store GB/s  fio GB/s  ratio")
        for r in res["nvme_get"]:
            _row(r)
        res["put_evict"] = [
            median_run([asyncio.run(put_evict(base, s, total, 2, fio_first=bool(i % 2))) for i in rep])
            for s in sizes
        ]
        print(f"put-evict  (2-value host tier; median of {a.repeat}):      size  store GB/s  fio GB/s  ratio")
        for r in res["put_evict"]:
            _row(r)
        res["put_evict_16"] = [
            median_run([asyncio.run(put_evict(base, s, total, 16, fio_first=bool(i % 2))) for i in rep])
            for s in sizes
        ]
        print(f"put-evict  (16-value host tier; median of {a.repeat}):     size  store GB/s  fio GB/s  ratio")
        for r in res["put_evict_16"]:
            _row(r)
        # the same bytes per size (so a 1 MiB copy is timed over hundreds of
        # calls, not the 8 that suit 64 MiB), at most 512 calls
        res["host_hit"] = [asyncio.run(host_hit(base, s, max(4, min(512, total // s // 2)))) for s in sizes]
        print("host-hit:  size  get GB/s (fresh / out=)  memcpy GB/s (fresh / into)  ratios  µs/call 4K")
        for r in res["host_hit"]:
            print(
                f"  {r['size'] >> 20:>5} MiB  {r['get_GBps']:.2f} / {r['get_out_GBps']:.2f}"
                f"  {r['memcpy_fresh_GBps']:.2f} / {r['memcpy_GBps']:.2f}"
                f"  {r['ratio_fresh']:.2f} / {r['ratio_out']:.2f}"
                f"  {r['us_per_call_4K_out']:.1f} (out=) / {r['us_per_call_4K_fresh']:.1f}"
            )
        res["sweep"] = asyncio.run(sweep(base, parse_size(a.host), parse_size(a.sweep_size), a.passes))
        print("sweep (cyclic scan, LRU):  working set x  prefetch  hit ratio  GB/s")
        for r in res["sweep"]:
            print(f"  {r['working_set_x']:>4}  {r['prefetch']!s:>5}  {r['hit_ratio']:.2f}  {r['GBps']:.2f}")
        if a.plot:
            plot(res["sweep"], a.plot)
            print(f"plot: {a.plot}")
        if not a.no_deepspeed:
            n = 8 if a.quick else 32
            runs = [deepspeed_swap(base, max(sizes), n, a.ds_build, store_first=i % 2 == 1) for i in rep]
            r = runs[0]
            if "error" not in r:  # the median of each figure over the runs
                for k in _SWAP_RATIOS:
                    vs = sorted(float(x[k]) for x in runs if k in x)
                    if vs:
                        r[k] = vs[(len(vs) - 1) // 2]
                        r[k + "s"] = [round(float(x[k]), 3) for x in runs if k in x]
            res["deepspeed"] = r
            if "error" in r:
                print(f"deepspeed: {r['error']}")
            else:
                ds, ts = r["deepspeed_dropin"], r["tieredstore"]
                print(
                    f"deepspeed swap ({n} x {r['size'] >> 20} MiB, {r['rounds']} swap-outs),"
                    " GB/s: first out (fresh space) / steady out (last round) / in"
                )

                def line(name: str, g: dict[str, float], suffix: str | None) -> None:
                    ratios = (
                        ""
                        if suffix is None
                        else f"  (TieredStore x{r['ratio_first_out' + suffix]:.2f}"
                        f" / x{r['ratio_out' + suffix]:.2f} / x{r['ratio_in' + suffix]:.2f})"
                    )
                    print(
                        f"  {name}  {g['first_out_GBps']:.2f} / {g['out_GBps']:.2f}"
                        f" / {g['in_GBps']:.2f}{ratios}; CPU of the steady swap-out {g['out_cpu_s']:.2f} s"
                    )

                line("TieredStore", ts, None)
                line("AsyncTensorSwapper on the drop-in", ds, "")
                own = r["deepspeed_own_op"]
                if isinstance(own, str):
                    print(f"  AsyncTensorSwapper on DeepSpeed's own op: not run ({own})")
                else:
                    line("AsyncTensorSwapper on DeepSpeed's own op", own, "_own")
                lists = {k: r[k + "s"] for k in _SWAP_RATIOS if k + "s" in r}
                print(f"  (GB/s of the first run; ratios are medians of {a.repeat}: {lists})")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
