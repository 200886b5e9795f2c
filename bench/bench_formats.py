"""safetensors files and checkpoints: aionvme vs the formats' own loaders.

    python3 bench/bench_formats.py                     # 512 MiB, 5 runs, both workloads
    python3 bench/bench_formats.py --size 1G --repeat 7 --workload safetensors

Runs the workloads of aionvme.formats._bench (the same functions as
``aionvme bench --workload safetensors|checkpoint``) several times and prints
the median of every figure, with min-max, as a Markdown table. Run as root so
the page cache is dropped before every load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from typing import Any

from aionvme.cli._common import human_bytes, scratch_dir
from aionvme.defaults import parse_size
from aionvme.formats._bench import WORKLOADS

ROWS = {
    "safetensors": [
        (
            "load (cold, every page touched)",
            "load_s",
            "load_safetensors_s",
            "load_ratio",
            "safetensors load_file",
        ),
        ("save (fsync'd)", "save_s", "save_safetensors_s", "save_ratio", "safetensors save_file"),
    ],
    "checkpoint": [
        ("save (fsync'd)", "save_s", "save_torch_s", "save_ratio", "torch.save"),
        ("load (cold, every page touched)", "load_s", "load_torch_s", "load_ratio", "torch.load"),
    ],
}


def _med(runs: list[dict[str, float]], key: str) -> tuple[float, float, float]:
    vals = [r[key] for r in runs]
    return statistics.median(vals), min(vals), max(vals)


def report(name: str, runs: list[dict[str, float]], pause: float = 0.0) -> str:
    nbytes = runs[0]["bytes"]
    gb = nbytes / 1e9
    lines = [
        f"### {name}: {human_bytes(nbytes)} in {int(runs[0]['tensors'])} bf16 tensors, "
        f"median of {len(runs)} runs (min-max)"
        + (f", {pause:g} s idle before each load" if pause else "")
        + ("" if all(r["cold_cache"] for r in runs) else " - page cache NOT dropped (not root)"),
        "",
        "| operation | aionvme | baseline | ratio |",
        "|---|---|---|---|",
    ]
    for label, ours, base, ratio, base_name in ROWS[name]:
        o, omin, omax = _med(runs, ours)
        b, bmin, bmax = _med(runs, base)
        r, rmin, rmax = _med(runs, ratio)
        lines.append(
            f"| {label} | {o:.3f} s ({omin:.2f}-{omax:.2f}), {gb / o:.2f} GB/s "
            f"| {base_name}: {b:.3f} s ({bmin:.2f}-{bmax:.2f}), {gb / b:.2f} GB/s "
            f"| **{r:.2f}x** ({rmin:.2f}-{rmax:.2f}) |"
        )
    if name == "checkpoint":
        for kind in ("fresh", "reused"):
            ret, rmin, rmax = _med(runs, f"background_{kind}_return_s")
            tot, tmin, tmax = _med(runs, f"background_{kind}_total_s")
            lines.append(
                f"| save_in_background, {kind} snapshot buffer | returns in {ret:.3f} s "
                f"({rmin:.2f}-{rmax:.2f}); durable after {tot:.3f} s ({tmin:.2f}-{tmax:.2f}) | | |"
            )
    dev, dmin, dmax = _med(runs, "device_read_s")
    fresh, fmin, fmax = _med(runs, "fresh_memory_s")
    lines += [
        "",
        f"device alone (cold O_DIRECT read of the file into memory already faulted in): "
        f"{dev:.3f} s ({dmin:.2f}-{dmax:.2f}), {gb / dev:.2f} GB/s; "
        f"faulting in {human_bytes(nbytes)} of fresh memory: {fresh:.3f} s ({fmin:.2f}-{fmax:.2f})",
    ]
    return "\n".join(lines)


async def _run(name: str, directory: str, size: int, verify: bool, pause: float) -> dict[str, float]:
    return await WORKLOADS[name](directory, size, verify=verify, pause=pause)


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
    with scratch_dir(args.dir) as d:
        for name in names:
            runs: list[dict[str, Any]] = []
            for i in range(args.repeat):
                r = asyncio.run(_run(name, d, size, not args.no_verify, args.pause))
                runs.append(r)
                print(
                    f"# {name} run {i + 1}/{args.repeat}: "
                    + ", ".join(f"{k}={v:.3f}" for k, v in r.items() if k.endswith(("_s", "ratio"))),
                    file=sys.stderr,
                    flush=True,
                )
            print(report(name, runs, args.pause) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
