"""4 KiB random reads from a file in the page cache (buffered, batches of 64):
io_uring (engine 'auto' or 'uring') against the worker pool (engine 'aio').

    python3 bench/probes/cached_reads.py 100000                      # auto: buffered files through io_uring
    AIONVME_ENGINE=aio python3 bench/probes/cached_reads.py 100000   # the worker pool serves buffered files
"""

import asyncio
import os
import sys
import tempfile
import time

import numpy as np

import aionvme as nvme

path = os.path.join(tempfile.gettempdir(), "aionvme-cached-reads.bin")
if not os.path.exists(path):
    np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8).tofile(path)
with open(path, "rb") as fh:
    fh.read()  # into the page cache
N = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
offs = np.random.default_rng(1).integers(0, (256 << 20) // 4096, N) * 4096


async def main():
    bufs = [nvme.empty(4096) for _ in range(64)]
    async with nvme.open(path, "r", direct=False) as f:
        t0 = time.perf_counter()
        c0 = time.process_time()
        for i in range(0, N, 1024):
            chunk = offs[i : i + 1024]
            for j in range(0, len(chunk), 64):
                await f.pread_many([(bufs[k], int(o)) for k, o in enumerate(chunk[j : j + 64])])
        dt = time.perf_counter() - t0
        dc = time.process_time() - c0
    s = nvme.stats()
    print(
        f"{os.environ.get('AIONVME_ENGINE', 'auto'):6s} {N / dt:10.0f} IOPS  {dc / N * 1e6:5.1f} us CPU/op  "
        f"thread_jobs={s['thread_jobs']} ring={s.get('ring_submitted')}"
    )


asyncio.run(main())
