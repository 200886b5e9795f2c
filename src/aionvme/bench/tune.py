"""The measuring side of ``aionvme tune``: a staged sweep of the Handle
knobs over a DeepSpeed-like swapping workload, and the config it yields.

The workload: a scratch file read and written as :data:`REQUESTS` large
requests in flight together, O_DIRECT, into host buffers or (``gpu``) CUDA
tensors through aionvme's own GPU path; each write pass overwrites the file
in place (a swapper's files are allocated once) and ends with an fsync,
timed with it, as ``bench``'s seqwrite times its writes. Instead of DeepNVMe's full grid the
sweep is staged: block size first, then queue depth x intra-op parallelism
at the best block size, then the submit modes, then the best few points are
measured again. Only those re-measured points are ranked, by their median:
a point measured once cannot beat the median of several by one lucky run.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .result import Result, median
from .timer import Timer

__all__ = ["GRIDS", "REQUESTS", "Grid", "Knobs", "Point", "Sweep", "TuneFile", "config_of"]

K, M = 1 << 10, 1 << 20
REQUESTS = 4  # large requests in flight together, like a swapper's tensors


@dataclass(frozen=True)
class Grid:
    """The values each stage sweeps, the scratch file size, and how many of
    the best points are measured ``repeats`` more times."""

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


def size_label(n: int) -> str:
    return f"{n // M}M" if n % M == 0 else f"{n // K}K"


@dataclass(frozen=True)
class Knobs:
    """One point of the sweep: the Handle knobs it runs with."""

    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool = False
    overlap_events: bool = True

    def label(self) -> str:
        ipp = self.intra_op_parallelism or "all"
        sub = "single" if self.single_submit else "batch"
        ev = "overlap" if self.overlap_events else "wait"
        return f"block={size_label(self.block_size)} qd={self.queue_depth} ipp={ipp} {sub}/{ev}"

    def handle(self) -> Any:
        """An :class:`aionvme.Handle` with these knobs (O_DIRECT, backend auto)."""
        from .. import Handle

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
class Point:
    """Every measurement of one :class:`Knobs` (read and write results, in order)."""

    knobs: Knobs
    reads: list[Result] = field(default_factory=list)
    writes: list[Result] = field(default_factory=list)

    @property
    def runs(self) -> int:
        return len(self.reads)

    @property
    def read(self) -> float:
        """Median read GB/s."""
        return median(r.gb_s for r in self.reads)

    @property
    def write(self) -> float:
        """Median write GB/s."""
        return median(r.gb_s for r in self.writes)

    @property
    def combined(self) -> float:
        """GB/s over equal bytes read and written (2 / (1/read + 1/write)), of the medians."""
        return 2 / (1 / self.read + 1 / self.write) if self.read > 0 and self.write > 0 else 0.0


Measure = Callable[[Knobs], Awaitable[tuple[Result, Result]]]


class TuneFile:
    """The scratch file and the buffers of a tune run; :meth:`measure` reads
    and writes the whole file once with the given knobs.

    Parameters
    ----------
    path : str
        The scratch file (made, overwritten; the caller removes it).
    size : int
        Its size, rounded to :data:`REQUESTS` requests of whole pages.
    gpu : bool
        Move data to and from CUDA tensors through aionvme's GPU path
        (cuFile or the pinned bounce pipeline) instead of host memory. Needs
        torch with a CUDA device.
    """

    def __init__(self, path: str, size: int, gpu: bool = False) -> None:
        import numpy as np

        from .. import empty
        from .. import open as nvme_open

        self.path = path
        self.each = max(4096, size // REQUESTS // 4096 * 4096)
        self.size = self.each * REQUESTS
        self.gpu = gpu
        self.host = [empty(self.each) for _ in range(REQUESTS)]
        rng = np.random.default_rng(0)
        for b in self.host:
            b[:] = rng.integers(0, 256, size=self.each, dtype=np.uint8)
        self.bufs: list[Any] = self.host
        if gpu:
            import torch

            self.bufs = [torch.from_numpy(b).to("cuda") for b in self.host]
        with nvme_open(path, "w+") as f:
            f.sync_pwrite_many([(b, i * self.each) for i, b in enumerate(self.host)])
            f.sync_fsync()
        self.file = nvme_open(path, "r+")
        self.info = self.file.info

    def close(self) -> None:
        self.file.close()

    def _sync(self) -> None:
        if self.gpu:
            import torch

            torch.cuda.synchronize()

    async def measure(self, knobs: Knobs) -> tuple[Result, Result]:
        """(read, write) of the whole file with ``knobs``, all requests in
        flight together; the write's time includes the fsync that makes it durable."""
        offsets = [i * self.each for i in range(REQUESTS)]
        params = dict(knobs.__dict__, gpu=self.gpu)
        async with knobs.handle() as h:
            with Timer() as t:
                await asyncio.gather(*(h.pread(b, self.file, o) for b, o in zip(self.bufs, offsets)))
                self._sync()
            read = t.result("tune-read", self.size, REQUESTS, params=params)
            with Timer() as t:
                await asyncio.gather(*(h.pwrite(b, self.file, o) for b, o in zip(self.bufs, offsets)))
                # Durable, as bench's seqwrite and the demo count a write: an O_DIRECT
                # write completes once the device (or a hypervisor's cache in front
                # of it) has the data; fsync flushes that cache to the medium.
                await self.file.fsync()
            write = t.result("tune-write", self.size, REQUESTS, params=params)
        return read, write

    async def measure_fresh(self, knobs: Knobs) -> Result:
        """A write of the same bytes with ``knobs`` into a fresh file, fsync
        included (then removed): what ``bench``'s seqwrite and the demo
        measure. The filesystem allocates its blocks as it goes, where the
        sweep's writes overwrite blocks allocated once."""
        from .. import open as nvme_open

        path = f"{self.path}.fresh"
        offsets = [i * self.each for i in range(REQUESTS)]
        try:
            async with knobs.handle() as h:
                with nvme_open(path, "w") as f, Timer() as t:
                    await asyncio.gather(*(h.pwrite(b, f, o) for b, o in zip(self.bufs, offsets)))
                    await f.fsync()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return t.result("tune-write-fresh", self.size, REQUESTS, params=dict(knobs.__dict__, gpu=self.gpu))


class Sweep:
    """The staged search. Every measured point is kept in :attr:`points`.

    Parameters
    ----------
    measure : async callable
        ``await measure(knobs)`` -> (read result, write result) of one run.
    grid : Grid
        What to sweep.
    on_stage, on_point : callables, optional
        Called with (title, number of runs) when a stage starts, and with the
        :class:`Point` after each run (progress display).
    """

    def __init__(
        self,
        measure: Measure,
        grid: Grid,
        on_stage: Callable[[str, int], None] | None = None,
        on_point: Callable[[Point], None] | None = None,
    ) -> None:
        self.measure = measure
        self.grid = grid
        self.on_stage = on_stage or (lambda title, n: None)
        self.on_point = on_point or (lambda p: None)
        self.points: dict[Knobs, Point] = {}
        self.remeasured: list[Knobs] = []

    async def _stage(self, title: str, knobs: list[Knobs]) -> None:
        todo = [k for k in dict.fromkeys(k.canonical() for k in knobs) if k not in self.points]
        if todo:
            self.on_stage(title, len(todo))
            for k in todo:
                await self._measure(k)

    async def _measure(self, k: Knobs) -> None:
        read, write = await self.measure(k)
        p = self.points.setdefault(k, Point(k))
        p.reads.append(read)
        p.writes.append(write)
        self.on_point(p)

    def _leader(self) -> Knobs:
        """The best point so far, by every point's figure (steers the stages)."""
        return max(self.points.values(), key=lambda p: p.combined).knobs

    def ranked(self) -> list[Point]:
        """The re-measured points, best median first (every point, before the last stage)."""
        pool = [self.points[k] for k in self.remeasured] or list(self.points.values())
        return sorted(pool, key=lambda p: p.combined, reverse=True)

    def best(self) -> Point:
        """The winner: the re-measured point with the best median."""
        return self.ranked()[0]

    def unranked(self) -> list[Point]:
        """Points measured in the stages only (not candidates), best first."""
        chosen = set(self.remeasured)
        rest = [p for k, p in self.points.items() if k not in chosen]
        return sorted(rest, key=lambda p: p.combined, reverse=True)

    async def run(self) -> Point:
        """Run every stage; return :meth:`best`."""
        g = self.grid
        depth0 = g.depths[len(g.depths) // 2]
        await self._stage("1. block size", [Knobs(b, depth0, 0) for b in g.blocks])
        b = self._leader().block_size
        await self._stage(
            "2. queue depth x intra-op parallelism",
            [Knobs(b, qd, p) for qd in g.depths for p in g.parallelism],
        )
        k = self._leader()
        await self._stage(
            "3. submit modes",
            [
                Knobs(k.block_size, k.queue_depth, k.intra_op_parallelism, ss, oe)
                for ss in (False, True)
                for oe in (True, False)
            ],
        )
        if g.reblock:
            k = self._leader()
            await self._stage(
                "4. block size again",
                [
                    Knobs(b, k.queue_depth, k.intra_op_parallelism, k.single_submit, k.overlap_events)
                    for b in g.blocks
                ],
            )
        top = [p.knobs for p in sorted(self.points.values(), key=lambda p: p.combined, reverse=True)]
        top = top[: g.repeat_top]
        if g.repeats > 0:
            self.on_stage(f"{4 + g.reblock}. the best {len(top)} again", len(top) * g.repeats)
            for _ in range(g.repeats):
                for k in top:
                    await self._measure(k)
            self.remeasured = top
        return self.best()


def _point_dict(p: Point, ranked: bool) -> dict[str, Any]:
    return {
        **p.knobs.__dict__,
        "read_GBps": round(p.read, 3),
        "write_GBps": round(p.write, 3),
        "runs": p.runs,
        "ranked": ranked,
    }


def config_of(sweep: Sweep, tf: TuneFile, directory: str, fresh: Result | None = None) -> dict[str, Any]:
    """The config file: aionvme's knobs (``"aionvme"``), DeepSpeed's ``"aio"``
    section, and how they were found (``"tune"``; ``measured`` lists the
    ranked points first, best first, then the rest; ``write_fresh_GBps`` the
    best knobs' write into a fresh file, :meth:`TuneFile.measure_fresh`)."""
    import aionvme

    best = sweep.best()
    k = best.knobs
    h = k.handle()
    # DeepSpeed serves a handle's requests one after another: its queue depth is
    # what the device had in flight here, all requests together.
    in_flight = min(k.queue_depth, REQUESTS * (k.intra_op_parallelism or k.queue_depth))
    aio = {**h.deepspeed_config(), "queue_depth": in_flight}
    measured = [_point_dict(p, True) for p in sweep.ranked()]
    if sweep.remeasured:
        measured += [_point_dict(p, False) for p in sweep.unranked()]
    return {
        "aionvme": h.config(),
        "aio": aio,
        "tune": {
            "aionvme_version": aionvme.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dir": os.path.abspath(directory),
            "filesystem": tf.info.fs_name,
            "o_direct": tf.info.direct,
            "file_size": tf.size,
            "requests_in_flight": REQUESTS,
            "chunks_in_flight": in_flight,
            "gpu": tf.gpu,
            "read_GBps": round(best.read, 3),
            "write_GBps": round(best.write, 3),
            "write_fresh_GBps": None if fresh is None else round(fresh.gb_s, 3),
            "measured": measured,
        },
    }
