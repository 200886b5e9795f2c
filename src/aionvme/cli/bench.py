"""``aionvme bench``: measure reads and writes the way applications do them.

Parses the arguments, runs the workloads of :mod:`aionvme.bench` by name and
prints what they measured; the measuring is all in the package.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import sys
import textwrap
import time
from typing import Any

from aionvme import bench as B
from aionvme.bench import render

from ._common import Progress, count, fit, human_bytes, need_directory, need_matplotlib, size, terminal_width

DEFAULT = "seqread,seqwrite,randread"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-w",
        "--workload",
        default=DEFAULT,
        help=f"comma-separated workload names, 'all', or package.module:function (default: {DEFAULT}); "
        "--list shows them",
    )
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    p.add_argument(
        "--size", default="1G", type=size(), help="file size for seq*/rand* and the formats' state dict (1G)"
    )
    p.add_argument("--block-size", default=None, help="chunk size a request is split into (default 1M)")
    p.add_argument(
        "--queue-depth", type=count(1), default=None, help="chunks in flight per engine (default 128)"
    )
    p.add_argument(
        "--parallelism",
        type=count(0),
        default=None,
        help="chunks of one request in flight (intra-op parallelism; default: no cap)",
    )
    p.add_argument(
        "--request-size",
        default="64M",
        type=size(),
        help="seqread/seqwrite request size (64M, like a tensor)",
    )
    p.add_argument("--bs", default="4K", type=size(), help="randread/randwrite transfer size (4K)")
    p.add_argument(
        "--iodepth", type=count(1), default=64, help="randread/randwrite operations in flight (64)"
    )
    p.add_argument("--ops", type=count(1), default=100_000, help="randread/randwrite operations (100000)")
    p.add_argument(
        "--mode",
        choices=("gather", "batch", "rows", "all", "both"),
        default="all",
        help="randread: coroutines awaiting one read each (gather), pread_many or pread_rows batches "
        "sharing --iodepth (batch, rows), or all three (all; 'both' is the same)",
    )
    p.add_argument("--nfiles", type=count(1), default=1000, help="manyfiles: number of files (1000)")
    p.add_argument("--file-size", default="1M", type=size(), help="manyfiles: size of each (1M)")
    p.add_argument(
        "--misalign",
        type=count(0),
        default=0,
        help="seqread: shift buffers and file offsets by this many bytes (bounce path)",
    )
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload-specific setting (repeatable), e.g. -o pause=2 for the formats",
    )
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--direct", dest="direct", action="store_true", default=None, help="O_DIRECT (default)")
    g.add_argument("--buffered", dest="direct", action="store_false", help="buffered I/O (page cache)")
    p.add_argument("--engine", choices=("auto", "uring", "aio", "thread"), default=None)
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
    p.add_argument("--repeat", type=count(1), default=1, help="runs of each workload; medians are reported")
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
        "(bounce) and host memory + copy (host), each against the same file",
    )
    p.add_argument("--gpu-ways", default="gds,bounce,host", help="with --gpu: the ways to measure")
    p.add_argument("--device", default="cuda", help="with --gpu: the CUDA device (cuda, cuda:1, ...)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the test files")


def _workloads(spec: str, parser: argparse.ArgumentParser) -> list[str]:
    names = B.names(all_only=True) if spec == "all" else [w.strip() for w in spec.split(",") if w.strip()]
    if not names:
        parser.error(f"-w {spec!r}: no workload named")
    try:
        for n in names:
            B.get(n)
    except B.UnknownWorkloadError as e:
        parser.error(str(e))
    return names


def _options(pairs: list[str], parser: argparse.ArgumentParser | None = None) -> dict[str, str]:
    out = {}
    for kv in pairs:
        key, eq, value = kv.partition("=")
        if not eq or not key.strip():
            msg = f"-o wants KEY=VALUE, got {kv!r}"
            if parser is None:
                raise SystemExit(f"aionvme bench: {msg}")
            parser.error(msg)
        out[key.strip()] = value.strip()
    return out


def _options_read(name: str) -> set[str] | None:
    """The -o keys workload ``name`` reads (``ctx.option("key", ...)`` in its
    source), or None where that cannot be told (its source cannot be read, or
    it reads ``ctx.options`` itself): then any key goes."""
    try:
        fn = B.get(name).load()
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, ImportError, AttributeError):
        return None
    if any(isinstance(node, ast.Attribute) and node.attr == "options" for node in ast.walk(tree)):
        return None
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "option"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }


def _check(
    args: argparse.Namespace, names: list[str], settings: dict[str, Any]
) -> tuple[str | None, list[str]]:
    """Everything about the arguments that can be wrong, before any work:
    parser.error (one line, exit status 2) on the first problem. Returns the
    sweep (setting name or None, its values)."""
    from aionvme import defaults
    from aionvme.exceptions import InvalidSettingError

    parser: argparse.ArgumentParser = args.parser
    need_directory(parser, "--dir", args.dir)
    if args.file is not None:
        need_directory(parser, "--file's directory", os.path.dirname(os.path.abspath(args.file)))
    options = _options(args.option, parser)
    if options:
        read: set[str] = set()
        for n in names:
            keys = _options_read(n)
            if keys is None:
                read = set(options)
                break
            read |= keys
        ignored = sorted(set(options) - read)
        if ignored:
            which = ", ".join(f"-o {k}" for k in ignored)
            takes = ", ".join(sorted(read)) or "none"
            parser.error(f"{which}: not read by {','.join(names)} (the options they read: {takes})")
    sweep_name: str | None = None
    sweep_values: list[str] = []
    if args.sweep:
        sweep_name, _, vals = args.sweep.partition("=")
        sweep_values = [v for v in vals.split(",") if v]
        if not sweep_name or not sweep_values:
            parser.error("--sweep needs NAME=V1,V2,...")
    if args.plot and not args.sweep:
        parser.error("--plot needs --sweep")
    for sv in sweep_values or [""]:
        s = dict(settings)
        if sweep_name:
            s[sweep_name] = sv
        try:
            with defaults.set(**s):
                pass
        except InvalidSettingError as e:
            parser.error(str(e))
    if args.plot:
        need_matplotlib(parser)
    return sweep_name, sweep_values


def _context(args: argparse.Namespace, workdir: str, mode: str) -> B.Context:
    from aionvme.defaults import parse_size

    return B.Context(
        workdir=workdir,
        size=parse_size(args.size),
        file=args.file,
        overwrite=args.overwrite,
        request_size=parse_size(args.request_size),
        bs=parse_size(args.bs),
        iodepth=args.iodepth,
        ops=args.ops,
        mode=mode,
        nfiles=args.nfiles,
        file_size=parse_size(args.file_size),
        misalign=args.misalign,
        options=_options(args.option),
    )


def _list() -> int:
    names = B.names()
    w = max(len(n) for n in names) + 2
    for n in names:
        e = B.get(n)
        text = ("" if e.in_all else "(not in 'all') ") + e.help
        print(fit(f"{n:<{w}}{text}", terminal_width(), " " * w))
    return 0


def run(args: argparse.Namespace) -> int:
    args.loop = B.resolve_loop(args.loop)
    if args.list:
        return _list()
    try:
        return _run_gpu(args) if args.gpu else _run(args)
    except FileExistsError as e:
        msg = f"aionvme bench: {e.filename}: {e.strerror} (pass --overwrite to replace it)"
        raise SystemExit(msg) from None


def _run(args: argparse.Namespace) -> int:
    from aionvme import defaults

    names = _workloads(args.workload, args.parser)
    settings: dict[str, Any] = {}
    for key in ("block_size", "queue_depth", "direct", "engine"):
        v = getattr(args, key)
        if v is not None:
            settings[key] = v
    if args.parallelism is not None:
        settings["max_inflight"] = args.parallelism
    sweep_name, checked = _check(args, names, settings)
    sweep_values: list[Any] = list(checked) if sweep_name else [None]

    plan: list[tuple[Any, str, str]] = []
    for sv in sweep_values:
        for name in names:
            modes = B.get(name).modes
            if modes:
                modes = modes if args.mode in ("all", "both") else (args.mode,)
            for m in modes or ("gather",):
                plan.extend((sv, name, m) for _ in range(args.repeat))
    note: str | None = (
        "not root: the page cache was not dropped (O_DIRECT bypasses it; "
        "the buffered loads evict their files)"
    )

    runs: dict[tuple[Any, str, str], list[B.Result]] = {}
    t0 = time.perf_counter()
    with B.scratch_dir(args.dir, keep=args.keep) as workdir, Progress(quiet=args.json) as progress:
        progress.stage("", len(plan), announce=False)
        for sv, name, m in plan:
            s = dict(settings)
            if sweep_name:
                s[sweep_name] = sv
            with defaults.set(**s):
                if os.geteuid() == 0:
                    note = B.drop_caches()
                r = B.run_loop(B.run(name, _context(args, workdir, m)), args.loop)
            if sweep_name:
                r.params["sweep"] = {sweep_name: sv}
            runs.setdefault((sv, name, m), []).append(r)
            progress.advance(f"{r.label}{'' if sv is None else f' {sweep_name}={sv}'}")
    results = [B.median_result(v) for v in runs.values()]
    if args.json:
        print(render.to_json(results, settings=defaults.get(), loop=args.loop, note=note))
    else:
        width = terminal_width()
        where = args.file or args.dir or "a temporary directory"
        title = (
            f"aionvme bench on {where}, loop={args.loop}, {args.repeat} run(s) each "
            f"(medians; stall: worst), {time.perf_counter() - t0:.0f} s"
        )
        if sweep_name:
            for sv in sweep_values:
                sub = [r for r in results if r.params.get("sweep", {}).get(sweep_name) == sv]
                print(render.results_table(sub, f"{title}; {sweep_name}={sv}", width))
        else:
            print(render.results_table(results, title, width))
        if note:
            print(fit(f"note: {note}", width, "  "))
        if any(not r.verified for r in results):
            print("DATA MISMATCH: a run read back wrong bytes", file=sys.stderr)
    if args.plot and sweep_name:
        series: dict[str, list[float]] = {}
        for r in results:
            series.setdefault(r.label, []).append(r.mb_s)
        problem = render.plot(
            args.plot,
            sweep_values,
            series,
            title=f"aionvme bench: MB/s by {sweep_name}",
            xlabel=sweep_name,
            ylabel="MB/s",
        )
        if problem:
            raise SystemExit(f"aionvme bench: --plot: {problem}")
        if not args.json:
            print(
                fit(f"plot: {args.plot} ({human_bytes(os.path.getsize(args.plot))})", terminal_width(), "  ")
            )
    return 0 if all(r.verified for r in results) else 1


def _gpu_results(args: argparse.Namespace) -> list[B.Result]:
    from aionvme import gpu
    from aionvme.defaults import parse_size

    size = parse_size(args.size)
    rs = parse_size(args.request_size)
    ways = [w.strip() for w in args.gpu_ways.split(",") if w.strip()]
    bad = [w for w in ways if w not in B.GPU_WAYS]
    if bad:
        raise SystemExit(
            f"aionvme bench: unknown --gpu-ways: {', '.join(bad)} (known: {', '.join(B.GPU_WAYS)})"
        )
    out: list[B.Result] = []
    status = gpu.cufile_status()
    with B.scratch_dir(args.dir, keep=args.keep) as workdir:
        path = args.file or os.path.join(workdir, "gpu.bin")
        B.make_file(path, size, overwrite=args.overwrite)
        wpath = os.path.join(workdir, "gpu-w.bin")
        for way in ways:
            if way == "gds" and status["mode"] is None:
                out += [
                    B.Result.skip(name, str(status["reason"]), way=way) for name in ("gpu-read", "gpu-write")
                ]
                continue
            label = f"gds ({status['mode']})" if way == "gds" else way
            reads, writes = [], []
            for _ in range(args.repeat):
                if os.geteuid() == 0:
                    B.drop_caches()
                reads.append(
                    B.run_loop(B.gpu_read(path, way=way, request_size=rs, device=args.device), args.loop)
                )
                writes.append(
                    B.run_loop(
                        B.gpu_write(wpath, size, way=way, request_size=rs, device=args.device), args.loop
                    )
                )
            for r in (B.median_result(reads), B.median_result(writes)):
                r.params["label"] = label
                out.append(r)
    return out


def _run_gpu(args: argparse.Namespace) -> int:
    bad = [w.strip() for w in args.gpu_ways.split(",") if w.strip() and w.strip() not in B.GPU_WAYS]
    if bad:
        args.parser.error(f"unknown --gpu-ways: {', '.join(bad)} (known: {', '.join(B.GPU_WAYS)})")
    need_directory(args.parser, "--dir", args.dir)
    why = B.cuda_unavailable()
    if why:
        print(f"aionvme bench: --gpu needs a CUDA device: {why}", file=sys.stderr)
        return 2
    import torch

    from aionvme import gpu

    results = _gpu_results(args)
    device = torch.cuda.get_device_name(args.device)
    if args.json:
        print(render.to_json(results, device=device, cufile=gpu.stats()))
    else:
        title = f"aionvme bench --gpu on {device}, {args.size} per transfer, {args.repeat} run(s) (medians)"
        print(render.gpu_table(results, title, terminal_width()))
    return 0 if all(r.verified for r in results) else 1
