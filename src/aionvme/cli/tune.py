"""``aionvme tune --dir PATH``: find the Handle knobs that move data fastest
here, and write them as a config that ``Handle.from_config``,
``aionvme.defaults.load_config`` and DeepSpeed (its ``"aio"`` section) read.

Parses the arguments and prints; the sweep itself is
:mod:`aionvme.bench.tune`. ``--quick`` uses a coarse grid and a 256 MiB file
(well under a minute on a laptop SSD).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time

from aionvme import bench as B
from aionvme.bench import render
from aionvme.bench.tune import GRIDS, REQUESTS, Point, Sweep, TuneFile, config_of

from ._common import Progress, fit, human_bytes, need_matplotlib, size, terminal_width


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="directory on the device to tune (a scratch file goes there)")
    p.add_argument("--quick", action="store_true", help="coarse sweep on a 256 MiB file (under a minute)")
    p.add_argument(
        "--size", default=None, type=size(4096), help="scratch file size (default 256M with --quick, else 1G)"
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="read into and write from CUDA tensors through aionvme's GPU path (cuFile or the pinned "
        "bounce pipeline); skipped with a message where there is no CUDA device",
    )
    p.add_argument(
        "--output", default="aionvme-config.json", help="config file to write (default %(default)s)"
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="plot the measurements (needs matplotlib)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--grid", choices=sorted(GRIDS), default=None, help=argparse.SUPPRESS)


def _point_msg(p: Point) -> str:
    return f"{p.knobs.label()}: read {p.reads[-1].gb_s:.2f} write {p.writes[-1].gb_s:.2f} GB/s"


def _write_config(cfg: dict[str, object], path: str) -> None:
    # replaced whole, never left half-written over a config in use
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def run(args: argparse.Namespace) -> int:
    from aionvme.defaults import parse_size

    args.loop = B.resolve_loop(args.loop)
    width = terminal_width()
    if not os.path.isdir(args.dir):
        print(f"aionvme tune: --dir {args.dir} is not a directory")
        return 2
    if args.plot:
        need_matplotlib(args.parser)  # said now, not after the sweep
    grid = GRIDS[args.grid or ("quick" if args.quick else "full")]
    size = parse_size(args.size) if args.size else grid.size
    free = shutil.disk_usage(args.dir).free
    if size * 1.05 > free:
        print(
            fit(
                f"aionvme tune: {args.dir} has {human_bytes(free)} free; "
                f"the scratch file needs {human_bytes(size)}"
            )
        )
        return 2
    gpu = False
    if args.gpu:
        why = B.cuda_unavailable()
        if why is None:
            import torch

            gpu = True
            print(
                fit(
                    f"--gpu: reading into and writing from CUDA tensors on {torch.cuda.get_device_name(0)}",
                    width,
                )
            )
        else:
            print(fit(f"--gpu skipped: {why}. Tuning host-memory transfers.", width))
    t0 = time.perf_counter()
    with B.scratch_dir(args.dir) as d:
        tf = TuneFile(os.path.join(d, "tune.bin"), size, gpu)
        try:
            how = "O_DIRECT" if tf.info.direct else "buffered"
            print(
                fit(
                    f"tuning {tf.path} ({tf.info.fs_name}, {how}): {REQUESTS} requests of "
                    f"{human_bytes(tf.each)} in flight, read and written (in place, then fsync) per point",
                    width,
                    "  ",
                )
            )
            with Progress() as progress:
                sweep = Sweep(tf.measure, grid, progress.stage, lambda p: progress.advance(_point_msg(p)))
                best = B.run_loop(sweep.run(), args.loop)
            fresh = B.run_loop(tf.measure_fresh(best.knobs), args.loop)
        finally:
            tf.close()
    ranked = sweep.ranked()
    print(
        render.tune_table(
            ranked,
            f"aionvme tune: the best {len(ranked)} of {len(sweep.points)} points, measured again "
            f"(medians of {best.runs} runs)",
            width,
        )
    )
    cfg = config_of(sweep, tf, args.dir, fresh)
    _write_config(cfg, args.output)
    print(
        fit(
            f"best: {best.knobs.label()}: read {best.read:.2f} GB/s, write {best.write:.2f} GB/s "
            f"({len(sweep.points)} points, {time.perf_counter() - t0:.1f} s)",
            width,
            "  ",
        )
    )
    print(
        fit(
            f"writes overwrite the file in place, as a swapper's do, and are timed with their fsync; "
            f"into a fresh file (blocks allocated as it goes, what `aionvme bench -w seqwrite` and "
            f"the demo measure) the best knobs wrote {fresh.gb_s:.2f} GB/s",
            width,
            "  ",
        )
    )
    print(
        fit(
            f"wrote {args.output}: Handle.from_config({args.output!r}), "
            f'aionvme.defaults.load_config(...), and its "aio" section for DeepSpeed:',
            width,
            "  ",
        )
    )
    print(json.dumps({"aio": cfg["aio"]}, indent=2))
    if args.plot:
        points = ranked + sweep.unranked()
        problem = render.plot(
            args.plot,
            [p.knobs.label() for p in reversed(points)],
            {"read": [p.read for p in reversed(points)], "write": [p.write for p in reversed(points)]},
            title="aionvme tune",
            xlabel="knobs",
            ylabel="GB/s",
            bars=True,
        )
        print(fit(f"--plot: {problem}", width) if problem else f"plot: {args.plot}")
    sys.stdout.flush()
    return 0
