#!/usr/bin/env python3
"""aionvme side by side with fio and the Python alternatives, in one run.

For each repetition every tool runs once, in turn, on the same files, so a
ratio compares figures taken minutes apart on the same machine, not on
different days (the sequential writers each after a sync and a 1 s pause, in
the reverse order every other repetition: on this kind of disk whoever writes
first after a pause gains). fio (O_DIRECT, libaio and io_uring) is the device's practical
ceiling: for sequential reads and writes a small bs x iodepth sweep, the
best point of each repetition. Reported figures are medians over repetitions; ratios are
computed per repetition, then their median is taken.

    python3 bench/suites/compare.py                       # 1 GiB, 3 repetitions, temp dir on a local disk
    python3 bench/suites/compare.py --size 256M --repeat 1 --quick
    python3 bench/suites/compare.py --json results.json --markdown results.md

Baselines:
  fio             libaio and io_uring engines, O_DIRECT (needs fio in PATH)
  deepspeed       DeepSpeed's aio_handle (its real async_io op, built once with
                  ninja; needs libaio-dev), in a child process without aionvme's
                  drop-in: the whole file into one buffer from new_cpu_locked_tensor
                  (mlocked) and one plain page-aligned tensor, best point of a
                  block size x queue depth x intra_op_parallelism sweep
                  (--ds-grid full|quick); write + fsync likewise (smaller sweep)
  threadpool      os.preadv/pwritev through asyncio.to_thread, O_DIRECT fd, aligned buffers
  aiofiles        aiofiles (thread pool, buffered, page cache dropped before each run when root)
  caio            caio's linux_aio context (returns copies; buffered fd: it cannot align buffers)
  numpy.fromfile  one call for the whole file (buffered)

aionvme's figures come from aionvme.bench (the workloads of ``aionvme bench``);
every tool is timed by the same aionvme.bench.Timer and reported as the same
aionvme.bench.Result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aionvme import bench as B
from aionvme.bench import peers, render
from aionvme.bench.peers import fio
from aionvme.defaults import parse_size

REQ = 64 << 20
WRITE_PAUSE = 1.0  # seconds of quiet before each sequential writer
Rep = dict[str, B.Result]
DS_PREFIX = "deepspeed "


# -- Python baselines ------------------------------------------------------------------------


def _aligned_touched(n: int) -> np.ndarray:
    return B.touched_buffers(n, n)[0]


async def threadpool_seqread(path: str, size: int) -> B.Result:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = _aligned_touched(size)
    try:
        with B.Timer() as t:
            got = await asyncio.gather(
                *(asyncio.to_thread(os.preadv, fd, [buf[o : o + REQ]], o) for o in range(0, size, REQ))
            )
    finally:
        os.close(fd)
    return t.result("seqread", size, len(got), verified=sum(got) == size)


async def threadpool_seqwrite(path: str, size: int) -> B.Result:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    buf = _aligned_touched(size)
    try:
        with B.Timer() as t:
            wrote = await asyncio.gather(
                *(asyncio.to_thread(os.pwritev, fd, [buf[o : o + REQ]], o) for o in range(0, size, REQ))
            )
            await asyncio.to_thread(os.fsync, fd)
    finally:
        os.close(fd)
    if sum(wrote) != size:
        raise RuntimeError(f"threadpool pwritev: {sum(wrote)} of {size} bytes written")
    return t.result("seqwrite", size, len(wrote))


async def threadpool_randread(path: str, ops: int, iodepth: int) -> B.Result:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    offs = B.random_offsets(ops, os.path.getsize(path), 4096).tolist()
    bufs = _aligned_touched(iodepth * 4096).reshape(iodepth, 4096)

    async def worker(k: int) -> None:
        b = bufs[k]
        for i in range(k, ops, iodepth):
            await asyncio.to_thread(os.preadv, fd, [b], offs[i])

    try:
        with B.Timer() as t:
            await asyncio.gather(*(worker(k) for k in range(iodepth)))
    finally:
        os.close(fd)
    return t.result("randread", ops * 4096, ops)


async def aiofiles_seqread(path: str, size: int) -> B.Result:
    import aiofiles

    buf = _aligned_touched(size)

    async def one(o: int) -> int:
        async with aiofiles.open(path, "rb", buffering=0) as f:
            await f.seek(o)
            n: int = await f.readinto(memoryview(buf)[o : o + REQ])
            return n

    with B.Timer() as t:
        got = await asyncio.gather(*(one(o) for o in range(0, size, REQ)))
    return t.result("seqread", size, len(got), verified=sum(got) == size)


async def aiofiles_randread(path: str, ops: int, iodepth: int) -> B.Result:
    import aiofiles

    offs = B.random_offsets(ops, os.path.getsize(path), 4096).tolist()

    async def worker(k: int) -> None:
        async with aiofiles.open(path, "rb", buffering=0) as f:
            for i in range(k, ops, iodepth):
                await f.seek(offs[i])
                await f.read(4096)

    with B.Timer() as t:
        await asyncio.gather(*(worker(k) for k in range(iodepth)))
    return t.result("randread", ops * 4096, ops)


def _caio_context(n: int) -> Any:
    from caio.linux_aio_asyncio import AsyncioContext

    return AsyncioContext(max_requests=n)


async def caio_seqread(path: str, size: int) -> B.Result:
    ctx = _caio_context(128)
    fd = os.open(path, os.O_RDONLY)
    try:
        with B.Timer() as t:
            got = await asyncio.gather(*(ctx.read(min(REQ, size - o), fd, o) for o in range(0, size, REQ)))
    finally:
        os.close(fd)
        ctx.close()
    return t.result("seqread", size, len(got), verified=sum(len(g) for g in got) == size)


async def caio_randread(path: str, ops: int, iodepth: int) -> B.Result:
    ctx = _caio_context(iodepth)
    fd = os.open(path, os.O_RDONLY)
    offs = B.random_offsets(ops, os.path.getsize(path), 4096).tolist()

    async def worker(k: int) -> None:
        for i in range(k, ops, iodepth):
            await ctx.read(4096, fd, offs[i])

    try:
        with B.Timer() as t:
            await asyncio.gather(*(worker(k) for k in range(iodepth)))
    finally:
        os.close(fd)
        ctx.close()
    return t.result("randread", ops * 4096, ops)


def numpy_fromfile(path: str) -> B.Result:
    size = os.path.getsize(path)
    with B.Timer() as t:
        a = np.fromfile(path, dtype=np.uint8)
    return t.result("seqread", size, 1, verified=a.nbytes == size and B.holds_pattern(a[:4096], 0))


# -- the run -----------------------------------------------------------------------------------


def _run(coro_fn: Callable[[], Awaitable[B.Result]], loop: str) -> B.Result:
    async def main() -> B.Result:
        return await coro_fn()

    return B.run_loop(main(), loop)


def _fresh(buffered: bool) -> None:
    if buffered and os.geteuid() == 0:
        B.drop_caches()


def _settle() -> None:
    """Write back what earlier writers left dirty, then WRITE_PAUSE of quiet: before each writer."""
    os.sync()
    time.sleep(WRITE_PAUSE)


def _ours(r: B.Result) -> B.Result:
    if not r.verified:
        raise RuntimeError(f"aionvme {r.label}: data mismatch")
    return r


def deepspeed_rows(args: argparse.Namespace, res: Rep, points: list[B.Result], op: str, path: str) -> None:
    """DeepSpeed's best point per buffer kind into ``res`` (every point into ``points``)."""
    workload = "seqread" if op == "read" else "seqwrite"
    if op == "read":
        got = peers.deepspeed_sweep(path, "read", peers.DS_GRIDS[args.ds_grid], build=args.ds_build)
    else:
        grid = peers.DS_GRIDS["quick" if args.ds_grid == "quick" else "write"]
        # Every point writes the whole file, each after its own sync and pause, as every other
        # writer here (the caller settles the disk before the first): run back to back, a point
        # would start on the last one's write-back.
        got = []
        for i, point in enumerate(grid):
            if i:
                _settle()
            got += peers.deepspeed_sweep(
                path, "write", [point], ("locked",), size=args.size, build=args.ds_build
            )
        top = peers.best(got, "locked")
        if top is not None:  # plain tensors at locked's best point
            p = top.params
            point = (p["block_size"], p["queue_depth"], p["intra_op_parallelism"])
            _settle()
            got += peers.deepspeed_sweep(path, "write", [point], ("plain",), size=args.size)
    points.extend(got)
    if got and got[0].skipped:
        res[f"{workload}/{DS_PREFIX}aio_handle"] = got[0]
        return
    for kind in peers.BUFFERS:
        top = peers.best(got, kind)
        n = sum(1 for r in got if r.params.get("buffer") == kind)
        if top is not None:
            res[f"{workload}/{DS_PREFIX}aio_handle {kind} (best of {n})"] = top
        elif n:
            bad = B.Result(f"deepspeed-{op}", verified=False, params=dict(buffer=kind))
            res[f"{workload}/{DS_PREFIX}aio_handle {kind} (best of {n})"] = bad


def one_repetition(args: argparse.Namespace, d: str, points: list[B.Result], rep: int = 0) -> Rep:
    size, ops, qd = args.size, args.ops, args.iodepth
    path = os.path.join(d, "read.bin")
    wpath = os.path.join(d, "write.bin")
    B.make_file(path, size)
    res: Rep = {}
    have_fio = shutil.which("fio") is not None
    have = {m: _importable(m) for m in ("aiofiles", "caio")}

    # sequential read ---------------------------------------------------------------
    if have_fio:
        # up to 512 MiB in flight: a deep queue of big transfers is what the
        # best readers (ours, a thread pool of 64 MiB preadv) give the device
        grid = (
            [("1M", 32)] if args.quick else [(bs, q) for bs in ("256k", "1M", "4M", "16M") for q in (8, 32)]
        )
        for eng in ("libaio", "io_uring"):
            for bs, q in grid:
                res[f"seqread/fio {eng} bs={bs} qd={q}"] = fio(path, "read", bs, q, eng, size)
    for loop in args.loops:
        res[f"seqread/aionvme ({loop})"] = _ours(_run(lambda: B.seqread(path), loop))
    res["seqread/aionvme one request (uvloop)"] = _ours(
        _run(lambda: B.seqread(path, request_size=size), "uvloop")
    )
    res["seqread/aionvme unaligned (uvloop)"] = _ours(_run(lambda: B.seqread(path, misalign=4104), "uvloop"))
    if args.deepspeed:
        deepspeed_rows(args, res, points, "read", path)
    res["seqread/threadpool preadv O_DIRECT"] = _run(lambda: threadpool_seqread(path, size), "asyncio")
    if have["aiofiles"]:
        _fresh(True)
        res["seqread/aiofiles (buffered)"] = _run(lambda: aiofiles_seqread(path, size), "asyncio")
    if have["caio"]:
        _fresh(True)
        res["seqread/caio linux_aio (buffered)"] = _run(lambda: caio_seqread(path, size), "asyncio")
    _fresh(True)
    res["seqread/numpy.fromfile (buffered)"] = numpy_fromfile(path)

    # sequential write (fresh file + fsync) -----------------------------------------------
    # Each writer starts after a sync and a pause (this disk writes faster after
    # a pause, and a writer right after another pays for its write-back), and
    # every other repetition runs them in the reverse order.
    steps: list[Callable[[], None]] = []
    if have_fio:
        # bytes in flight decide this disk's write speed (measured: bs 1M QD 32
        # 1.4 GB/s, bs 64M QD 32 2.4 GB/s): the best point is the ceiling
        wgrid = [("1M", 32)] if args.quick else [("1M", 32), ("8M", 8), ("8M", 32), ("64M", 4), ("64M", 16)]
        for bs, q in wgrid:

            def fio_point(bs: str = bs, q: int = q) -> None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(wpath)
                res[f"seqwrite/fio libaio bs={bs} qd={q}"] = fio(
                    wpath, "write", bs, q, "libaio", size, end_fsync=1
                )

            steps.append(fio_point)

    def ours() -> None:
        res["seqwrite/aionvme (uvloop)"] = _ours(_run(lambda: B.seqwrite(wpath, size), "uvloop"))

    def threadpool() -> None:
        res["seqwrite/threadpool pwritev O_DIRECT"] = _run(
            lambda: threadpool_seqwrite(wpath, size), "asyncio"
        )

    steps += [ours, threadpool]
    if args.deepspeed:
        steps.append(lambda: deepspeed_rows(args, res, points, "write", os.path.join(d, "ds-write.bin")))
    for step in steps if rep % 2 == 0 else steps[::-1]:
        _settle()
        step()

    # 4 KiB random reads -----------------------------------------------------------------------
    if have_fio:
        for eng in ("libaio", "io_uring"):
            res[f"randread/fio {eng} qd={qd}"] = fio(
                path, "randread", "4k", qd, eng, size, io_size=ops * 4096
            )
    for loop in args.loops:
        res[f"randread/aionvme batch ({loop})"] = _ours(
            _run(lambda: B.randread(path, ops=ops, iodepth=qd, mode="batch"), loop)
        )
        res[f"randread/aionvme gather ({loop})"] = _ours(
            _run(lambda: B.randread(path, ops=ops, iodepth=qd, mode="gather"), loop)
        )
        res[f"randread/aionvme rows ({loop})"] = _ours(
            _run(lambda: B.randread(path, ops=ops, iodepth=qd, mode="rows"), loop)
        )
    small = max(2000, ops // 10)  # the slow baselines get fewer operations
    res["randread/threadpool preadv O_DIRECT"] = _run(lambda: threadpool_randread(path, small, qd), "asyncio")
    if have["aiofiles"]:
        _fresh(True)
        res["randread/aiofiles (buffered)"] = _run(lambda: aiofiles_randread(path, small, qd), "asyncio")
    if have["caio"]:
        _fresh(True)
        res["randread/caio linux_aio (buffered)"] = _run(lambda: caio_randread(path, small, qd), "asyncio")
    return res


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def _metric(workload: str) -> str:
    return "iops" if workload == "randread" else "mb_s"


def summarize(reps: list[Rep]) -> list[dict[str, Any]]:
    rows = []
    keys = list(dict.fromkeys(k for r in reps for k in r))
    for key in keys:
        workload, tool = key.split("/", 1)
        metric = _metric(workload)
        mine = [r[key] for r in reps if key in r and r[key].skipped is None]
        skipped = [r[key].skipped for r in reps if key in r and r[key].skipped]
        if not mine:
            rows.append(dict(workload=workload, tool=tool, metric=metric, skipped=skipped[0], verified=True))
            continue
        row: dict[str, Any] = dict(
            workload=workload,
            tool=tool,
            metric=metric,
            median=B.median(getattr(x, metric) for x in mine),
            spread=B.spread(getattr(x, metric) for x in mine)[1:],
            runs=len(mine),
            ratio_to_fio=_ratio(reps, key, metric, _fio_ref),
            ratio_to_ds=_ratio(reps, key, metric, _ds_ref),
            cpu_s_per_gib=B.median(x.cpu_s_per_gib for x in mine),
            cpu_us_per_op=B.median(x.cpu_us_per_op for x in mine),
            verified=all(x.verified for x in mine),
        )
        if tool.startswith(DS_PREFIX):  # which point was DeepSpeed's best, per repetition
            row["best_points"] = [peers.point_label(x) for x in mine]
        if tool.startswith("aionvme"):  # the stall and latencies are measured for ours only
            row["max_stall_ms"] = max(x.max_stall_s for x in mine) * 1e3
            p99 = [x.p99_us for x in mine if x.p99_us is not None]
            if p99:
                row["p99_us"] = B.median(p99)
        rows.append(row)
    return rows


def _ratio(reps: list[Rep], key: str, metric: str, ref: Callable[[Rep, str], float | None]) -> float | None:
    """The median over repetitions of ``key``'s figure / the reference's in the same repetition."""
    workload = key.split("/", 1)[0]
    ratios = []
    for r in reps:
        ceiling = ref(r, workload)
        if ceiling and key in r and r[key].skipped is None:
            ratios.append(getattr(r[key], metric) / ceiling)
    return B.median(ratios) if ratios else None


def _fio_ref(rep: Rep, workload: str) -> float | None:
    """The fio figure a workload is compared with in one repetition (the
    issues' targets): the best point of the sweep for seqread (libaio and
    io_uring) and seqwrite (libaio, fresh file + fsync); for randread (4 KiB,
    QD 64) the better of fio libaio and fio io_uring (issue 17's reference is
    io_uring, issue 3's libaio: the better one is the stricter)."""
    prefix = f"{workload}/fio"
    cands = [getattr(v, _metric(workload)) for k, v in rep.items() if k.startswith(prefix)]
    return max(cands) if cands else None


def _ds_ref(rep: Rep, workload: str) -> float | None:
    """DeepSpeed's best configuration in one repetition (either buffer kind)."""
    cands = [
        getattr(v, _metric(workload))
        for k, v in rep.items()
        if k.startswith(f"{workload}/{DS_PREFIX}") and v.skipped is None and v.verified
    ]
    return max(cands) if cands else None


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    head = (
        "workload",
        "tool",
        "median",
        "min-max",
        "vs fio",
        "vs DeepSpeed",
        "CPU",
        "p99 µs",
        "worst stall ms",
    )
    cells = []
    notes = []
    for r in rows:
        if r.get("skipped"):
            cells.append([r["workload"], r["tool"], "skipped", "", "", "", "", "", ""])
            notes.append(f"- {r['workload']}/{r['tool']}: skipped: {r['skipped']}")
            continue
        unit = "IOPS" if r["metric"] == "iops" else "MB/s"
        cpu = (
            f"{r['cpu_us_per_op']:.1f} µs/op" if r["metric"] == "iops" else f"{r['cpu_s_per_gib']:.3f} s/GiB"
        )
        lo, hi = r["spread"]
        cells.append(
            [
                r["workload"],
                r["tool"] + ("" if r["verified"] else " (DATA MISMATCH)"),
                f"{r['median']:,.0f} {unit}",
                f"{lo:,.0f}-{hi:,.0f}",
                f"{r['ratio_to_fio']:.2f}x" if r["ratio_to_fio"] is not None else "",
                f"{r['ratio_to_ds']:.2f}x" if r["ratio_to_ds"] is not None else "",
                cpu,
                f"{r['p99_us']:,.0f}" if r.get("p99_us") else "",
                f"{r['max_stall_ms']:.0f}" if "max_stall_ms" in r else "",
            ]
        )
        if r.get("best_points"):
            notes.append(
                f"- {r['workload']}/{r['tool']}: best point per repetition: {', '.join(r['best_points'])}"
            )
    table = render.markdown_table(head, cells, right=2)
    return header + "\n\n" + table + ("\n\n" + "\n".join(notes) if notes else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1G")
    p.add_argument("--ops", type=int, default=100_000, help="4 KiB random reads per run (100000)")
    p.add_argument("--iodepth", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--loops", default="uvloop,asyncio")
    p.add_argument("--dir", default=None)
    p.add_argument("--quick", action="store_true", help="one fio point per engine instead of the sweep")
    p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false", help="leave DeepSpeed out")
    p.add_argument(
        "--ds-grid",
        choices=("full", "quick"),
        default="full",
        help="DeepSpeed's sweep: full = block 1M/4M/8M x QD 32/64/128 x IOP 1/4/8 (reads), 8 points (writes)",
    )
    p.add_argument(
        "--ds-build", action="store_true", help="build DeepSpeed's async_io op when missing (minutes)"
    )
    p.add_argument("--json", default=None, help="write all figures to this file")
    p.add_argument("--markdown", default=None, help="write the table to this file")
    args = p.parse_args(argv)
    args.size = parse_size(args.size)
    args.loops = [B.resolve_loop(x) for x in args.loops.split(",") if x]
    if shutil.which("fio") is None:
        print("fio is not installed: ratios cannot be computed (apt-get install fio)", file=sys.stderr)
    if args.deepspeed:
        why = peers.deepspeed_unavailable(args.ds_build)
        if why:
            print(f"DeepSpeed's rows are skipped: {why}", file=sys.stderr)
    reps: list[Rep] = []
    points: list[B.Result] = []
    with B.scratch_dir(args.dir) as d:
        for i in range(args.repeat):
            t0 = time.perf_counter()
            reps.append(one_repetition(args, d, points, len(reps)))
            print(f"repetition {i + 1}/{args.repeat}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = summarize(reps)
    header = (
        f"{time.strftime('%Y-%m-%d')}, {platform.node()}: {os.cpu_count()} CPUs, kernel "
        f"{platform.release()}, file {args.size >> 20} MiB, {args.ops} random reads at QD "
        f"{args.iodepth}, {args.repeat} repetitions (medians; stall: worst)"
    )
    table = markdown(rows, header)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    header=header,
                    rows=rows,
                    repetitions=[{k: v.to_dict() for k, v in r.items()} for r in reps],
                    deepspeed_points=[x.to_dict() for x in points],
                ),
                f,
                indent=1,
            )
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
