"""A checked NVMe get of a large value read in segments, hashed as they land
(``_checksum.read_hashed``, from ``PIPE_MIN`` bytes), against the same get in
one request with the hash after it, and against the get without checksums;
the three alternate per round over the same values, page cache dropped before
each; medians of the per-round ratios to the unchecked get.

    python3 bench/probes/checked_segments.py               # 64 MiB, 20 rounds
    python3 bench/probes/checked_segments.py --size 48M --rounds 12

The store's file is on the local disk (``local_scratch_dir``) unless ``--dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time

import numpy as np

from aionvme.bench import drop_caches, local_scratch_dir
from aionvme.defaults import parse_size
from aionvme.store import TieredStore, _nvme


async def run(d: str, size: int, rounds: int, keys: int) -> dict[str, list[float]]:
    pipe_min = _nvme.PIPE_MIN
    res: dict[str, list[float]] = {"segments": [], "one request": [], "no checksum": []}
    async with TieredStore(d, host=0) as s:
        for k in range(keys):
            await s.put(f"k{k}", np.random.default_rng(k).integers(0, 256, size, dtype=np.uint8))
        try:
            for r in range(rounds):
                for side in list(res) if r % 2 == 0 else list(reversed(res)):
                    _nvme.PIPE_MIN = pipe_min if side == "segments" else 1 << 62
                    s._nvme.checksum = side != "no checksum"
                    drop_caches()
                    await asyncio.sleep(0.2)
                    t0 = time.perf_counter()
                    for k in range(keys):
                        await s.get(f"k{k}")
                    res[side].append(time.perf_counter() - t0)
        finally:
            _nvme.PIPE_MIN = pipe_min
            s._nvme.checksum = True
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64M", help="bytes per value (default 64M; segmented from PIPE_MIN)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--keys", type=int, default=4, help="values read per round")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    size = parse_size(a.size)
    d = tempfile.mkdtemp(prefix="aionvme-segments-", dir=a.dir or local_scratch_dir())
    try:
        res = asyncio.run(run(d, size, a.rounds, a.keys))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    base = res["no checksum"]
    for side, v in res.items():
        paired = statistics.median(b / x for b, x in zip(base, v))
        gbs = a.keys * size / statistics.median(v) / 1e9
        print(f"{size >> 20} MiB  {side:12s} {gbs:.2f} GB/s   over the unchecked get (paired): {paired:.3f}")


if __name__ == "__main__":
    main()
