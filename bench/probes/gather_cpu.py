"""CPU per 4 KiB random read when 64 coroutines each await File.pread in turn
(the gather pattern), on a 256 MiB O_DIRECT file; for A/B runs of two builds:

    PYTHONPATH=/path/to/build-a/src python3 bench/probes/gather_cpu.py
    PYTHONPATH=/path/to/build-b/src python3 bench/probes/gather_cpu.py
    python3 bench/probes/gather_cpu.py --profile        # cProfile of the Python layer
"""

import asyncio
import cProfile
import os
import pstats
import sys
import tempfile
import time

import numpy as np

import aionvme as nvme

PATH = os.path.join(tempfile.gettempdir(), "aionvme-gather-cpu.bin")
N = 40_000


async def _worker(f: nvme.File, buf: np.ndarray, it) -> None:
    for o in it:
        await f.pread(buf, o)


async def main() -> None:
    offs = (np.random.default_rng(1).integers(0, (256 << 20) // 4096, N) * 4096).tolist()
    async with nvme.open(PATH) as f:
        it = iter(offs)
        bufs = [nvme.empty(4096) for _ in range(64)]
        t0 = time.perf_counter()
        c0 = time.process_time()
        await asyncio.gather(*(_worker(f, b, it) for b in bufs))
        dt = time.perf_counter() - t0
        dc = time.process_time() - c0
    print(f"{N / dt:8.0f} IOPS {dc / N * 1e6:5.2f} us CPU/op")


if __name__ == "__main__":
    import uvloop

    if not os.path.exists(PATH):
        np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8).tofile(PATH)
    if "--profile" in sys.argv:
        cProfile.run("uvloop.run(main())", "gather_cpu.prof")
        pstats.Stats("gather_cpu.prof").sort_stats("tottime").print_stats(18)
    else:
        for _ in range(3):
            uvloop.run(main())
