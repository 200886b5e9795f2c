#!/usr/bin/env python3
"""safetensors files and checkpoints: aionvme vs the formats' own loaders.

    python3 bench/suites/bench_formats.py                     # 512 MiB, 5 runs, both workloads
    python3 bench/suites/bench_formats.py --size 1G --repeat 7 --workload safetensors

Runs the format workloads of aionvme.bench (the same as ``aionvme bench
--workload safetensors|checkpoint``) several times and prints the median of
every figure, with min-max, as a Markdown table. Run as root so the page
cache is dropped before every load.
"""

from __future__ import annotations

import argparse
import sys

from aionvme import bench as B
from aionvme.bench import render
from aionvme.bench.formats import FORMAT_BASELINES
from aionvme.defaults import parse_size

WORKLOADS = tuple(FORMAT_BASELINES)
LABELS = {"load": "load (cold, every page touched)", "save": "save (fsync'd)"}
ORDER = {"safetensors": ("load", "save"), "checkpoint": ("save", "load")}


def _fmt(runs: list[B.Result], key: str) -> tuple[float, str]:
    med, lo, hi = B.spread(r.figures[key] for r in runs)
    return med, f"{med:.3f} s ({lo:.2f}-{hi:.2f})"


def report(name: str, runs: list[B.Result], pause: float = 0.0) -> str:
    first = runs[0].figures
    nbytes = first["bytes"]
    gb = nbytes / 1e9
    title = (
        f"### {name}: {render.human_bytes(nbytes)} in {int(first['tensors'])} bf16 tensors, "
        f"median of {len(runs)} runs (min-max)"
        + (f", {pause:g} s idle before each load" if pause else "")
        + ("" if all(r.figures["cold_cache"] for r in runs) else " - page cache NOT dropped (not root)")
    )
    base = "safetensors" if name == "safetensors" else "torch"
    rows = []
    for op in ORDER[name]:
        o, ours = _fmt(runs, f"{op}_s")
        b, theirs = _fmt(runs, f"{op}_{base}_s")
        r, rlo, rhi = B.spread(x.figures[f"{op}_ratio"] for x in runs)
        rows.append(
            [
                LABELS[op],
                f"{ours}, {gb / o:.2f} GB/s",
                f"{FORMAT_BASELINES[name][op]}: {theirs}, {gb / b:.2f} GB/s",
                f"**{r:.2f}x** ({rlo:.2f}-{rhi:.2f})",
            ]
        )
    if name == "checkpoint":
        for kind in ("fresh", "reused"):
            _, ret = _fmt(runs, f"background_{kind}_return_s")
            _, tot = _fmt(runs, f"background_{kind}_total_s")
            rows.append(
                [
                    f"save_in_background, {kind} snapshot buffer",
                    f"returns in {ret}; durable after {tot}",
                    "",
                    "",
                ]
            )
    if name == "safetensors" and all("floor_s" in r.figures for r in runs):
        fl, floor = _fmt(runs, "floor_s")
        _, fio_s = _fmt(runs, "floor_fio_s")
        _, touch_s = _fmt(runs, "touch_s")
        r, rlo, rhi = B.spread(x.figures["floor_ratio"] for x in runs)
        rows.append(
            [
                "load vs the floor",
                "",
                f"fio's best cold read {fio_s} + touching {touch_s} = {floor}, {gb / fl:.2f} GB/s",
                f"**{r:.2f}x** ({rlo:.2f}-{rhi:.2f})",
            ]
        )
    dev, dev_s = _fmt(runs, "device_read_s")
    _, fresh_s = _fmt(runs, "fresh_memory_s")
    table = render.markdown_table(("operation", "aionvme", "baseline", "ratio"), rows, right=4)
    return (
        f"{title}\n\n{table}\n\n"
        f"device alone (cold O_DIRECT read of the file into memory already faulted in): "
        f"{dev_s}, {gb / dev:.2f} GB/s; faulting in {render.human_bytes(nbytes)} of fresh memory: {fresh_s}"
    )


async def _one(name: str, directory: str, size: int, verify: bool, pause: float) -> B.Result:
    ctx = B.Context(directory, size=size, verify=verify, options={"pause": str(pause)})
    return await B.run(name, ctx)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="512M", help="state dict size (default 512M; 1G-2G on bigger machines)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per workload (default 5)")
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a local disk)")
    ap.add_argument("--no-verify", action="store_true", help="skip checking the data read back")
    ap.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="idle seconds before each load (a VM returns freed memory to its host meanwhile)",
    )
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    ok = True
    with B.scratch_dir(args.dir) as d:
        for name in names:
            runs: list[B.Result] = []
            for i in range(args.repeat):
                r = B.run_loop(_one(name, d, size, not args.no_verify, args.pause), "asyncio")
                if r.skipped:
                    print(f"# {name}: skipped: {r.skipped}", file=sys.stderr)
                    break
                ok = ok and r.verified
                runs.append(r)
                print(
                    f"# {name} run {i + 1}/{args.repeat}: "
                    + ", ".join(f"{k}={v:.3f}" for k, v in r.figures.items() if k.endswith(("_s", "ratio")))
                    + ("" if r.verified else " DATA MISMATCH"),
                    file=sys.stderr,
                    flush=True,
                )
            if runs:
                print(report(name, runs, args.pause) + "\n", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
