"""``aionvme tune --dir PATH``: find the Handle knobs that move data fastest
here, and write them as a config that ``Handle.from_config``,
``aionvme.defaults.load_config`` and DeepSpeed (its ``"aio"`` section) read.

The workload is DeepSpeed-like swapping: a scratch file in PATH is read and
written as a few large requests in flight together, O_DIRECT. Instead of
DeepNVMe's full grid (minutes), the sweep is staged: block size first, then
queue depth x intra-op parallelism at the best block size, then the submit
modes (single_submit, overlap_events), then the best few points are measured
again and ranked by their median. ``--quick`` uses a coarse grid and a 256 MiB
file (well under a minute on a laptop SSD).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ._common import human_bytes, resolve_loop, run_loop, scratch_dir

K, M = 1 << 10, 1 << 20
REQUESTS = 4  # large requests in flight together, like a swapper's tensors


@dataclass(frozen=True)
class Grid:
    blocks: tuple[int, ...]
    depths: tuple[int, ...]
    parallelism: tuple[int, ...]  # 0: up to the queue depth
    size: int
    repeat_top: int
    repeats: int
    reblock: bool  # sweep block sizes again at the best depth/parallelism/modes


GRIDS = {
    "quick": Grid((256 * K, M, 4 * M, 8 * M), (4, 16, 64, 128), (1, 4, 16, 0), 256 * M, 3, 2, False),
    "full": Grid(
        (128 * K, 256 * K, 512 * K, M, 2 * M, 4 * M, 8 * M),
        (4, 8, 16, 32, 64, 128, 256),
        (1, 2, 4, 8, 16, 0),
        1 << 30,
        5,
        2,
        True,
    ),
    # for the test suite: every stage, a few points, a tiny file
    "smoke": Grid((256 * K, M), (8,), (2, 0), 8 * M, 2, 1, False),
}


@dataclass(frozen=True)
class Knobs:
    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool = False
    overlap_events: bool = True

    def label(self) -> str:
        ipp = self.intra_op_parallelism or "all"
        sub = "single" if self.single_submit else "batch"
        ev = "overlap" if self.overlap_events else "wait"
        return f"block={_size(self.block_size)} qd={self.queue_depth} ipp={ipp} {sub}/{ev}"

    def handle(self) -> Any:
        """An aionvme.Handle with these knobs (O_DIRECT, backend auto)."""
        from aionvme import Handle

        return Handle(
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            intra_op_parallelism=self.intra_op_parallelism,
            single_submit=self.single_submit,
            overlap_events=self.overlap_events,
            direct=True,
            backend="auto",
        )

    def canonical(self) -> Knobs:
        """Parallelism at or above the queue depth behaves as 'all' (0)."""
        if self.intra_op_parallelism >= self.queue_depth:
            return Knobs(self.block_size, self.queue_depth, 0, self.single_submit, self.overlap_events)
        return self


@dataclass
class Result:
    knobs: Knobs
    reads: list[float] = field(default_factory=list)  # GB/s per run
    writes: list[float] = field(default_factory=list)

    @property
    def read(self) -> float:
        return statistics.median(self.reads)

    @property
    def write(self) -> float:
        return statistics.median(self.writes)

    @property
    def combined(self) -> float:
        """GB/s over equal bytes read and written (2 / (1/read + 1/write))."""
        return 2 / (1 / self.read + 1 / self.write) if self.read > 0 and self.write > 0 else 0.0


def _size(n: int) -> str:
    return f"{n // M}M" if n % M == 0 else f"{n // K}K"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="directory on the device to tune (a scratch file goes there)")
    p.add_argument("--quick", action="store_true", help="coarse sweep on a 256 MiB file (under a minute)")
    p.add_argument("--size", default=None, help="scratch file size (default 256M with --quick, else 1G)")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="move data to and from CUDA tensors (via page-aligned host buffers)",
    )
    p.add_argument(
        "--output", default="aionvme-config.json", help="config file to write (default %(default)s)"
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="plot the measurements (needs matplotlib)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--grid", choices=sorted(GRIDS), default=None, help=argparse.SUPPRESS)


# -- progress display ------------------------------------------------------------------


class _Progress:
    """rich or tqdm bars when installed, else one line per point."""

    def __init__(self) -> None:
        self._rich: Any = None
        self._tqdm: Any = None
        self._bar: Any = None
        self._task: Any = None
        self._n = 0
        self._total = 0
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._rich = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TextColumn("{task.fields[last]}"),
            )
        except ImportError:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm
            except ImportError:
                pass

    def __enter__(self) -> _Progress:
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
        if self._bar is not None:
            self._bar.close()

    def stage(self, title: str, total: int) -> None:
        self._n, self._total = 0, total
        if self._rich is not None:
            self._task = self._rich.add_task(title, total=total, last="")
        elif self._tqdm is not None:
            if self._bar is not None:
                self._bar.close()
            self._bar = self._tqdm(total=total, desc=title, leave=True)
        else:
            print(title, flush=True)

    def point(self, r: Result) -> None:
        self._n += 1
        msg = f"{r.knobs.label()}: read {r.reads[-1]:.2f} write {r.writes[-1]:.2f} GB/s"
        if self._rich is not None:
            self._rich.update(self._task, advance=1, last=msg)
        elif self._bar is not None:
            self._bar.set_postfix_str(msg)
            self._bar.update(1)
        else:
            print(f"  [{self._n}/{self._total}] {msg}", flush=True)


# -- measuring --------------------------------------------------------------------------------


class Bench:
    """The scratch file, the buffers, and one measurement per call."""

    def __init__(self, path: str, size: int, gpu: bool) -> None:
        import numpy as np

        import aionvme as nvme

        self.path = path
        self.each = max(4096, size // REQUESTS // 4096 * 4096)
        self.size = self.each * REQUESTS
        self.gpu = gpu
        like = "torch" if gpu else "numpy"
        self.host = [nvme.empty(self.each, like=like) for _ in range(REQUESTS)]
        rng = np.random.default_rng(0)
        for b in self.host:
            view = b.numpy() if gpu else b
            view[:] = rng.integers(0, 256, size=self.each, dtype=np.uint8)
        self.dev: list[Any] = []
        if gpu:
            self.dev = [b.to("cuda") for b in self.host]
        with nvme.open(path, "w+") as f:
            f.sync_pwrite_many([(b, i * self.each) for i, b in enumerate(self.host)])
            f.sync_fsync()
        self.file = nvme.open(path, "r+")
        self.info = self.file.info

    def close(self) -> None:
        self.file.close()

    async def measure(self, knobs: Knobs) -> tuple[float, float]:
        """(read GB/s, write GB/s) of the whole file with these knobs."""
        offsets = [i * self.each for i in range(REQUESTS)]
        async with knobs.handle() as h:
            t0 = time.perf_counter()
            if self.gpu:
                await asyncio.gather(*(self._read_to_gpu(h, i, off) for i, off in enumerate(offsets)))
                _cuda_sync()
            else:
                await asyncio.gather(*(h.pread(b, self.file, off) for b, off in zip(self.host, offsets)))
            t_read = time.perf_counter() - t0
            t0 = time.perf_counter()
            if self.gpu:
                await asyncio.gather(*(self._write_from_gpu(h, i, off) for i, off in enumerate(offsets)))
            else:
                await asyncio.gather(*(h.pwrite(b, self.file, off) for b, off in zip(self.host, offsets)))
            t_write = time.perf_counter() - t0
        return self.size / t_read / 1e9, self.size / t_write / 1e9

    async def _read_to_gpu(self, h: Any, i: int, off: int) -> None:
        await h.pread(self.host[i], self.file, off)
        self.dev[i].copy_(self.host[i], non_blocking=True)

    async def _write_from_gpu(self, h: Any, i: int, off: int) -> None:
        self.host[i].copy_(self.dev[i])
        await h.pwrite(self.host[i], self.file, off)


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


class Sweep:
    """Staged search; every measured point is kept in results."""

    def __init__(self, bench: Bench, grid: Grid, progress: _Progress) -> None:
        self.bench = bench
        self.grid = grid
        self.progress = progress
        self.results: dict[Knobs, Result] = {}

    async def _run(self, title: str, points: list[Knobs]) -> None:
        todo = list(dict.fromkeys(k.canonical() for k in points))
        todo = [k for k in todo if k not in self.results]
        if not todo:
            return
        self.progress.stage(title, len(todo))
        for k in todo:
            await self._measure(k)

    async def _measure(self, k: Knobs) -> None:
        read, write = await self.bench.measure(k)
        r = self.results.setdefault(k, Result(k))
        r.reads.append(read)
        r.writes.append(write)
        self.progress.point(r)

    def best(self) -> Knobs:
        return max(self.results.values(), key=lambda r: r.combined).knobs

    def ranked(self) -> list[Result]:
        return sorted(self.results.values(), key=lambda r: r.combined, reverse=True)

    async def run(self) -> None:
        g = self.grid
        depth0 = g.depths[len(g.depths) // 2]
        await self._run("1. block size", [Knobs(b, depth0, 0) for b in g.blocks])
        b = self.best().block_size
        await self._run(
            "2. queue depth x intra-op parallelism",
            [Knobs(b, qd, p) for qd in g.depths for p in g.parallelism],
        )
        k = self.best()
        await self._run(
            "3. submit modes",
            [
                Knobs(k.block_size, k.queue_depth, k.intra_op_parallelism, ss, oe)
                for ss in (False, True)
                for oe in (True, False)
            ],
        )
        if g.reblock:
            k = self.best()
            await self._run(
                "4. block size again",
                [
                    Knobs(b, k.queue_depth, k.intra_op_parallelism, k.single_submit, k.overlap_events)
                    for b in g.blocks
                ],
            )
        top = [r.knobs for r in self.ranked()[: g.repeat_top]]
        self.progress.stage(f"{4 + g.reblock}. the best {len(top)} again", len(top) * g.repeats)
        for _ in range(g.repeats):
            for k in top:
                await self._measure(k)


# -- output --------------------------------------------------------------------------------


def _table(results: list[Result], limit: int) -> list[list[str]]:
    rows = []
    for i, r in enumerate(results[:limit], 1):
        k = r.knobs
        rows.append(
            [
                str(i),
                _size(k.block_size),
                str(k.queue_depth),
                str(k.intra_op_parallelism or "all"),
                "single" if k.single_submit else "batch",
                "overlap" if k.overlap_events else "wait",
                f"{r.read:.2f}",
                f"{r.write:.2f}",
                f"{r.combined:.2f}",
                str(len(r.reads)),
            ]
        )
    return rows


_HEAD = ["#", "block", "qd", "ipp", "submit", "events", "read GB/s", "write GB/s", "combined", "runs"]


def print_table(results: list[Result], limit: int = 10) -> None:
    rows = _table(results, limit)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_HEAD)]
        print("  ".join(h.rjust(w) for h, w in zip(_HEAD, widths)))
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        return
    t = Table(title=f"aionvme tune: best {len(rows)} of {len(results)} (median of runs)")
    for h in _HEAD:
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(*r)
    Console().print(t)


def config_of(best: Result, sweep: Sweep, bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """The config file: aionvme's knobs, DeepSpeed's "aio" section, and how they were found."""
    import aionvme

    k = best.knobs
    h = k.handle()
    # DeepSpeed serves a handle's requests one after another: its queue depth is
    # what the device had in flight here, all requests together.
    in_flight = min(k.queue_depth, REQUESTS * (k.intra_op_parallelism or k.queue_depth))
    aio = {**h.deepspeed_config(), "queue_depth": in_flight}
    measured = [
        {
            **r.knobs.__dict__,
            "read_GBps": round(r.read, 3),
            "write_GBps": round(r.write, 3),
            "runs": len(r.reads),
        }
        for r in sweep.ranked()
    ]
    return {
        "aionvme": h.config(),
        "aio": aio,
        "tune": {
            "aionvme_version": aionvme.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dir": os.path.abspath(args.dir),
            "filesystem": bench.info.fs_name,
            "o_direct": bench.info.direct,
            "file_size": bench.size,
            "requests_in_flight": REQUESTS,
            "chunks_in_flight": in_flight,
            "gpu": bench.gpu,
            "read_GBps": round(best.read, 3),
            "write_GBps": round(best.write, 3),
            "measured": measured,
        },
    }


def plot(results: list[Result], path: str) -> str | None:
    """Write a PNG of every point's read and write GB/s; None, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib (pip install 'aionvme[plot]'); no plot written"
    ranked = list(reversed(results))
    labels = [r.knobs.label() for r in ranked]
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.28 * len(ranked) + 1)))
    ys = range(len(ranked))
    ax.barh([y + 0.2 for y in ys], [r.read for r in ranked], height=0.4, label="read")
    ax.barh([y - 0.2 for y in ys], [r.write for r in ranked], height=0.4, label="write")
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.set_xlabel("GB/s")
    ax.set_title("aionvme tune")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# -- the command ---------------------------------------------------------------------------


def _gpu_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return True, torch.cuda.get_device_name(0)


@dataclass
class _Timer:
    start: float = field(default_factory=time.perf_counter)

    def __call__(self) -> float:
        return time.perf_counter() - self.start


def run(args: argparse.Namespace) -> int:
    from aionvme.defaults import parse_size

    args.loop = resolve_loop(args.loop)
    if not os.path.isdir(args.dir):
        print(f"aionvme tune: --dir {args.dir} is not a directory")
        return 2
    grid = GRIDS[args.grid or ("quick" if args.quick else "full")]
    size = parse_size(args.size) if args.size else grid.size
    free = shutil.disk_usage(args.dir).free
    if size * 1.05 > free:
        print(
            f"aionvme tune: {args.dir} has {human_bytes(free)} free; "
            f"the scratch file needs {human_bytes(size)}"
        )
        return 2
    gpu = False
    if args.gpu:
        gpu, why = _gpu_available()
        if gpu:
            print(
                f"--gpu: reading into and writing from CUDA tensors on {why} (via page-aligned host buffers)"
            )
        else:
            print(f"--gpu skipped: {why}. Tuning host-memory transfers.")
    timer = _Timer()
    with scratch_dir(args.dir) as d:
        bench = Bench(os.path.join(d, "tune.bin"), size, gpu)
        try:
            how = "O_DIRECT" if bench.info.direct else "buffered"
            print(
                f"tuning {bench.path} ({bench.info.fs_name}, {how}): {REQUESTS} requests of "
                f"{human_bytes(bench.each)} in flight, read and written per point"
            )
            with _Progress() as progress:
                sweep = Sweep(bench, grid, progress)
                run_loop(sweep.run(), args.loop)
        finally:
            bench.close()
    ranked = sweep.ranked()
    print_table(ranked)
    best = ranked[0]
    cfg = config_of(best, sweep, bench, args)
    # replaced whole, never left half-written over a config in use
    tmp = f"{args.output}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.output)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    print(
        f"best: {best.knobs.label()}: read {best.read:.2f} GB/s, write {best.write:.2f} GB/s "
        f"({len(ranked)} points, {timer():.1f} s)"
    )
    print(f"wrote {args.output}: Handle.from_config({args.output!r}), aionvme.defaults.load_config(...),")
    print('and its "aio" section for DeepSpeed:')
    print(json.dumps({"aio": cfg["aio"]}, indent=2))
    if args.plot:
        problem = plot(ranked, args.plot)
        print(problem if problem else f"plot: {args.plot}")
    sys.stdout.flush()
    return 0
