"""torch.distributed.checkpoint on aionvme vs torch's own storage and fio.

    python3 bench/suites/bench_dcp.py                                # 2 GiB, 1, 2 and 4 ranks
    python3 bench/suites/bench_dcp.py --size 256M --ranks 1,2 --torch-threads 1,4

For each rank count it starts a real gloo process group (subprocesses, env://
on 127.0.0.1) whose ranks hold ``size / ranks`` bytes of tensors each, and
measures, with the page cache dropped before every step (run as root):

- save with ``aionvme.dcp.Writer`` and with torch's ``FileSystemWriter`` at
  each ``--torch-threads`` (the best is the baseline), fsync'd as both do;
- load with ``aionvme.dcp.Reader`` and ``FileSystemReader`` (the aionvme
  checkpoint; every byte is compared with the source afterwards);
- how long ``dcp.async_save`` blocks the caller with each writer as the stager;
- fio sequential write (``end_fsync``, fresh files) and read of the same
  bytes, one job per rank, O_DIRECT, libaio, at bs 4M and 64M (QD 16), each
  ``--repeat`` times: the median over the runs of each run's best point is
  the device's ceiling, and the last column, torch's best time over fio's,
  is about the most any writer could lead torch by.

Times are wall seconds from a barrier before the step to a barrier after it.
Each writer first saves a tiny state dict untimed (a process's first save pays
DCP's imports and first planning); ``--repeat N`` saves N times per writer in
alternating order (ours first, then ours last: this disk writes faster after a
pause) and reports medians.
Rank 0 also reads the device's counters around every step (the whole device:
run it idle) and prints the median KiB per device request of each writer and
reader: memory scattered in physical memory makes small requests (see
``write_copy`` in README.md; ``AIONVME_WRITE_COPY=never`` in the environment
turns the copy off for an A/B).
Prints a Markdown table (``--json`` for the raw figures).

    python3 bench/suites/bench_dcp.py --repeat 3                     # the figures in bench/README.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

from aionvme.bench import drop_caches
from aionvme.bench.peers import disk_figures, disk_stats

TENSOR = 32 << 20  # bytes per tensor (the last ones of a rank smaller), plus small ones


def _state(rank: int, nbytes: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(rank)
    sd: dict[str, Any] = {}
    left, i = nbytes, 0
    while left > 0:
        n = min(TENSOR, left)
        elems = max(1, n // 2)
        sd[f"rank{rank}.layer{i}.weight"] = torch.randn(elems, generator=g, dtype=torch.float32).bfloat16()
        sd[f"rank{rank}.layer{i}.bias"] = torch.randn(1024, generator=g)
        left -= elems * 2 + 4096
        i += 1
    sd[f"rank{rank}.step"] = 100
    return sd


def _worker(
    rank: int,
    world: int,
    port: str,
    base: str,
    per_rank: int,
    threads: list[int],
    out: str,
    repeat: int = 1,
    settle: float = 0.0,
) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import aionvme.dcp

    warnings.filterwarnings("ignore")
    # all ranks on this machine, as torchrun says it (the stager shares the CPUs by it)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sd = _state(rank, per_rank)
    res: dict[str, Any] = {"cold": True}

    def step(name: str, fn: Any) -> None:
        dist.barrier()
        if rank == 0:
            res["cold"] = drop_caches() is None and res["cold"]
            time.sleep(settle)  # the disk's own write-back of what came before (see --settle)
        dist.barrier()
        disk0 = disk_stats(base) if rank == 0 else None
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        wall = time.perf_counter() - t0
        res.setdefault(name + "_all", []).append(wall)
        res[name] = statistics.median(res[name + "_all"])
        if rank == 0:  # the sizes of the requests the device saw (the whole device: run it idle)
            fig = disk_figures(disk0, disk_stats(base), wall)
            side = "write" if name.startswith("save") else "read"
            res.setdefault(name + "_kib", []).append(fig.get(f"dev_{side}_kib_per_request", 0.0))

    def clean(path: str) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def dest() -> dict[str, Any]:
        d = {k: (torch.ones_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
        return d  # touched: the load does not pay the first page faults

    ours = f"{base}/ours"

    def save_ours() -> None:
        clean(ours)
        step("save_aionvme", lambda: dcp.save(sd, storage_writer=aionvme.dcp.Writer(ours)))

    def save_torch(tc: int) -> None:
        p = f"{base}/torch{tc}"
        step(
            f"save_torch_t{tc}",
            lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(p, thread_count=tc)),
        )
        clean(p)

    # Untimed warm-up: a process's first dcp.save pays imports and DCP's first
    # planning for whichever writer runs first (0.1 s here).
    tiny = {f"rank{rank}.warm": torch.zeros(1024)}
    for name, make in (("aionvme", aionvme.dcp.Writer), ("torch", dcp.FileSystemWriter)):
        dcp.save(tiny, storage_writer=make(f"{base}/warm_{name}"))
        clean(f"{base}/warm_{name}")

    # Repetitions alternate the order (ours first, then ours last): this disk
    # writes faster after a pause, so whoever goes first would gain.
    for rep in range(repeat):
        saves = [save_ours] + [lambda tc=tc: save_torch(tc) for tc in threads]
        for fn in saves if rep % 2 == 0 else saves[::-1]:
            fn()
    for name, make in (("aionvme", aionvme.dcp.Reader), ("torch", dcp.FileSystemReader)):
        got = dest()
        step(f"load_{name}", lambda got=got, make=make: dcp.load(got, storage_reader=make(ours)))
        bad = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and not torch.equal(got[k], v)]
        if bad or got[f"rank{rank}.step"] != 100:
            raise SystemExit(f"rank {rank}: {name} loaded wrong data for {bad[:3]}")
        del got
    clean(ours)
    for name, make in (("aionvme", aionvme.dcp.Writer), ("torch", dcp.FileSystemWriter)):
        p = f"{base}/async_{name}"
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=make(p))
        blocked = time.perf_counter() - t0
        fut.result()
        res[f"async_block_{name}"] = max(t for t in _all_gather(dist, blocked))
        clean(p)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(res, fh)


def _all_gather(dist: Any, x: float) -> list[float]:
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, x)
    return [float(v) for v in got]


# fio's sequential points: on the disk of bench/README.md the bytes in flight
# decide the write rate (bs 4M QD 16 ~1.5 GB/s, bs 64M QD 16 up to 2.4), so the
# device's ceiling is the best of a few, not one configuration.
FIO_POINTS = [("4M", 16), ("64M", 16)]


def _fio(directory: str, rw: str, jobs: int, per_job: int, bs: str = "4M", qd: int = 16) -> float:
    """Wall seconds of fio moving jobs x per_job bytes sequentially; a write
    goes to fresh files (a checkpoint's are new), a read reads the last write's."""
    if rw == "write":
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
    cmd = [
        "fio",
        "--name=dcp",
        f"--directory={directory}",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--iodepth={qd}",
        "--ioengine=libaio",
        "--direct=1",
        f"--size={per_job}",
        f"--numjobs={jobs}",
        "--group_reporting",
        "--output-format=json",
    ] + (["--end_fsync=1"] if rw == "write" else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
    side = job["write"] if rw == "write" else job["read"]
    return float(side["io_bytes"]) / max(side["bw_bytes"], 1)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run(
    world: int, size: int, threads: list[int], parent: str | None, repeat: int = 1, settle: float = 0.0
) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="aionvme-dcp-", dir=parent)
    try:
        out = os.path.join(base, "result.json")
        port = _free_port()
        args = [
            str(world),
            port,
            base,
            str(size // world),
            ",".join(map(str, threads)),
            out,
            str(repeat),
            str(settle),
        ]
        procs = [
            subprocess.Popen([sys.executable, __file__, "--worker", str(r), *args]) for r in range(world)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"{world} ranks: a rank failed ({codes})")
        with open(out) as fh:
            res: dict[str, Any] = json.load(fh)
        if shutil.which("fio"):
            fio_dir = os.path.join(base, "fio")
            os.makedirs(fio_dir)
            writes, reads = [], []
            for _ in range(repeat):
                w, r = [], []
                for bs, qd in FIO_POINTS:
                    drop_caches()
                    time.sleep(settle)
                    w.append(_fio(fio_dir, "write", world, size // world, bs, qd))
                    drop_caches()
                    time.sleep(settle)
                    r.append(_fio(fio_dir, "read", world, size // world, bs, qd))
                writes.append(min(w))
                reads.append(min(r))
            # the best point of each run, then the median of the runs, as the
            # writers' medians (the best of every run would pick a lucky one)
            res["fio_write"], res["fio_read"] = statistics.median(writes), statistics.median(reads)
            res["fio_write_all"], res["fio_read_all"] = writes, reads
        res["ranks"], res["bytes"] = world, size
        return res
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report(results: list[dict[str, Any]], threads: list[int]) -> str:
    lines = [
        "| ranks | op | aionvme | torch (best threads) | fio (best point) | vs torch | vs fio "
        "| fio vs torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        gb = r["bytes"] / 1e9
        best_tc = min(threads, key=lambda tc: r[f"save_torch_t{tc}"])
        rows = [
            ("save", r["save_aionvme"], r[f"save_torch_t{best_tc}"], f" (t={best_tc})", r.get("fio_write")),
            ("load", r["load_aionvme"], r["load_torch"], "", r.get("fio_read")),
        ]
        for op, ours, theirs, note, fio in rows:
            fio_s = f"{fio:.2f} s ({gb / fio:.2f} GB/s)" if fio else "-"
            vs_fio = f"{fio / ours:.2f}x" if fio else "-"
            # the device's lead over torch: what any writer could reach against it
            ceiling = f"{theirs / fio:.2f}x" if fio else "-"
            lines.append(
                f"| {r['ranks']} | {op} | {ours:.2f} s ({gb / ours:.2f} GB/s) | "
                f"{theirs:.2f} s ({gb / theirs:.2f} GB/s){note} | {fio_s} | {theirs / ours:.2f}x | {vs_fio} "
                f"| {ceiling} |"
            )
        ours_b, torch_b = r["async_block_aionvme"], r["async_block_torch"]
        lines.append(
            f"| {r['ranks']} | async_save blocks | {ours_b:.3f} s | {torch_b:.3f} s | - "
            f"| {torch_b / ours_b:.2f}x | - | - |"
        )
    for r in results:
        runs = {
            k[len("save_") : -len("_all")]: v
            for k, v in r.items()
            if k.startswith("save_") and k.endswith("_all")
        }
        if any(len(v) > 1 for v in runs.values()):
            each = ", ".join(f"{k} " + "/".join(f"{x:.2f}" for x in v) for k, v in runs.items())
            lines.append(f"\n{r['ranks']} ranks, every save (s; medians above): {each}")
        kib = {k[: -len("_kib")]: v for k, v in r.items() if k.endswith("_kib") and v}
        if kib:
            each = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in kib.items())
            lines.append(f"\n{r['ranks']} ranks, KiB per device request (median): {each}")
    cold = all(r["cold"] for r in results)
    lines.append("")
    lines.append("page cache dropped before every step" if cold else "page cache NOT dropped (not root)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        rank, world, port, base, per_rank, threads, out, repeat, settle = argv[1:10]
        _worker(
            int(rank),
            int(world),
            port,
            base,
            int(per_rank),
            [int(t) for t in threads.split(",")],
            out,
            int(repeat),
            float(settle),
        )
        return 0
    from aionvme.defaults import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2G", help="bytes of the whole state dict (default 2G)")
    ap.add_argument("--ranks", default="1,2,4", help="rank counts (default 1,2,4)")
    ap.add_argument("--torch-threads", default="1,4,8", help="FileSystemWriter thread_count values")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a local temp dir)")
    ap.add_argument(
        "--repeat", type=int, default=1, help="saves per writer, in alternating order; medians are reported"
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds of idle before every timed step, after the sync and cache drop (default 2): "
        "the virtual disk of bench/README.md goes on writing back what the step before wrote "
        "(and discarding what it deleted) after the guest's sync returns, so without a pause "
        "a step pays for its predecessor",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    threads = [int(t) for t in a.torch_threads.split(",")]
    results = [run(int(w), size, threads, a.dir, a.repeat, a.settle) for w in a.ranks.split(",")]
    print(json.dumps(results, indent=1) if a.json else report(results, threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
