#!/usr/bin/env python3
"""The data loader's plain ``for`` on the process's shared background loop
(asyncio, what it uses) against a private uvloop thread (what it had before),
alternated in one process: wall time and CPU per sample.

    python3 bench/loader_loop.py                         # 16k samples of 4 KiB, batch 256, 5 rounds
    python3 bench/loader_loop.py --samples 4096 --repeat 1   # a smoke run

The samples come from the page cache (written just before, warmed by one
round of each), so the figure is the loop's and the loader's CPU, not the disk.
The private thread is installed by swapping the loader module's loop lookup:
an A/B harness, not an API.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np


class PrivateLoop:
    """A loop on its own daemon thread: the loader's former ``_LoopThread``."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="private-loop", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16384, help="4 KiB samples in the dataset")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5, help="alternated rounds of each")
    ap.add_argument("--dir", help="scratch directory (default: a temp dir)")
    args = ap.parse_args()

    from aionvme.data import Loader, _loader, sync_write_dataset

    d = tempfile.mkdtemp(dir=args.dir)
    try:
        path = os.path.join(d, "ds")
        n = args.samples
        samples = ({"x": np.full(4096 - 8, i % 251, np.uint8), "id": np.int64(i)} for i in range(n))
        sync_write_dataset(path, samples)
        private = PrivateLoop()
        shared = (_loader.background, _loader.is_background)

        def once(kind: str) -> tuple[float, float]:
            if kind == "private":
                _loader.background = lambda: private  # type: ignore[assignment]
                _loader.is_background = lambda loop: loop is private.loop  # type: ignore[assignment]
            else:
                _loader.background, _loader.is_background = shared
            with Loader(path, batch_size=args.batch, shuffle=True, seed=1, prefetch="32M") as ld:
                t0, c0 = time.perf_counter(), cpu_s()
                n = sum(len(b["id"]) for b in ld)
                t1, c1 = time.perf_counter(), cpu_s()
            if n != args.samples:
                raise SystemExit(f"{kind}: {n} samples, expected {args.samples}")
            return (t1 - t0) / n * 1e6, (c1 - c0) / n * 1e6

        kinds = ("shared", "private")
        for k in kinds:
            once(k)  # warm: page cache, batch memory faulted in
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for _ in range(args.repeat):
            for k in kinds:
                res[k].append(once(k))
        print(f"{args.samples} samples of 4 KiB, batch {args.batch}, {args.repeat} alternated rounds")
        print(f"{'loop':18s} {'wall us/sample':>15s} {'CPU us/sample':>14s}   (medians)")
        names = {"shared": "shared (asyncio)", "private": "private (uvloop)"}
        for k in kinds:
            wall = statistics.median(a for a, _ in res[k])
            cpu = statistics.median(b for _, b in res[k])
            print(f"{names[k]:18s} {wall:15.1f} {cpu:14.1f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
