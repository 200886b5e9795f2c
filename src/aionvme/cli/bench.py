"""``aionvme bench``: measure reads and writes the way applications do them.

Workloads: seqread, seqwrite, randread, randwrite, manyfiles (many small
files by path), and the formats' safetensors and checkpoint. Test files are
made in a temporary directory on a local disk unless --file/--dir say where.
Every run verifies the data it read, reports MB/s, IOPS, CPU seconds per GiB
and per operation, p50/p99 latency and the longest event-loop stall.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._common import drop_caches, human_bytes, resolve_loop, run_loop, scratch_dir

IO_WORKLOADS = ("seqread", "seqwrite", "randread", "randwrite", "manyfiles")
FORMAT_WORKLOADS = ("safetensors", "checkpoint")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-w",
        "--workload",
        default="seqread,seqwrite,randread",
        help="comma-separated: " + ", ".join(IO_WORKLOADS + FORMAT_WORKLOADS) + ", or 'all' "
        "(default: seqread,seqwrite,randread)",
    )
    p.add_argument("--size", default="1G", help="file size for seq*/rand* and the formats' state dict (1G)")
    p.add_argument("--block-size", default=None, help="chunk size a request is split into (default 1M)")
    p.add_argument("--queue-depth", type=int, default=None, help="chunks in flight per engine (default 128)")
    p.add_argument(
        "--parallelism",
        type=int,
        default=None,
        help="chunks of one request in flight (intra-op parallelism; default: no cap)",
    )
    p.add_argument("--request-size", default="64M", help="seqread/seqwrite request size (64M, like a tensor)")
    p.add_argument("--bs", default="4K", help="randread/randwrite transfer size (4K)")
    p.add_argument("--iodepth", type=int, default=64, help="randread/randwrite operations in flight (64)")
    p.add_argument("--ops", type=int, default=100_000, help="randread/randwrite operations (100000)")
    p.add_argument(
        "--mode",
        choices=("gather", "batch", "both"),
        default="both",
        help="randread: coroutines awaiting one read each, pread_many batches, or both",
    )
    p.add_argument("--nfiles", type=int, default=1000, help="manyfiles: number of files (1000)")
    p.add_argument("--file-size", default="1M", help="manyfiles: size of each (1M)")
    p.add_argument(
        "--misalign",
        type=int,
        default=0,
        help="seqread: shift buffers and file offsets by this many bytes (bounce path)",
    )
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--direct", dest="direct", action="store_true", default=None, help="O_DIRECT (default)")
    g.add_argument("--buffered", dest="direct", action="store_false", help="buffered I/O (page cache)")
    p.add_argument("--engine", choices=("auto", "aio", "thread"), default=None)
    loc = p.add_mutually_exclusive_group()
    loc.add_argument(
        "--file",
        default=None,
        help="use this file for seq*/rand* (made if missing; an existing file that is not an "
        "aionvme benchmark file is refused unless --overwrite)",
    )
    loc.add_argument("--dir", default=None, help="make test files in this directory")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --file replace a file that holds other data (its content is lost)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of each workload; medians are reported")
    p.add_argument(
        "--sweep",
        default=None,
        metavar="NAME=V1,V2,...",
        help="repeat the workloads for each value of a setting, e.g. block_size=256K,1M,4M",
    )
    p.add_argument("--plot", default=None, metavar="OUT.png", help="with --sweep: plot MB/s per value")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="measure NVMe->GPU and GPU->NVMe instead: cuFile (gds), the pinned bounce pipeline "
        "(bounce) and host memory + .cuda()/.cpu() (host), each against the same file",
    )
    p.add_argument("--gpu-ways", default="gds,bounce,host", help="with --gpu: the ways to measure")
    p.add_argument("--device", default="cuda", help="with --gpu: the CUDA device (cuda, cuda:1, ...)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the test files")


def _workloads(spec: str) -> list[str]:
    names = list(IO_WORKLOADS + FORMAT_WORKLOADS) if spec == "all" else [w.strip() for w in spec.split(",")]
    bad = [w for w in names if w not in IO_WORKLOADS + FORMAT_WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workload(s): {', '.join(bad)}")
    return names


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[str], None]]:
    """advance(label) per finished run: rich or tqdm when installed, else plain lines."""
    if quiet:
        yield lambda label: None
        return
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        pass
    else:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
            console=None,
        ) as prog:
            task = prog.add_task("bench", total=total)

            def adv_rich(label: str) -> None:
                prog.update(task, advance=1, description=label)

            yield adv_rich
        return
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]

        def adv_plain(label: str) -> None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {label}", file=sys.stderr, flush=True)

        yield adv_plain
        return
    bar = tqdm(total=total, file=sys.stderr, leave=False)
    try:

        def adv_tqdm(label: str) -> None:
            bar.set_description(label)
            bar.update(1)

        yield adv_tqdm
    finally:
        bar.close()


async def _run_one(name: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    from aionvme import benchmark as B
    from aionvme.defaults import parse_size

    size = parse_size(args.size)
    path = args.file or os.path.join(workdir, "bench.bin")
    if name == "seqread":
        B.make_file(path, size, overwrite=args.overwrite)
        r = await B.seqread(path, request_size=parse_size(args.request_size), misalign=args.misalign)
    elif name == "seqwrite":
        # a fresh file in the scratch directory (next to --file's would risk another's data)
        r = await B.seqwrite(
            os.path.join(workdir, "write.bin"), size, request_size=parse_size(args.request_size)
        )
    elif name == "randread":
        B.make_file(path, size, overwrite=args.overwrite)
        r = await B.randread(
            path, ops=args.ops, bs=parse_size(args.bs), iodepth=args.iodepth, mode=args._mode
        )
    elif name == "randwrite":
        B.make_file(path, size, overwrite=args.overwrite)
        r = await B.randwrite(path, ops=args.ops, bs=parse_size(args.bs), iodepth=args.iodepth)
    elif name == "manyfiles":
        d = os.path.join(workdir, "many")
        os.makedirs(d, exist_ok=True)
        r = await B.manyfiles(d, nfiles=args.nfiles, file_size=parse_size(args.file_size))
    else:
        from aionvme.formats._bench import WORKLOADS as FORMATS

        figures = await FORMATS[name](workdir, size, verify=True)
        return {"workload": name, **figures}
    return dict(r.summary())


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in rows)
    out["verified"] = all(r.get("verified", True) for r in rows)
    out["runs"] = len(rows)
    if "max_stall_ms" in rows[0]:
        out["max_stall_ms"] = max(r["max_stall_ms"] for r in rows)  # the worst, not the median
    return out


def _label(row: dict[str, Any]) -> str:
    name = str(row["workload"])
    p = row.get("params") or {}
    if name == "randread" and p.get("mode"):
        name += f" ({p['mode']})"
    if name == "seqread" and p.get("misalign"):
        name += f" (+{p['misalign']} B)"
    return name


def _table(rows: list[dict[str, Any]], title: str) -> str:
    head = ["workload", "MB/s", "IOPS", "CPU s/GiB", "CPU µs/op", "p50 µs", "p99 µs", "stall ms", "ok"]
    lines = []
    for r in rows:
        if "mb_s" not in r:  # a format workload: its own figures
            figs = ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in r.items()
                if k not in ("workload", "runs")
            )
            lines.append([r["workload"], figs])
            continue
        lines.append(
            [
                _label(r),
                f"{r['mb_s']:.0f}",
                f"{r['iops']:.0f}",
                f"{r['cpu_s_per_gib']:.3f}",
                f"{r['cpu_us_per_op']:.1f}",
                f"{r['p50_us']:.0f}",
                f"{r['p99_us']:.0f}",
                f"{r['max_stall_ms']:.1f}",
                "yes" if r["verified"] else "NO",
            ]
        )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        out = [title, "  ".join(f"{h:>10}" for h in head)]
        for ln in lines:
            out.append("  ".join(f"{c:>10}" for c in ln))
        return "\n".join(out)
    table = Table(title=title)
    for h in head:
        table.add_column(h, justify="left" if h == "workload" else "right")
    for ln in lines:
        table.add_row(*(ln + [""] * (len(head) - len(ln))))
    console = Console(record=True, width=140)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def _plot(path: str, setting: str, values: list[str], results: dict[str, list[dict[str, Any]]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib (pip install 'aionvme[plot]')") from e
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in results.items():
        ax.plot(values, [r.get("mb_s", 0) for r in rows], marker="o", label=name)
    ax.set_xlabel(setting)
    ax.set_ylabel("MB/s")
    ax.set_title(f"aionvme bench: MB/s by {setting}")
    ax.legend()
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _gpu_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from aionvme import benchmark as B
    from aionvme import gpu
    from aionvme.defaults import parse_size

    size = parse_size(args.size)
    rs = parse_size(args.request_size)
    ways = [w.strip() for w in args.gpu_ways.split(",") if w.strip()]
    bad = [w for w in ways if w not in B.GPU_WAYS]
    if bad:
        raise SystemExit(f"unknown --gpu-ways: {', '.join(bad)} (known: {', '.join(B.GPU_WAYS)})")
    rows: list[dict[str, Any]] = []
    status = gpu.cufile_status()
    with scratch_dir(args.dir, keep=args.keep) as workdir:
        path = args.file or os.path.join(workdir, "gpu.bin")
        B.make_file(path, size, overwrite=args.overwrite)
        for way in ways:
            if way == "gds" and status["mode"] is None:
                for name in ("gpu-read", "gpu-write"):
                    rows.append(dict(workload=name, way=way, unavailable=status["reason"]))
                continue
            label = f"gds ({status['mode']})" if way == "gds" else way
            for repeat in range(args.repeat):
                if os.geteuid() == 0:
                    drop_caches()
                r = run_loop(B.gpu_read(path, way=way, request_size=rs, device=args.device), args.loop)
                w = run_loop(
                    B.gpu_write(
                        os.path.join(workdir, "gpu-w.bin"), size, way=way, request_size=rs, device=args.device
                    ),
                    args.loop,
                )
                for res in (r, w):
                    row = dict(res.summary())
                    row.update(way=label, repeat=repeat, gb_s=round(res.nbytes / res.wall_s / 1e9, 3))
                    rows.append(row)
    return rows


def _gpu_table(rows: list[dict[str, Any]]) -> str:
    host = {r["workload"]: r["gb_s"] for r in rows if r.get("way") == "host" and "gb_s" in r}
    out = [f"{'direction':<10} {'way':<14} {'GB/s':>8} {'vs host':>8} {'path used':<10} ok"]
    for r in rows:
        direction = "NVMe->GPU" if r["workload"] == "gpu-read" else "GPU->NVMe"
        if "unavailable" in r:
            out.append(f"{direction:<10} {r['way']:<14} {'-':>8} {'-':>8} unavailable: {r['unavailable']}")
            continue
        base = host.get(r["workload"])
        ratio = f"{r['gb_s'] / base:.2f}x" if base else "-"
        used = (r.get("params") or {}).get("used", "")
        out.append(
            f"{direction:<10} {r['way']:<14} {r['gb_s']:>8.2f} {ratio:>8} {used:<10} "
            + ("yes" if r["verified"] else "NO")
        )
    return "\n".join(out)


def _run_gpu(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("aionvme bench: --gpu needs a CUDA device: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "aionvme bench: --gpu needs a CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}; a CPU-only build or no visible GPU)",
            file=sys.stderr,
        )
        return 2
    rows = _gpu_rows(args)
    if args.json:
        from aionvme import gpu

        print(
            json.dumps(dict(device=torch.cuda.get_device_name(args.device), cufile=gpu.stats(), results=rows))
        )
    else:
        print(f"aionvme bench --gpu on {torch.cuda.get_device_name(args.device)}, {args.size} per transfer")
        print(_gpu_table(rows))
    return 0 if all(r.get("verified", True) for r in rows) else 1


def run(args: argparse.Namespace) -> int:
    args.loop = resolve_loop(args.loop)
    try:
        return _run_gpu(args) if args.gpu else _run(args)
    except FileExistsError as e:
        msg = f"aionvme bench: {e.filename}: {e.strerror} (pass --overwrite to replace it)"
        raise SystemExit(msg) from None


def _run(args: argparse.Namespace) -> int:
    from aionvme import defaults

    names = _workloads(args.workload)
    settings: dict[str, Any] = {}
    for key in ("block_size", "queue_depth", "direct", "engine"):
        v = getattr(args, key)
        if v is not None:
            settings[key] = v
    if args.parallelism is not None:
        settings["max_inflight"] = args.parallelism
    sweep_name: str | None = None
    sweep_values: list[Any] = [None]
    if args.sweep:
        sweep_name, _, vals = args.sweep.partition("=")
        sweep_values = [v for v in vals.split(",") if v]
        if not sweep_values:
            raise SystemExit("--sweep needs NAME=V1,V2,...")
    if args.plot and not args.sweep:
        raise SystemExit("--plot needs --sweep")

    plan: list[tuple[Any, str, str]] = []
    for sv in sweep_values:
        for name in names:
            modes = ["gather", "batch"] if (name == "randread" and args.mode == "both") else [args.mode]
            for m in modes:
                plan.extend((sv, name, m) for _ in range(args.repeat))
    note: str | None = "not root: the page cache was not dropped (O_DIRECT bypasses it)"

    results: dict[tuple[Any, str, str], list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    with scratch_dir(args.dir, keep=args.keep) as workdir, _progress(len(plan), args.json) as advance:
        for sv, name, m in plan:
            s = dict(settings)
            if sweep_name:
                s[sweep_name] = sv
            args._mode = m
            with defaults.set(**s):
                if os.geteuid() == 0:
                    note = drop_caches()
                row = run_loop(_run_one(name, args, workdir), args.loop)
            results.setdefault((sv, name, m), []).append(row)
            advance(f"{name}{'' if sv is None else f' {sweep_name}={sv}'}")
    rows = [_median_row(v) for v in results.values()]
    for (sv, _, _), row in zip(results, rows):
        if sweep_name:
            row["sweep"] = {sweep_name: sv}
    if args.json:
        print(json.dumps(dict(settings=defaults.get(), loop=args.loop, note=note, results=rows), indent=2))
    else:
        where = args.file or args.dir or "a temporary directory"
        title = (
            f"aionvme bench on {where}, loop={args.loop}, {args.repeat} run(s) each "
            f"(medians; stall: worst), {time.perf_counter() - t0:.0f} s"
        )
        if sweep_name:
            for sv in sweep_values:
                sub = [r for r in rows if r.get("sweep", {}).get(sweep_name) == sv]
                print(_table(sub, f"{title}; {sweep_name}={sv}"))
        else:
            print(_table(rows, title))
        if note:
            print(f"note: {note}")
        if any(not r.get("verified", True) for r in rows):
            print("DATA MISMATCH: a run read back wrong bytes", file=sys.stderr)
    if args.plot and sweep_name:
        by_name: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by_name.setdefault(_label(r), []).append(r)
        _plot(args.plot, sweep_name, sweep_values, by_name)
        if not args.json:
            print(f"plot: {args.plot} ({human_bytes(os.path.getsize(args.plot))})")
    return 0 if all(r.get("verified", True) for r in rows) else 1
