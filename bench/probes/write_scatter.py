"""O_DIRECT writes from memory scattered in physical memory: zero-copy against
the engine's huge-page buffers (``write_copy``), and the requests the device saw.

::

    python3 bench/probes/write_scatter.py                     # 512 MiB, 3 alternated rounds
    python3 bench/probes/write_scatter.py --size 1G --rounds 5 --dir /nvme

Sources (each allocated once, written by every mode):
- first-to-last: an anonymous mapping faulted first page to last by one thread
  (usually physically contiguous in long runs; not always: the script prints
  the request size the check predicts for each source);
- last-to-first: the same faulted last page first (usually descending frames:
  no two neighbours adjacent, the worst case);
- torch: 32 MiB bf16 tensors made by ``torch.randn(...).bfloat16()`` (torch's
  threads fault them).

Each write is ``File.sync_pwrite_many`` of the source's whole pages into a fresh
file (16 MiB chunks, the library's bulk writes) and an fsync, after a sync and a
settle pause, timed; the device's requests and KiB per request come from
``/sys/dev/block/MAJ:MIN/stat`` (the whole device: run it on an idle machine).
Modes: ``never`` (zero-copy), ``auto`` (what the library does), ``always``.
Physical frame numbers, which ``auto`` reads, are visible to root only.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

import aionvme as nvme
from aionvme import File, defaults
from aionvme._engine import buffer_info
from aionvme._runtime import scatter
from aionvme.bench.peers import disk_figures, disk_stats

PAGE = 4096
MADV_NOHUGEPAGE = 15


def _anon(nbytes: int) -> tuple[np.ndarray, mmap.mmap]:
    m = mmap.mmap(-1, nbytes)
    a = np.frombuffer(m, dtype=np.uint8)
    ctypes.CDLL(None).madvise(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(nbytes), MADV_NOHUGEPAGE)
    return a, m


def sources(nbytes: int) -> dict[str, tuple[list[tuple[Any, int]], Any]]:
    out: dict[str, tuple[list[tuple[Any, int]], Any]] = {}
    a, m = _anon(nbytes)
    a[:] = 7
    out["first-to-last"] = ([(a, 0)], m)
    b, m2 = _anon(nbytes)
    for off in range(nbytes - PAGE, -1, -PAGE):
        b[off] = 1
    b[:] = 7
    out["last-to-first"] = ([(b, 0)], m2)
    import torch

    items: list[tuple[Any, int]] = []
    keep = []
    pos = 0
    while pos < nbytes:
        t = torch.randn(16 << 20).bfloat16()
        v = t.view(torch.uint8)
        lead = (-v.data_ptr()) % PAGE
        body = min((v.numel() - lead) // PAGE * PAGE, nbytes - pos)
        items.append((v[lead : lead + body], pos))
        keep.append(t)
        pos += body
    out["torch"] = (items, keep)
    return out


def write_once(path: str, items: list[tuple[Any, int]]) -> dict[str, float]:
    os.sync()
    time.sleep(args.settle)
    before = disk_stats(os.path.dirname(path))
    t0 = time.perf_counter()
    with File(path, "w", block_size=defaults.bulk_write_block()) as f:
        f.sync_pwrite_many(items)
        f.sync_fsync()
    wall = time.perf_counter() - t0
    fig = disk_figures(before, disk_stats(os.path.dirname(path)), wall)
    os.unlink(path)
    nbytes = sum(x[0].nbytes if hasattr(x[0], "nbytes") else len(x[0]) for x in items)
    return {"gbps": nbytes / wall / 1e9, **fig}


def predicted(items: list[tuple[Any, int]], path: str) -> str:
    limits = scatter.device_limits(os.stat(os.path.dirname(path)).st_dev)
    if limits is None:
        return "no request queue"
    addr, nbytes = buffer_info(items[0][0])
    got = scatter.request_bytes(addr, nbytes, limits)
    return "frames hidden" if got is None else f"{got / 1024:.0f} KiB predicted"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="512M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the file goes (default: a temp dir on /var/tmp)")
    ap.add_argument("--modes", default="never,auto,always")
    ap.add_argument("--settle", type=float, default=1.0)
    args = ap.parse_args()
    nbytes = defaults.parse_size(args.size)
    d = args.dir or tempfile.mkdtemp(prefix="aionvme-scatter-", dir="/var/tmp")
    path = os.path.join(d, "scatter.bin")
    srcs = sources(nbytes)
    modes = args.modes.split(",")
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    limits = scatter.device_limits(os.stat(d).st_dev)
    print(f"{nvme.__name__}: {nbytes >> 20} MiB per write into {d}; (max_segments, max bytes) {limits}")
    for name, (items, _) in srcs.items():
        print(f"  {name}: {predicted(items, path)}")
    for r in range(args.rounds):
        order = [(s, m) for s in srcs for m in modes]
        for s, m in order if r % 2 == 0 else order[::-1]:
            with defaults.set(write_copy=m):
                runs.setdefault((s, m), []).append(write_once(path, srcs[s][0]))
    print(f"\n| source | mode | GB/s (median of {args.rounds}) | device requests | KiB per request |")
    print("|---|---|---:|---:|---:|")
    for (s, m), rs in runs.items():
        med = statistics.median(x["gbps"] for x in rs)
        req = statistics.median(x.get("dev_write_requests", 0) for x in rs)
        kib = statistics.median(x.get("dev_write_kib_per_request", 0) for x in rs)
        each = ", ".join(f"{x['gbps']:.2f}" for x in rs)
        print(f"| {s} | {m} | {med:.2f} ({each}) | {req:.0f} | {kib:.0f} |")
    if not args.dir:
        os.rmdir(d)
    sys.exit(0)
