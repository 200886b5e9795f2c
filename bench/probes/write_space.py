"""What a large O_DIRECT write's speed depends on, besides the writer.

Three zero-copy writes of the same bytes with ``File.pwrite_many``, in
alternated order over ``--repeat`` rounds (GB/s, medians):

  fresh      torch tensors into a new fallocated file (unwritten extents:
             ext4 converts them as each write completes)
  overwrite  torch tensors over blocks written before
  hugepage   the same bytes from page-aligned huge-page memory
             (``aionvme.empty``) over blocks written before

torch's tensors are 4 KiB pages. A device whose ``max_segments`` x 4 KiB is
below its ``max_sectors_kb`` cuts each request from such memory short (see
``/sys/block/<dev>/queue``). Every tensor is placed at its memory's phase
(file offset = its address modulo 4096), as TieredStore and the DCP writer
place them.

    python3 bench/probes/write_space.py                      # 32 x 64 MiB, 3 rounds
    python3 bench/probes/write_space.py --dir /nvme --count 16 --size 128M --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import aionvme as nvme
from aionvme.bench.system import local_scratch_dir


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory on the drive to measure (default: a temp dir on a local disk)")
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--size", default="64M", help="bytes per tensor")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    size = nvme.defaults.parse_size(a.size)
    n = a.count
    span = size + 4096
    d = tempfile.mkdtemp(prefix="aionvme-write-space-", dir=local_scratch_dir(a.dir))
    path = os.path.join(d, "w.bin")
    small = [torch.full((size // 4,), float(i)) for i in range(n)]
    huge = []
    for i in range(n):
        t = nvme.empty(size // 4 + 1024, "float32", like="torch")[
            16 : 16 + size // 4
        ]  # 64 bytes in, as torch's
        t.fill_(float(i))
        huge.append(t)

    async def write(ts: list[object], fresh: bool) -> float:
        if fresh and os.path.exists(path):
            os.unlink(path)
        if fresh:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
            os.posix_fallocate(fd, 0, n * span)
            os.close(fd)
        os.sync()
        await asyncio.sleep(0.5)
        with nvme.open(path, "r+") as f:
            t0 = time.perf_counter()
            await f.pwrite_many([(t, i * span + t.data_ptr() % 4096) for i, t in enumerate(ts)])  # type: ignore[attr-defined]
            return n * size / (time.perf_counter() - t0) / 1e9

    runs: dict[str, list[float]] = {"fresh": [], "overwrite": [], "hugepage": []}
    try:
        for r in range(a.repeat):
            # fresh must come first in a round (it makes the file the others overwrite)
            order = ["fresh", "overwrite", "hugepage"] if r % 2 == 0 else ["fresh", "hugepage", "overwrite"]
            for k in order:
                runs[k].append(asyncio.run(write(huge if k == "hugepage" else small, k == "fresh")))
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(d)
    print(f"{n} x {size >> 20} MiB zero-copy writes, GB/s (median of {a.repeat}; every round):")
    for k, v in runs.items():
        print(f"  {k:10s} {statistics.median(v):5.2f}   {' '.join(f'{x:.2f}' for x in v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
