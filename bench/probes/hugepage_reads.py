"""A cold O_DIRECT File.pread of S bytes into page-aligned memory backed by
transparent huge pages (an AlignedBuffer of 2 MiB or more: it starts on a
2 MiB boundary) against the same read into 4 KiB pages (an mmap with
MADV_NOHUGEPAGE), the two taking turns call by call on a 256 MiB file;
medians of wall time and of CPU per call.

    python3 bench/probes/hugepage_reads.py            # 1 MiB and 4 MiB
    python3 bench/probes/hugepage_reads.py 16 64      # sizes in MiB

An O_DIRECT read pins the user pages and hands the device one segment per
physically contiguous run: a huge page is one segment of 2 MiB, 4 KiB pages
are one each, and a request holds at most max_segments of them
(/sys/block/<dev>/queue/max_segments), so reads into 4 KiB pages go to the
device as more, smaller requests.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import tempfile
import time

import numpy as np

import aionvme as nvme
from aionvme.bench import drop_caches, local_scratch_dir

MiB = 1 << 20
FILE = 256 * MiB


async def probe(path: str, size: int, rounds: int = 4) -> None:
    huge = nvme.empty(max(size, 2 * MiB))[:size]  # under 2 MiB: inside one huge page
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    small = np.frombuffer(m, np.uint8)
    bufs = {"huge pages": huge, "4 KiB pages": small}
    wall: dict[str, list[float]] = {k: [] for k in bufs}
    cpu: dict[str, list[float]] = {k: [] for k in bufs}
    names = list(bufs)
    n = FILE // size
    with nvme.open(path, "r") as f:
        for r in range(rounds):
            for i in range(n):
                for k in names[(r + i) % 2 :] + names[: (r + i) % 2]:
                    t0, c0 = time.perf_counter(), time.process_time()
                    await f.pread(bufs[k], i * size)
                    wall[k].append(time.perf_counter() - t0)
                    cpu[k].append(time.process_time() - c0)
    for k in names:
        w = float(np.median(wall[k]))
        print(
            f"{size // MiB:>4} MiB  {k:<12} {w * 1e3:7.3f} ms  {size / w / 1e9:5.2f} GB/s"
            f"  cpu {float(np.median(cpu[k])) * 1e6:6.0f} us"
        )
    del small, bufs
    m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sizes", nargs="*", type=int, default=[1, 4], help="read sizes in MiB (default: 1 4)")
    sizes = [x * MiB for x in ap.parse_args().sizes]
    d = tempfile.mkdtemp(prefix="aionvme-hugepage-", dir=local_scratch_dir(None))
    path = os.path.join(d, "data.bin")
    try:
        with open(path, "wb") as fh:
            for _ in range(FILE // (4 * MiB)):
                fh.write(os.urandom(4 * MiB))
        drop_caches()
        for s in sizes:
            asyncio.run(probe(path, s))
    finally:
        os.unlink(path)
        os.rmdir(d)


if __name__ == "__main__":
    main()
